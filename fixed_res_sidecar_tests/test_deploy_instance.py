"""deploy/dagster.yaml for real: a Postgres-backed instance with a live `dagster-daemon` (the default
run launcher instead of Kubernetes), shard backfills launched as the UI does (GraphQL), the
processes that can die mid-backfill killed with SIGKILL, and the database stopped mid-run.

The fixtures (fixtures/postgres.py, fixtures/dagster_deployment.py) start a real PostgreSQL server,
the code location's gRPC server (which starts one process per run, the default run launcher), the
daemon and the webserver, each in its own session. Every wait is bounded and says what it waited
for; nothing is timed.
"""

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import yaml
from dagster._core.execution.backfill import BulkActionStatus
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.tags import PARTITION_NAME_TAG

from fixed_res_sidecar.defs.config import SidecarConfig, parse_config
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.history import RESTATED_FROM_RUN, read_ledger
from fixed_res_sidecar.defs.ledger import Action
from fixed_res_sidecar.defs.names import RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.defs.run_resources import DATASET_TAG
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.sample_data import DEFAULT_SHARDS, write_sample_dataset
from fixed_res_sidecar.shards.pipeline import PipelineOptions, Stages, StoredOutputs
from fixed_res_sidecar_tests.defs.conftest import TINY_SIZES, check_partition_status, dataset_entry, register
from fixed_res_sidecar_tests.fixtures.dagster_deployment import (
    CLUSTER_ONLY,
    DEPLOY_INSTANCE,
    REPO,
    InstanceSettings,
    launched_at,
    run_partitions,
    shard_runs,
    wait_until,
)
from fixed_res_sidecar_tests.fixtures.docs import documented_command
from fixed_res_sidecar_tests.fixtures.postgres import restart_postgres, stop_postgres
from fixed_res_sidecar_tests.fixtures.processes import descendants

RUN_TIMEOUT = 240.0  # generous: a tiny shard's run takes seconds, a queue wait and a process start a few more
# deploy's run_monitoring keys the test instance sets (deploy keeps max_resume_run_attempts: 0 itself).
TEST_MONITORING = ("poll_interval_seconds", "max_runtime_seconds", "start_timeout_seconds", "cancel_timeout_seconds")
IN_PROGRESS = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
BACKFILL_DONE = {BulkActionStatus.COMPLETED_SUCCESS, BulkActionStatus.COMPLETED_FAILED}


def tiny_dataset(
    root: Path, name: str, shards: list[str], rows: int = 7, sizes=TINY_SIZES, audits_after_runs: bool = False, **extra
) -> dict:
    """A main dataset of `shards` under `root` and its datasets-file entry (one resize thread, and
    one shard per run: these tests follow single shards through runs, retries and limits). Two rows a
    verification compared with their source (8 by default, all or most of these shards' valid rows):
    the verifier's own tests cover what it compares; here each compared row only cost a run a fresh
    render and encode.

    No audit after each run unless `audits_after_runs` (the shipped default is on): the tests whose
    subject they are turn them on (the audit triggers', one dataset of the concurrency limits', the Ray backfill's);
    elsewhere they only doubled the runs a test waits for (an audit run is a run worker of its own, on a
    Ray node a Ray job)."""
    write_sample_dataset(root / "main" / name, shards=shards, rows_per_shard=rows, row_group_size=4, sizes=sizes)
    settings = {"threads_per_shard": 1, "shards_per_run": 1, "fidelity_sample": 2, **extra}
    settings["audit"] = {"after_runs": audits_after_runs, **settings.get("audit", {})}
    return dataset_entry(name, Location.parse(root / "main" / name), Location.parse(root / "out"), **settings)


def datasets_config(deployment, *entries: dict) -> SidecarConfig:
    config = {"datasets": list(entries)}
    deployment.write_datasets(config)
    return parse_config(config, source=str(deployment.datasets_file))


def partitioned_check_keys(config: SidecarConfig) -> list[dg.AssetCheckKey]:
    graph = build_definitions(config).resolve_asset_graph()
    return [key for key in graph.asset_check_keys if graph.get(key).partitions_def is not None]


def shard_asset_keys(name: str) -> list[dg.AssetKey]:
    keys = DatasetKeys(name)
    return [*(keys.resized(r) for r in RESOLUTION_NAMES), *(keys.verify(r) for r in RESOLUTION_NAMES), keys.crop_bbox]


def output_asset_keys(name: str) -> list[dg.AssetKey]:
    """The assets that write a shard's outputs (the verifiers only read them)."""
    keys = DatasetKeys(name)
    return [*(keys.resized(r) for r in RESOLUTION_NAMES), keys.crop_bbox]


def built_by(instance, key: dg.AssetKey, rel: str) -> list[str]:
    """The runs whose materialisation of `key` for shard `rel` wrote it ("built", not "skipped" as up to date,
    nor restated: a restatement repeats the metadata of the build it restates)."""
    return [
        m.run_id
        for m in materializations(instance, key, rel)
        if m.asset_materialization.metadata["status"].value == "built"
        and RESTATED_FROM_RUN not in m.asset_materialization.metadata
    ]


