"""The automation sensor of one dataset (`<dataset>__automation`, running by default): the runs that
follow a shard's runs, as its ledger says (`ShardLedger.follow_up`): a verifier after an output was
built by a run that did not verify it, and crop_bbox once both verifiers' checks passed for the shard,
also when they pass in a later run (SPEC 7's gate across runs).

Not Dagster's automation conditions (`eager()` on the verifiers and crop_bbox): they are evaluated over
every partition at each tick, and each condition's subsets are written into the cursor, 30-60 s a tick
at 100,000 partitions (docs/performance.md). This tick reads only what was recorded since the last
ones, so it costs what the runs did, not what the dataset holds. Each tick:

1. reads the materializations of the shard assets, and the failed verifications, recorded after
   `settled`. On Postgres concurrent writers commit out of order (audit_state.py), so events are read
   again until they have surely committed (`audit_state.settle`, as the dataset audit does), and
   `handled` keeps a shard from being decided twice on one event. At most `EVENTS_PER_TICK` records
   per asset and kind: a longer backlog (a first tick on a long history) is read over several ticks;
2. a shard whose latest event is a failed verification needs nothing (a failure is for the operator, as
   with Dagster's `~execution_failed()`), nor one whose latest event is crop_bbox's materialization by a
   run that verified every output it built. The others wait until the run that wrote that event has
   ended. A run that failed and will be retried leaves its shards to the retry (a follow-up would race
   it), a canceled one to the operator; after the others (a success, a data failure, which is never
   retried), at most `LEDGERS_PER_TICK` shards a tick have their ledgers read. A ledger that holds a
   newer event than the one waited on is decided on that event instead, once its run ended;
3. asks each ledger what follows, and requests runs of those assets, ranges of at most
   `shards_per_run` shards (more than `BACKFILL_ABOVE_RUNS` runs' worth: one backfill), tagged
   `AUTOMATION_TAG`.
"""

import json
import time
from dataclasses import asdict, dataclass, field

import dagster as dg

from fixed_res_sidecar.defs import history, ledger
from fixed_res_sidecar.defs.audit_state import RUNS_PER_QUERY, SETTLE_SECONDS, settle
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.names import AUTOMATION_TAG, RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.defs.partitions import chunks
from fixed_res_sidecar.defs.run_resources import RETRY_ON_FAILURE_TAG
from fixed_res_sidecar.defs.sensors import shard_run_requests

EVENTS_PER_TICK = 10_000  # records read per asset and kind in one tick
LEDGERS_PER_TICK = 200  # shards whose ledgers one tick reads (about 20 queries each); the rest wait


