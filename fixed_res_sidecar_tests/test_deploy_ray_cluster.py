"""deploy/dagster-ray.yaml on a real 2-node Ray cluster, and `sidecar-ops --use-ray` against it.

The cluster (fixtures/ray_cluster.py) is a head with the job server and one worker node, 1 CPU each,
each node in a cgroup of its own. The Dagster deployment is deploy/dagster-ray.yaml as shipped (its
run launcher pointed at the head's job server) on a real PostgreSQL, with the code server, the daemon
and the webserver started once for the module, on three datasets (one per test). The nodes' own
environment has nothing of it (no SIDECAR_DATASETS, no DAGSTER_*): a run's job gets what it needs
from the launcher, as on a real cluster, and the code from the package importable on the node.

Kills happen mid-run on an event (a temporary output file written by a process of the worker node),
never after a sleep. Each test prints its timeline; the figures are seconds after the kill.
"""

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from dagster._core.storage.tags import PARTITION_NAME_TAG

from fixed_res_sidecar.defs.dagster_private import PARENT_RUN_ID_TAG
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.run_resources import RAY_CONFIG_TAG
from fixed_res_sidecar_tests.defs.conftest import register
from fixed_res_sidecar_tests.fixtures.dagster_deployment import (
    InstanceSettings,
    deployment_lane,
    wait_until,
)
from fixed_res_sidecar_tests.fixtures.postgres import fresh_database
from fixed_res_sidecar_tests.fixtures.ray_cluster import RayCluster, RayNode, command_line, ray_deployment
from fixed_res_sidecar_tests.fixtures.shared import run_lock
from fixed_res_sidecar_tests.test_deploy_instance import (
    SLOW_SHARD,
    assert_outputs_whole,
    assert_shards_complete,
    built_by,
    datasets_config,
    materializations,
    output_asset_keys,
    tiny_dataset,
)

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster]

RUN_TIMEOUT = 240.0
SHARDS = [f"part-{i}.parquet" for i in range(4)]
RUN_RESOURCES = {"cpu": 1, "memory_gb": 1}  # one run per node at a time (1 CPU each)
# One dataset per test: its shards and what else its config says. The kill tests have one shard per
# node (both runs start at once, one on each node: the worker node's is the one killed).
DATASETS = {
    "ray_backfill": (SHARDS, {"audits_after_runs": True}),  # its audits run as Ray jobs beside the shards'
    "ray_node_kill": (SHARDS[:2], SLOW_SHARD),
    "ray_raylet_kill": (SHARDS[:2], SLOW_SHARD),
}
RAY_JOB_ENDED = {"SUCCEEDED", "FAILED", "STOPPED"}
TEMPORARY = re.compile(r"-(\d+)-[0-9a-f]{8}\.tmp$")  # io/locations.py: .<name>.<machine>-<pid>-<uuid8>.tmp


@pytest.fixture(scope="module")
def deployment(two_node_ray_cluster, postgres_server, tmp_path_factory):
    """The Ray deployment with its servers running and every dataset's shards registered."""
    root = tmp_path_factory.mktemp("ray-deployment")
    lane = deployment_lane(__name__)  # see deployment_slot
    with run_lock(tmp_path_factory, lane), fresh_database(postgres_server) as database:
        settings = InstanceSettings(max_concurrent_runs=2, per_dataset_limit=2)
        with ray_deployment(two_node_ray_cluster, database, root / "deployment", settings) as deployment:
            entries = [tiny_dataset(root, name, shards, run_resources=RUN_RESOURCES, **extra)
                       for name, (shards, extra) in DATASETS.items()]  # fmt: skip
            deployment.config = datasets_config(deployment, *entries)
            with deployment.instance() as instance:
                for name in DATASETS:
                    assert register(instance, deployment.config, name) == shards_of(name)
            started = time.monotonic()
            deployment.start_code_server()
            deployment.start_webserver()
            deployment.start_daemon()
            print(f"\nDagster deployment (code server, webserver, daemon) up in {time.monotonic() - started:.1f} s")
            yield deployment


@pytest.fixture
def cluster(two_node_ray_cluster) -> RayCluster:
    """The cluster with a live worker node (a fresh one if an earlier test killed it), once no run of an
    earlier test holds a node's CPU: a run's end is stored before its Ray job ends, and while one held
    the worker node's one CPU, every task of the next test went to the head (c65)."""
    started = time.monotonic()
    node = two_node_ray_cluster.replace_worker()
    if time.monotonic() - started > 1:
        print(f"\nreplacement worker node {node.name} up in {node.start_seconds:.1f} s")
    wait_until(lambda: not jobs_running(two_node_ray_cluster), 120, "the Ray jobs of earlier tests to end")
    return two_node_ray_cluster


