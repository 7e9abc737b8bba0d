"""Run a shard job over many shards as Ray tasks (`sidecar-ops build-* --use-ray`).

The same picklable `job(rel)` the local runner uses (the CLI's
`functools.partial(build_resized_shard, ...)`) runs once per shard as a Ray task with
`num_cpus=task_cpus` and `memory=task_memory_gb` GiB, at most `max_inflight` at a time
(`RayTaskOptions`).

Failures, as a user of a shared cluster expects:

- a task whose worker or node died (killed, out of memory, node lost) gets another
  attempt, up to `max_attempts` in all; then the shard is reported failed with the reason;
- an exception raised by the job itself (unreadable Parquet, missing column) fails that
  shard at once: running it again would fail the same way;
- other shards go on either way, and the summary lists every failure.

Ray's own task retries are off (`max_retries=0`): this loop does the retrying, so it can
count attempts and say why a shard was given up. Outputs are written atomically, so a
task that dies mid-shard leaves nothing at the final name and its retry starts clean.

Stopping. There is no pool on the driver: it submits tasks and waits. Interrupted (Ctrl-C,
SIGTERM, any exception), it cancels its tasks (a KeyboardInterrupt inside each, so the shard
unwinds and removes its temporaries), kills those still running `WORKER_STOP_SECONDS` later,
and disconnects. If the driver is killed outright, Ray ends the tasks itself: they are owned
by the driver's job, and when the driver dies the job is finished and its workers are killed
(a local Ray started here shares the driver's fate: its GCS and raylet die with it and the task
workers exit about two seconds later; through Ray Client, `ray://`, the server first waits
RAY_CLIENT_RECONNECT_GRACE_PERIOD, 30 s by default). What a killed task leaves is removed by
later writes (see `io/leftovers.py`).

Importing this module needs Ray (`pip install 'fixed-resolution-sidecar[ray]'`); the CLI
turns the ImportError into a clear message.
"""

import contextlib
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions as ray_errors

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.shards.runner import WORKER_STOP_SECONDS, Progress, RunSummary, machine_cores

GIB = 2**30
FIRST_LINE_CHARS = 500  # of a Ray error's text in a failure message

# The task's process or node went away, or its result was lost with a node: run it again.
# (RayTaskError is not here: it wraps an exception raised by the job itself.)
LOST_TASK_ERRORS: tuple[type[BaseException], ...] = (
    ray_errors.WorkerCrashedError,
    ray_errors.OutOfMemoryError,
    ray_errors.NodeDiedError,
    ray_errors.ObjectLostError,  # includes OwnerDiedError, ObjectReconstructionFailedError
)


@dataclass
class RaySummary(RunSummary):
    """A RunSummary that also says how many attempts each shard took."""

    attempts: dict[str, int] = field(default_factory=dict)  # rel -> tasks submitted for it

    @property
    def retried(self) -> dict[str, int]:
        return {rel: n for rel, n in self.attempts.items() if n > 1}


@dataclass(frozen=True)
class RayTaskOptions:
    """The shard tasks of a run: how many run at once, what each asks of the cluster, and how many
    attempts a shard gets when its task is lost. Invalid values raise ValueError on construction."""

    max_inflight: int = 8
    task_cpus: float = 1
    task_memory_gb: float = 4.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.max_attempts < 1 or self.task_cpus <= 0 or self.task_memory_gb <= 0:
            raise ValueError("max_inflight and max_attempts must be >= 1; task_cpus and task_memory_gb > 0")


def _run_job(job: Callable[[str], Any], rel: str) -> Any:
    return job(rel)


