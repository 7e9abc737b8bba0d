"""defs/fencing.py against a real Dagster instance (`instance_for_test`, on disk, shared by processes).

A worker is a real process holding a fence on a STARTED run; "monitoring" is this test process
writing the run's FAILURE, as the daemon would. Killing is tried only on workers of our own: an
armed fence in the test process would kill pytest.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from types import SimpleNamespace

import dagster as dg
import pytest
from dagster._serdes import serialize_value

from fixed_res_sidecar.defs import fencing
from fixed_res_sidecar.defs.fencing import OwnerCheck, RunFenced, run_fence
from fixed_res_sidecar_tests.fixtures.processes import Proc, descendants, wait_until_gone

WAIT = 30.0


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        yield instance


def started_run(instance) -> dg.DagsterRun:
    run = dg.DagsterRun(job_name="shard_job", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED)
    return instance.add_run(run)


def context_of(instance, run) -> SimpleNamespace:
    return SimpleNamespace(instance=instance, run=run)


def wait_for(predicate, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


# A worker: opens the instance from its ref, enters an armed fence on the run, starts a child (a
# stand-in for a shard worker process), says it is in its step, then "works" until the test tells it
# to commit; committing checks ownership first, as the shard commit does.
WORKER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path
    from types import SimpleNamespace
    import dagster as dg
    from dagster._serdes import deserialize_value
    from fixed_res_sidecar.defs.fencing import RunFenced, run_fence

    ref, run_id, folder, own_failure = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "own"
    instance = dg.DagsterInstance.from_ref(deserialize_value(ref))
    context = SimpleNamespace(instance=instance, run=instance.get_run_by_id(run_id))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (folder / "child").write_text(str(child.pid))
    try:
        with run_fence(context, armed=True, watch_parent=sys.argv[5] == "parent", status_poll=0.1, parent_poll=0.05) as fence:
            (folder / "in-step").write_text(str(os.getpid()))
            while not (folder / "commit").exists():
                time.sleep(0.01)
            fence.check()
            (folder / "committed").write_text("yes")
            if own_failure:
                raise RuntimeError("the step's own failure")
    except RuntimeError:
        instance.report_run_failed(instance.get_run_by_id(run_id))
        time.sleep(1.0)  # the fence's thread has looked at least once since
        (folder / "survived").write_text("yes")
    child.kill()
    """
)


def start_worker(tmp_path, instance, run, *, own_failure=False, parent=False, launcher=None):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    folder = tmp_path / "worker"
    folder.mkdir()
    args = [sys.executable, str(script), serialize_value(instance.get_ref()), run.run_id, str(folder),
            "own" if own_failure else "-", "parent" if parent else "-"]  # fmt: skip
    process = subprocess.Popen(launcher(args) if launcher else args, start_new_session=True)
    wait_for(lambda: (folder / "in-step").exists() or process.poll() is not None, "the worker's step")
    assert (folder / "in-step").exists(), "the worker ended before its step"
    return process, folder


def test_a_run_failed_by_another_process_kills_its_worker_before_it_commits(instance, tmp_path):
    run = started_run(instance)
    process, folder = start_worker(tmp_path, instance, run)
    worker = int((folder / "in-step").read_text())
    child = int((folder / "child").read_text())
    [child_proc] = [p for p in descendants(worker) if p.pid == child]

    instance.report_run_failed(run)  # run monitoring: "Ray job ... FAILED"
    failed = time.monotonic()
    assert process.wait(timeout=WAIT) == -signal.SIGKILL
    print(f"\nworker killed {time.monotonic() - failed:.2f} s after its run was failed elsewhere")
    wait_until_gone([child_proc], timeout=10)  # its shard worker process went with it
    (folder / "commit").write_text("now")  # too late: nobody is left to commit
    time.sleep(0.2)
    assert not (folder / "committed").exists()
    messages = [e.message for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]
    assert any("Run worker fenced" in m and "FAILURE" in m for m in messages), messages
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE


def test_a_run_failed_by_the_worker_itself_does_not_kill_it(instance, tmp_path):
    run = started_run(instance)
    process, folder = start_worker(tmp_path, instance, run, own_failure=True)
    (folder / "commit").write_text("now")
    assert process.wait(timeout=WAIT) == 0
    assert (folder / "committed").exists() and (folder / "survived").exists()


