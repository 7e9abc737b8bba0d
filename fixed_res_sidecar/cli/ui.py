"""`sidecar-ops ui`: the Dagster UI (`dagster dev`) on a datasets file, from any folder.

Which datasets file and Dagster home, first that applies:
  --datasets FILE              that file; the home is --dagster-home, $DAGSTER_HOME or <FILE's folder>/dagster_home
  --workdir DIR                a `sidecar-ops demo` work dir: DIR/datasets.yaml and DIR/dagster_home
  ./sidecar-demo               the demo's work dir, when it exists (after `sidecar-ops demo`)
  the last demo run from here  `sidecar-ops demo --workdir DIR` run from this folder (recorded under
                               $XDG_STATE_HOME, default ~/.local/state), with the home it used
  ./datasets.yaml              with --dagster-home, $DAGSTER_HOME or ./dagster_home

The home gets the packaged instance settings (dagster.yaml) if it has none, and a workspace
file of its own, so no checkout is needed. In the foreground, Ctrl-C stops the UI. With
`--detach` it runs in its own session (log in <home>/dagster-dev.log) and `sidecar-ops ui --stop`
with the same options stops it: the whole process group (webserver, daemon, code server)
gets SIGINT, as Ctrl-C would send, then SIGKILL if it has not stopped after a while.
"""

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fixed_res_sidecar.cli.common import usage_error

DEMO_WORKDIR = Path("sidecar-demo")
PID_FILE = "dagster-dev.pid"
LOG_FILE = "dagster-dev.log"
WORKSPACE_FILE = "workspace.yaml"
STARTUP_SECONDS = 120  # the webserver answers after the code location loaded
STOP_SECONDS = 30


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ui",
        help="start the Dagster UI (dagster dev) on a datasets file, from any folder",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,  # None under python -OO
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--datasets", default=None, help="the datasets file")
    parser.add_argument("--workdir", default=None, help="a `sidecar-ops demo` work dir (default: ./sidecar-demo)")
    parser.add_argument("--dagster-home", default=None, help="where Dagster keeps runs and events")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--detach", action="store_true", help="run in the background; stop it with --stop")
    parser.add_argument("--stop", action="store_true", help="stop a UI started with --detach (same options)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fixed_res_sidecar.defs.config import ConfigError, load_config

    try:
        datasets, home = where(args)
    except ValueError as exc:
        return usage_error(exc)
    if args.stop:
        return stop(home)
    env = {**os.environ, "DAGSTER_HOME": str(home), "SIDECAR_DATASETS": str(datasets)}
    previous = {name: os.environ.get(name) for name in ("SIDECAR_DATASETS",)}
    os.environ["SIDECAR_DATASETS"] = str(datasets)
    try:
        config = load_config()  # refused here, before anything starts, with the dataset and field named
    except ConfigError as exc:
        return usage_error(exc)
    finally:
        _restore(previous)
    for problem in filter(None, (dataset.main_problem() for dataset in config.datasets)):
        print(f"warning: {problem}; its discovery sensor fails until it exists", file=sys.stderr)
    workspace = prepare_home(home)
    command = [
        sys.executable, "-m", "dagster", "dev", "-w", str(workspace), "-h", args.host, "-p", str(args.port),
    ]  # fmt: skip
    url = f"http://{args.host}:{args.port}"
    print(f"Dagster UI on {datasets} (Dagster home {home}): {url}", flush=True)
    if not args.detach:
        print("Ctrl-C stops it.", flush=True)
        try:
            return subprocess.call(command, env=env)
        except KeyboardInterrupt:  # dagster dev got the same Ctrl-C and stops itself
            return 130
    return detach(command, env, home, url, args)


def where(args: argparse.Namespace) -> tuple[Path, Path]:
    """(datasets file, Dagster home) from the options, the demo's work dir, or the current folder."""
    from fixed_res_sidecar.demo import remembered_demo  # Dagster is imported only when a command runs

    explicit_home = args.dagster_home or os.environ.get("DAGSTER_HOME")
    if args.datasets:
        datasets = Path(args.datasets).expanduser().resolve()
        home = Path(explicit_home).expanduser().resolve() if explicit_home else datasets.parent / "dagster_home"
    elif args.workdir or DEMO_WORKDIR.is_dir():
        workdir = Path(args.workdir or DEMO_WORKDIR).expanduser().resolve()
        datasets, home = workdir / "datasets.yaml", Path(args.dagster_home or workdir / "dagster_home").resolve()
    elif (demo := remembered_demo(Path.cwd())) is not None and not Path("datasets.yaml").is_file():
        workdir, demo_home = demo
        datasets, home = workdir / "datasets.yaml", Path(args.dagster_home or demo_home).resolve()
    else:
        datasets = Path("datasets.yaml").resolve()
        home = Path(explicit_home or "dagster_home").expanduser().resolve()
    if not datasets.is_file():
        raise ValueError(
            f"no datasets file at {datasets}: give --datasets FILE or --workdir DIR, or run `sidecar-ops demo` first"
        )
    return datasets, home


def prepare_home(home: Path) -> Path:
    """The Dagster home with instance settings and a workspace file; returns the workspace file."""
    from fixed_res_sidecar.demo import INSTANCE_YAML

    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        shutil.copyfile(INSTANCE_YAML, home / "dagster.yaml")
    workspace = home / WORKSPACE_FILE
    workspace.write_text(
        "# Written by `sidecar-ops ui`: the code location, built from the datasets file in SIDECAR_DATASETS.\n"
        "load_from:\n"
        "  - python_module:\n"
        "      module_name: fixed_res_sidecar.defs.definitions\n"
        "      location_name: fixed_res_sidecar\n"
    )
    return workspace


def detach(command: list[str], env: dict[str, str], home: Path, url: str, args: argparse.Namespace) -> int:
    if _running(home):
        return usage_error(f"a UI started from {home} is already running (pid {_pid(home)}); stop it with --stop")
    with open(home / LOG_FILE, "ab") as log:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_sigint_at_its_default,
        )
    (home / PID_FILE).write_text(str(process.pid))
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return usage_error(f"dagster dev stopped at once (exit {process.returncode}); see {home / LOG_FILE}")
        if _answers(url):
            stop_options = " ".join(
                f"--{name.replace('_', '-')} {value}"
                for name, value in (
                    ("datasets", args.datasets),
                    ("workdir", args.workdir),
                    ("dagster_home", args.dagster_home),
                )
                if value
            )
            print(f"Running in the background (log {home / LOG_FILE}). Browse {url}", flush=True)
            print(f"Stop it with: sidecar-ops ui --stop {stop_options}".rstrip(), flush=True)
            return 0
        time.sleep(1)
    _signal_group(process.pid, signal.SIGKILL)
    return usage_error(f"dagster dev did not answer on {url} within {STARTUP_SECONDS} s; see {home / LOG_FILE}")