def run_records(instance, **filters) -> list[dg.RunRecord]:
    return list(instance.get_run_records(dg.RunsFilter(**filters)))


def materializations(instance, key: dg.AssetKey, rel: str) -> list[dg.EventLogRecord]:
    return list(
        instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[rel]), limit=100).records
    )


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most spans (start, end) open at one instant; a span ending when another starts does not overlap it."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    open_now = most = 0
    for _, step in edges:
        open_now += step
        most = max(most, open_now)
    return most


def run_spans(records: list[dg.RunRecord]) -> list[tuple[float, float]]:
    return [(r.start_time, r.end_time) for r in records if r.start_time is not None]


def slot_spans(instance, records: list[dg.RunRecord]) -> dict[str, tuple[float, float]]:
    """Run id -> when it held a run slot: from its launch (the queue's RUN_STARTING) to its end. The queue
    frees a slot at a run's end and fills it at a launch; a run's own start (`start_time`) can come after
    the other slot's run ended on a loaded machine, so starts alone may never show both slots in use."""
    spans = {}
    for record in records:
        launched = launched_at(instance, record.dagster_run.run_id)
        if launched is not None and record.end_time is not None:
            spans[record.dagster_run.run_id] = (launched, record.end_time)
    return spans


def assert_no_partition_built_twice_at_once(records: list[dg.RunRecord]) -> None:
    by_partition = defaultdict(list)
    for record in records:
        by_partition[record.dagster_run.tags[PARTITION_NAME_TAG]].append(record)
    for rel, runs in by_partition.items():
        assert most_at_once(run_spans(runs)) <= 1, (
            f"{rel}: runs overlapped: {[(r.dagster_run.run_id, r.start_time, r.end_time) for r in runs]}"
        )


def assert_shards_complete(instance, config: SidecarConfig, rels_by_dataset: dict[str, list[str]]) -> None:
    """Every shard materialised (each asset of the shard job) and every partitioned check SUCCEEDED."""
    check_keys = partitioned_check_keys(config)
    for name, rels in rels_by_dataset.items():
        for key in shard_asset_keys(name):
            assert instance.get_materialized_partitions(key) == set(rels), key.to_user_string()
        keys = [k for k in check_keys if k.asset_key.path[0] == name]
        statuses = check_partition_status(instance, keys, rels)
        assert statuses == {(k.to_user_string(), rel): "SUCCEEDED" for k in keys for rel in rels}


def assert_outputs_whole(dataset, rels: list[str]) -> None:
    """Each output holds exactly the shards `rels` (no stray files listed), each with main's keys in order."""
    for output in ("resized_512", "resized_1024", "crop_bbox"):
        location = dataset.output(output)
        assert location.list_shards() == sorted(rels), output
        for rel in rels:
            main_keys = pq.read_table(dataset.main.child(rel), columns=[dataset.key_column]).column(0).to_pylist()
            keys = pq.read_table(location.child(rel), columns=[dataset.key_column]).column(0).to_pylist()
            assert keys == main_keys, f"{output}: {rel}"


def backfill_status(instance, backfill_id: str) -> BulkActionStatus:
    return instance.get_backfill(backfill_id).status


def changed_leaves(before, after, path: str = "") -> set[str]:
    """Dotted paths of the values that differ between two loaded YAML documents (of sections both have)."""
    if isinstance(before, dict) and isinstance(after, dict):
        keys = set(before) & set(after) if not path else set(before) | set(after)
        return set().union(*(changed_leaves(before.get(k), after.get(k), f"{path}{k}.") for k in keys))
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return set().union(*(changed_leaves(b, a, f"{path}{i}.") for i, (b, a) in enumerate(zip(before, after))))
    return set() if before == after else {path.rstrip(".")}


# ----------------------------------------------------------------------------------------------- tests


def test_instance_is_deploy_with_the_default_run_launcher(dagster_deployment):
    """The derived dagster.yaml keeps every deploy section but the cluster-only ones, and Dagster
    reads it as Postgres storage, deploy's coordinator, limits, retries and monitoring."""
    deploy = yaml.safe_load(DEPLOY_INSTANCE.read_text())
    written = yaml.safe_load((dagster_deployment.home / "dagster.yaml").read_text())
    assert set(written) == set(deploy) - set(CLUSTER_ONLY)
    assert changed_leaves(deploy, written) == {
        "storage.postgres.postgres_db.port",
        "run_coordinator.config.dequeue_interval_seconds",
        "concurrency.runs.max_concurrent_runs",
        "concurrency.runs.tag_concurrency_limits.0.limit",
        *(f"run_monitoring.{key}" for key in TEST_MONITORING),
    }
    assert written["storage"]["postgres"]["postgres_db"]["port"] == dagster_deployment.database.server.pool_port

    ref = InstanceRef.from_dir(str(dagster_deployment.home))
    assert ref.run_coordinator_data.class_name == deploy["run_coordinator"]["class"]
    with dagster_deployment.instance() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.run_launcher).__name__ == "DefaultRunLauncher"
        assert instance.run_retries_enabled and instance.run_retries_max_retries == deploy["run_retries"]["max_retries"]
        assert (
            instance.run_monitoring_enabled
            and instance.run_monitoring_max_runtime_seconds == InstanceSettings().max_runtime_seconds
        )
        limits = instance.get_concurrency_config().run_queue_config
        assert limits.max_concurrent_runs == InstanceSettings().max_concurrent_runs
        (per_dataset,) = [rule for rule in limits.tag_concurrency_limits if rule["key"] == DATASET_TAG]
        assert per_dataset["limit"] == InstanceSettings().per_dataset_limit
        # Really on the test server: the storage's tables are in the test database.
        tables = dagster_deployment.database.server.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'runs'", dagster_deployment.database.name
        )
        assert tables == [(1,)]


