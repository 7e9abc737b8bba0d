"""Run a shard job over many shards in local worker processes, with progress and retries.

A shard job is any picklable callable `job(rel) -> result` whose result has `rows`
(e.g. `functools.partial(build_resized_shard, main, outputs=..., ...)`). A shard that
raises fails alone; a worker process that dies (killed, out of memory) costs the shards
it held one attempt each, and they are retried on a fresh pool up to `max_attempts`.

Stopping. Workers never outlive the run: when the run is interrupted (Ctrl-C, SIGTERM, any
exception) the parent sends its workers SIGTERM and kills those still there after
`WORKER_STOP_SECONDS`; when the parent dies (even SIGKILL), each worker gets SIGTERM from
the kernel (Linux parent-death signal) or from its own watchdog thread, which polls the
parent pid (any OS) and ends the worker after `WORKER_STOP_SECONDS` at the latest. A worker
handles SIGTERM by unwinding its shard, so `finally` blocks remove temporaries and abort
uploads, and then exits with status 143.
"""

import contextlib
import ctypes
import functools
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TextIO

from fixed_res_sidecar.core.errors import describe_exception

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, what a shell reports for a process ended by SIGTERM
WORKER_STOP_SECONDS = 5.0  # a stopping worker's time to unwind before it is killed
PARENT_POLL_SECONDS = 0.2  # how often a worker's watchdog looks at its parent
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: handled like Ctrl-C. Only `finally` blocks and handlers meant for an
    interrupt see it (temporaries are removed and uploads aborted on the way out), and libraries
    that cancel their work on KeyboardInterrupt (boto3 transfers, Ray) do so for SIGTERM too."""


def raise_terminated(signum, frame) -> None:
    """SIGTERM handler: raise Terminated once; later ones are ignored so the cleanup can finish."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(f"signal {signum}")


@dataclass
class RunSummary:
    results: dict[str, Any] = field(default_factory=dict)  # rel -> job result
    failures: dict[str, str] = field(default_factory=dict)  # rel -> reason
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


class Progress:
    """One line per finished shard: shards done, failures, rows per second."""

    def __init__(self, total: int, stream: TextIO | None = None, quiet: bool = False):
        self.total, self.stream, self.quiet = total, stream, quiet
        self.done = self.failed = self.rows = 0
        self.started = time.monotonic()

    def shard_finished(self, rel: str, result: Any = None, error: str | None = None) -> None:
        self.done += 1
        if error is not None:
            self.failed += 1
        else:
            self.rows += getattr(result, "rows", 0)
        if self.quiet:
            return
        elapsed = max(time.monotonic() - self.started, 1e-9)
        status = f"FAILED: {error}" if error is not None else getattr(result, "status_text", "done")
        print(
            f"[{self.done}/{self.total} shards, {self.failed} failed, {self.rows / elapsed:.1f} rows/s] {rel}: {status}",
            file=self.stream or sys.stderr,  # looked up late: callers may redirect stderr
            flush=True,
        )


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def local_workers(max_inflight: int, task_cpus: int) -> int:
    """At most `max_inflight`, and no more than the cores allow at `task_cpus` each."""
    return max(1, min(max_inflight, machine_cores() // max(1, task_cpus)))


def run_shards(
    job: Callable[[str], Any],
    shards: Sequence[str],
    *,
    workers: int = 1,
    max_attempts: int = 3,
    progress: Progress | None = None,
    threads: bool = False,
) -> RunSummary:
    """Run `job` for every shard; never raises for a failing shard.

    Processes by default (CPU-bound image work); `threads=True` for light, I/O-bound jobs
    such as the crop sidecar, where starting processes would cost more than it saves.

    When a worker process dies, the pool breaks and every shard it held is lost without
    knowing which one killed it. Those shards are then run one at a time, so only a shard
    that kills its worker while running alone is charged an attempt: a shard that is
    OOM-killed every time cannot take healthy neighbours down with it.
    """
    started = time.monotonic()
    summary = RunSummary()
    progress = progress or Progress(len(shards))
    deaths = dict.fromkeys(shards, 0)
    task = job if threads else functools.partial(_run_job, job)
    todo, suspects = list(shards), []
    while todo or suspects:
        if suspects:
            batch, width = [suspects.pop(0)], 1
        else:
            batch, width, todo = todo, workers, []
        with _pool(width, threads) as pool:
            lost, unstarted = _run_pool(pool, task, batch, width, summary, progress)
        if width == 1 and lost:  # it died alone: it is the culprit
            (rel,) = lost
            deaths[rel] += 1
            if deaths[rel] >= max_attempts:
                summary.failures[rel] = f"worker process died {deaths[rel]} times (killed or out of memory)"
                progress.shard_finished(rel, error=summary.failures[rel])
            else:
                suspects.insert(0, rel)
        else:
            suspects.extend(lost)
        todo = unstarted + todo
    summary.seconds = time.monotonic() - started
    return summary


_POOL_NUMBERS = itertools.count()


@contextlib.contextmanager
def _pool(workers: int, threads: bool):
    """A pool that is shut down normally at the end, and stopped when the block raises."""
    if threads:
        # A name of its own, so that _stop can find every thread of this pool (see there).
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"shards-{next(_POOL_NUMBERS)}")
    else:
        # spawn, not fork: boto3 clients and thread pools are not fork-safe. The workers are
        # started by the thread that submits (this one), which outlives them: the kernel's
        # parent-death signal follows the thread that started a process, not the process.
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(os.getpid(),),
        )
    try:
        yield pool
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()


