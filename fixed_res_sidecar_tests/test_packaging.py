"""A non-editable install works on its own: no checkout, no repository files."""

import os
import subprocess
import sys
from pathlib import Path

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


# ---- The package alone: no extras, a clean virtual environment (issue 23)

PILLOW_SIMD = "pillow-simd==12.1.1.post0"
# Top-level modules the package imports only where an extra provides them, each behind an ImportError
# that names the extra: the Ray runner (--use-ray) and dagster-postgres's error type; or in a module
# only a production instance loads (defs/ray_launcher.py, named by deploy/dagster-ray.yaml).
EXTRA_IMPORTS = {"ray": "ray", "dagster_postgres": "deploy", "dagster_ray": "deploy"}


def _project() -> dict:
    import tomllib

    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def _requirement_names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _third_party_imports() -> dict[str, str]:
    """Each top-level module the package imports that is not its own or the standard library's, with
    one file that imports it."""
    import ast

    found: dict[str, str] = {}
    for path in sorted((REPO_ROOT / "fixed_res_sidecar").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "fixed_res_sidecar" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(REPO_ROOT)))
    return found


def test_every_run_time_import_comes_from_the_dependencies_or_a_named_extra():
    from importlib import metadata

    project = _project()
    dependencies = _requirement_names(project["dependencies"])
    distributions = metadata.packages_distributions()
    for module, where in _third_party_imports().items():
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        assert names, f"{where} imports {module}, which no installed distribution provides"
        if module in EXTRA_IMPORTS:
            extra = _requirement_names(project["optional-dependencies"][EXTRA_IMPORTS[module]])
            assert names & extra, f"{where} imports {module} ({names}), not in the {EXTRA_IMPORTS[module]} extra"
        else:
            assert names & dependencies, f"{where} imports {module} ({names}), not in [project.dependencies]"


def test_the_deploy_extra_has_rays_job_server_at_the_ray_extras_version():
    extras = _project()["optional-dependencies"]
    [deploy_ray] = [r for r in extras["deploy"] if r.startswith("ray[")]
    [plain_ray] = extras["ray"]
    assert "default" in deploy_ray.split("]")[0], deploy_ray  # the job server dagster-ray's launcher submits to
    assert deploy_ray.split("==")[1] == plain_ray.split("==")[1]


def _pillow_simd_wheel(tmp_path) -> Path:
    """The pillow-simd wheel pip already built (its wheel cache), or one built now (about a minute)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "list", "pillow_simd", "--format=abspath"],
        capture_output=True,
        text=True,
    )
    version = PILLOW_SIMD.split("==")[1]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    cached = [Path(line) for line in listed.stdout.split() if f"-{version}-{tag}-" in line and Path(line).is_file()]
    if cached:
        return cached[0]
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", "pillow-simd", PILLOW_SIMD]
    subprocess.run([*build, "-w", str(wheels)], check=True, capture_output=True, timeout=600)
    return next(wheels.glob("pillow_simd-*.whl"))


@pytest.mark.install
def test_a_plain_install_without_extras_runs_in_a_clean_venv(tmp_path):
    """`pip install` of the checkout, no extras, no system site packages: the console script and the
    demo run, WebP works, and pillow-simd is the only PIL."""
    import shutil

    # The checkout's sources, copied: the build writes no build/ into the checkout and packs no stale file.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(
        REPO_ROOT / "fixed_res_sidecar", source / "fixed_res_sidecar", ignore=shutil.ignore_patterns("__pycache__")
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [
        str(python),
        "-m",
        "pip",
        "install",
        "-q",
        "--no-compile",
        str(_pillow_simd_wheel(tmp_path)),
        str(source),
    ]
    installed = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DAGSTER_HOME", "SIDECAR_DATASETS")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)

    names = run(
        str(python),
        "-c",
        "from importlib import metadata; print(*(d.metadata['Name'] for d in metadata.distributions()))",
    )
    distributions = {n.lower() for n in names.stdout.split()}
    assert "pillow-simd" in distributions and "pillow" not in distributions, sorted(distributions)
    assert "ray" not in distributions and "pytest" not in distributions  # no extra came along

    helped = run(str(venv / "bin" / "sidecar-ops"), "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "build-both" in helped.stdout
    webp = run(str(python), "-c", "import PIL.features; assert PIL.features.check('webp')")
    assert webp.returncode == 0, webp.stderr[-2000:]
    demo = run(str(venv / "bin" / "sidecar-ops"), "demo", "--workdir", "demo", "--shards", "1", "--rows-per-shard", "3")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "result: OK" in demo.stdout


# ---- scripts/requirements_met.py: what lets scripts/setup.sh skip pip's resolver


def _requirements_met():
    import importlib.util

    spec = importlib.util.spec_from_file_location("requirements_met", REPO_ROOT / "scripts" / "requirements_met.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_requirements_met_names_the_first_requirement_not_installed_at_any_depth(tmp_path, monkeypatch):
    from importlib import metadata

    unmet = _requirements_met().unmet
    assert unmet(REPO_ROOT / "pyproject.toml", ["test", "ray", "deploy"]) is None  # this machine, set up
    # Installed distributions of our own making: one needing pytest, and with its extra "more" a missing
    # package (and on Python 2 only another); one needing a missing package.
    site = tmp_path / "site"
    made = {
        "made-up-dist": 'pytest\nRequires-Dist: made-up-extra-dep; extra == "more"\n'
        'Requires-Dist: made-up-python2-dep; python_version < "3"',
        "made-up-broken": "made-up-not-installed",
    }
    for name, requires in made.items():
        (site / f"{name.replace('-', '_')}-1.0.dist-info").mkdir(parents=True)
        (site / f"{name.replace('-', '_')}-1.0.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nRequires-Dist: {requires}\n"
        )
    monkeypatch.syspath_prepend(str(site))
    pyproject = tmp_path / "pyproject.toml"

    def unmet_with(dependencies: list[str], extra: list[str] | None = None) -> str | None:
        pyproject.write_text(
            f"[project]\nname = 'p'\ndependencies = {dependencies!r}\n"
            f"[project.optional-dependencies]\nextra = {extra or []!r}\n"
        )
        return unmet(pyproject, ["extra"])

    assert unmet_with(["made-up-dist==1.0", "pytest>=1"]) is None
    assert unmet_with(['made-up-python2-only; python_version < "3"']) is None
    assert unmet_with(["pytest"], extra=["made-up-not-installed"]) == "made-up-not-installed: not installed"
    assert unmet_with(["made_up_broken"]) == "made-up-not-installed: not installed"  # a level down
    assert unmet_with(["pytest==0.0.1"]) == f"pytest==0.0.1: {metadata.version('pytest')} is installed"
    assert unmet_with(["made-up-dist[more]"]) == 'made-up-extra-dep; extra == "more": not installed'
    assert unmet(REPO_ROOT / "pyproject.toml", ["no-such-extra"]) == "no such extra in pyproject.toml: no-such-extra"