def start_with_backfills(deployment, backfills: dict[str, list[str]]) -> list[str]:
    """Code server and webserver, the backfills launched from GraphQL (job name -> partitions), then the
    daemon: its first backfill iteration submits them at once."""
    deployment.start_code_server()
    deployment.start_webserver()
    ids = [deployment.launch_backfill(job, partitions) for job, partitions in backfills.items()]
    deployment.start_daemon()
    return ids


def test_backfills_run_within_the_concurrency_limits(dagster_deployment, tmp_path):
    """Three datasets backfilled at once: every shard built with all its checks, never more than
    max_concurrent_runs runs in progress, never more than the per-dataset limit of one dataset's runs.
    Four shard runs: three datasets' first runs compete for the two slots (the global limit binds), and
    the first dataset's second run waits for its first (the per-dataset limit binds); the first dataset's
    audit runs compete for the slots too."""
    settings = dagster_deployment.write_instance(InstanceSettings(max_concurrent_runs=2, per_dataset_limit=1))
    limit = settings["concurrency"]["runs"]["max_concurrent_runs"]
    shards = ["part-0.parquet", "deep/part-1.parquet"]
    shards_of = {"fleet_a": shards, "fleet_b": shards[:1], "fleet_c": shards[1:]}
    names = list(shards_of)
    # One dataset's audits after its runs: audit runs take run slots too, untagged (no dataset limit holds them).
    entries = [tiny_dataset(tmp_path, n, rels, audits_after_runs=n == "fleet_a") for n, rels in shards_of.items()]
    config = datasets_config(dagster_deployment, *entries)
    with dagster_deployment.instance() as instance:
        for name in names:
            assert register(instance, config, name) == sorted(shards_of[name])
    backfills = {DatasetKeys(name).shard_job: rels for name, rels in shards_of.items()}
    shard_jobs = list(backfills)
    start_with_backfills(dagster_deployment, backfills)

    with dagster_deployment.instance() as instance:
        seen_total, seen_per_dataset = 0, 0

        def all_runs_finished() -> bool:
            nonlocal seen_total, seen_per_dataset
            running = instance.get_runs(dg.RunsFilter(statuses=IN_PROGRESS))
            per_dataset = defaultdict(int)
            for run in running:  # audit runs carry no dataset tag: the dataset's limit does not hold them
                if DATASET_TAG in run.tags:
                    per_dataset[run.tags[DATASET_TAG]] += 1
            seen_total = max(seen_total, len(running))
            seen_per_dataset = max([seen_per_dataset, *per_dataset.values()])
            runs = [r for r in instance.get_runs() if r.job_name in shard_jobs]
            return len(runs) == sum(map(len, shards_of.values())) and all(r.status in FINISHED for r in runs)

        dagster_deployment.wait_on_runs(instance, all_runs_finished, RUN_TIMEOUT, "the backfills' runs to finish",
                                        interval=0.2)  # fmt: skip

        dagster_deployment.wait_until_idle(instance, RUN_TIMEOUT)  # and any run the automation sensors added
        everything = run_records(instance)
        records = [r for r in everything if r.dagster_run.job_name in shard_jobs]
        assert {r.dagster_run.status for r in records} == {dg.DagsterRunStatus.SUCCESS}
        run_of = {(r.dagster_run.tags[DATASET_TAG], r.dagster_run.tags[PARTITION_NAME_TAG]): r for r in records}
        assert len(records) == len(run_of) and set(run_of) == {
            (n, rel) for n, rels in shards_of.items() for rel in rels
        }
        assert seen_total <= limit and seen_per_dataset <= 1
        # From the stored launch and end times too (every run counts); the global limit was reached.
        slots = slot_spans(instance, everything)
        first = min(start for start, _ in slots.values())
        seen = sorted((round(start - first, 1), round(end - first, 1)) for start, end in slots.values())
        assert most_at_once(list(slots.values())) == limit, f"run slots held (s after the first launch): {seen}"
        for name in names:
            of_dataset = [slots[r.dagster_run.run_id] for r in everything
                          if r.dagster_run.tags.get(DATASET_TAG) == name and r.dagster_run.run_id in slots]  # fmt: skip
            assert most_at_once(of_dataset) == 1, f"{name}: {seen}"
        for (name, rel), record in run_of.items():
            for key in output_asset_keys(name):
                assert built_by(instance, key, rel) == [record.dagster_run.run_id], (key.to_user_string(), rel)
        assert_shards_complete(instance, config, shards_of)
        for name, rels in shards_of.items():
            assert_outputs_whole(config.dataset(name), rels)