def _stop(pool) -> None:
    """Stop a pool at once: nothing more starts, worker processes unwind (SIGTERM), then are killed."""
    if isinstance(pool, ThreadPoolExecutor):
        # A thread cannot be stopped from outside; running shards finish (their writes are atomic).
        pool.shutdown(wait=True, cancel_futures=True)
        # shutdown joins the threads the pool has registered; a signal inside submit() can come after
        # a thread started (and took its shard) but before it was registered. Found by CI under load.
        prefix = f"{pool._thread_name_prefix}_"  # CPython's ThreadPoolExecutor names its threads so
        for thread in threading.enumerate():
            if thread.name.startswith(prefix) and thread is not threading.current_thread():
                thread.join()
        return
    processes = list((pool._processes or {}).values())  # CPython's pid -> Process map of the pool
    for process in processes:
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + WORKER_STOP_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


# -- inside a worker process ------------------------------------------------------------

_job_running = False


def _init_worker(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the workers
    signal.signal(signal.SIGTERM, _worker_sigterm)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    # Also the portable fallback, and the case where the parent died before prctl.
    start_parent_watchdog(parent_pid)


def start_parent_watchdog(parent_pid: int) -> None:
    """End this process (SIGTERM, then at the latest `WORKER_STOP_SECONDS` later) once `parent_pid` is not its parent."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)  # unwind the shard in the main thread
    time.sleep(WORKER_STOP_SECONDS)
    os._exit(EXIT_TERMINATED)  # the unwinding is stuck (e.g. a write that never returns)


def _worker_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not _job_running:
        os._exit(EXIT_TERMINATED)  # idle: nothing to clean up
    raise Terminated(f"signal {signum}")


def _run_job(job: Callable[[str], Any], rel: str) -> Any:
    """`job(rel)` in a worker; on SIGTERM, exit once the shard has unwound (never take another)."""
    global _job_running
    _job_running = True
    try:
        return job(rel)
    except Terminated:
        os._exit(EXIT_TERMINATED)
    finally:
        _job_running = False


def _run_pool(pool, job, batch, workers, summary, progress) -> tuple[list[str], list[str]]:
    """Run `batch` with at most `workers` in flight. If the pool breaks, return the shards it
    held (lost) and those not yet started; otherwise two empty lists."""
    queue = list(reversed(batch))
    running: dict = {}
    while queue or running:
        while queue and len(running) < workers:
            rel = queue.pop()
            running[pool.submit(job, rel)] = rel
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        lost = []
        for future in finished:
            rel = running.pop(future)
            try:
                result = future.result()
            except BrokenProcessPool:
                lost.append(rel)
            except Exception as exc:  # noqa: BLE001 - a shard that raises fails alone
                summary.failures[rel] = describe_exception(exc)
                progress.shard_finished(rel, error=summary.failures[rel])
            else:
                summary.results[rel] = result
                progress.shard_finished(rel, result)
        if lost:
            return [*lost, *running.values()], list(reversed(queue))
    return [], []
