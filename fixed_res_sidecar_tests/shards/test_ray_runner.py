"""shards/ray_runner.py: `--use-ray` builds on a real local Ray cluster.

One 2-CPU Ray cluster is shared by the module (Ray takes seconds to start). The CLI runs
in process, so `--use-ray` finds that cluster. Workers die for real: the wrapper below
SIGKILLs its own Ray worker process in the middle of a shard.
"""

import functools
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar import cli
from fixed_res_sidecar.cli import build as build_cli
from fixed_res_sidecar.core.geometry import AREA_512
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.layout import ResizedOutput
from fixed_res_sidecar.shards.resize import build_resized_shard
from fixed_res_sidecar.shards.runner import Progress
from fixed_res_sidecar_tests.fixtures.datasets import (
    SHARDS,
    SLOW_ROWS,
    SLOW_SHARDS,
    layout_of,
    resized_outputs,
)
from fixed_res_sidecar_tests.fixtures.processes import pool_workers, read_to_eof, started, wait_until_gone

pytestmark = pytest.mark.ray  # every test here starts Ray (the module's cluster, or the command's own)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with 2 CPUs for this module; workers can import the test package."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    saved = os.environ.pop("RAY_ADDRESS", None)  # never attach the tests to someone's cluster
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        job_config=ray.job_config.JobConfig(code_search_path=[str(REPO)]),
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


# -- shard jobs that run inside Ray workers (top-level, so they pickle by reference) -----


def build_or_kill_worker(layout, rel, *, marker_dir: str, kill_rels=(), kill_times: int = 0, **kwargs):
    """`build_resized_shard`, counting attempts per shard in `marker_dir`.

    For a shard in `kill_rels`, on its first `kill_times` attempts the Ray worker process
    SIGKILLs itself after the first row group went into the half-written output (a real
    dead worker, not an exception), first noting the temporary files it leaves behind.
    """
    attempt = _record_attempt(Path(marker_dir), rel)
    if rel in kill_rels and attempt <= kill_times:

        def die(_rows: int) -> None:
            outputs = layout.resized.values()
            half_written = [str(p) for o in outputs for p in Path(o.location.child(rel)).parent.glob(".*.tmp")]
            Path(marker_dir, f"{_safe(rel)}.killed-{attempt}").write_text(json.dumps(half_written))
            os.kill(os.getpid(), signal.SIGKILL)

        kwargs["on_rows"] = die
    return build_resized_shard(layout, rel, **kwargs)


def _safe(rel: str) -> str:
    return rel.replace("/", "__")


def _record_attempt(marker_dir: Path, rel: str) -> int:
    for attempt in itertools.count(1):
        try:
            os.close(os.open(marker_dir / f"{_safe(rel)}.attempt-{attempt}", os.O_CREAT | os.O_EXCL))
            return attempt
        except FileExistsError:
            continue


def attempts(marker_dir: Path, rel: str) -> int:
    return len(list(marker_dir.glob(f"{_safe(rel)}.attempt-*")))


@dataclass
class Rows:
    rows: int


def timed_job(rel: str, log_dir: str) -> Rows:
    """Sleeps a little and logs when it ran, to check how many tasks overlap."""
    start = time.time()
    time.sleep(0.4)
    Path(log_dir, _safe(rel)).write_text(json.dumps([start, time.time(), os.getpid()]))
    if rel.startswith("bad"):
        raise ValueError(f"{rel}: not a readable Parquet file")
    return Rows(rows=3)


# -- helpers ------------------------------------------------------------------------------


def build_both(main, out_root, *extra: str) -> list[str]:
    out512, out1024 = resized_outputs(out_root)
    return [
        "build-both",
        "--main-prefix", main.uri,
        "--output-prefix-512", out512.location.uri,
        "--output-prefix-1024", out1024.location.uri,
        "--max-inflight", "2",
        *extra,
    ]  # fmt: skip


def use_wrapper(monkeypatch, marker_dir: Path, **options) -> None:
    """Make the CLI's shard job `build_or_kill_worker` (the CLI partials it as usual)."""
    marker_dir.mkdir(exist_ok=True)
    wrapper = functools.partial(build_or_kill_worker, marker_dir=str(marker_dir), **options)
    monkeypatch.setattr(build_cli, "build_resized_shard", wrapper)


def assert_same_output(a, b, rel: str) -> None:
    """Same rows, keys, audit values, image bytes and recorded settings."""
    ta, tb = pq.read_table(a.location.child(rel)), pq.read_table(b.location.child(rel))
    assert ta.schema == tb.schema
    assert ta.schema.metadata == tb.schema.metadata
    assert ta.num_rows == tb.num_rows
    for name in ta.column_names:
        assert ta.column(name).equals(tb.column(name)), f"{rel}: column {name} differs"


