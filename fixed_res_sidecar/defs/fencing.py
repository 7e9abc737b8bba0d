"""Fencing a run's worker: a worker that no longer owns its run stops before it writes anything.

A run is owned by the process executing it while the instance says the run is STARTED. Run
monitoring can take that away: it marks a run FAILURE when the run's launcher says its worker is
gone (on Ray: the job failed because its node, or only its raylet, died) and run retries then
launch a new run for the same shard. If the old worker in fact lives on (the raylet was killed,
the worker's processes were not; a node was cut off from the cluster but not from storage), it
must neither finish its shard (a second build beside the retry's) nor write its end (a RUN_SUCCESS
over the FAILURE that monitoring wrote). The fence:

- `run_fence(context)`, entered at the start of a step, starts a daemon thread in the run worker
  that kills the worker at once (SIGKILL: its shard worker processes first, then itself, so
  nothing of it writes again) when
  (a) its Ray parent is gone: the job supervisor that started this entrypoint died (with its node;
      with only its raylet, seconds later: about when Ray declares the node dead and fails the job,
      docs/ray.md). Checked every `PARENT_POLL_SECONDS`, with no storage call. Only for a Ray job's
      entrypoint (another launcher's parent is no verdict on the run). Monitoring fails the run at
      its next poll, mostly later; a run it failed first is fenced by (b);
  (b) the run is no longer STARTED (FAILURE or CANCELED, by someone else: monitoring, a user)
      in the instance, read every `STATUS_POLL_SECONDS`; CANCELING is left to Dagster's own
      termination (the worker is being stopped cleanly). A run failure written by this very process
      (its own step failed: the event's pid is ours) is no reason. The thread keeps watching after
      the step until the run ended, so an orphan that lost its run between the end of its step and
      its RUN_SUCCESS is stopped too.
  Killing is only armed in a dedicated run worker (a Ray job's entrypoint, or `dagster api
  execute_run`/`resume_run`); in-process execution (`materialize`, `dagster asset materialize`, the
  tests, the default launcher's code-server children) gets the checks below but is never killed.
  `SIDECAR_RUN_FENCE=0` / `1` forces it off / on.
- `fence.still_owner()` / `fence.check()`: a fresh read, for the shard commit to call right before
  each output is renamed or uploaded into place (and before the step records its shards): owner
  means the run is STARTED now, this process was not fenced and its Ray parent lives. Storage that
  does not answer is waited for (`history.storage_call`), then the answer is "not owner": a commit
  is never made on a guess.
- `fence.commit_check`: the same check as a picklable callable for the step's shard worker
  processes (it opens the instance from its ref in the process that calls it); raises RunFenced.

Windows that remain (no fence over a plain rename can close them; storage would have to make the
rename conditional):
- between the last ownership check and the rename (microseconds for a local rename, the upload's
  time on S3): a run failed exactly then has its output committed by the old worker, unrecorded;
  the retry finds it up to date and records it as skipped (it is not built twice);
- between monitoring's FAILURE and the status poll (at most STATUS_POLL_SECONDS) when the worker's
  Ray parent lives (a node cut off from the cluster but not from storage): that worker may write
  events, or its RUN_SUCCESS if it was in its last second. A retry starts later than that (the
  retry daemon, the queue, a Ray job start and a code load take several seconds);
- a worker stopped (SIGSTOP, a frozen VM) across both: it runs its next instruction before its
  thread can look.
"""

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from fixed_res_sidecar.defs.dagster_private import InstanceRef

FENCE_ENV = "SIDECAR_RUN_FENCE"  # "0": never kill; "1": kill even outside a dedicated run worker
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor in the entrypoint's environment
PARENT_POLL_SECONDS = 0.2
STATUS_POLL_SECONDS = 1.0
# A commit waits as long for storage to confirm ownership as the step waits to record its shards
# (history.STORAGE_RETRY's budget, None here): an outage the recording would outlast does not fail the commit.
CHECK_STORAGE_BUDGET_SECONDS: float | None = None
OWNED = dg.DagsterRunStatus.STARTED
LOST = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
SHELLS = {"sh", "dash", "bash"}


class RunFenced(Exception):
    """This process no longer owns its run: nothing may be committed or recorded."""


# -- processes (Linux /proc; elsewhere the parent check degrades to os.getppid) ----------------------


