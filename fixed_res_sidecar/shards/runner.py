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
    todo, suspects = list(shards), []
    while todo or suspects:
        if suspects:
            batch, width = [suspects.pop(0)], 1
        else:
            batch, width, todo = todo, workers, []
        with _pool(width, threads) as pool:
            lost, unstarted = _run_pool(pool, job, batch, width, summary, progress)
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


def _pool(workers: int, threads: bool):
    if threads:
        return ThreadPoolExecutor(max_workers=workers)
    # spawn, not fork: boto3 clients and thread pools are not fork-safe.
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


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
