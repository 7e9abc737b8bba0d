"""defs/audit_triggers.py: an audit is requested after every run of the dataset that ends, once."""

import dagster as dg

from fixed_res_sidecar.defs.audit_triggers import AUDIT_PRIORITY, PRIORITY_TAG, after_runs_tick, audit_after_runs_sensor
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
    assert (
        request.tags[PRIORITY_TAG] == AUDIT_PRIORITY
        and failed.run_id[:8] in request.tags["fixed_res_sidecar/audit_after"]
    )
    again = after_runs_tick(instance, KEYS, tick.cursor)
    assert again.run_requests == []  # each ended run once

    ended_run(instance, tiny_defs, KEYS.audit_job, dg.DagsterRunStatus.SUCCESS)  # the audit itself
    assert after_runs_tick(instance, KEYS, again.cursor).run_requests == []

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