def _start_time(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _parent_of(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ray_parents() -> list[tuple[int, int | None]]:
    """(pid, start time) of this entrypoint's Ray parents: the shell Ray's job supervisor ran the
    entrypoint in, if there is one, and the supervisor itself."""
    chain, pid = [], os.getppid()
    while pid > 1:
        chain.append((pid, _start_time(pid)))
        if _name(pid) not in SHELLS:
            break
        pid = _parent_of(pid) or 0
    return chain


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (parent := _parent_of(int(entry.name))) is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_this_worker() -> None:
    """SIGKILL this process's descendants (shard worker processes), then this process."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def dedicated_run_worker() -> bool:
    """Whether this process exists only to execute a run (so killing it harms nothing else)."""
    forced = os.environ.get(FENCE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return RAY_JOB_ENV in os.environ or any(arg in ("execute_run", "resume_run") for arg in sys.argv[1:4])


# -- ownership -----------------------------------------------------------------------------------------


def _status(instance: dg.DagsterInstance, run_id: str, budget: float | None) -> dg.DagsterRunStatus | None:
    """The run's status now; None when storage did not answer within `budget` s."""
    from fixed_res_sidecar.defs.history import EventLogUnavailable, storage_call

    try:
        run = storage_call(instance.get_run_by_id, run_id, budget=budget)
    except EventLogUnavailable:
        return None
    return run.status if run is not None else dg.DagsterRunStatus.FAILURE  # deleted: nobody owns it


def _lost_by_others(instance: dg.DagsterInstance, run_id: str, status: dg.DagsterRunStatus) -> bool:
    """Whether the run's FAILURE/CANCELED was written by another process than this one."""
    kind = (
        dg.DagsterEventType.RUN_FAILURE if status == dg.DagsterRunStatus.FAILURE else dg.DagsterEventType.RUN_CANCELED
    )
    try:
        records = instance.get_records_for_run(run_id, of_type=kind, limit=1, ascending=False).records
    except Exception:  # noqa: BLE001 - unreadable: assume another process (the safe side)
        return True
    if not records:
        return True
    event = records[0].event_log_entry.dagster_event
    return event is None or event.pid != os.getpid()


_INSTANCES: dict[str, dg.DagsterInstance] = {}  # by serialized ref


@dataclass(frozen=True)
class OwnerCheck:
    """The ownership check as a picklable callable, for the shard worker processes of a step:
    raises RunFenced when `run_id` is not STARTED now, or its run worker `owner_pid` is gone."""

    instance_ref: InstanceRef
    run_id: str
    owner_pid: int
    owner_started: int | None

    def reason(self) -> str | None:
        """Why this process may not commit for the run (None: it may)."""
        if self.owner_pid == os.getpid() and _FENCE is not None and _FENCE.run_id == self.run_id:
            return _FENCE.reason()  # in the run worker itself: its fence (and its instance)
        if self.owner_pid != os.getpid() and _start_time(self.owner_pid) != self.owner_started:
            return f"its run worker (pid {self.owner_pid}) is gone"
        key = dg.serialize_value(self.instance_ref)
        instance = _INSTANCES.get(key)
        if instance is None:  # a shard worker process: its own instance, opened once
            instance = _INSTANCES[key] = dg.DagsterInstance.from_ref(self.instance_ref)
        status = _status(instance, self.run_id, CHECK_STORAGE_BUDGET_SECONDS)
        return None if status == OWNED else _status_reason(self.run_id, status)

    def __call__(self) -> None:
        if (why := self.reason()) is not None:
            raise RunFenced(f"not committing: {why}")


def _status_reason(run_id: str, status: dg.DagsterRunStatus | None) -> str:
    if status is None:
        return f"the instance's storage did not answer whether run {run_id} is still this worker's"
    return f"run {run_id} is {status.value} in the instance (no longer this worker's: failed or canceled elsewhere)"


_FENCE: "RunFence | None" = None  # the fence of this process's current run


class RunFence:
    """The fence of one run in its run worker (see the module's docstring)."""

    def __init__(self, instance: dg.DagsterInstance, run_id: str, *, armed: bool, watch_parent: bool,
                 status_poll: float = STATUS_POLL_SECONDS, parent_poll: float = PARENT_POLL_SECONDS):  # fmt: skip
        self.instance, self.run_id, self.armed = instance, run_id, armed
        self.parents = _ray_parents() if watch_parent else []
        self.status_poll, self.parent_poll = status_poll, parent_poll
        self.lost: str | None = None  # why this worker lost its run, once it did
        self.step_failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        ref = instance.get_ref()
        self.commit_check = OwnerCheck(ref, run_id, os.getpid(), _start_time(os.getpid()))

    # -- checks

    def parent_gone(self) -> str | None:
        for pid, started in self.parents:
            if _start_time(pid) != started:
                return (
                    f"its Ray parent (pid {pid}, the job supervisor or its shell) is gone: the node or its raylet died"
                )
        return None

    def reason(self, budget: float | None = CHECK_STORAGE_BUDGET_SECONDS) -> str | None:
        """Why this worker may not commit now (None: it still owns its run); a fresh status read."""
        if self.lost is None:
            self.lost = self.parent_gone()
        if self.lost:
            return self.lost
        status = _status(self.instance, self.run_id, budget)
        if status == OWNED:
            return None
        why = _status_reason(self.run_id, status)
        if status in LOST:
            self.lost = why
        return why

    def still_owner(self) -> bool:
        return self.reason() is None

    def check(self) -> None:
        """Raise RunFenced unless this worker still owns its run (call right before a commit)."""
        if (why := self.reason()) is not None:
            raise RunFenced(f"not committing: {why}")

    # -- the watch thread

    def start(self) -> "RunFence":
        self._thread = threading.Thread(target=self._watch, name=f"run-fence {self.run_id[:8]}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        next_status = time.monotonic()
        while not self._stop.wait(self.parent_poll):
            if why := self.parent_gone():
                self._lose(why)
                return
            if time.monotonic() < next_status:
                continue
            next_status = time.monotonic() + self.status_poll
            try:
                run = self.instance.get_run_by_id(self.run_id)
            except Exception:  # noqa: BLE001 - storage down: nobody can fail the run through it either
                continue
            status = run.status if run is not None else dg.DagsterRunStatus.FAILURE
            if status == dg.DagsterRunStatus.SUCCESS or (status in LOST and self.step_failed):
                return  # the run ended, by this worker's own doing
            if status in LOST and _lost_by_others(self.instance, self.run_id, status):
                self._lose(_status_reason(self.run_id, status))
                return

    def _lose(self, why: str) -> None:
        self.lost = why
        if not self.armed:
            return
        message = f"Run worker fenced (pid {os.getpid()}): {why}; killing it so it cannot write for this run again."
        print(f"[fence] {message}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # best effort, bounded: the kill must not wait on storage
            recorder = threading.Thread(target=self._record, args=(message,), daemon=True)
            recorder.start()
            recorder.join(timeout=2.0)
        kill_this_worker()

    def _record(self, message: str) -> None:
        run = self.instance.get_run_by_id(self.run_id)
        if run is not None:
            self.instance.report_engine_event(message, run, cls=RunFence)


@contextlib.contextmanager
def run_fence(context, *, armed: bool | None = None, watch_parent: bool | None = None,
              status_poll: float = STATUS_POLL_SECONDS, parent_poll: float = PARENT_POLL_SECONDS) -> Iterator[RunFence]:  # fmt: skip
    """The fence of the run executing this step (`context`: an op or asset execution context; see
    the module's docstring). Raises RunFenced at once if the run is not this worker's already.

    `armed` (kill on loss): by default in a dedicated run worker only; `watch_parent`: by default in
    a Ray job's entrypoint only."""
    global _FENCE
    armed = dedicated_run_worker() if armed is None else armed
    watch_parent = (RAY_JOB_ENV in os.environ) if watch_parent is None else watch_parent
    fence = RunFence(context.instance, context.run.run_id, armed=armed, watch_parent=watch_parent,
                     status_poll=status_poll, parent_poll=parent_poll)  # fmt: skip
    fence.check()
    previous, _FENCE = _FENCE, fence
    fence.start()
    ok = False
    try:
        yield fence
        ok = True
    finally:
        _FENCE = previous
        if not ok:
            # This step fails: the run's FAILURE will be this worker's own, no reason to kill it. A
            # parent that dies meanwhile still is (the thread goes on watching for that).
            fence.step_failed = True
        if not armed:
            fence.stop()
        # Armed, the thread goes on after the step (a daemon thread: it ends with the process) until
        # the run ended, so a FAILURE written by monitoring before this worker's RUN_SUCCESS stops it.


def current_fence() -> RunFence:
    """The fence of the step running in this process (entered with `run_fence` or `fenced`)."""
    if _FENCE is None:
        raise RuntimeError("no run fence: the step is not running inside run_fence() / @fenced")
    return _FENCE


def fenced(step):
    """Decorator for a step's (generator) compute function whose first argument is its context: the
    whole step runs inside `run_fence(context)`. Keeps the function's signature and annotations,
    which Dagster reads (put it under `@dg.multi_asset(...)`)."""

    @functools.wraps(step)
    def fenced_step(context, *args, **kwargs):
        with run_fence(context):
            yield from step(context, *args, **kwargs)

    return fenced_step


__all__ = [
    "OwnerCheck",
    "RunFence",
    "RunFenced",
    "current_fence",
    "dedicated_run_worker",
    "fenced",
    "kill_this_worker",
    "run_fence",
]
