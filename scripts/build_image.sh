#!/usr/bin/env bash
# Builds the container image (deploy/Containerfile, docs/image.md) with podman, no image registry needed:
#   1. a Debian bookworm base made by mmdebstrap from Debian's packages, with this machine's apt sources
#      and apt settings (proxy, Check-Valid-Until), cached as a tarball and imported once;
#   2. the two-stage image, tagged $SIDECAR_IMAGE:<key> and :latest, where <key> hashes the staged build
#      context (Containerfile, pyproject.toml, README.md, package sources) and the base image: the same
#      inputs are never built twice. The last line of stdout is the tag.
# pip inside the build trusts this machine's CA bundle and uses its index settings, both given as build
# secrets (never written to a layer).
#
# Environment: SIDECAR_IMAGE (localhost/fixed-res-sidecar), BASE_IMAGE (unset: the mmdebstrap base; or
# e.g. python:3.11-slim), CONTAINER_ENGINE (podman; docker works with a BASE_IMAGE), SIDECAR_CA_BUNDLE
# (pip's cert setting), SIDECAR_IMAGE_CACHE (~/.cache/fixed-res-sidecar), REFRESH_BASE=1 (remake the base).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

ENGINE=${CONTAINER_ENGINE:-podman}
IMAGE=${SIDECAR_IMAGE:-localhost/fixed-res-sidecar}
CACHE=${SIDECAR_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fixed-res-sidecar}
SUITE=bookworm  # its python3 is 3.11, the version the package needs
PYTHON=${PYTHON:-python3}
if [ "$ENGINE" = podman ]; then
    # runc and ulimits that this VM allows (deploy/containers.conf says why).
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$REPO/deploy/containers.conf}
else
    export DOCKER_BUILDKIT=1  # build secrets
fi
log() { echo "build_image: $*" >&2; }
image_exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# `pip config list` in, a pip.conf out with the index settings a build can use (http(s) URLs only: a
# file:// index or a local directory of this machine is not inside the build).
PIP_CONF_PY=$(cat <<'PY'
import re, sys
settings = {}
for line in sys.stdin:  # later lines (and the environment's, listed last) override earlier ones, as in pip
    m = re.match(r"^[^.]*[.](index-url|extra-index-url|trusted-host)=(.*)$", line.strip())
    if m:
        settings[m[1]] = m[2].strip("'\"")
out = ["[global]"]
for key, value in settings.items():
    keep = [v for v in value.split() if key == "trusted-host" or re.match(r"https?://", v)]
    if keep:
        out.append(f"{key} = " + " ".join(keep))
print("\n".join(out))
PY
)