# -- helpers ------------------------------------------------------------------------------------------


def shards_of(name: str) -> list[str]:
    return DATASETS[name][0]


def ray_job(cluster: RayCluster, run_id: str) -> dict:
    with urllib.request.urlopen(f"{cluster.dashboard_url}/api/jobs/dagster-run-{run_id}", timeout=10) as response:
        return json.loads(response.read())


def ended_ray_job(cluster: RayCluster, run_id: str, timeout: float = 60) -> dict:
    """The run's Ray job once it ended (a run's end is stored before its worker process exits)."""
    return wait_until(lambda: (job := ray_job(cluster, run_id))["status"] in RAY_JOB_ENDED and job, timeout,
                      f"the Ray job of run {run_id} to end")  # fmt: skip


def jobs_running(cluster: RayCluster) -> dict[int, str]:
    """The processes of Ray jobs on the cluster's nodes (run workers, job supervisors): pid -> command line."""
    return {
        pid: cmd
        for node in cluster.nodes()
        for pid, cmd in node.processes().items()
        if "execute_run" in cmd or "JobSupervisor" in cmd
    }


def run_workers(node: RayNode) -> dict[int, str]:
    """The node's `dagster api execute_run` processes (run workers): pid -> command line."""
    return {pid: cmd for pid, cmd in node.processes().items() if "execute_run" in cmd}


def all_run_workers(cluster: RayCluster) -> dict[int, str]:
    return {pid: cmd for node in cluster.nodes() for pid, cmd in run_workers(node).items()}


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp")]


def writing_on(node: RayNode, output_root: Path) -> tuple[Path, int] | None:
    """A temporary output file being written by a process of `node`, and that process, if any."""
    pids = node.pids()
    for path in temporaries(output_root):
        if (match := TEMPORARY.search(path.name)) and int(match.group(1)) in pids:
            return path, int(match.group(1))
    return None


def run_of_process(instance, pid: int) -> dg.DagsterRun:
    (run,) = [r for r in instance.get_runs() if r.run_id in command_line(pid)]
    return run


def shard_runs(instance, name: str) -> list[dg.DagsterRun]:
    return instance.get_runs(dg.RunsFilter(job_name=DatasetKeys(name).shard_job))


def build_counts(instance, name: str) -> dict[str, dict[str, int]]:
    """Per shard, per output asset: how many runs built it (restatements and skips are not builds)."""
    return {
        rel: {key.path[-1]: len(built_by(instance, key, rel)) for key in output_asset_keys(name)}
        for rel in shards_of(name)
    }


def assert_built_once(instance, name: str) -> dict[str, dict[str, int]]:
    counts = build_counts(instance, name)
    print(f"builds per shard: {counts}")
    assert all(n == 1 for per_asset in counts.values() for n in per_asset.values()), counts
    return counts


def wait_idle(deployment, instance) -> list[dg.DagsterRun]:
    return deployment.wait_until_idle(instance, RUN_TIMEOUT)


def finished_retry(instance, run_id: str) -> dg.DagsterRun | None:
    retries = instance.get_runs(dg.RunsFilter(tags={PARENT_RUN_ID_TAG: run_id}))
    return next((r for r in retries if r.is_finished), None)


def record_of(instance, run_id: str) -> dg.RunRecord:
    (record,) = instance.get_run_records(dg.RunsFilter(run_ids=[run_id]))
    return record


def engine_messages(instance, run_id: str) -> list[str]:
    return [e.message for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]


def assert_no_run_worker_left(cluster: RayCluster) -> None:
    wait_until(lambda: not all_run_workers(cluster), 30, "every run worker process to end",
               detail=lambda: str(all_run_workers(cluster)))  # fmt: skip


# -- tests ---------------------------------------------------------------------------------------------