def engine_messages(instance, run_id: str) -> list[str]:
    return [e.message for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]


def run_worker_pid(instance, run_id: str) -> int | None:
    """The pid the run's process reported ("Started process for run (pid: N)")."""
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        metadata = entry.dagster_event.engine_event_data.metadata
        if "pid" in metadata:
            return int(metadata["pid"].value)
    return None


def started_steps(instance, run_id: str) -> set[str]:
    return {e.step_key for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_START)}


# Resizing this shard takes seconds (WebP's slowest method, one thread), long enough to kill its run
# inside the step, with pictures that are quick to generate.
SLOW_SHARD = {"rows": 16, "sizes": ((800, 600), (600, 800)), "webp_method": 6}


def test_a_killed_run_is_retried_and_its_shard_built_once(dagster_deployment, tmp_path):
    """SIGKILL the run worker in the middle of the first step (the resize) of a shard run that the discovery
    sensor requested: the code server reports the run failed, run_retries starts a retry, and the
    shard ends built once, whole, with every check of its partition recorded."""
    rel = "2026/part-0.parquet"
    sensor = {"interval_seconds": 5, "default_status": "running"}
    entry = tiny_dataset(tmp_path, "slow", [rel], sensor=sensor, **SLOW_SHARD)
    config = datasets_config(dagster_deployment, entry)
    dagster_deployment.start_code_server()
    dagster_deployment.start_daemon()

    with dagster_deployment.instance() as instance:

        def building_run() -> dg.DagsterRun | None:
            runs = shard_runs(instance, "slow", [dg.DagsterRunStatus.STARTED])
            return next((r for r in runs if started_steps(instance, r.run_id)), None)

        run = wait_until(building_run, RUN_TIMEOUT, "the sensor's shard run to start its first step", interval=0.1,
                         detail=dagster_deployment.report)  # fmt: skip
        assert run.tags[PARTITION_NAME_TAG] == rel and "dagster/backfill" not in run.tags
        pid = run_worker_pid(instance, run.run_id)
        assert pid in dagster_deployment.code_server_processes(), "the run worker is a child of the code server"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()

        failed = wait_until(lambda: (r := instance.get_run_by_id(run.run_id)).is_finished and r, RUN_TIMEOUT,
                            "the killed run to be marked finished", detail=dagster_deployment.report)  # fmt: skip
        detected = time.monotonic() - killed
        retry_filter = dg.RunsFilter(tags={"dagster/parent_run_id": run.run_id})
        retry = dagster_deployment.wait_on_runs(
            instance, lambda: next((r for r in instance.get_runs(retry_filter) if r.is_finished), None),
            RUN_TIMEOUT, "the retry of the killed run to finish")  # fmt: skip
        retried = time.monotonic() - killed
        print(f"\nkilled run: marked failed after {detected:.1f} s, retry finished after {retried:.1f} s")

        # Killed inside its first step (the resize): nothing was materialised; the code server saw the SIGKILL.
        assert failed.status == dg.DagsterRunStatus.FAILURE
        assert started_steps(instance, run.run_id)
        assert not instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        assert any("SIGKILL" in m for m in engine_messages(instance, run.run_id)), engine_messages(instance, run.run_id)
        # One retry, and it succeeded; no other run of the shard.
        assert retry.status == dg.DagsterRunStatus.SUCCESS, engine_messages(instance, retry.run_id)
        assert retry.tags["dagster/retry_number"] == "1" and retry.tags[PARTITION_NAME_TAG] == rel
        assert {r.run_id for r in shard_runs(instance, "slow")} == {
            run.run_id,
            retry.run_id,
        }
        # Built once, by the retry; the verifiers ran in it too. The automation sensor added no run: the
        # retry built the whole shard.
        dagster_deployment.wait_until_idle(instance, RUN_TIMEOUT)
        assert {r.run_id for r in shard_runs(instance, "slow", automation=True)} == {run.run_id, retry.run_id}
        for key in output_asset_keys("slow"):
            assert built_by(instance, key, rel) == [retry.run_id], key.to_user_string()
        for key in shard_asset_keys("slow"):
            assert retry.run_id in [m.run_id for m in materializations(instance, key, rel)], key.to_user_string()
        assert_shards_complete(instance, config, {"slow": [rel]})
        assert_outputs_whole(config.dataset("slow"), [rel])