# ---- 1. the base image
# Apt as it is configured here: the Debian sources of this suite, and the files of Acquire settings
# (proxy, Check-Valid-Until); they stay in the base (99mmdebstrap), so apt inside the build uses them too.
# No manuals, docs or translations in the image (later apt installs obey the same dpkg filter).
make_local_base() {
    local sources=() aptopts=() file
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -s "$file" ] || continue
        if grep -vE '^\s*#' "$file" | grep -qE "(^|\s)$SUITE(-updates|-security)?(\s|$)"; then sources+=("$file"); fi
    done
    for file in /etc/apt/apt.conf /etc/apt/apt.conf.d/*; do
        if [ -f "$file" ] && grep -q 'Acquire::' "$file"; then aptopts+=("--aptopt=$file"); fi
    done
    local options=(--variant=minbase --format=tar
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/info/*'
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias'
        "${aptopts[@]}")
    # The base's recipe names its tarball and its tag: a changed apt setup makes a new base.
    local recipe
    recipe=$( (echo "$SUITE ${options[*]}"; cat "${sources[@]}" "${aptopts[@]#--aptopt=}" 2>/dev/null) | sha256sum | cut -c1-12)
    LOCAL_BASE=localhost/sidecar-base:$SUITE-minbase-$recipe
    if [ "${REFRESH_BASE:-0}" != 1 ] && image_exists "$LOCAL_BASE"; then
        return
    fi
    local tarball=$CACHE/debian-$SUITE-minbase-$recipe.tar
    mkdir -p "$CACHE"
    if [ "${REFRESH_BASE:-0}" = 1 ] || [ ! -s "$tarball" ]; then
        command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing (bash scripts/setup.sh installs it)"; exit 2; }
        log "making the $SUITE base with mmdebstrap (sources: ${sources[*]:-the default Debian mirror}; ${#aptopts[@]} apt settings files)"
        local start=$SECONDS
        mmdebstrap --quiet "${options[@]}" "$SUITE" "$tarball.tmp" "${sources[@]}"
        mv "$tarball.tmp" "$tarball"
        log "base tarball: $tarball ($(du -h "$tarball" | cut -f1), $((SECONDS - start)) s)"
    fi
    "$ENGINE" image rm -f "$LOCAL_BASE" >/dev/null 2>&1 || true
    "$ENGINE" import --change 'CMD ["/bin/bash"]' "$tarball" "$LOCAL_BASE" >/dev/null
    log "imported $LOCAL_BASE"
}
PULL=()
if [ -z "${BASE_IMAGE:-}" ]; then
    make_local_base
    BASE_IMAGE=$LOCAL_BASE
    if [ "$ENGINE" = podman ]; then PULL=(--pull=never); fi  # it is local: never ask a registry
fi

# ---- 2. the staged context and its key
CONTEXT=$WORK/context
mkdir -p "$CONTEXT/deploy"
cp pyproject.toml README.md "$CONTEXT/"
cp deploy/Containerfile deploy/check_image.py "$CONTEXT/deploy/"
# What the image installs besides the package: the dependencies and the ray and deploy extras (the
# Containerfile's dependency layer, kept while they stay the same).
"$PYTHON" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; extras = p["optional-dependencies"]; print("\n".join(["setuptools>=68", "wheel", *p["dependencies"], *extras["ray"], *extras["deploy"]]))' >"$CONTEXT/deploy/requirements.txt"
tar -c --exclude=__pycache__ --exclude='*.pyc' fixed_res_sidecar | tar -x -C "$CONTEXT"
base_id=$("$ENGINE" image inspect --format '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || echo "$BASE_IMAGE")
KEY=$( (cd "$CONTEXT" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; echo "$base_id") | sha256sum | cut -c1-16)
TAG=$IMAGE:$KEY

# pip's settings for the build: the CA bundle it trusts, and its index URLs that a build can reach.
CA=${SIDECAR_CA_BUNDLE:-}
if [ -z "$CA" ]; then
    CA=$("$PYTHON" -m pip config get global.cert 2>/dev/null || true)
fi
for candidate in "$CA" "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt /dev/null; do
    if [ -f "$candidate" ] || [ "$candidate" = /dev/null ]; then CA=$candidate; break; fi
done
log "pip trusts $CA; the image key is $KEY"

if image_exists "$TAG"; then
    log "$TAG is already built from these inputs"
else
    PIP_CONF=$WORK/pip.conf
    "$PYTHON" -m pip config list 2>/dev/null | "$PYTHON" -c "$PIP_CONF_PY" >"$PIP_CONF"
    chmod 600 "$PIP_CONF"
    log "building $TAG from $BASE_IMAGE (pip index settings: $(grep -c = "$PIP_CONF" || true))"
    start=$SECONDS
    "$ENGINE" build --network host "${PULL[@]}" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --secret "id=ca.pem,src=$CA" --secret "id=pip.conf,src=$PIP_CONF" \
        -f "$CONTEXT/deploy/Containerfile" -t "$TAG" "$CONTEXT" >&2
    log "built $TAG in $((SECONDS - start)) s"
fi
"$ENGINE" tag "$TAG" "$IMAGE:latest"
log "size: $("$ENGINE" image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')"
echo "$TAG"