def test_a_backfill_runs_as_ray_jobs_and_records_every_shard(deployment, cluster):
    name = "ray_backfill"
    started = time.monotonic()
    backfill = deployment.launch_backfill(DatasetKeys(name).shard_job, SHARDS)
    with deployment.instance() as instance:
        deployment.wait_on_runs(instance, lambda: len(shard_runs(instance, name)) == len(SHARDS) and all(
            r.is_finished for r in shard_runs(instance, name)), RUN_TIMEOUT, "the backfill's runs")  # fmt: skip
        print(f"\n{len(SHARDS)} shard runs finished {time.monotonic() - started:.1f} s after the backfill was launched")
        runs = shard_runs(instance, name)
        assert {r.status for r in runs} == {dg.DagsterRunStatus.SUCCESS}
        assert sorted(r.tags[PARTITION_NAME_TAG] for r in runs) == SHARDS
        assert all(r.tags.get("dagster/backfill") == backfill for r in runs)
        # Each run was one Ray job, which succeeded; the jobs used both nodes.
        nodes = set()
        for run in runs:
            job = ended_ray_job(cluster, run.run_id)
            assert job["status"] == "SUCCEEDED" and job["metadata"]["dagster/run-id"] == run.run_id, job
            assert job["entrypoint"].startswith("dagster api execute_run"), job["entrypoint"][:200]
            # The datasets file came with the job (the nodes have no SIDECAR_DATASETS of their own).
            assert "SIDECAR_DATASETS_TEXT" in job["runtime_env"]["env_vars"]
            nodes.add(job["driver_node_id"])
        assert nodes == {cluster.head.node_id, cluster.worker.node_id}, "the runs ran on both nodes"
        wait_idle(deployment, instance)
        for run in runs:
            for key in output_asset_keys(name):
                assert built_by(instance, key, run.tags[PARTITION_NAME_TAG]) == [run.run_id]
        assert_built_once(instance, name)
        assert_shards_complete(instance, deployment.config, {name: SHARDS})
        assert_outputs_whole(deployment.config.dataset(name), SHARDS)
        assert_no_run_worker_left(cluster)


def kill_mid_run(deployment, cluster: RayCluster, name: str, kill) -> dict:
    """Launch a run of each of `name`'s shards, `kill(worker node)` once a run on the worker node is
    writing its first output, then wait until everything finished; returns the timeline and the killed
    run. Runs, not a backfill: a job backfill whose other runs are done closes as the killed run fails,
    and Dagster then declines the retry (docs/dagster.md), a race of Dagster's this test is not about."""
    output_root = Path(deployment.config.dataset(name).output("resized_512").path).parents[1]
    node = cluster.worker
    launched = time.monotonic()
    for rel in shards_of(name):
        deployment.launch_run(DatasetKeys(name).shard_job, rel)
    with deployment.instance() as instance:
        path, pid = wait_until(lambda: writing_on(node, output_root), RUN_TIMEOUT,
                               "a run on the worker node to write an output", interval=0.05,
                               detail=deployment.report)  # fmt: skip
        run = run_of_process(instance, pid)
        killed_at, killed = time.time(), time.monotonic()
        kill(node)
        timeline = {"launched": launched - killed, "killed": 0.0}
        print(f"\nkilled {node.name} ({kill.__name__}) while run {run.run_id[:8]} ({run.tags[PARTITION_NAME_TAG]}) "
              f"wrote {path.name}")  # fmt: skip
        # The kill reached the run worker: it is gone within seconds (a node kill takes it at once; a
        # raylet kill leaves it orphaned until its fence sees its Ray parent gone).
        seconds = wait_until(lambda: pid not in node.pids() and time.monotonic() - killed, 30,
                             "the killed run's worker to be gone", interval=0.05)  # fmt: skip
        timeline["run worker gone"] = seconds
        cluster.wait_node_dead(node, timeout=60)
        timeline["node dead (GCS)"] = time.monotonic() - killed
        failed = wait_until(lambda: (r := instance.get_run_by_id(run.run_id)).is_finished and r, RUN_TIMEOUT,
                            "the killed run to be marked failed", detail=deployment.report)  # fmt: skip
        timeline["run marked failed"] = record_of(instance, run.run_id).end_time - killed_at
        retry = deployment.wait_on_runs(instance, lambda: finished_retry(instance, run.run_id), RUN_TIMEOUT,
                                        "its retry to finish")  # fmt: skip
        retry_record = record_of(instance, retry.run_id)
        timeline["retry created"] = retry_record.create_timestamp.timestamp() - killed_at
        timeline["retry started"] = retry_record.start_time - killed_at
        timeline["retry done"] = retry_record.end_time - killed_at
        deployment.wait_on_runs(instance, lambda: all(r.is_finished for r in shard_runs(instance, name)) and len(
            [r for r in shard_runs(instance, name) if r.status == dg.DagsterRunStatus.SUCCESS]) == len(shards_of(name)),
            RUN_TIMEOUT, "every shard's run to succeed")  # fmt: skip
        wait_idle(deployment, instance)
        timeline["all done"] = time.monotonic() - killed
        print("timeline (s after the kill): " + ", ".join(f"{k} {v:+.1f}" for k, v in timeline.items()))
        return {"run": failed, "retry": retry, "timeline": timeline, "pid": pid}