def _sigint_at_its_default() -> None:
    """In the detached `dagster dev`, before it starts: `--stop` sends it SIGINT. This command, started in
    the background by a script, inherits SIGINT ignored, and an ignored signal stays ignored across exec:
    dagster dev would ignore `--stop` (and SIGTERM, which Dagster maps to SIGINT's handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(home: Path) -> int:
    pid = _pid(home)
    if pid is None or not _running(home):
        print(f"no UI started from {home} is running", flush=True)
        (home / PID_FILE).unlink(missing_ok=True)
        return 0
    _signal_group(pid, signal.SIGINT)  # what Ctrl-C sends: dagster dev stops its webserver, daemon and code server
    deadline = time.monotonic() + STOP_SECONDS
    while time.monotonic() < deadline and _group_alive(pid):
        time.sleep(0.5)
    if _group_alive(pid):
        print(f"the UI had not stopped {STOP_SECONDS} s after SIGINT: killing it", file=sys.stderr, flush=True)
        _signal_group(pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_SECONDS
        while time.monotonic() < deadline and _group_alive(pid):
            time.sleep(0.1)
    (home / PID_FILE).unlink(missing_ok=True)
    print(f"stopped the UI started from {home}", flush=True)
    return 0


def _pid(home: Path) -> int | None:
    try:
        return int((home / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _running(home: Path) -> bool:
    pid = _pid(home)
    return pid is not None and _group_alive(pid)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. A zombie has exited: where nothing reaps orphans
    (PID 1 of some containers), the group's exited processes stay zombies for good."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): any member, zombie or not
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in entries:
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # ended while we looked
                continue
            state, _ppid, group = text[text.rindex(")") + 2 :].split()[:3]
            if int(group) == pgid and state not in "ZX":
                return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _restore(previous: dict[str, str | None]) -> None:
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