def test_a_killed_daemon_restarts_and_the_backfill_finishes(dagster_deployment, tmp_path):
    """SIGKILL the daemon's process group while a backfill has runs in progress and runs queued, then
    start it again: the backfill finishes, each shard was built by exactly one run (never two at once,
    none submitted twice, none skipped), with all its checks."""
    shards = [f"part-{i}.parquet" for i in range(4)]
    config = datasets_config(dagster_deployment, tiny_dataset(tmp_path, "restart", shards))
    keys = DatasetKeys("restart")
    with dagster_deployment.instance() as instance:
        register(instance, config)
    (backfill,) = start_with_backfills(dagster_deployment, {keys.shard_job: shards})

    with dagster_deployment.instance() as instance:

        def mid_backfill() -> dict[str, dg.DagsterRunStatus] | None:
            statuses = {r.run_id: r.status for r in instance.get_runs(dg.RunsFilter.for_backfill(backfill))}
            busy = set(statuses.values())
            return statuses if dg.DagsterRunStatus.STARTED in busy and dg.DagsterRunStatus.QUEUED in busy else None

        at_kill = wait_until(mid_backfill, RUN_TIMEOUT, "a run in progress and a run queued", interval=0.1,
                             detail=dagster_deployment.report)  # fmt: skip
        dagster_deployment.kill_daemon()
        killed_at, killed = time.time(), time.monotonic()
        # The runs in progress live on without the daemon: their processes belong to the code server.
        in_flight = [i for i, s in at_kill.items() if instance.get_run_by_id(i).status == dg.DagsterRunStatus.STARTED]
        for run_id in in_flight:
            assert run_worker_pid(instance, run_id) in dagster_deployment.code_server_processes()
        dagster_deployment.start_daemon()

        dagster_deployment.wait_on_runs(instance, lambda: backfill_status(instance, backfill) in BACKFILL_DONE,
                                        RUN_TIMEOUT + 60, "the backfill to finish after the restart")  # fmt: skip
        print(f"\nbackfill finished {time.monotonic() - killed:.1f} s after the daemon was killed")

        assert backfill_status(instance, backfill) == BulkActionStatus.COMPLETED_SUCCESS
        records = run_records(instance, tags={"dagster/backfill": backfill})
        assert sorted(r.dagster_run.tags[PARTITION_NAME_TAG] for r in records) == shards  # one run each
        assert {r.dagster_run.status for r in records} == {dg.DagsterRunStatus.SUCCESS}
        # The runs in flight finished after the daemon's death; the queued ones waited for the new daemon.
        by_id = {r.dagster_run.run_id: r for r in records}
        assert all(by_id[run_id].end_time > killed_at for run_id in in_flight)
        assert all(by_id[i].start_time > killed_at for i, s in at_kill.items() if s == dg.DagsterRunStatus.QUEUED)
        assert_no_partition_built_twice_at_once(run_records(instance, job_name=keys.shard_job))
        dagster_deployment.wait_until_idle(instance, RUN_TIMEOUT)
        for record in records:
            for key in output_asset_keys("restart"):
                rel = record.dagster_run.tags[PARTITION_NAME_TAG]
                assert built_by(instance, key, rel) == [record.dagster_run.run_id], (key.to_user_string(), rel)
        assert_shards_complete(instance, config, {"restart": shards})
        assert_outputs_whole(config.dataset("restart"), shards)


OUTAGE_SECONDS = 20.0


def failures(instance, run: dg.DagsterRun) -> list:
    return [e for e in instance.all_logs(run.run_id) if e.is_dagster_event and e.dagster_event.is_failure]


def error_text(error, max_chars: int = 240) -> str:
    """An error and each of its causes (the innermost says why), one line."""
    parts = []
    while error is not None:
        parts.append(f"{error.cls_name}: {' '.join(error.message.split())[:max_chars]}")
        error = error.cause
    return " <- ".join(parts)


def runs_summary(instance, runs: list[dg.DagsterRun], since: float) -> str:
    """One line per run (created at, shard, status, parent, its failures with their causes), then its
    engine events that say how it was launched, retried or not: what a failed assertion needs to show."""
    lines = []
    records = instance.get_run_records(dg.RunsFilter(run_ids=[run.run_id for run in runs]))
    for record in sorted(records, key=lambda r: r.create_timestamp):
        run, created = record.dagster_run, record.create_timestamp.timestamp() - since
        errors = {error_text(error) for e in failures(instance, run)
                  if (error := getattr(e.dagster_event.event_specific_data, "error", None))}  # fmt: skip
        lines.append(f"+{created:6.1f} s run {run.run_id[:8]} {run.tags.get(PARTITION_NAME_TAG)} {run.status.value}"
                     f" parent={run.parent_run_id and run.parent_run_id[:8]} {sorted(errors)}")  # fmt: skip
        for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
            if re.search(r"retr|dequeue|duplicate|fenced|unexpectedly|timed out", entry.message, re.IGNORECASE):
                error = entry.dagster_event.engine_event_data.error
                lines.append(f"    +{entry.timestamp - since:6.1f} s {' '.join(entry.message.split())[:200]}"
                             + (f" ({error_text(error)})" if error else ""))  # fmt: skip
    return "\n".join(lines)