def assert_recovered(deployment, cluster, name: str, outcome: dict) -> None:
    run, retry = outcome["run"], outcome["retry"]
    with deployment.instance() as instance:
        assert run.status == dg.DagsterRunStatus.FAILURE
        assert retry.status == dg.DagsterRunStatus.SUCCESS, engine_messages(instance, retry.run_id)
        assert (
            retry.tags["dagster/retry_number"] == "1" and retry.tags[PARTITION_NAME_TAG] == run.tags[PARTITION_NAME_TAG]
        )
        assert ended_ray_job(cluster, run.run_id)["status"] == "FAILED"
        # The killed run stays failed (nothing of it lived on to write its end), recorded nothing, and its
        # shard was built by the retry alone; every shard once.
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
        rel = run.tags[PARTITION_NAME_TAG]
        for key in output_asset_keys(name):
            assert run.run_id not in [m.run_id for m in materializations(instance, key, rel)]
            assert built_by(instance, key, rel) == [retry.run_id], key.to_user_string()
        by_rel = defaultdict(list)
        for r in shard_runs(instance, name):
            by_rel[r.tags[PARTITION_NAME_TAG]].append(r.status.value)
        print(f"runs per shard: {dict(by_rel)}")
        assert_built_once(instance, name)
        assert_shards_complete(instance, deployment.config, {name: shards_of(name)})
        assert_outputs_whole(deployment.config.dataset(name), shards_of(name))
    output_root = Path(deployment.config.dataset(name).output("resized_512").path).parents[1]
    assert not temporaries(output_root), temporaries(output_root)
    assert_no_run_worker_left(cluster)


def test_a_worker_node_killed_mid_run_is_retried_and_every_shard_built_once(deployment, cluster):
    def node_kill(node: RayNode) -> None:
        node.kill()  # echo 1 > cgroup.kill: every process of the node at once

    outcome = kill_mid_run(deployment, cluster, "ray_node_kill", node_kill)
    assert_recovered(deployment, cluster, "ray_node_kill", outcome)


def test_a_killed_raylet_leaves_no_orphan_to_finish_its_run(deployment, cluster):
    """Only the raylet is killed: Ray fails the job, monitoring fails the run and retries it, while
    the run worker is no child of anything that died with the raylet. Its fence (defs/fencing.py)
    kills it as soon as its Ray parent is gone, so it neither builds its shard a second time nor
    turns its failed run to SUCCESS."""

    def raylet_kill(node: RayNode) -> None:
        node.kill_raylet()

    outcome = kill_mid_run(deployment, cluster, "ray_raylet_kill", raylet_kill)
    # Gone before its retry started: it could not build beside the retry. An order of events, not a time
    # limit. (Not necessarily before monitoring failed its run: its Ray parent ends when Ray declares the
    # node dead, which fails the job too; one run saw the failure 0.1 s first. The fence's status poll
    # and the commit's ownership check cover that moment, and assert_recovered checks the run stayed failed
    # and recorded nothing.)
    timeline = outcome["timeline"]
    assert timeline["run worker gone"] < timeline["retry started"], timeline
    assert_recovered(deployment, cluster, "ray_raylet_kill", outcome)
    with deployment.instance() as instance:
        messages = engine_messages(instance, outcome["run"].run_id)
    assert any("Run worker fenced" in m and "Ray parent" in m for m in messages), messages


def test_a_run_that_cannot_load_its_code_location_is_not_retried(deployment, cluster):
    """A deterministic failure before any step: the run's job gets a datasets file that cannot be
    read (a run tag's environment overrides the one the launcher carries). It fails once, with the
    reason, and no retry is created."""
    name, rel = "ray_backfill", SHARDS[0]
    broken = {"num_cpus": 1, "memory": 2**30, "runtime_env": {"env_vars": {"SIDECAR_DATASETS_TEXT": "not-base64!"}}}
    started = time.monotonic()
    deployment.launch_backfill(DatasetKeys(name).shard_job, [rel], tags={RAY_CONFIG_TAG: json.dumps(broken)})
    with deployment.instance() as instance:

        def failed_run():
            return next((r for r in shard_runs(instance, name) if r.status == dg.DagsterRunStatus.FAILURE), None)

        run = wait_until(failed_run, RUN_TIMEOUT, "the broken run to fail", detail=deployment.report)
        wait_idle(deployment, instance)
        run = instance.get_run_by_id(run.run_id)  # its tags as they ended (will_retry follows the status)
        print(f"\nthe run failed {time.monotonic() - started:.1f} s after its launch; no retry")
        assert run.tags.get("dagster/max_retries") == "0" and run.tags.get("dagster/will_retry") == "false"
        assert not instance.get_runs(dg.RunsFilter(tags={PARENT_RUN_ID_TAG: run.run_id}))
        messages = engine_messages(instance, run.run_id)
        assert "Could not load job definition." in messages, messages
        assert any("SIDECAR_DATASETS_TEXT" in m and "not retried" in m for m in messages), messages


