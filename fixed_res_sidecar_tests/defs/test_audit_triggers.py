"""defs/audit_triggers.py: an audit is requested after every run of the dataset that ends, once."""

import subprocess
import time
from collections.abc import Callable

import dagster as dg

from fixed_res_sidecar.defs import dagster_private as private
from fixed_res_sidecar.defs.audit_triggers import (
    AUDIT_AFTER_TAG,
    AUDIT_PRIORITY,
    PRIORITY_TAG,
    after_runs_tick,
    audit_after_runs_sensor,
)
from fixed_res_sidecar.defs.names import DATASET_TAG, DatasetKeys
from fixed_res_sidecar_tests.defs.conftest import dataset_entry, make_config

KEYS = DatasetKeys("tiny")


def ended_run(instance, defs: dg.Definitions, job: str, status: dg.DagsterRunStatus) -> dg.DagsterRun:
    """A run of `job` that ended with `status` (its end recorded as a run worker records it)."""
    run = instance.create_run_for_job(
        defs.resolve_job_def(job), tags={DATASET_TAG: "tiny"}, status=dg.DagsterRunStatus.STARTED
    )
    if status is dg.DagsterRunStatus.FAILURE:
        instance.report_run_failed(run)
    elif status is dg.DagsterRunStatus.CANCELED:
        instance.report_run_canceled(run)
    else:
        instance.handle_run_event(
            run.run_id,
            dg.DagsterEvent(dg.DagsterEventType.RUN_SUCCESS.value, job_name=run.job_name, message="done"),
        )
    return run


def ended_backfill(instance) -> str:
    """A backfill of the dataset's shard assets that the backfill daemon closed just now."""
    from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill

    instance.add_dynamic_partitions(KEYS.partitions, ["a.parquet"])
    partitions = dg.DynamicPartitionsDefinition(name=KEYS.partitions)
    request = private.backfill_request(partitions, dict.fromkeys(KEYS.shard_assets, ("a.parquet",)), {})
    backfill = PartitionBackfill.from_asset_graph_subset(
        backfill_id="closed1",
        dynamic_partitions_store=instance,
        backfill_timestamp=time.time(),
        asset_graph_subset=request.asset_graph_subset,
        tags={},
        title=None,
        description=None,
        run_config=None,
    )
    instance.add_backfill(backfill)
    closed = backfill.with_status(BulkActionStatus.COMPLETED_FAILED).with_end_timestamp(time.time())
    instance.update_backfill(closed)
    return closed.backfill_id


def test_each_run_that_ends_is_audited_once_and_audits_do_not_call_for_audits(tiny_defs, instance):
    first = after_runs_tick(instance, KEYS, None)
    assert first.skip_reason is not None and first.cursor  # starts now: earlier runs are the schedule's
    quiet = after_runs_tick(instance, KEYS, first.cursor)
    assert quiet.run_requests == [] and "no run of the dataset ended" in str(quiet.skip_reason)

    failed = ended_run(instance, tiny_defs, KEYS.shard_job, dg.DagsterRunStatus.FAILURE)
    ended_run(instance, tiny_defs, KEYS.shard_job, dg.DagsterRunStatus.SUCCESS)
    ended_run(instance, tiny_defs, KEYS.shard_job, dg.DagsterRunStatus.CANCELED)
    tick = after_runs_tick(instance, KEYS, quiet.cursor)
    (request,) = tick.run_requests
    assert failed.run_id[:8] in request.tags[AUDIT_AFTER_TAG]
    # The audit job's runs jump the queue and are not held back by the dataset's own run limit.
    tags = tiny_defs.resolve_job_def(KEYS.audit_job).tags
    assert tags[PRIORITY_TAG] == AUDIT_PRIORITY and DATASET_TAG not in tags
    again = after_runs_tick(instance, KEYS, tick.cursor)
    assert again.run_requests == []  # each ended run once

    ended_run(instance, tiny_defs, KEYS.audit_job, dg.DagsterRunStatus.SUCCESS)  # the audit itself
    assert after_runs_tick(instance, KEYS, again.cursor).run_requests == []

    # A backfill is under way until the daemon closes it, after its last run: its end calls for an audit.
    backfill = ended_backfill(instance)
    closed = after_runs_tick(instance, KEYS, again.cursor)
    (request,) = closed.run_requests
    assert request.tags[AUDIT_AFTER_TAG] == f"backfill {backfill}"
    again = after_runs_tick(instance, KEYS, closed.cursor)
    assert again.run_requests == []  # once

    # An audit run waiting to start reads what ended meanwhile: no second one.
    instance.create_run_for_job(
        tiny_defs.resolve_job_def(KEYS.audit_job), tags={DATASET_TAG: "tiny"}, status=dg.DagsterRunStatus.NOT_STARTED
    )
    ended_run(instance, tiny_defs, KEYS.shard_job, dg.DagsterRunStatus.FAILURE)
    waiting = after_runs_tick(instance, KEYS, again.cursor)
    assert waiting.run_requests == [] and "waiting to start reads them" in str(waiting.skip_reason)
    assert after_runs_tick(instance, KEYS, waiting.cursor).run_requests == []  # the cursor moved on


