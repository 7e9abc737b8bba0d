"""When the dataset audit runs: within a minute of every run of the dataset that ends, and on a schedule.

- `<name>__audit_after_runs` (a sensor; running by default, `audit.after_runs` in the datasets file)
  looks every `AFTER_RUNS_INTERVAL_SECONDS` for runs of the dataset that ended since its cursor
  (succeeded, failed or canceled; every run of a dataset carries its dataset tag, also those launched
  from an asset page: defs/run_coordinator.py), or backfills of it that ended, and requests one audit
  run for all of them, unless an audit run is already waiting to start, which will read them anyway.
  Audit runs do not count (an audit does not call for another). A failed backfill run therefore shows in the audit within a
  minute, without a click; each audit reads only what was recorded since the previous one
  (defs/dataset_audit.py).
- `<name>__audit_hourly` (a schedule; `audit.cron`, hourly by default) audits whatever happened.

Audit runs jump the run queue (`dagster/priority`), so a backfill that fills every run slot delays
them by one shard run at most, and they do not carry the dataset's tag, so the dataset's own run
limit does not hold them back (defs/run_coordinator.py leaves them untagged too); they are small
(`AUDIT_CPU`, `AUDIT_MEMORY_GB`). While the dataset's runs are under way the audit says so, and does
not judge completeness (defs/checks.py `audit_check_results`).
"""

import json
from datetime import UTC, datetime

import dagster as dg

from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.dagster_private import BulkActionsFilter, BulkActionStatus
from fixed_res_sidecar.defs.dataset_audit import is_audit_run, targets_dataset
from fixed_res_sidecar.defs.names import DATASET_TAG, DatasetKeys
from fixed_res_sidecar.defs.run_resources import launcher_tags

AFTER_RUNS_INTERVAL_SECONDS = 15
PRIORITY_TAG = "dagster/priority"  # the queued run coordinator starts higher priorities first
AUDIT_PRIORITY = "10"
AUDIT_AFTER_TAG = "fixed_res_sidecar/audit_after"  # the runs (ids' first 8 characters) an audit run follows
ENDED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
WAITING = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING]
PAGE = 1000  # run records read per tick (the cursor moves on; the next tick reads the rest)
BACKFILL_ENDED = [
    BulkActionStatus.COMPLETED_SUCCESS,
    BulkActionStatus.COMPLETED_FAILED,
    BulkActionStatus.COMPLETED,
    BulkActionStatus.FAILED,
    BulkActionStatus.CANCELED,
]
BACKFILLS_READ = 50  # the latest ended backfills looked at per tick
# What an audit run needs: it reads the event log incrementally and keeps a ledger per shard (a few
# megabytes of JSON at 100,000 shards).
AUDIT_CPU, AUDIT_MEMORY_GB = 1, 2


def audit_run_tags() -> dict[str, str]:
    """Tags of every audit run: first in the queue, its pod's (or Ray job's) size; no dataset tag."""
    return {**launcher_tags(AUDIT_CPU, AUDIT_MEMORY_GB), PRIORITY_TAG: AUDIT_PRIORITY}


def audit_schedule(dataset: DatasetConfig, audit_job) -> dg.ScheduleDefinition:
    keys = DatasetKeys(dataset.name)
    return dg.ScheduleDefinition(
        name=keys.audit_schedule,
        job=audit_job,
        cron_schedule=dataset.audit.cron,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"The audit of {dataset.name} on a schedule ({dataset.audit.cron}), whatever happened.",
    )


def audit_after_runs_sensor(dataset: DatasetConfig) -> dg.SensorDefinition:
    keys = DatasetKeys(dataset.name)
    status = dg.DefaultSensorStatus.RUNNING if dataset.audit.after_runs else dg.DefaultSensorStatus.STOPPED

    @dg.sensor(
        name=keys.audit_sensor,
        job_name=keys.audit_job,
        minimum_interval_seconds=AFTER_RUNS_INTERVAL_SECONDS,
        default_status=status,
        description=(
            f"Audits {dataset.name} within a minute of every run of it that ends (succeeded, failed or canceled), "
            "so that the audit is never stale."
        ),
    )
    def _after_runs(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        return after_runs_tick(context.instance, keys, context.cursor)

    return _after_runs


def after_runs_tick(instance: dg.DagsterInstance, keys: DatasetKeys, cursor: str | None) -> dg.SensorResult:
    """One tick: an audit run for the runs of the dataset that ended since `cursor` (the latest end time
    seen, JSON), or why none. The first tick only starts the cursor (what ended before is audited hourly)."""
    now = datetime.now(UTC).timestamp()
    since = _parse(cursor)
    if since is None:
        return dg.SensorResult(skip_reason="started: audits after the runs that end from now on", cursor=_dump(now))
    records = instance.get_run_records(
        dg.RunsFilter(
            tags={DATASET_TAG: keys.dataset},
            statuses=ENDED,
            updated_after=datetime.fromtimestamp(since, UTC),
        ),
        limit=PAGE,
        order_by="update_timestamp",
        ascending=True,
    )
    ended = [
        (record.dagster_run.run_id[:8], end)
        for record in records
        if (end := _ended_at(record)) > since and not is_audit_run(record.dagster_run, keys)
    ]
    # A backfill is under way until the backfill daemon closes it, after its last run ended (up to 30 s
    # later): its end calls for an audit too, or the last one would say "under way" until the next hour.
    backfills = instance.get_backfills(filters=BulkActionsFilter(statuses=BACKFILL_ENDED), limit=BACKFILLS_READ)
    ended += [
        (f"backfill {backfill.backfill_id}", end)
        for backfill in backfills
        if (end := backfill.backfill_end_timestamp or 0) > since and targets_dataset(backfill, keys)
    ]
    if not ended:
        return dg.SensorResult(skip_reason="no run of the dataset ended since the last audit request", cursor=cursor)
    latest = max(end for _, end in ended)
    runs = ", ".join(name for name, _ in ended[:10])
    waiting = [
        run for run in instance.get_runs(dg.RunsFilter(statuses=WAITING, job_name=keys.audit_job), limit=10)
    ]  # fmt: skip
    if waiting:
        reason = (
            f"{len(ended)} run(s) ended ({runs}); the audit run {waiting[0].run_id[:8]} waiting to start reads them"
        )
        return dg.SensorResult(skip_reason=reason, cursor=_dump(latest))
    request = dg.RunRequest(run_key=f"after-runs-{latest:.6f}", tags={AUDIT_AFTER_TAG: runs[:200]})
    return dg.SensorResult(run_requests=[request], cursor=_dump(latest))


def _ended_at(record: dg.RunRecord) -> float:
    if record.end_time is not None:
        return record.end_time
    return record.update_timestamp.timestamp()


def _parse(cursor: str | None) -> float | None:
    try:
        return float(json.loads(cursor)["ended_after"]) if cursor else None
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: start again from now


def _dump(timestamp: float) -> str:
    return json.dumps({"ended_after": timestamp})