@dataclass
class AutomationCursor:
    """How far the sensor read (`settled`, `marks`: audit_state.settle), and the shards it is following."""

    settled: int = 0
    marks: list[list[float]] = field(default_factory=list)
    waiting: dict[str, list] = field(default_factory=dict)  # rel -> [storage id, run id] of its latest event
    handled: dict[str, int] = field(default_factory=dict)  # rel -> storage id of the event it was decided on

    @classmethod
    def parse(cls, text: str | None) -> "AutomationCursor":
        try:
            data = json.loads(text or "")
            return cls(
                int(data["settled"]),
                [[float(when), int(high)] for when, high in data["marks"]],
                {rel: [int(storage_id), str(run_id)] for rel, (storage_id, run_id) in data["waiting"].items()},
                {rel: int(storage_id) for rel, storage_id in data["handled"].items()},
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls()  # none yet, or unreadable: read from the start

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class LatestEvent:
    storage_id: int
    run_id: str
    name: str  # the asset's ledger name ("crop_bbox")
    failure: bool  # a failed verification (an observation)

    def final(self, built_by_its_run: set[str]) -> bool:
        """Nothing follows it: a failed verification, or crop_bbox built by a run that verified every output
        it built (a run may build an output and crop_bbox without its verifier: that output is verified next)."""
        if self.failure:
            return True
        return self.name == ledger.CROP_BBOX and all(
            ledger.verifier(r) in built_by_its_run for r in RESOLUTION_NAMES if ledger.resized(r) in built_by_its_run
        )


def automation_tick(
    dataset: DatasetConfig,
    instance: dg.DagsterInstance,
    cursor: str | None,
    settle_seconds: float = SETTLE_SECONDS,
) -> dg.SensorResult:
    keys = DatasetKeys(dataset.name)
    state = AutomationCursor.parse(cursor)
    started = time.time()
    latest, final, high, backlog = _latest_events(instance, keys, state.settled, started - 2 * settle_seconds)
    for rel, event in latest.items():
        if rel in state.waiting and state.waiting[rel][0] > event.storage_id:
            continue  # a newer event waits already (this read stopped short of it)
        if rel in final or state.handled.get(rel, 0) >= event.storage_id:
            state.waiting.pop(rel, None)
        else:
            state.waiting[rel] = [event.storage_id, event.run_id]
    followed, left = _ended_runs(instance, {run_id for _, run_id in state.waiting.values()})
    for rel, (storage_id, run_id) in list(state.waiting.items()):
        if run_id in left:
            state.handled[rel] = storage_id
            del state.waiting[rel]
    ready = [rel for rel, (_, run_id) in state.waiting.items() if run_id in followed][:LEDGERS_PER_TICK]
    follow_ups: dict[tuple[str, ...], list[str]] = {}
    for rel, shard in history.read_ledgers(instance, keys, ready).items():
        storage_id = state.handled[rel] = state.waiting.pop(rel)[0]
        if _newest_event(shard) > storage_id:
            continue  # another run wrote to the shard since: it is decided on that run's event, once it ended
        if assets := shard.follow_up():
            follow_ups.setdefault(assets, []).append(rel)
    settled, state.marks = settle(state.marks, high, state.settled, started, settle_seconds)
    state.settled = min(settled, high)  # never past what this tick read (it may have stopped at a page's end)
    if backlog:  # an old backlog: what was read up to `high` had long committed
        state.settled, state.marks = high, []
    state.handled = {rel: storage_id for rel, storage_id in state.handled.items() if storage_id > state.settled}
    requests = _run_requests(dataset, instance, follow_ups)
    if not requests:
        return dg.SensorResult(skip_reason=_skip_reason(state, len(ready)), cursor=state.to_json())
    return dg.SensorResult(run_requests=requests, cursor=state.to_json())


def _latest_events(
    instance: dg.DagsterInstance, keys: DatasetKeys, after: int, long_ago: float
) -> tuple[dict[str, LatestEvent], set[str], int, bool]:
    """Each shard's latest event after `after` among the shard assets' materializations and failed
    verifications; the shards whose latest event is final; the largest storage id read; and whether that was
    an old backlog (a kind had more than a page, and the last record read was recorded before `long_ago`)."""
    assets = history.asset_keys(keys)
    pages = [(name, False, _page(instance.fetch_materializations, assets[name], after)) for name in ledger.SHARD_ASSETS]
    pages += [(name, True, _page(instance.fetch_observations, assets[name], after)) for name in history.VERIFIED_ASSETS]
    # A kind with more than a page: every kind is read up to that page's last record only, so none is skipped.
    upto = min((page.records[-1].storage_id for _, _, page in pages if page.has_more), default=None)
    latest: dict[str, LatestEvent] = {}
    built: dict[tuple[str, str], set[str]] = {}  # (shard, run) -> the assets the run materialised for it
    high, newest = after, None
    for name, observations, page in pages:
        for record in page.records:
            if upto is not None and record.storage_id > upto:
                break
            if record.storage_id > high:
                high, newest = record.storage_id, record
            rel = record.partition_key
            if rel is None or (observations and not history.is_failed_verification(record)):
                continue
            if not observations:
                built.setdefault((rel, record.run_id), set()).add(name)
            held = latest.get(rel)
            if held is None or record.storage_id > held.storage_id:
                latest[rel] = LatestEvent(record.storage_id, record.run_id, name, observations)
    backlog = upto is not None and newest is not None and newest.timestamp <= long_ago
    final = {rel for rel, event in latest.items() if event.final(built.get((rel, event.run_id), set()))}
    return latest, final, high, backlog


def _page(fetch, key: dg.AssetKey, after: int):
    records_filter = dg.AssetRecordsFilter(asset_key=key, after_storage_id=after)
    return history.storage_call(fetch, records_filter, limit=EVENTS_PER_TICK, ascending=True)


def _ended_runs(instance: dg.DagsterInstance, run_ids: set[str]) -> tuple[set[str], set[str]]:
    """The runs of `run_ids` whose shards are followed up: those that succeeded, failed on data (never
    retried: its other shards are whole), or that the instance no longer has; and those whose shards are
    left to their run retry (failed otherwise) or to the operator (canceled). The others are still going."""
    unfinished, left = set(), set()
    for chunk in chunks(sorted(run_ids), RUNS_PER_QUERY):
        records = history.storage_call(instance.get_run_records, dg.RunsFilter(run_ids=chunk), limit=len(chunk))
        for run in (record.dagster_run for record in records):
            if not run.is_finished:
                unfinished.add(run.run_id)
            elif run.status == dg.DagsterRunStatus.CANCELED or (
                run.status == dg.DagsterRunStatus.FAILURE and run.tags.get(RETRY_ON_FAILURE_TAG) != "false"
            ):
                left.add(run.run_id)
    return run_ids - unfinished - left, left


def _newest_event(shard: ledger.ShardLedger) -> int:
    """The storage id of the newest shard-asset event a ledger holds (main's left out)."""
    events = [m for name, m in shard.materializations.items() if name != ledger.MAIN]
    return max((m.storage_id for m in [*events, *shard.failed_verifications.values()]), default=0)


def _run_requests(
    dataset: DatasetConfig, instance: dg.DagsterInstance, follow_ups: dict[tuple[str, ...], list[str]]
) -> list[dg.RunRequest]:
    """Runs of each set of follow-up assets over its shards, in partition order (retired partitions left out)."""
    if not follow_ups:
        return []
    keys = DatasetKeys(dataset.name)
    assets = history.asset_keys(keys)
    order = instance.get_dynamic_partitions(keys.partitions)
    known = set(order)
    requests = []
    for names, rels in sorted(follow_ups.items()):
        shards = [rel for rel in rels if rel in known]
        selection = [assets[name] for name in names]
        if shards:
            requests += shard_run_requests(dataset, shards, order, selection, {AUTOMATION_TAG: "true"})
    return requests


def _skip_reason(state: AutomationCursor, read: int) -> str:
    waiting = f"; {len(state.waiting)} shard(s) wait for their runs to end" if state.waiting else ""
    return f"nothing to follow up ({read} shard ledger(s) read){waiting}"


def automation_sensor(dataset: DatasetConfig) -> dg.SensorDefinition:
    """The automation sensor of one dataset; running by default, so that the cross-run gate on
    `crop_bbox` works without a click."""
    keys = DatasetKeys(dataset.name)

    @dg.sensor(
        name=keys.automation_sensor,
        asset_selection=dg.AssetSelection.assets(*keys.shard_assets),
        minimum_interval_seconds=dataset.automation.interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            f"Every {dataset.automation.interval_seconds} s: reads what the runs recorded since its last ticks, and "
            f"builds {keys.crop_bbox.to_user_string()} of a shard once both verifiers' blocking checks passed for it "
            "(and verifies again the shards whose resized outputs were rebuilt without their verifiers)."
        ),
    )
    def _automation(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        return automation_tick(dataset, context.instance, context.cursor)

    return _automation