def assert_keys_match_main(main, output, rel: str) -> None:
    keys = pq.read_table(main.child(rel), columns=["image_key"]).column("image_key")
    assert pq.read_table(output.location.child(rel), columns=["image_key"]).column("image_key").equals(keys)


# -- tests ----------------------------------------------------------------------------------


def test_ray_build_equals_the_local_build(ray_cluster, sample_main, tmp_path, capsys):
    assert cli.main(build_both(sample_main, tmp_path / "local")) == 0
    assert cli.main(build_both(sample_main, tmp_path / "ray", "--use-ray", "--task-memory-gb", "1")) == 0
    assert "3 total, 3 built, 0 skipped, 0 failed" in capsys.readouterr().out
    for local, on_ray in zip(resized_outputs(tmp_path / "local"), resized_outputs(tmp_path / "ray")):
        assert on_ray.location.list_shards() == sorted(SHARDS)
        for rel in SHARDS:
            assert_same_output(local, on_ray, rel)
            assert_keys_match_main(sample_main, on_ray, rel)


def test_a_worker_killed_mid_shard_is_retried(ray_cluster, sample_build, tmp_path, monkeypatch, capsys):
    main, reference = sample_build
    victim, markers = SHARDS[1], tmp_path / "markers"
    use_wrapper(monkeypatch, markers, kill_rels=(victim,), kill_times=1)

    assert cli.main(build_both(main, tmp_path / "ray", "--use-ray", "--max-attempts", "3")) == 0

    assert "3 total, 3 built, 0 skipped, 0 failed" in capsys.readouterr().out
    assert attempts(markers, victim) == 2
    assert all(attempts(markers, rel) == 1 for rel in SHARDS if rel != victim)
    # It really died mid-shard: its outputs were half written (temporaries) when it was killed.
    assert json.loads((markers / f"{_safe(victim)}.killed-1").read_text())
    for ref, on_ray in zip(reference, resized_outputs(tmp_path / "ray")):
        assert on_ray.location.list_shards() == sorted(SHARDS)
        for rel in SHARDS:
            assert_same_output(ref, on_ray, rel)


def test_a_shard_that_keeps_dying_fails_and_skip_existing_finishes_it(
    ray_cluster, sample_build, tmp_path, monkeypatch, capsys
):
    main, reference = sample_build
    victim, markers = SHARDS[2], tmp_path / "markers"
    use_wrapper(monkeypatch, markers, kill_rels=(victim,), kill_times=99)
    args = build_both(main, tmp_path / "ray", "--use-ray", "--max-attempts", "2", "--skip-existing")

    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert "3 total, 2 built, 0 skipped, 1 failed" in out
    assert f"FAILED {victim}: Ray worker died 2 times (killed or out of memory)" in out
    assert attempts(markers, victim) == 2
    outputs = resized_outputs(tmp_path / "ray")
    for output in outputs:
        assert output.location.list_shards() == sorted(rel for rel in SHARDS if rel != victim)
        assert not Path(output.location.child(victim)).exists()  # nothing at the final name

    # The cluster is healthy again: the rerun builds only what is missing.
    use_wrapper(monkeypatch, markers)
    finished = {rel: Path(outputs[0].location.child(rel)).stat().st_mtime_ns for rel in SHARDS if rel != victim}
    assert cli.main(args) == 0
    assert "3 total, 1 built, 2 skipped, 0 failed" in capsys.readouterr().out
    assert finished == {rel: Path(outputs[0].location.child(rel)).stat().st_mtime_ns for rel in finished}
    for ref, on_ray in zip(reference, outputs):
        for rel in SHARDS:
            assert_same_output(ref, on_ray, rel)


def test_a_job_exception_fails_its_shard_once_and_others_finish(
    ray_cluster, sample_main, tmp_path, monkeypatch, capsys
):
    Path(sample_main.child("broken.parquet")).write_bytes(b"PAR1 this is not parquet")
    markers = tmp_path / "markers"
    use_wrapper(monkeypatch, markers)

    assert cli.main(build_both(sample_main, tmp_path / "ray", "--use-ray")) == 1

    out = capsys.readouterr().out
    assert "4 total, 3 built, 0 skipped, 1 failed" in out
    assert "FAILED broken.parquet: ShardError:" in out and "not a readable Parquet file" in out
    assert attempts(markers, "broken.parquet") == 1  # an application error is not retried
    for output in resized_outputs(tmp_path / "ray"):
        assert output.location.list_shards() == sorted(SHARDS)


