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
    left = [name for name in names if podman("container", "exists", name, check=False).returncode == 0]
    assert not left, f"containers left behind: {left}"


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


def readable_by_all(root: Path) -> None:
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o755)
        for file in files:
            os.chmod(os.path.join(folder, file), 0o644)


def test_the_image_has_its_commands_and_every_codec_and_runs_as_a_user(image, container_names):
    checked = run_in(image, container_names(), "python3", "/opt/sidecar/check_image.py")
    assert checked.returncode == 0, checked.stderr
    assert "image check: ok" in checked.stdout
    who = run_in(
        image,
        container_names(),
        "sh",
        "-c",
        "id -u; for c in sidecar-ops dagster ray rsync; do command -v $c; done; python3 -V",
    )
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
    readable_by_all(data / "main")  # the session's temporary folders are the test user's alone
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


def _secret_needles(image: dict, container_names) -> list[bytes]:
    """What would show the build's CA bundle in a layer: the bundle (newlines dropped) and, for each of
    this machine's own certificates in it (those beyond Debian's public ones), a piece of its body."""
    bundle = image["ca"].read_bytes()
    debian = run_in(image, container_names(), "sh", "-c", "cat /usr/share/ca-certificates/*/*.crt")
    assert debian.returncode == 0, debian.stderr
    public = _certificates(debian.stdout.encode())
    for path in Path("/usr/share/ca-certificates").rglob("*.crt"):  # this machine's copy of Debian's
        public |= _certificates(path.read_bytes())
    # A PEM file wraps base64 at 64 characters: the second and third lines of each body.
    needles = [body[64:192] for body in _certificates(bundle) - public if len(body) > 192]
    return [*needles, bundle.replace(b"\n", b"")] if bundle else needles


def _files_holding(tag: str, needles: list[bytes]) -> list[str]:
    """The files, in any layer of the image `tag` (also those a later layer deletes), holding a needle."""
    layers = podman(
        "image", "inspect", "--format", "{{.GraphDriver.Data.UpperDir}}:{{.GraphDriver.Data.LowerDir}}", tag
    )
    found = []
    for layer in filter(None, layers.stdout.strip().split(":")):
        for folder, _, files in os.walk(layer):
            for file in files:
                path = os.path.join(folder, file)
                if os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as handle:
                        text = handle.read().replace(b"\n", b"")
                    found += [path for needle in needles if needle in text]
    return found


def test_the_image_holds_no_secret_of_its_build(image, container_names, tmp_path):
    needles = _secret_needles(image, container_names)
    assert needles
    assert not _files_holding(image["tag"], needles)
    config = podman("image", "inspect", "--format", "{{json .Config.Env}} {{json .Config.Labels}}", image["tag"]).stdout
    assert "/run/secrets" not in config and "PIP_CERT" not in config and "PIP_CONFIG_FILE" not in config, config
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", image["tag"]).stdout
    assert "BEGIN CERTIFICATE" not in history

    # The scan sees a bundle copied into a layer, even one that a later layer deletes.
    (tmp_path / "ca.pem").write_bytes(image["ca"].read_bytes())
    (tmp_path / "Containerfile").write_text(
        f"FROM {image['tag']}\nCOPY ca.pem /tmp/ca.pem\nUSER root\nRUN rm /tmp/ca.pem\n"
    )
    leaky = f"localhost/sidecar-test-leak:{uuid.uuid4().hex[:10]}"
    try:
        podman("build", "--pull=never", "--network", "none", "-t", leaky, str(tmp_path), timeout=300)
        assert _files_holding(leaky, needles)
    finally:
        podman("image", "rm", "--force", leaky, check=False)