def test_a_storage_outage_mid_run_leaves_no_built_shard_unrecorded(private_dagster_deployment, tmp_path):
    """Stop PostgreSQL (a fast shutdown, as `pg_ctl stop -m fast`) for 20 s once a shard run of the discovery
    sensor is in its work (a few seconds: the outage outlasts it), then start it again on the same data
    folder and port: every shard ends recorded (its materializations and every check of its partition,
    describing the very objects in storage), in the same run or a retry of it, and no output is built
    but unrecorded."""
    deployment, server = private_dagster_deployment, private_dagster_deployment.database.server
    shards = ["part-0.parquet", "part-1.parquet"]
    sensor = {"interval_seconds": 5, "default_status": "running"}
    config = datasets_config(deployment, tiny_dataset(tmp_path, "outage", shards, sensor=sensor))
    keys = DatasetKeys("outage")
    deployment.start_code_server()
    deployment.start_daemon()

    resized = Path(config.dataset("outage").output("resized_512").path)

    def in_work() -> bool:  # a shard's resize is writing its temporary (or wrote its output)
        return any(resized.glob("*.parquet")) or any(resized.glob(".*.tmp"))

    wait_until(in_work, RUN_TIMEOUT, "a shard run in its work", interval=0.05, detail=deployment.report)
    stop_postgres(server)
    time.sleep(OUTAGE_SECONDS)
    restart_postgres(server)

    with deployment.instance() as instance:
        runs = deployment.wait_until_idle(instance, RUN_TIMEOUT + 60)
        print("\n" + runs_summary(instance, runs, 0.0))  # what the outage did, for the test's output
        # Every shard recorded: its assets materialised, every check of its partition passed...
        assert_shards_complete(instance, config, {"outage": shards})
        assert_outputs_whole(config.dataset("outage"), shards)
        # ...on the outputs now in storage: nothing built after what is on record.
        everything = Stages(resize=RESOLUTION_NAMES, verify=RESOLUTION_NAMES, crop=True)
        dataset = config.dataset("outage")
        options = PipelineOptions(pixels=dataset.pixel_options())
        for rel in shards:
            outputs = StoredOutputs(dataset.layout, rel, everything, options)
            decision = read_ledger(instance, keys, rel).decide(everything, True, outputs)
            assert decision.action is Action.RESTATE, f"{rel}: {decision.reason}"
        # Each shard's runs ended well, by themselves or through their retries.
        for rel in shards:
            statuses = [r.status for r in shard_runs(instance, "outage") if rel in run_partitions(r, shards)]
            assert dg.DagsterRunStatus.SUCCESS in statuses, (rel, statuses)