def test_runner_keeps_max_inflight_and_reports_progress(ray_cluster, tmp_path):
    from fixed_res_sidecar.shards.ray_runner import RayTaskOptions, run_shards_on_ray

    shards = ["a.parquet", "bad.parquet", "c.parquet"]
    stream = io.StringIO()
    job = functools.partial(timed_job, log_dir=str(tmp_path))
    tasks = RayTaskOptions(max_inflight=1, task_memory_gb=0.5)
    summary = run_shards_on_ray(job, shards, tasks=tasks, progress=Progress(3, stream))

    assert sorted(summary.results) == ["a.parquet", "c.parquet"]
    assert summary.failures == {"bad.parquet": "ValueError: bad.parquet: not a readable Parquet file"}
    assert summary.attempts == dict.fromkeys(shards, 1) and not summary.ok
    spans = sorted(json.loads(p.read_text())[:2] for p in tmp_path.iterdir())
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans)), spans  # one at a time
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("[3/3 shards, 1 failed, ")
    assert "bad.parquet: FAILED: ValueError" in stream.getvalue()


def _run_cli_subprocess(
    args: list[str], *, block_ray: bool = False, timeout: float = 240
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    prelude = f"import sys\nif {block_ray!r}: sys.modules['ray'] = None\n"
    code = prelude + "from fixed_res_sidecar.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_the_command_starts_its_own_local_ray(sample_main, tmp_path):
    """No Ray session and no RAY_ADDRESS: the command starts a local Ray sized to the machine,
    shrinking a task request that the machine cannot hold instead of waiting forever."""
    pytest.importorskip("ray")
    out = ResizedOutput(Location.parse(tmp_path / "ray"), AREA_512, "0_26mp_process")
    args = ["build-0-262mp", "--main-prefix", sample_main.uri, "--output-prefix", out.location.uri, "--use-ray"]
    done = _run_cli_subprocess([*args, "--task-cpus", "64", "--task-memory-gb", "4096"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Started a local Ray instance" in done.stderr
    assert "asks for 64 CPUs and 4096.0 GiB, but this machine has" in done.stderr
    assert "3 total, 3 built, 0 skipped, 0 failed" in done.stdout
    local = ResizedOutput(Location.parse(tmp_path / "local"), AREA_512, "0_26mp_process")
    for rel in SHARDS:  # the same single-resolution build, in this process
        build_resized_shard(layout_of(sample_main, [local]), rel)
        assert_same_output(local, out, rel)


def test_use_ray_without_ray_installed_says_so(sample_main, tmp_path):
    args = build_both(sample_main, tmp_path / "out", "--use-ray")
    done = _run_cli_subprocess(args, block_ray=True, timeout=120)
    assert done.returncode == 2
    assert "--use-ray needs Ray, which is not installed" in done.stderr
    assert "pip install 'fixed-resolution-sidecar[ray]'" in done.stderr
    assert not (tmp_path / "out").exists()


# -- stopping a `--use-ray` command: its tasks end too ------------------------------------


def _ray_build_of_slow_shards(slow_main, tmp_path) -> tuple[list[str], dict[str, str], Path]:
    pytest.importorskip("ray")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "fixed_res_sidecar.cli", *build_both(slow_main, out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return args, env, out


def _whole_or_absent(out: Path) -> None:
    assert not list(out.rglob(".*.tmp"))
    for path in out.rglob("*.parquet"):
        assert pq.ParquetFile(path).metadata.num_rows == SLOW_ROWS


def test_sigterm_cancels_the_ray_tasks_and_exits_143(slow_main, tmp_path):
    args, env, out = _ray_build_of_slow_shards(slow_main, tmp_path)
    with started([*args, "--use-ray"], lambda: list(out.rglob(".*.tmp")), env) as (process, procs):
        os.kill(process.pid, signal.SIGTERM)  # the driver alone, as Kubernetes or `ray job stop` do
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 143, stderr.decode()[-3000:]
        assert not [p for p in pool_workers(procs) if p.running]  # the tasks ended before the driver
        wait_until_gone(procs, timeout=60)  # the local Ray it started is shut down
    _whole_or_absent(out)  # the cancelled tasks unwound: no temporary left


def test_ray_tasks_end_when_the_driver_is_killed(slow_main, tmp_path):
    args, env, out = _ray_build_of_slow_shards(slow_main, tmp_path)
    with started([*args, "--use-ray"], lambda: list(out.rglob(".*.tmp")), env) as (process, procs):
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        # The local Ray shares the driver's fate; its task workers exit once their raylet is gone.
        # (Ray's dashboard and runtime-env agents take about a minute more; the test ends them.)
        seconds = wait_until_gone(pool_workers(procs), timeout=60)
        assert read_to_eof(process.stdout, timeout=30) is not None
    print(f"\nRay task workers gone {seconds:.2f} s after the driver's death")
    for path in out.rglob("*.parquet"):
        assert pq.ParquetFile(path).metadata.num_rows == SLOW_ROWS  # whole or absent
    # Temporaries the tasks may have left (Ray ends them with or without unwinding) name their dead
    # processes: the next run removes them at once.
    rerun = subprocess.run([*args, "--skip-existing"], env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _whole_or_absent(out)
    assert len(list(out.rglob("*.parquet"))) == 2 * len(SLOW_SHARDS)  # every shard, every row
