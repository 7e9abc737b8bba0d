"""The dataset audit's state: what it has read of the event log, kept per shard in the instance's
key-value store, brought up to date incrementally (`update_state`).

Never missing an event: storage ids are assigned when an event is inserted, but on Postgres
concurrent writers commit out of order, and Dagster records a check's result in a second
transaction after its event: an event with a smaller id can become visible after a reader saw
larger ones. A cursor at the largest id read loses it (reported: 7-12 of 6,000 events with 4
writers; defs/test_dataset_audit.py, with some commits held back: 10 of 540). So each update reads again
from `settled`, the largest id known to have been read at least `SETTLE_SECONDS` after it was
assigned, by when it had committed: each update marks (when it finished, the largest id it read),
and every id at or below that was assigned before then. A record is applied only when newer than
what its shard holds (one read again is not counted again), so the state equals an audit
computed from scratch. The bound assumes a writer commits within SETTLE_SECONDS of taking its id
and the clocks of the machines running the audit agree to within a fraction of it.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.defs import history, ledger
from fixed_res_sidecar.defs.checks import COVERAGE_COMPARABLE, COVERAGE_EVER, COVERAGE_SINCE
from fixed_res_sidecar.defs.ledger import ShardLedger
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.partitions import chunks
from fixed_res_sidecar.shards.verify.fidelity import SCORE_BINS

STATE_KEY = "fixed_res_sidecar/dataset_audit/{dataset}"
PAGE = 10_000  # event records read at a time
# How long after taking its storage id an event's writer has surely committed it (Dagster's own
# connection retries take ~11 s): events younger than this are read again by the next update.
SETTLE_SECONDS = 300.0
STATE_VERSION = 3  # 2: a ledger per shard; 3: failed verifications, fidelity coverage
RUNS_PER_QUERY = 1000  # run ids asked at once whether the instance still has them
PARTITIONS_PER_QUERY = 1000  # shards read again at once (those of deleted runs)


@dataclass
class AuditState:
    """What the audit has read so far: how far, and per shard, its ledger and its numbers."""

    # "high": the largest storage id read; "settled": every event at or below it was read once it
    # had surely committed (each update reads again after it)
    cursors: dict[str, int] = field(default_factory=dict)
    # rel -> {"ledger": ShardLedger.to_json(), "main": [rows, bytes], "<res>": bytes of the output,
    #         "verify_<res>": [valid, invalid, {code: n}], "fidelity_<res>": fidelity_state(...)}
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    marks: list[list[float]] = field(default_factory=list)  # [when an update finished, "high" then]

    def ledger(self, rel: str) -> ShardLedger:
        return ShardLedger.from_json(rel, self.shards.get(rel, {}).get("ledger", {}))


def load_audit_state(instance: dg.DagsterInstance, dataset: str) -> AuditState:
    data = history.load_json(instance, STATE_KEY.format(dataset=dataset))
    try:
        # A state of another version (e.g. before shards held ledgers) is read again from the start, once.
        if data["version"] != STATE_VERSION:
            return AuditState()
        cursors = {name: data["cursors"][name] for name in ("high", "settled") if name in data["cursors"]}
        return AuditState(cursors, dict(data["shards"]), list(data.get("marks", [])))
    except (TypeError, KeyError, AttributeError):
        return AuditState()  # none yet, or unreadable: read everything again


def save_audit_state(instance: dg.DagsterInstance, dataset: str, state: AuditState) -> None:
    value = {"version": STATE_VERSION, "cursors": state.cursors, "shards": state.shards, "marks": state.marks}
    history.save_json(instance, STATE_KEY.format(dataset=dataset), value)


def update_state(
    instance: dg.DagsterInstance, keys: DatasetKeys, state: AuditState, settle_seconds: float = SETTLE_SECONDS
) -> int:
    """Read the events recorded lately into the state (those after its settled cursor: see the module's
    docstring); returns how many were new to it. Each is applied to its shard's ledger, which keeps
    the newer of what it holds and what it is given. Shards holding a materialization of a run deleted
    since are read again whole first: deleting a run deletes its events, which a state read before
    still held (the audit from scratch no longer sees them)."""
    started = time.time()
    read = 0
    if gone := _shards_of_deleted_runs(instance, state):
        for rel in gone:
            del state.shards[rel]
        for chunk in chunks(sorted(gone), PARTITIONS_PER_QUERY):
            read += _read_events(instance, keys, state, after=0, known=0, partitions=chunk)
    after, known = state.cursors.get("settled", 0), state.cursors.get("high", 0)
    read += _read_events(instance, keys, state, after=after, known=known)
    _settle(state, started, settle_seconds)
    return read


def _read_events(
    instance: dg.DagsterInstance,
    keys: DatasetKeys,
    state: AuditState,
    after: int,
    known: int,
    partitions: list[str] | None = None,
) -> int:
    """Apply the events after storage id `after` (of `partitions` only, when given) to the state's ledgers;
    returns how many were new to it (`known`: the largest id read before). Moves the "high" cursor."""
    high, read = max(known, state.cursors.get("high", 0)), 0
    ledgers: dict[str, ShardLedger] = {}  # the shards touched by this update

    def ledger_of(rel: str) -> ShardLedger:
        if rel not in ledgers:
            ledgers[rel] = state.ledger(rel)
        return ledgers[rel]

    for name, key in history.asset_keys(keys).items():
        for record in _new_events(instance.fetch_materializations, key, after, partitions):
            high = max(high, record.storage_id)
            rel = record.partition_key
            if rel is None:
                continue
            held = ledger_of(rel)
            ledgers[rel] = held.with_materialization(name, history.materialization_of(record))
            if ledgers[rel] is held:
                continue  # read before, or older than what the shard holds (it committed late)
            read += 1
            _keep_numbers(state.shards.setdefault(rel, {}), name, record)
    # Shards the discovery sensor found removed from main (an observation; a later materialization undoes it).
    for record in _new_events(instance.fetch_observations, keys.main, after, partitions):
        high = max(high, record.storage_id)
        rel = record.partition_key
        if rel is not None and history.is_removal(record):
            held = ledger_of(rel)
            ledgers[rel] = held.with_removal(record.storage_id)
            read += ledgers[rel] is not held
    # Failed verifications: observations of the verifiers and crop_bbox (a failed one is not materialised).
    assets = history.asset_keys(keys)
    for name in history.VERIFIED_ASSETS:
        for record in _new_events(instance.fetch_observations, assets[name], after):
            high = max(high, record.storage_id)
            rel = record.partition_key
            if rel is None or not history.is_failed_verification(record):
                continue
            held = ledger_of(rel)
            ledgers[rel] = held.with_failed_verification(name, ledger.Materialization(record.storage_id, record.run_id))
            if ledgers[rel] is not held:
                read += 1
                _keep_numbers(state.shards.setdefault(rel, {}), name, record)
    # The latest result per check and shard (what the storage holds now, so applied as it is).
    names = {key: name for name, key in history.check_keys(keys).items()}
    infos = history.storage_call(
        instance.event_log_storage.get_asset_check_partition_info,
        list(names),
        after_storage_id=after,
        partition_keys=partitions,
    )
    for info in infos:
        high = max(high, info.latest_check_event_storage_id)
        if info.partition_key is None:
            continue
        held, record = ledger_of(info.partition_key), history.check_record_of(info)
        name = names[info.check_key]
        if held.checks.get(name) != record or info.latest_check_event_storage_id > known:
            read += 1
        ledgers[info.partition_key] = held.with_check(name, record)
    for rel, shard_ledger in ledgers.items():
        state.shards.setdefault(rel, {})["ledger"] = shard_ledger.to_json()
    state.cursors["high"] = high
    return read


def _shards_of_deleted_runs(instance: dg.DagsterInstance, state: AuditState) -> set[str]:
    """The shards whose ledger holds a materialization of a run the instance no longer has (one query per
    RUNS_PER_QUERY runs; runless events, such as main's, have no run to delete)."""
    runs_of: dict[str, set[str]] = {}
    for rel, shard in state.shards.items():
        for fields in shard.get("ledger", {}).get("m", {}).values():
            if fields[1]:
                runs_of.setdefault(fields[1], set()).add(rel)
    existing: set[str] = set()
    for chunk in chunks(sorted(runs_of), RUNS_PER_QUERY):
        existing.update(history.storage_call(instance.get_run_ids, dg.RunsFilter(run_ids=chunk), limit=len(chunk)))
    return {rel for run_id, rels in runs_of.items() if run_id not in existing for rel in rels}


def _keep_numbers(shard: dict[str, Any], name: str, record: dg.EventLogRecord) -> None:
    """The counts a materialization (or a failed verification's observation) adds to its shard's numbers
    (rows, bytes, valid and invalid rows, fidelity), unless the shard holds newer ones of that asset."""
    event = record.asset_materialization or record.asset_observation
    assert event is not None  # a record of fetch_materializations or fetch_observations
    since = shard.setdefault("at", {})
    if since.get(name, 0) > record.storage_id:
        return  # older than what the shard holds (a materialization read after a later failure)
    since[name] = record.storage_id
    metadata = {key: value.value for key, value in event.metadata.items()}
    if name == ledger.MAIN:
        shard["main"] = [_int(metadata.get("dagster/row_count")), _int(metadata.get("bytes"))]
    elif name.startswith("resized_"):
        shard[name.removeprefix("resized_")] = _int(metadata.get("bytes"))
    elif name.startswith("verify_"):
        errors = {code: _int(metadata.get(f"invalid_{code}")) for code in ERROR_CODES}
        shard[name] = [
            _int(metadata.get("valid")),
            _int(metadata.get("invalid")),
            {c: n for c, n in errors.items() if n},
        ]
        shard[f"fidelity_{name.removeprefix('verify_')}"] = fidelity_state(metadata)


def _settle(state: AuditState, started: float, settle_seconds: float) -> None:
    state.cursors["settled"], state.marks = settle(
        state.marks, state.cursors["high"], state.cursors.get("settled", 0), started, settle_seconds
    )


def settle(
    marks: list[list[float]], high: int, settled: int, started: float, settle_seconds: float = SETTLE_SECONDS
) -> tuple[int, list[list[float]]]:
    """A reader's new `settled` cursor and marks, after a read that began at `started` and read up to storage
    id `high`: the read is marked, and `settled` moves up to the marks older than `settle_seconds` when it
    began (their events had committed by then, so this read saw every one of them)."""
    marks = [*marks, [time.time(), high]]
    ripe = [int(mark) for when, mark in marks if when <= started - settle_seconds]  # storage ids: ints
    if not ripe:
        return settled, marks
    return max([settled, *ripe]), [mark for mark in marks if mark[0] > started - settle_seconds]


def _new_events(fetch, key: dg.AssetKey, after: int, partitions: list[str] | None = None):
    """Event records of `key` after storage id `after` (of `partitions` only, when given), oldest first, a page
    at a time (`fetch` is the instance's fetch_materializations or fetch_observations)."""
    records_filter = dg.AssetRecordsFilter(asset_key=key, after_storage_id=after, asset_partitions=partitions)
    cursor = None
    while True:
        page = history.storage_call(fetch, records_filter, limit=PAGE, cursor=cursor, ascending=True)
        yield from page.records
        if not page.has_more:
            return
        cursor = page.cursor


def fidelity_state(metadata: dict[str, Any]) -> dict[str, Any]:
    """What a verifier materialization says about fidelity (defs/checks.py `fidelity_numbers`), and its
    rolling coverage: comparable (valid) rows, rows compared ever on these bytes, and since when."""
    return {
        "checked": _int(metadata.get("fidelity_rows_checked")),
        "failing": _int(metadata.get("fidelity_failing_rows")),
        "min": _float(metadata.get("fidelity_min_score")),
        "median": _float(metadata.get("fidelity_median_score")),
        "bins": {bin: _int(metadata.get(f"fidelity_score_{bin}")) for bin in SCORE_BINS},
        "comparable": _int(metadata.get(COVERAGE_COMPARABLE)),
        "ever": _int(metadata.get(COVERAGE_EVER)),
        "since": _float(metadata.get(COVERAGE_SINCE)),
    }


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
