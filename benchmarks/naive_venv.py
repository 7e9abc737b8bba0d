"""The python that runs the naive pipeline: by default that of a Pillow 13 virtual environment.

Issue 6 defines the naive baseline on plain Pillow 13, which must not be installed next to
the project's pillow-simd, so the benchmark makes its own venv once, in the workdir
(`python -m venv`, no system site packages, then `pip install pillow==13.0.0
pyarrow==<the installed version>`), and checks that its PIL really is Pillow 13 with WebP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from benchmarks import naive_worker
from benchmarks.common import log

NAIVE_PILLOW_VERSION = "13.0.0"
NAIVE_VENV_NAME = "naive-pillow-venv"
NAIVE_WORKER = Path(naive_worker.__file__).resolve()


class NaiveVenvError(RuntimeError):
    pass


def _isolated_env() -> dict[str, str]:
    """This environment without the variables that would let the venv's python import from elsewhere."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


@dataclass
class NaiveRuntime:
    """The python that runs naive_worker.py: the Pillow 13 venv's, or this one (installed PIL)."""

    kind: str  # "venv" | "installed"
    python: str
    venv: str | None = None
    created: bool = False
    info: dict | None = None

    @classmethod
    def installed(cls) -> NaiveRuntime:
        return cls("installed", sys.executable, info=naive_worker.pil_info())

    def worker_command(self, *args: str) -> list[str]:
        # -I (isolated): no PYTHONPATH, user site or script directory, so only the venv's own
        # site-packages (Pillow 13, pyarrow) can be imported.
        python = [self.python, "-I"] if self.kind == "venv" else [self.python]
        return [*python, str(NAIVE_WORKER), *args]

    def env(self) -> dict[str, str] | None:
        return _isolated_env() if self.kind == "venv" else None

    def check(self, info: dict) -> None:
        """Fails unless the worker's reported PIL is the venv's Pillow 13 (not pillow-simd)."""
        problems = _venv_problems(info)
        if problems:
            raise NaiveVenvError(f"naive worker in {self.venv}: {'; '.join(problems)} ({info})")

    def describe(self) -> dict:
        return {"kind": self.kind, "python": self.python, "venv": self.venv, "created": self.created, "pil": self.info}


def _venv_problems(info: dict) -> list[str]:
    problems = []
    if info.get("is_pillow_simd"):
        problems.append("runs pillow-simd")
    if info.get("distribution", "").lower() != "pillow" or info.get("version") != NAIVE_PILLOW_VERSION:
        problems.append(f"PIL is {info.get('distribution')} {info.get('version')}, not Pillow {NAIVE_PILLOW_VERSION}")
    if not info.get("webp"):
        problems.append("its Pillow has no WebP support (PIL.features.check('webp') is False)")
    return problems


def _run_logged(command: list[str], what: str, env: dict | None = None, timeout: float = 900) -> str:
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NaiveVenvError(f"{what} failed: {' '.join(command)}: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise NaiveVenvError(f"{what} failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
    return done.stdout


def _probe_venv(python: Path) -> dict:
    runtime = NaiveRuntime("venv", str(python))
    out = _run_logged(runtime.worker_command("--info"), "probing the naive venv", runtime.env(), 120)
    return json.loads(out.strip().splitlines()[-1])


def ensure_naive_venv(venv: Path, *, create: bool = True) -> NaiveRuntime:
    """The Pillow 13 virtual environment for the naive baseline, created (and cached) on first use.

    Reused when its python imports Pillow 13 with WebP; recreated otherwise, unless `create` is false.
    """
    venv = venv.absolute()  # not resolve(): the venv's bin/python is a symlink to the base python
    python = venv / "bin" / "python"
    if python.exists():
        try:
            info = _probe_venv(python)
            if not _venv_problems(info):
                return NaiveRuntime("venv", str(python), str(venv), False, info)
            reason = "; ".join(_venv_problems(info))
        except (NaiveVenvError, ValueError) as exc:
            reason = str(exc)
        if not create:
            raise NaiveVenvError(f"{venv} is not a usable Pillow {NAIVE_PILLOW_VERSION} venv: {reason}")
        log(f"naive venv: {venv} unusable ({reason}); recreating it")
    elif not create:
        raise NaiveVenvError(f"no venv at {venv} (and creating one was not allowed)")
    if venv.exists():
        shutil.rmtree(venv)
    requirements = [f"pillow=={NAIVE_PILLOW_VERSION}", f"pyarrow=={metadata.version('pyarrow')}"]
    started = time.perf_counter()
    log(f"naive venv: creating {venv} and installing {' '.join(requirements)} (first run only) ...")
    env = _isolated_env()
    _run_logged([sys.executable, "-m", "venv", str(venv)], "creating the naive venv (python -m venv)", env)
    _run_logged(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements],
        "pip install in the naive venv",
        env,
    )
    info = _probe_venv(python)
    problems = _venv_problems(info)
    if problems:
        raise NaiveVenvError(f"naive venv {venv} after install: {'; '.join(problems)} ({info})")
    log(
        f"naive venv: ready in {time.perf_counter() - started:.0f} s: {info['distribution']} {info['version']}, libwebp {info['libwebp']}"
    )
    return NaiveRuntime("venv", str(python), str(venv), True, info)


def naive_runtime(
    workdir: Path, *, on_installed_pil: bool = False, venv: Path | None = None, create: bool = True
) -> NaiveRuntime:
    if on_installed_pil:
        return NaiveRuntime.installed()
    return ensure_naive_venv(venv or workdir / NAIVE_VENV_NAME, create=create)