def run_shards_on_ray(
    job: Callable[[str], Any],
    shards: Sequence[str],
    *,
    tasks: RayTaskOptions = RayTaskOptions(),
    address: str | None = None,
    progress: Progress | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> RaySummary:
    """Run `job` for every shard as a Ray task (as `tasks` say); never raises for a failing shard.

    Uses the Ray session of this process when there is one; otherwise connects to
    `address`, else `RAY_ADDRESS`, else starts a local Ray sized to this machine, and
    disconnects at the end. `runtime_env` is passed to `ray.init` when this call connects.
    """
    started = time.monotonic()
    summary = RaySummary()
    progress = progress or Progress(len(shards))
    if not shards:
        return summary
    connected_here = connect(address, runtime_env=runtime_env)
    try:
        local = connected_here == "local"
        num_cpus, memory = _task_resources(tasks.task_cpus, tasks.task_memory_gb, local=local, progress=progress)
        options = {"num_cpus": num_cpus, "memory": memory, "max_retries": 0, "retry_exceptions": False}
        _loop(ray.remote(_run_job), options, ray.put(job), shards, tasks, summary, progress)
    finally:
        if connected_here:
            ray.shutdown()
    summary.seconds = time.monotonic() - started
    return summary


class RayConnectionError(ConnectionError):
    """The Ray cluster named by `address` / RAY_ADDRESS could not be joined."""


def connect(address: str | None = None, runtime_env: dict[str, Any] | None = None) -> str | None:
    """Make sure this process has a Ray session; returns how it got one.

    None: one was already there (used as is, left alone at the end). "remote": connected to
    `address` or `RAY_ADDRESS`. "local": started a new local Ray with this machine's cores.
    """
    if ray.is_initialized():
        return None
    target = address or os.environ.get("RAY_ADDRESS") or "local"
    options: dict[str, Any] = {"runtime_env": runtime_env} if runtime_env else {}
    with _keeping_sigterm_handler():
        if target != "local":
            try:
                ray.init(address=target, **options)
            except Exception as exc:
                raise RayConnectionError(
                    f"cannot connect to the Ray cluster at {target!r} (from --ray-address or RAY_ADDRESS): "
                    f"{describe_exception(exc)}"
                ) from exc
            return "remote"
        # address="local" always starts a fresh instance (never attaches to a stray one).
        ray.init(address="local", num_cpus=machine_cores(), include_dashboard=False, **options)
    return "local"


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """ray.init replaces the SIGTERM handler with sys.exit; a caller's own handler (the command
    line's, which stops the tasks and exits 143) is put back."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def _task_resources(task_cpus: float, task_memory_gb: float, *, local: bool, progress: Progress) -> tuple[float, int]:
    """The per-task request; on a local Ray started here, capped to what the machine has.

    A task asking for more than any node has would wait forever. On the local machine
    that is certain, so the request is capped (as the local runner runs at least one
    worker). On a cluster an autoscaler may still add a big enough node: only warn.
    """
    num_cpus, memory = float(task_cpus), int(task_memory_gb * GIB)
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(r.get("CPU", 0) >= num_cpus and r.get("memory", 0) >= memory for r in nodes):
        return num_cpus, memory
    biggest_cpu = max((r.get("CPU", 0) for r in nodes), default=0)
    biggest_memory = max((r.get("memory", 0) for r in nodes), default=0)
    have = f"the largest node has {biggest_cpu:g} CPUs and {biggest_memory / GIB:.1f} GiB"
    want = f"a shard task asks for {num_cpus:g} CPUs and {memory / GIB:.1f} GiB"
    if local and biggest_cpu > 0 and biggest_memory > 0:
        num_cpus, memory = min(num_cpus, biggest_cpu), min(memory, int(biggest_memory))
        _note(
            progress,
            f"{want}, but this machine has {biggest_cpu:g} CPUs and {biggest_memory / GIB:.1f} GiB for Ray: "
            f"using {num_cpus:g} CPUs and {memory / GIB:.1f} GiB",
        )
    else:
        _note(progress, f"warning: {want}; {have}: tasks wait until the cluster can place them (autoscaler)")
    return num_cpus, memory


def _loop(remote, options, job_ref, shards, tasks: RayTaskOptions, summary: RaySummary, progress) -> None:
    queue = deque(shards)
    inflight: dict[ray.ObjectRef, str] = {}
    try:
        while queue or inflight:
            while queue and len(inflight) < tasks.max_inflight:
                rel = queue.popleft()
                summary.attempts[rel] = summary.attempts.get(rel, 0) + 1
                task = remote.options(**options, name=f"sidecar-shard {rel}")  # the name shows in the dashboard
                inflight[task.remote(job_ref, rel)] = rel
            ready, _ = ray.wait(list(inflight), num_returns=1)
            for ref in ready:
                rel = inflight.pop(ref)
                retry = _collect(ref, rel, tasks.max_attempts, summary, progress)
                if retry:
                    queue.appendleft(rel)  # retried next, so a crashing shard is settled early
    finally:
        _cancel(list(inflight))  # interrupted: leave no task running on the cluster


def _cancel(refs: list) -> None:
    """Stop running tasks: a KeyboardInterrupt in each (its shard unwinds, removing its temporaries),
    then the worker is killed if the task is still running `WORKER_STOP_SECONDS` later."""
    if not refs:
        return
    for ref in refs:
        ray.cancel(ref)
    _, running = ray.wait(refs, num_returns=len(refs), timeout=WORKER_STOP_SECONDS)
    for ref in running:
        ray.cancel(ref, force=True)


def _collect(ref, rel: str, max_attempts: int, summary: RaySummary, progress: Progress) -> bool:
    """Record one finished task; True when the shard should run again."""
    attempt = summary.attempts[rel]
    try:
        result = ray.get(ref)
    except LOST_TASK_ERRORS as exc:
        reason = describe_exception(exc, max_chars=FIRST_LINE_CHARS)
        if attempt < max_attempts:
            _note(progress, f"{rel}: Ray task lost on attempt {attempt}/{max_attempts} ({reason}); retrying")
            return True
        summary.failures[rel] = f"Ray worker died {attempt} times (killed or out of memory); last: {reason}"
    except ray_errors.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, ray_errors.RayError):
            summary.failures[rel] = describe_exception(cause)
        else:
            summary.failures[rel] = describe_exception(exc, max_chars=FIRST_LINE_CHARS)
    except Exception as exc:  # noqa: BLE001 - unschedulable, runtime env setup, cancelled: not worth retrying
        summary.failures[rel] = describe_exception(exc, max_chars=FIRST_LINE_CHARS)
    else:
        summary.results[rel] = result
        progress.shard_finished(rel, result)
        return False
    progress.shard_finished(rel, error=summary.failures[rel])
    return False


def _note(progress: Progress, message: str) -> None:
    """A line beside the progress lines (same stream; silent when the progress is)."""
    if not getattr(progress, "quiet", False):
        print(f"[ray] {message}", file=progress.stream or sys.stderr, flush=True)


__all__ = ["LOST_TASK_ERRORS", "RayConnectionError", "RaySummary", "RayTaskOptions", "connect", "run_shards_on_ray"]