# -- the command line against the cluster ---------------------------------------------------------------


def test_the_cli_on_the_cluster_survives_a_worker_node_kill(cluster, slow_main, tmp_path):
    from fixed_res_sidecar_tests.fixtures.datasets import SLOW_SHARDS
    from fixed_res_sidecar_tests.shards.test_ray_runner import build_both

    out = tmp_path / "out"
    args = [sys.executable, "-m", "fixed_res_sidecar.cli",
            *build_both(slow_main, out, "--use-ray", "--ray-address", cluster.gcs_address,
                        "--task-cpus", "1", "--task-memory-gb", "1")]  # fmt: skip
    node = cluster.worker
    started = time.monotonic()
    with open(tmp_path / "cli.log", "wb") as log:
        process = subprocess.Popen(args, env=cluster.env, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        try:
            path, _pid = wait_until(lambda: writing_on(node, out) or (process.poll() is not None and ("ended", 0)),
                                   120, "a task on the worker node to write a shard", interval=0.05)  # fmt: skip
            assert path != "ended", (tmp_path / "cli.log").read_text()[-3000:]
            node.kill()
            killed = time.monotonic()
            stdout, _ = process.communicate(timeout=240)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    stderr = (tmp_path / "cli.log").read_text()
    print(f"\nworker node killed {killed - started:.1f} s after the start; the command ended "
          f"{time.monotonic() - killed:.1f} s later")  # fmt: skip
    print("\n".join(line for line in stderr.splitlines() if "[ray]" in line))
    assert process.returncode == 0, stderr[-3000:]
    assert "retrying" in stderr  # the shard of the lost node ran again
    assert f"{len(SLOW_SHARDS)} total, {len(SLOW_SHARDS)} built, 0 skipped, 0 failed" in stdout.decode()
    assert not temporaries(out)
    _assert_every_row_kept(slow_main, out)


def _assert_every_row_kept(slow_main, out: Path) -> None:
    """Both resolutions' outputs of every slow shard hold every row of main, keys in main's order."""
    from fixed_res_sidecar_tests.fixtures.datasets import SLOW_ROWS, SLOW_SHARDS

    outputs = sorted(out.glob("*/sample"))
    assert len(outputs) == 2, outputs  # the 512 and the 1024 output
    for rel in SLOW_SHARDS:
        main_keys = pq.read_table(slow_main.child(rel), columns=["image_key"]).column(0).to_pylist()
        for output in outputs:
            table = pq.read_table(output / rel, columns=["image_key"])
            assert table.num_rows == SLOW_ROWS and table.column(0).to_pylist() == main_keys, (output, rel)


def test_the_cli_submitted_as_a_ray_job_builds_every_shard(cluster, slow_main, tmp_path):
    """What docs/ray.md advises instead of Ray Client: the command submitted to the job server (its
    driver runs on the cluster; Ray sets RAY_ADDRESS for it, so no --ray-address)."""
    import shlex

    from ray.job_submission import JobStatus, JobSubmissionClient

    from fixed_res_sidecar_tests.fixtures.datasets import SLOW_SHARDS
    from fixed_res_sidecar_tests.shards.test_ray_runner import build_both

    out = tmp_path / "out"
    command = [sys.executable, "-m", "fixed_res_sidecar.cli",
               *build_both(slow_main, out, "--use-ray", "--task-cpus", "1", "--task-memory-gb", "1")]  # fmt: skip
    client = JobSubmissionClient(cluster.dashboard_url)
    started = time.monotonic()
    job_id = client.submit_job(entrypoint=shlex.join(command), entrypoint_num_cpus=0)
    status = wait_until(lambda: (s := client.get_job_status(job_id)).is_terminal() and s, 180,
                        "the submitted command to end", interval=0.5)  # fmt: skip
    logs = client.get_job_logs(job_id)
    print(f"\nsubmitted command ended {time.monotonic() - started:.1f} s after its submission: {status}")
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert f"{len(SLOW_SHARDS)} total, {len(SLOW_SHARDS)} built, 0 skipped, 0 failed" in logs
    assert not temporaries(out)
    _assert_every_row_kept(slow_main, out)