def test_the_sensor_runs_by_default_and_can_be_turned_off(tiny_main, tmp_path):
    dataset = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out")).datasets[0]
    sensor = audit_after_runs_sensor(dataset)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING and sensor.job_name == KEYS.audit_job
    off = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", audit={"after_runs": False})).datasets[0]
    assert audit_after_runs_sensor(off).default_status == dg.DefaultSensorStatus.STOPPED


def test_on_a_deployment_a_backfill_under_way_reads_under_way_and_its_failure_shows_within_a_minute(
    dagster_deployment, tmp_path
):
    """deploy/dagster.yaml on Postgres with a live daemon: the scheduled audit fires (every minute here)
    while a backfill's first run is held in its step (SIGSTOP): it says "under way", does not judge
    completeness, fails nothing; the dataset's run limit (1 here) does not hold it back. Once the
    backfill ends, its last run having failed on a broken shard, the run-status sensor's audit names that
    shard, requested within a minute of the run's end and with nobody clicking."""
    import os
    import signal

    from fixed_res_sidecar.defs.checks import DATASET_AUDIT_CHECK, DATASET_COMPLETE_CHECK
    from fixed_res_sidecar.io.locations import Location
    from fixed_res_sidecar_tests.defs.conftest import register
    from fixed_res_sidecar_tests.fixtures.dagster_deployment import InstanceSettings, wait_until
    from fixed_res_sidecar_tests.test_deploy_instance import (
        BACKFILL_DONE,
        RUN_TIMEOUT,
        SLOW_SHARD,
        datasets_config,
        run_worker_pid,
        start_with_backfills,
        started_steps,
        tiny_dataset,
    )

    keys = DatasetKeys("watched")
    # A held run must outlive a minute: run monitoring's backstop is raised for it.
    dagster_deployment.write_instance(
        InstanceSettings(max_concurrent_runs=2, per_dataset_limit=1, max_runtime_seconds=900)
    )
    # Slow shards (seconds of resizing): the first run is caught in its step.
    entry = tiny_dataset(tmp_path, "watched", ["a.parquet", "b.parquet"], audit={"cron": "* * * * *", "after_runs": True},
                         **SLOW_SHARD)  # fmt: skip
    Location.parse(entry["main_prefix"]).write_bytes("z-broken.parquet", b"this is not parquet")
    config = datasets_config(dagster_deployment, entry)
    with dagster_deployment.instance() as instance:
        order = register(instance, config)
        assert order == ["a.parquet", "b.parquet", "z-broken.parquet"]
        (backfill_id,) = start_with_backfills(dagster_deployment, {keys.shard_job: order})

        def in_its_step() -> dg.DagsterRun | None:
            runs = instance.get_runs(dg.RunsFilter(job_name=keys.shard_job, statuses=[dg.DagsterRunStatus.STARTED]))
            return next((r for r in runs if started_steps(instance, r.run_id)), None)

        held = wait_until(in_its_step, RUN_TIMEOUT, "the backfill's first run in its step", interval=0.2,
                          detail=dagster_deployment.report)  # fmt: skip
        pid = run_worker_pid(instance, held.run_id)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        held_at = time.time()
        try:
            scheduled_filter = dg.RunsFilter(
                job_name=keys.audit_job,
                tags={"dagster/schedule_name": keys.audit_schedule},
                statuses=[dg.DagsterRunStatus.SUCCESS],
            )
            scheduled = dagster_deployment.wait_on_runs(
                instance,
                lambda: next(
                    (r for r in instance.get_run_records(scheduled_filter) if r.create_timestamp.timestamp() > held_at),
                    None,
                ),
                150,
                "the scheduled audit while the backfill's run is held",
            )
            assert instance.get_run_by_id(held.run_id).status is dg.DagsterRunStatus.STARTED  # still under way
        finally:
            os.kill(pid, signal.SIGCONT)
        # From here on only the after-runs sensor makes audits. An audit already waiting to start when runs
        # end reads them, so the sensor asks for none then (after_runs_tick): the audit that reads a run
        # is the first of the sensor's to start after it ended, whether it names that run or not.
        stop = ["dagster", "schedule", "stop", keys.audit_schedule, "-w", str(dagster_deployment.workspace_file)]
        stopped = subprocess.run(stop, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
        evaluations = {
            e.dagster_event.event_specific_data.check_name: e.dagster_event.event_specific_data
            for e in instance.all_logs(scheduled.dagster_run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        }
        assert set(evaluations) == {DATASET_AUDIT_CHECK}  # completeness not judged while work is under way
        assert evaluations[DATASET_AUDIT_CHECK].passed  # work in progress is no failure
        (verdict,) = [
            e.dagster_event.event_specific_data.materialization.metadata["verdict"].value
            for e in instance.all_logs(scheduled.dagster_run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        ]
        assert verdict.startswith("watched under way: ") and "run(s) queued or running" in verdict, verdict

        wait_until(lambda: instance.get_backfill(backfill_id).status in BACKFILL_DONE, 3 * RUN_TIMEOUT,
                   "the backfill to end", detail=dagster_deployment.report)  # fmt: skip
        runs = instance.get_run_records(dg.RunsFilter(job_name=keys.shard_job))
        last = max(runs, key=lambda r: r.end_time or 0)
        assert last.dagster_run.tags.get("dagster/partition") == "z-broken.parquet"
        assert last.dagster_run.status is dg.DagsterRunStatus.FAILURE

        def sensor_audit_started_after(moment: float) -> Callable[[], dg.RunRecord | None]:
            def first() -> dg.RunRecord | None:
                records = instance.get_run_records(
                    dg.RunsFilter(job_name=keys.audit_job, statuses=[dg.DagsterRunStatus.SUCCESS])
                )
                started = [r for r in records if AUDIT_AFTER_TAG in r.dagster_run.tags and r.start_time >= moment]
                return min(started, key=lambda r: r.start_time, default=None)

            return first

        following = wait_until(sensor_audit_started_after(last.end_time), 3 * 60,
                               "the audit after the backfill's last run", detail=dagster_deployment.report)  # fmt: skip
        # Requested within a minute of the run's end (or waiting already when it ended).
        assert following.create_timestamp.timestamp() - last.end_time <= 60
        checks = {
            e.dagster_event.event_specific_data.check_name: e.dagster_event.event_specific_data
            for e in instance.all_logs(following.dagster_run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        }
        assert not checks[DATASET_AUDIT_CHECK].passed and "z-broken.parquet" in checks[DATASET_AUDIT_CHECK].description

        # Once the backfill daemon closed the backfill (one loop after its last run), an audit judges
        # completeness again: nothing is under way.
        closed_at = instance.get_backfill(backfill_id).backfill_end_timestamp

        closing = wait_until(sensor_audit_started_after(closed_at), 3 * 60, "the audit after the backfill ended",
                             detail=dagster_deployment.report)  # fmt: skip
        assert closing.create_timestamp.timestamp() - closed_at <= 60
        checks = {
            e.dagster_event.event_specific_data.check_name: e.dagster_event.event_specific_data
            for e in instance.all_logs(closing.dagster_run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        }
        assert not checks[DATASET_COMPLETE_CHECK].passed  # judged again: nothing is under way
        print(f"\naudit requested {following.create_timestamp.timestamp() - last.end_time:.1f} s after the last run")
