"""The container image (deploy/Containerfile, scripts/build_image.sh): built here with podman and no
registry, it runs the demo and a build-both, and carries none of the build's secrets."""

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar_tests.fixtures import REPO_ROOT
from fixed_res_sidecar_tests.fixtures.datasets import SHARDS

pytestmark = pytest.mark.image

BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_image.sh"
# Builds run at most this long (a cold build here: a few minutes, most of it pip and pillow-simd's compile).
BUILD_TIMEOUT = 1800


def podman_env() -> dict[str, str]:
    return {
        **os.environ,
        "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(REPO_ROOT / "deploy" / "containers.conf")),
    }


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"podman {' '.join(args)}: {result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def image() -> dict:
    """The image built from the checkout's inputs (or the one already built from the same inputs):
    its tag, the CA bundle the build's pip trusted, and the build script's two run times."""
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        pytest.fail("podman and mmdebstrap are missing: bash scripts/setup.sh installs them")
    runs = []
    for _ in range(2):  # the second run finds the image the first one built or found
        start = time.monotonic()
        built = subprocess.run(
            ["bash", str(BUILD_SCRIPT)], env=podman_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT
        )
        assert built.returncode == 0, built.stderr[-5000:]
        runs.append((time.monotonic() - start, built))
    tag = runs[0][1].stdout.split()[-1]
    assert runs[1][1].stdout.split()[-1] == tag
    assert "already built from these inputs" in runs[1][1].stderr
    [ca] = re.findall(r"pip trusts (\S+);", runs[1][1].stderr)
    return {"tag": tag, "ca": Path(ca), "seconds": [round(seconds) for seconds, _ in runs]}


@pytest.fixture
def container_names():
    """Names for this test's containers; each one that is still there afterwards is removed."""
    names: list[str] = []

    def new() -> str:
        names.append(f"sidecar-test-{uuid.uuid4().hex[:10]}")
        return names[-1]

    yield new
    for name in names:
        podman("rm", "--force", "--ignore", name, check=False)
    left = podman("ps", "--all", "--quiet", "--filter", "name=sidecar-test-", check=False).stdout.split()
    assert not [n for n in names if podman("container", "exists", n, check=False).returncode == 0], left


def run_in(image: dict, name: str, *command: str, mount: Path | None = None, timeout: float = 600):
    """`command` in a new container of the image (its non-root user; no network: the image needs none)."""
    args = ["run", "--rm", "--name", name, "--network", "none"]
    if mount is not None:
        args += ["--volume", f"{mount}:/data"]
    return podman(*args, image["tag"], *command, timeout=timeout, check=False)


def shared_folder(tmp_path: Path) -> Path:
    """A folder the container's user (uid 1000) may write, mounted at /data."""
    folder = tmp_path / "data"
    folder.mkdir()
    folder.chmod(0o777)
    return folder


def test_the_image_has_its_commands_and_every_codec_and_runs_as_a_user(image, container_names):
    checked = run_in(image, container_names(), "python3", "/opt/sidecar/check_image.py")
    assert checked.returncode == 0, checked.stderr
    assert "image check: ok" in checked.stdout
    who = run_in(image, container_names(), "sh", "-c", "id -u; command -v sidecar-ops dagster ray rsync; python3 -V")
    assert who.returncode == 0, who.stderr
    uid, *paths, version = who.stdout.split("\n")[:-1]
    assert uid != "0" and len(paths) == 4 and version.startswith("Python 3.11"), who.stdout
    # No compiler or headers left from the builder stage.
    assert run_in(image, container_names(), "sh", "-c", "command -v gcc || ls /usr/include/webp").returncode != 0


def test_the_demo_runs_inside_the_image(image, container_names, tmp_path):
    data = shared_folder(tmp_path)
    demo = run_in(
        image, container_names(), "sidecar-ops", "demo", "--workdir", "/data/demo", "--shards", "2",
        "--rows-per-shard", "4", mount=data,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "result: OK" in demo.stdout
    assert (data / "demo" / "dagster_home" / "dagster.yaml").is_file()
    assert len(list((data / "demo" / "out").rglob("*.parquet"))) >= 2 * 2  # both resolutions, every shard


def test_build_both_runs_inside_the_image_on_a_local_dataset(image, container_names, tmp_path, sample_main_template):
    data = shared_folder(tmp_path)
    shutil.copytree(sample_main_template, data / "main")
    built = run_in(
        image, container_names(), "sidecar-ops", "build-both", "--main-prefix", "/data/main",
        "--output-prefix-512", "/data/512", "--output-prefix-1024", "/data/1024", mount=data,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    assert "shards: 3 total, 3 built, 0 skipped, 0 failed" in built.stdout
    for folder in ("512", "1024"):
        assert Location.parse(data / folder).list_shards() == sorted(SHARDS)


def _certificates(pem: bytes) -> set[bytes]:
    """The base64 bodies of the PEM certificates in `pem`, one line each."""
    blocks = re.findall(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", pem, re.S)
    return {b"".join(block.split()) for block in blocks}


def test_the_image_holds_no_secret_of_its_build(image, container_names):
    """The CA bundle pip trusted in the build is not in any layer of the image, in whole or any of the
    certificates it has beyond Debian's own; nor does the image's configuration point at a secret."""
    bundle = image["ca"].read_bytes()
    debian = run_in(image, container_names(), "sh", "-c", "cat /usr/share/ca-certificates/mozilla/*.crt")
    assert debian.returncode == 0, debian.stderr
    local_certificates = _certificates(bundle) - _certificates(debian.stdout.encode())
    # A PEM file wraps base64 at 64 characters: look for the second and third lines of each body.
    needles = [body[64:192] for body in local_certificates if len(body) > 192]
    if bundle:
        needles.append(bundle)

    layers = podman(
        "image", "inspect", "--format", "{{.GraphDriver.Data.UpperDir}}:{{.GraphDriver.Data.LowerDir}}", image["tag"]
    )
    found = []
    for layer in filter(None, layers.stdout.strip().split(":")):
        for folder, _, files in os.walk(layer):
            for file in files:
                path = os.path.join(folder, file)
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                with open(path, "rb") as handle:
                    content = handle.read()
                text = content.replace(b"\n", b"")
                found += [path for needle in needles if needle.replace(b"\n", b"") in text]
    assert not found, found
    config = podman("image", "inspect", "--format", "{{json .Config.Env}} {{json .Config.Labels}}", image["tag"]).stdout
    assert "/run/secrets" not in config and "PIP_CERT" not in config and "PIP_CONFIG_FILE" not in config, config
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", image["tag"]).stdout
    assert "BEGIN CERTIFICATE" not in history