@pytest.mark.heavy
def test_a_worker_whose_ray_parent_dies_is_killed(instance, tmp_path):
    """The job supervisor (here: a Python parent) runs the entrypoint in a shell that survives it, as
    Ray's does when only its raylet died; the worker goes within a fraction of a second, with no
    storage call, while its run is still STARTED."""

    def launcher(args):
        quoted = " ".join(f"'{a}'" for a in args)
        supervisor = (
            f"import subprocess, time; subprocess.Popen(['/bin/sh', '-c', {quoted!r} + '; true']); time.sleep(120)"
        )
        return [sys.executable, "-c", supervisor]

    run = started_run(instance)
    supervisor, folder = start_worker(tmp_path, instance, run, parent=True, launcher=launcher)
    worker = int((folder / "in-step").read_text())
    worker_proc = Proc(worker, fencing._start_time(worker), "worker")
    supervisor.kill()
    supervisor.wait()
    killed = time.monotonic()
    wait_until_gone([worker_proc], timeout=10)
    print(f"\nworker gone {time.monotonic() - killed:.2f} s after its Ray parent")
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED  # nobody failed it yet
    assert not (folder / "committed").exists()
    messages = [e.message for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]
    assert any("Ray parent" in m for m in messages), messages


def _check_in_child(check: OwnerCheck, queue) -> None:
    try:
        check()
        queue.put("owner")
    except Exception as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


def check_in_a_shard_worker(check: OwnerCheck) -> str:
    """`check` pickled into a spawned process (as the shard runner's workers are) and called there."""
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    process = spawn.Process(target=_check_in_child, args=(check, queue))
    process.start()
    try:
        return queue.get(timeout=60)
    finally:
        process.join(timeout=10)


def test_the_commit_check_says_whether_the_run_is_still_the_workers(instance, tmp_path):
    """Not armed (this is pytest's process): no kill, but every check reads the instance afresh, here
    and in a shard worker process."""
    run = started_run(instance)
    with run_fence(context_of(instance, run), armed=False, watch_parent=False) as fence:
        assert fence.still_owner()
        fence.check()
        fence.commit_check()
        assert check_in_a_shard_worker(fence.commit_check) == "owner"

        instance.report_run_failed(run)  # another process's verdict, seen at the very next check
        assert not fence.still_owner()
        with pytest.raises(RunFenced, match="FAILURE"):
            fence.check()
        with pytest.raises(RunFenced, match="FAILURE"):
            fence.commit_check()
        assert "FAILURE" in check_in_a_shard_worker(fence.commit_check)


def test_a_shard_worker_whose_run_worker_is_gone_may_not_commit(instance):
    run = started_run(instance)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    check = OwnerCheck(instance.get_ref(), run.run_id, gone.pid, 12345)
    assert "is gone" in check_in_a_shard_worker(check)


def test_a_fence_is_refused_on_a_run_that_is_not_started(instance):
    run = started_run(instance)
    instance.report_run_canceled(run)
    with pytest.raises(RunFenced, match="CANCELED"), run_fence(context_of(instance, run), armed=False):
        pass


def test_killing_is_armed_only_in_a_dedicated_run_worker(monkeypatch):
    monkeypatch.delenv(fencing.RAY_JOB_ENV, raising=False)
    monkeypatch.delenv(fencing.FENCE_ENV, raising=False)
    assert not fencing.dedicated_run_worker()  # pytest, as any in-process execution
    monkeypatch.setattr(sys, "argv", ["dagster", "api", "execute_run", "{}"])
    assert fencing.dedicated_run_worker()
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.setenv(fencing.RAY_JOB_ENV, "{}")
    assert fencing.dedicated_run_worker()
    monkeypatch.setenv(fencing.FENCE_ENV, "0")
    assert not fencing.dedicated_run_worker()


def test_the_fence_thread_of_an_unarmed_fence_ends_with_the_step(instance):
    run = started_run(instance)
    before = {t.name for t in __import__("threading").enumerate()}
    with run_fence(context_of(instance, run), armed=False, watch_parent=False):
        pass
    after = {t.name for t in __import__("threading").enumerate()}
    assert after <= before, after - before
    assert os.getpid() > 0  # and pytest lives on


def test_a_fenced_asset_keeps_its_signature_and_runs_inside_its_fence(tmp_path):
    """`@fenced` under `@dg.asset`: Dagster still sees the context and the resource it asks for, and the
    step's body finds its fence (with its commit check, picklable for shard worker processes)."""
    import pickle

    seen = {}

    class Thing(dg.ConfigurableResource):
        value: int = 3

    @dg.asset
    @fencing.fenced
    def fenced_asset(context: dg.AssetExecutionContext, thing: Thing):
        fence = fencing.current_fence()
        seen["owner"], seen["armed"], seen["value"] = fence.still_owner(), fence.armed, thing.value
        seen["check"] = pickle.loads(pickle.dumps(fence.commit_check)).run_id == context.run.run_id
        yield dg.MaterializeResult()

    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        result = dg.materialize([fenced_asset], resources={"thing": Thing()}, instance=instance)
    assert result.success
    assert seen == {"owner": True, "armed": False, "value": 3, "check": True}
    with pytest.raises(RuntimeError, match="no run fence"):
        fencing.current_fence()
