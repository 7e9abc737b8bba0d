import io
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixed_res_sidecar.shards.runner import Progress, Terminated, local_workers, raise_terminated, run_shards
from fixed_res_sidecar_tests.fixtures.processes import descendants, pool_workers, wait_until_gone


@dataclass
class Done:
    rel: str
    rows: int = 5


def steady_job(rel: str) -> Done:
    if rel == "bad.parquet":
        raise ValueError(f"{rel}: not a readable Parquet file")
    return Done(rel)


@dataclass
class DiesOnce:
    """Kills its own worker process the first time it sees `victim` (a marker file records it).

    Other shards take `others_seconds`, so they are still running when the victim dies.
    """

    marker_dir: str
    victim: str
    always: bool = False
    others_seconds: float = 0.0

    def __call__(self, rel: str) -> Done:
        marker = Path(self.marker_dir, rel.replace("/", "_"))
        if rel == self.victim and (self.always or not marker.exists()):
            marker.touch()
            time.sleep(0.2)  # let the neighbours start
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.others_seconds)
        return Done(rel)


def test_a_failing_shard_fails_alone():
    shards = ["a.parquet", "bad.parquet", "c.parquet"]
    summary = run_shards(steady_job, shards, workers=2, progress=Progress(3, quiet=True))
    assert sorted(summary.results) == ["a.parquet", "c.parquet"]
    assert list(summary.failures) == ["bad.parquet"]
    assert "bad.parquet: not a readable Parquet file" in summary.failures["bad.parquet"]
    assert not summary.ok


def test_a_killed_worker_is_retried(tmp_path):
    shards = [f"s{i}.parquet" for i in range(4)]
    stream = io.StringIO()
    summary = run_shards(DiesOnce(str(tmp_path), "s1.parquet"), shards, workers=2, progress=Progress(4, stream))
    assert summary.ok and sorted(summary.results) == shards
    assert stream.getvalue().count("\n") == 4  # one progress line per shard, none lost or doubled
    assert "[4/4 shards, 0 failed" in stream.getvalue()


def test_a_shard_that_keeps_killing_its_worker_is_reported_alone(tmp_path):
    # "a" runs beside "b" every time "b" kills the shared pool; it must not be blamed.
    shards = ["a.parquet", "b.parquet", "c.parquet"]
    job = DiesOnce(str(tmp_path), "b.parquet", always=True, others_seconds=1.0)
    summary = run_shards(job, shards, workers=2, max_attempts=2, progress=Progress(3, quiet=True))
    assert list(summary.failures) == ["b.parquet"]
    assert "died 2 times" in summary.failures["b.parquet"]
    assert sorted(summary.results) == ["a.parquet", "c.parquet"]


def test_local_workers_respect_inflight_and_cores():
    cores = len(os.sched_getaffinity(0))
    assert local_workers(1, 1) == 1
    assert local_workers(32, 1) == min(32, cores)
    assert local_workers(32, cores * 4) == 1  # never zero
    assert local_workers(32, 2) == max(1, cores // 2)


@dataclass
class Lingers:
    """Notes its pid, then works for a long time; notes when its shard unwinds (its `finally`)."""

    marker_dir: str
    seconds: float = 600.0

    def __call__(self, rel: str) -> Done:
        # The marker is written inside the `try`: a test that signals once it sees the marker must find the
        # shard unwound, however soon the signal comes (written before it, a SIGTERM landing between the
        # two left no `.unwound` on a loaded machine).
        try:
            Path(self.marker_dir, rel).write_text(str(os.getpid()))
            time.sleep(self.seconds)
        finally:
            Path(self.marker_dir, f"{rel}.unwound").touch()
        return Done(rel)


def _when(condition, then, timeout: float = 120) -> threading.Thread:
    """Run `then()` on a thread as soon as `condition()` holds."""

    def watch():
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def sigterm_raises():
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_stops_worker_processes_which_unwind_their_shards(tmp_path, sigterm_raises):
    shards = ["a", "b", "c", "d"]
    workers = []

    def note_workers_then_terminate():
        workers.extend(pool_workers(descendants(os.getpid())))
        os.kill(os.getpid(), signal.SIGTERM)

    _when(lambda: len(list(tmp_path.glob("?"))) == 2, note_workers_then_terminate)
    with pytest.raises(Terminated):
        run_shards(Lingers(str(tmp_path)), shards, workers=2, progress=Progress(4, quiet=True))
    assert len(workers) == 2 and not [w for w in workers if w.running]  # gone when run_shards returns
    assert sorted(p.name for p in tmp_path.glob("*.unwound")) == ["a.unwound", "b.unwound"]
    assert not Path(tmp_path, "c").exists()  # nothing more started


def test_sigterm_lets_running_threads_finish_and_starts_no_more(tmp_path, sigterm_raises):
    _when(lambda: Path(tmp_path, "a").exists(), lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(Terminated):
        run_shards(Lingers(str(tmp_path), 1.0), ["a", "b", "c"], workers=1, threads=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.unwound"]


def test_a_signal_as_a_thread_starts_still_lets_its_shard_finish(tmp_path, monkeypatch):
    """The signal comes inside the pool's submit, once its thread started and took shard `a` but before
    the pool registered the thread (seen in CI under load): run_shards still waits for `a`."""
    start = threading.Thread.start

    def start_then_signal(thread):
        start(thread)
        if thread.name.startswith("shards-") and not Path(tmp_path, "a.unwound").exists():
            deadline = time.monotonic() + 60
            while not Path(tmp_path, "a").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise Terminated("signal 15")

    monkeypatch.setattr(threading.Thread, "start", start_then_signal)
    with pytest.raises(Terminated):
        run_shards(Lingers(str(tmp_path), 1.0), ["a", "b", "c"], workers=1, threads=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.unwound"]


# A worker's watchdog alone (no parent-death signal), in a child of a parent that gets SIGKILLed.
WATCHED_WORKER = """
import os, signal, sys, time
from pathlib import Path
from fixed_res_sidecar.shards import runner

def job(rel):
    Path(rel).write_text(str(os.getpid()))
    try:
        time.sleep(600)
    finally:
        Path(rel + ".unwound").touch()

signal.signal(signal.SIGTERM, runner._worker_sigterm)
runner.start_parent_watchdog(os.getppid())
runner._run_job(job, sys.argv[1])
"""


def test_the_watchdog_ends_a_worker_whose_parent_died(tmp_path):
    marker = tmp_path / "job"
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)",
         sys.executable, "-c", WATCHED_WORKER, str(marker)],
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text()):
        assert time.monotonic() < deadline, "the worker never started its job"
        time.sleep(0.02)
    (worker,) = descendants(parent.pid)
    parent.kill()
    parent.wait()
    seconds = wait_until_gone([worker], timeout=30)
    assert Path(f"{marker}.unwound").exists()  # ended by unwinding its job, not killed
    print(f"\nthe watchdog ended the orphaned worker {seconds:.2f} s after its parent's death")
