"""A non-editable install works on its own: no checkout, no repository files."""

import os
import subprocess
import sys

import pytest

from fixed_res_sidecar_tests.fixtures import REPO_ROOT


@pytest.mark.install
def test_a_non_editable_install_runs_the_demo_and_the_code_location_outside_the_checkout(tmp_path):
    venv = tmp_path / "venv"
    # System site packages give the pinned dependencies; the project itself is installed as a wheel.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(REPO_ROOT)]
    subprocess.run(install, check=True, capture_output=True, text=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DAGSTER_HOME", "SIDECAR_DATASETS")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)

    where = run(str(python), "-c", "import fixed_res_sidecar; print(fixed_res_sidecar.__file__)")
    assert where.stdout.startswith(str(venv)), where.stdout  # the installed copy, not the checkout

    demo = run(str(venv / "bin" / "sidecar-ops"), "demo", "--workdir", "demo", "--shards", "1", "--rows-per-shard", "3")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "result: OK" in demo.stdout
    assert (elsewhere / "demo" / "dagster_home" / "dagster.yaml").is_file()  # the packaged instance settings

    env["SIDECAR_DATASETS"] = str(elsewhere / "demo" / "datasets.yaml")
    validate = run(str(python), "-m", "dagster", "definitions", "validate", "-m", "fixed_res_sidecar.defs.definitions")
    assert validate.returncode == 0, validate.stdout[-2000:] + validate.stderr[-2000:]