def test_the_documented_dagster_commands_build_their_shards(dagster_deployment, tmp_path):
    """docs/dagster.md's `dagster asset materialize` and `dagster job backfill` as written, from a folder
    holding the repository's workspace.yaml, on the deployment's instance (its daemon starts the backfill's
    queued runs), then its `dagster sensor start`, which finds the shard added since: every shard of the
    sample ends built, verified and cropped, each output built once."""
    later = "part-00001.parquet"  # added to main after the backfill, for the discovery sensor
    sensor = {"interval_seconds": 5, "default_status": "stopped"}
    entry = tiny_dataset(tmp_path, "sample", [rel for rel in DEFAULT_SHARDS if rel != later], sensor=sensor)
    config = datasets_config(dagster_deployment, entry)
    dataset, keys = config.dataset("sample"), DatasetKeys("sample")
    with dagster_deployment.instance() as instance:
        register(instance, config)
    dagster_deployment.start_code_server()
    dagster_deployment.start_daemon()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(REPO / "workspace.yaml", checkout)

    def dagster(command: str) -> None:
        result = subprocess.run(shlex.split(command), cwd=checkout, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"

    dagster(documented_command("docs/dagster.md", "dagster asset materialize"))
    with dagster_deployment.instance() as instance:
        (materialize_run,) = built_by(instance, keys.resized("512"), "part-00000.parquet")
        assert instance.get_run_by_id(materialize_run).status == dg.DagsterRunStatus.SUCCESS
        assert instance.get_materialized_partitions(keys.resized("1024")) == {"part-00000.parquet"}

        dagster(documented_command("docs/dagster.md", "dagster job backfill"))
        (backfill,) = instance.get_backfills()
        dagster_deployment.wait_until_idle(instance, RUN_TIMEOUT)
        backfilled = run_records(instance, tags={"dagster/backfill": backfill.backfill_id})
        assert sorted(r.dagster_run.tags[PARTITION_NAME_TAG] for r in backfilled) == sorted(
            set(DEFAULT_SHARDS) - {later}
        )
        assert {r.dagster_run.status for r in backfilled} == {dg.DagsterRunStatus.SUCCESS}

        write_sample_dataset(dataset.main, shards=[later], rows_per_shard=7, row_group_size=4, sizes=TINY_SIZES)
        (sensor_start,) = re.findall(r"`(dagster sensor start [^`]*)`", (REPO / "docs" / "dagster.md").read_text())
        dagster(sensor_start)
        dagster_deployment.wait_on_runs(instance, lambda: later in instance.get_materialized_partitions(keys.crop_bbox),
                                        RUN_TIMEOUT, "the discovery sensor's run of the new shard")  # fmt: skip
        dagster_deployment.wait_until_idle(instance, RUN_TIMEOUT)
        assert_shards_complete(instance, config, {"sample": list(DEFAULT_SHARDS)})
        assert_outputs_whole(dataset, list(DEFAULT_SHARDS))
        # The resized shards of part-00000 were built by `dagster asset materialize`; the backfill kept them.
        for key in output_asset_keys("sample"):
            for rel in DEFAULT_SHARDS:
                assert len(built_by(instance, key, rel)) == 1, (key.to_user_string(), rel)
        for resolution in RESOLUTION_NAMES:
            built = built_by(instance, keys.resized(resolution), "part-00000.parquet")
            assert built == [materialize_run]


# The times of a long outage, scaled down by a sixth (the same order of events, minutes less waiting):
STORAGE_WAIT_SECONDS = 20  # a run's storage wait (SIDECAR_STORAGE_WAIT_SECONDS; deploy's default 120 s)
LONG_OUTAGE_SECONDS = 30.0  # longer than a run's storage wait
# The daemon's StartRun deadline (DAGSTER_GRPC_TIMEOUT_SECONDS; Dagster's default 60 s): above a run
# worker's start on a loaded machine (17 s seen in CI), so that only the held starts below miss it. It
# bounds every call of the daemon to the code server, a retry's too: at 15 s a retry could fail to launch.
START_RUN_DEADLINE = 30
STALLED_STARTS = 3  # run workers that never start: more than the two retries a run gets


SPIN = """
import contextlib, os
os.nice(19)
with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:  # a kernel without autogroups
    group.write("19")
while True:
    pass
"""


@contextmanager
def busy_cores(count: int = 2):
    """`count` processes spinning on a core each, killed afterwards: no core of the machine is ever idle,
    as on a node shared with batch jobs. At the lowest priority, so that they take the cores' idle time
    and not the time of the suite's other workers and servers: nice 19, in a session of their own whose
    scheduling group is at nice 19 too (Linux's autogroups share the cores out per session first, so a
    spinner in pytest's session took that session's whole share whenever its workers waited). The long
    starts a loaded machine brings are made by `StalledRunStarts`, deterministically."""
    spin = [sys.executable, "-c", SPIN]
    spinners = [subprocess.Popen(spin, start_new_session=True) for _ in range(count)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=30)


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class StalledRunStarts:
    """Holds the next `count` run workers the code server spawns (SIGSTOP as each appears) for `seconds`
    each, then kills them: a run's start then takes longer than the daemon's StartRun deadline, as it
    does when a loaded machine takes over a minute to start a Python process and load the code location
    (seen with both cores busy after a long storage outage), and the queue launches the run again.
    Deterministic where a busy loop is not. A held worker let go instead would race the run's next
    launch (both may find it STARTING, and the fence then fails the run rather than build its shard
    twice), a race of Dagster's that this test is not about."""

    def __init__(self, deployment, count: int, seconds: float):
        self.deployment, self.count, self.seconds = deployment, count, seconds
        self.held: list[tuple[int, float]] = []  # (pid, when held)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _run_workers(self) -> set[int]:
        """The code server's own children that multiprocessing spawned (its shard workers are grandchildren)."""
        server = self.deployment.code_server.pid
        return {
            proc.pid for proc in descendants(server) if parent_of(proc.pid) == server and "spawn_main" in proc.command
        }

    def _hold(self) -> None:
        seen = self._run_workers()  # already running: not held
        while not self.stop.is_set():
            now = time.monotonic()
            for pid, since in list(self.held):
                if since is not None and now - since >= self.seconds:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    self.held[self.held.index((pid, since))] = (pid, None)
            if len(self.held) < self.count:
                for pid in sorted(self._run_workers() - seen):
                    seen.add(pid)
                    if len(self.held) < self.count:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGSTOP)
                            self.held.append((pid, time.monotonic()))
            elif all(since is None for _, since in self.held):
                return
            # A run worker imports Dagster for a second or more before it does anything; each look reads
            # every process's /proc entry, about 3 ms of CPU (at 50 a second, a sixth of a core all test long).
            time.sleep(0.1)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        for pid, since in self.held:
            if since is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_long_outage_on_a_busy_machine_leaves_no_shard_built_but_unrecorded(private_dagster_deployment, tmp_path):
    """PostgreSQL stopped mid-backfill for longer than a run waits for its storage, with both cores kept
    busy: the run in its work fails once its wait is over. Then the run workers of its retries (and of
    any other run) do not start within the daemon's StartRun deadline, three times in a row (more than a
    run's two retries); the waits scaled down (STORAGE_WAIT_SECONDS and below). Every shard
    still ends recorded (materialised, every check passed, describing the objects in storage): a run that
    could not start is started again, and a later run finds the outputs the interrupted run had written
    and records them (not rebuilt)."""
    deployment, server = private_dagster_deployment, private_dagster_deployment.database.server
    # The monitoring backstop (a run's longest life) must outlast the outage: a run it cancels is never retried.
    deployment.write_instance(InstanceSettings(max_runtime_seconds=int(LONG_OUTAGE_SECONDS) * 10))
    deployment.extra_env.update(
        {
            "SIDECAR_STORAGE_WAIT_SECONDS": str(STORAGE_WAIT_SECONDS),
            "DAGSTER_GRPC_TIMEOUT_SECONDS": str(START_RUN_DEADLINE),
        }
    )
    shards = [f"part-{i}.parquet" for i in range(3)]
    config = datasets_config(deployment, tiny_dataset(tmp_path, "longout", shards))
    keys = DatasetKeys("longout")
    dataset = config.dataset("longout")
    with deployment.instance() as instance:
        register(instance, config)
    resized = Path(dataset.output("resized_512").path)

    def built() -> bool:  # a shard's resized output is in place; the run records its shard at its end
        return any(resized.glob("*.parquet"))

    timeline: list[tuple[float, str]] = []
    started = time.time()  # wall clock: the runs' records are stamped with it
    with busy_cores(2):
        (backfill,) = start_with_backfills(deployment, {keys.shard_job: shards})
        wait_until(built, RUN_TIMEOUT * 2, "a shard's first output", interval=0.05, detail=deployment.report)
        timeline.append((time.time() - started, "database stopped"))
        stop_postgres(server)
        time.sleep(LONG_OUTAGE_SECONDS)
        with StalledRunStarts(deployment, STALLED_STARTS, START_RUN_DEADLINE + 5) as stalled:
            restart_postgres(server)
            timeline.append((time.time() - started, "database started again"))
            # What the outage left: outputs written, and not (or not all) recorded.
            written = {rel: os.stat(resized / rel).st_mtime_ns for rel in shards if (resized / rel).exists()}
            with deployment.instance() as instance:
                wait_until(lambda: backfill_status(instance, backfill) in BACKFILL_DONE, RUN_TIMEOUT * 6,
                           "the backfill to finish", detail=deployment.report)  # fmt: skip
                runs = deployment.wait_until_idle(instance, RUN_TIMEOUT * 6)
        timeline.append((time.time() - started, "every run finished"))

    with deployment.instance() as instance:
        for run in runs:
            for entry in instance.all_logs(run.run_id):  # how its launches, starts and end went
                kind = entry.dagster_event_type
                if kind and (kind.value.startswith(("PIPELINE_", "RUN_")) or kind == dg.DagsterEventType.ENGINE_EVENT):
                    what = kind.value if kind != dg.DagsterEventType.ENGINE_EVENT else entry.message[:100]
                    timeline.append((entry.timestamp - started, f"    {run.run_id[:8]}: {what}"))
        print("\n" + "\n".join(f"+{at:6.1f} s {what}" for at, what in sorted(timeline)))
        summary = (
            f"run workers held: {len(stalled.held)}; backfill {backfill}: {backfill_status(instance, backfill).value}\n"
            + runs_summary(instance, runs, started)
        )
        print(summary)
        assert len(stalled.held) == STALLED_STARTS, "the run workers to hold never came"
        # Every shard recorded: its assets materialised, every check of its partition passed...
        try:
            assert_shards_complete(instance, config, {"longout": shards})
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{summary}") from None
        assert_outputs_whole(dataset, shards)
        # ...on the outputs now in storage: nothing built after what is on record.
        everything = Stages(resize=RESOLUTION_NAMES, verify=RESOLUTION_NAMES, crop=True)
        options = PipelineOptions(pixels=dataset.pixel_options())
        for rel in shards:
            outputs = StoredOutputs(dataset.layout, rel, everything, options)
            decision = read_ledger(instance, keys, rel).decide(everything, True, outputs)
            assert decision.action is Action.RESTATE, f"{rel}: {decision.reason}"
        # What the interrupted run had written was found and recorded (as kept: "skipped"), not built again.
        assert written, "no output was written before the outage"
        for rel, mtime in written.items():
            assert os.stat(resized / rel).st_mtime_ns == mtime, f"{rel} was built again"
            assert built_by(instance, keys.resized("512"), rel) == [], rel
        # Never built twice: no output was written by two runs (a run started twice, or a run and its retry).
        for rel in shards:
            for key in output_asset_keys("longout"):
                assert len(built_by(instance, key, rel)) <= 1, (key.to_user_string(), rel, built_by(instance, key, rel))
        # Each shard has a run that ended well (the backfill's, or a retry of it).
        for rel in shards:
            statuses = [r.status for r in runs if r.tags.get(PARTITION_NAME_TAG) == rel]
            assert dg.DagsterRunStatus.SUCCESS in statuses, (rel, statuses)
