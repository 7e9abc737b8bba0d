"""Run a shard job over many shards in local worker processes, with progress and retries.

A shard job is any picklable callable `job(rel) -> result` whose result has `rows`
(e.g. `functools.partial(build_resized_shard, main, outputs=..., ...)`). A shard that
raises fails alone; a worker process that dies (killed, out of memory) costs the shards
it held one attempt each, and they are retried on a fresh pool up to `max_attempts`.
"""

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TextIO


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


def local_workers(max_inflight: int, task_cpus: int) -> int:
    """At most `max_inflight`, and no more than the cores allow at `task_cpus` each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(max_inflight, cores // max(1, task_cpus)))


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
    """
    started = time.monotonic()
    summary = RunSummary()
    progress = progress or Progress(len(shards))
    attempts = dict.fromkeys(shards, 0)
    todo = list(shards)
    context = multiprocessing.get_context("spawn")  # no fork: boto3 and thread pools are not fork-safe
    while todo:
        if threads:
            pool = ThreadPoolExecutor(max_workers=workers)
        else:
            pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
        with pool:
            todo = _run_pool(pool, job, todo, workers, attempts, max_attempts, summary, progress)
    summary.seconds = time.monotonic() - started
    return summary


def _run_pool(pool, job, todo, workers, attempts, max_attempts, summary, progress) -> list[str]:
    """Submit shards with at most `workers` in flight; return those to retry on a new pool."""
    queue = list(reversed(todo))
    running: dict = {}
    while queue or running:
        while queue and len(running) < workers:
            rel = queue.pop()
            attempts[rel] += 1
            running[pool.submit(job, rel)] = rel
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        lost = []
        for future in finished:
            rel = running.pop(future)
            try:
                result = future.result()
            except BrokenProcessPool:
                lost.append(rel)
            except Exception as exc:
                summary.failures[rel] = f"{type(exc).__name__}: {exc}"
                progress.shard_finished(rel, error=summary.failures[rel])
            else:
                summary.results[rel] = result
                progress.shard_finished(rel, result)
        if lost:
            # The pool is gone: every shard it held gets another attempt on a fresh pool.
            return _requeue_after_crash([*lost, *running.values()], queue, attempts, max_attempts, summary, progress)
    return []


def _requeue_after_crash(lost_shards, queue, attempts, max_attempts, summary, progress) -> list[str]:
    retry = []
    for lost in lost_shards:
        if attempts[lost] >= max_attempts:
            summary.failures[lost] = f"worker process died {attempts[lost]} times (killed or out of memory)"
            progress.shard_finished(lost, error=summary.failures[lost])
        else:
            retry.append(lost)
    return retry + list(reversed(queue))
