import io
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from fixed_res_sidecar.shards.runner import Progress, local_workers, run_shards


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
