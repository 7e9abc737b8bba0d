#!/usr/bin/env bash
# Everything a fresh machine (Debian, Python 3.11, root or sudo) needs: idempotent, so the
# README commands can always start with it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PILLOW_SIMD=pillow-simd==12.1.1.post0
# pillow-simd builds from source: these headers decide which formats it can read and write; without
# pkg-config its build finds no libtiff and silently leaves TIFF out.
BUILD_HEADERS="pkg-config libwebp-dev libjpeg-dev zlib1g-dev liblcms2-dev libtiff-dev libfreetype-dev"
# chromium: the browser tests drive Debian's Chromium with Playwright (no browser download).
# postgresql, pgbouncer: the Postgres-backed Dagster tests start their own server from Debian's binaries,
# with PgBouncer in front (Dagster connects once per storage call; fixtures/postgres.py).
# nodejs: the pip pyright runs on the node it finds on PATH (no node download).
# podman, runc, mmdebstrap: scripts/build_image.sh and the image test build the container image from
# Debian's packages, with no registry (runc: crun refuses hybrid cgroups).
APT_PACKAGES="$BUILD_HEADERS chromium postgresql pgbouncer nodejs podman runc mmdebstrap"

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
# `dpkg -s` also passes a package removed with its configuration kept: ask for "installed".
installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
missing=""
for package in $APT_PACKAGES; do installed "$package" || missing="$missing $package"; done
if [ -n "$missing" ]; then
    echo "setup: installing apt packages:$missing"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $APT_PACKAGES >/dev/null
fi

# pip's resolver takes about 6 s even when every requirement is in place: then only this checkout is
# installed (editable, without its requirements); else pip installs whatever is missing.
EXTRAS="test,ray,deploy"
if ! "$PYTHON" scripts/requirements_met.py "$EXTRAS" ||
    ! "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .; then
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-binary pillow-simd -e ".[$EXTRAS]"
fi

# Plain Pillow installs the same PIL package; if anything pulled it in, it shadows pillow-simd.
if "$PYTHON" -m pip show Pillow >/dev/null 2>&1; then
    echo "setup: removing plain Pillow, which would shadow pillow-simd"
    "$PYTHON" -m pip uninstall -y -q Pillow
    "$PYTHON" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps --no-binary pillow-simd "$PILLOW_SIMD"
fi

# The codecs pillow-simd must have. One built before its headers (or pkg-config) were present silently
# lacks some (and pip's wheel cache keeps it): rebuild it without the cache, then insist.
CODECS="webp jpg zlib littlecms2 libtiff"
if ! "$PYTHON" -c 'import sys, PIL.features as f; sys.exit(not all(f.check(c) for c in sys.argv[1:]))' $CODECS; then
    echo "setup: pillow-simd lacks one of: $CODECS; rebuilding it from source"
    "$PYTHON" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps --no-cache-dir --no-binary pillow-simd "$PILLOW_SIMD"
fi
"$PYTHON" - $CODECS <<'PY'
import sys
from importlib import metadata

import PIL.features

missing = [name for name in sys.argv[1:] if not PIL.features.check(name)]
if missing:
    sys.exit(f"setup: pillow-simd was built without {missing}; install their headers and pkg-config, and rerun")
print(f"setup: ok (pillow-simd {metadata.version('pillow-simd')}, WebP {PIL.features.version('webp')})")
PY
