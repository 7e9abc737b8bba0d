"""The dataset audit: one dataset's state at a glance, from what the Dagster instance knows, checked
against what storage holds.

It reads the event log: the materializations of `main`, both resized outputs, both verifiers and
`crop_bbox` (rows, bytes, valid and invalid counts per error code are in their metadata), and the
latest result of every per-shard check. It reads incrementally: what was read before is kept, per
shard, in the instance's key-value store, so each run reads only the events recorded lately (the
first run reads everything once; shards holding a deleted run's events are read again whole). And
it lists each output prefix once (`stored_outputs`: no image, no request per shard) to compare what
storage holds with the objects the verifiers checked (`ShardLedger.storage_problems`). Its verdict:

Two checks carry it, so that each label says what it means: `dataset_audit` (ERROR severity)
and `dataset_complete` (WARN severity):

- ERROR when a shard's latest blocking check failed (a verifier's or the sidecar's), when an output
  verified is gone from storage or is another object than the one verified, or when a
  finished shard (both verifiers passed on its current build) has no crop_bbox, or one older than
  its latest passed verification, and nothing of the dataset is still running;
- incomplete (WARN) while work is under way (runs or backfills of the dataset unfinished), shards were
  never built or verified, or shards were removed from main (their outputs are kept: orphans, listed);
- passed otherwise.

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

import statistics
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.defs import history, ledger
from fixed_res_sidecar.defs.dagster_private import BulkActionsFilter, BulkActionStatus
from fixed_res_sidecar.defs.ledger import ShardLedger
from fixed_res_sidecar.defs.names import DATASET_TAG, RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.shards.layout import DatasetLayout
from fixed_res_sidecar.shards.verify.fidelity import SCORE_BINS

STATE_KEY = "fixed_res_sidecar/dataset_audit/{dataset}"
PAGE = 10_000  # event records read at a time
# How long after taking its storage id an event's writer has surely committed it (Dagster's own
# connection retries take ~11 s): events younger than this are read again by the next update.
SETTLE_SECONDS = 300.0
STATE_VERSION = 2  # 2: a ledger per shard
RUNS_PER_QUERY = 1000  # run ids asked at once whether the instance still has them
PARTITIONS_PER_QUERY = 1000  # shards read again at once (those of deleted runs)
LISTED = 20  # shards named per problem in the audit's text and tables
UNFINISHED_RUNS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


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
        for chunk in _chunks(sorted(gone), PARTITIONS_PER_QUERY):
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
    for chunk in _chunks(sorted(runs_of), RUNS_PER_QUERY):
        existing.update(history.storage_call(instance.get_run_ids, dg.RunsFilter(run_ids=chunk), limit=len(chunk)))
    return {rel for run_id, rels in runs_of.items() if run_id not in existing for rel in rels}


def _chunks(items: list[str], size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _keep_numbers(shard: dict[str, Any], name: str, record: dg.EventLogRecord) -> None:
    """The counts a materialization adds to its shard's numbers (rows, bytes, valid and invalid rows, fidelity)."""
    materialization = record.asset_materialization
    assert materialization is not None  # a record of fetch_materializations
    metadata = {key: value.value for key, value in materialization.metadata.items()}
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
    """Mark this update, and move `settled` up to the marks older than `settle_seconds` when it started:
    their events had committed by then, so this update read every one of them."""
    state.marks.append([time.time(), state.cursors["high"]])
    ripe = [int(high) for when, high in state.marks if when <= started - settle_seconds]  # storage ids: ints
    if ripe:
        state.cursors["settled"] = max([state.cursors.get("settled", 0), *ripe])
        state.marks = [mark for mark in state.marks if mark[0] > started - settle_seconds]


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
    """What a verifier materialization says about fidelity (defs/checks.py `fidelity_numbers`)."""
    return {
        "checked": _int(metadata.get("fidelity_rows_checked")),
        "failing": _int(metadata.get("fidelity_failing_rows")),
        "min": _float(metadata.get("fidelity_min_score")),
        "median": _float(metadata.get("fidelity_median_score")),
        "bins": {bin: _int(metadata.get(f"fidelity_score_{bin}")) for bin in SCORE_BINS},
    }


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# -- the verdict -----------------------------------------------------------------------------


@dataclass
class DatasetAudit:
    """The audit's findings over the dataset's current shards (its partitions)."""

    dataset: str
    shards: int = 0
    main_rows: int = 0
    main_bytes: int = 0
    built: dict[str, int] = field(default_factory=dict)  # resolution -> shards built
    output_bytes: dict[str, int] = field(default_factory=dict)
    valid: dict[str, int] = field(default_factory=dict)
    invalid: dict[str, int] = field(default_factory=dict)
    errors: dict[str, Counter] = field(default_factory=dict)  # resolution -> error code -> rows
    verified: dict[str, int] = field(default_factory=dict)  # resolution -> shards whose checks all passed
    failed: dict[str, list[str]] = field(default_factory=dict)  # check key text -> shards whose latest result failed
    not_verified: dict[str, list[str]] = field(default_factory=dict)  # resolution -> shards never verified
    crop_shards: int = 0  # shards with a crop_bbox
    crop_missing: list[str] = field(default_factory=list)  # finished shards without a crop_bbox
    crop_stale: list[str] = field(default_factory=list)  # crop_bbox older than the latest passed verification
    orphans: list[str] = field(default_factory=list)  # removed from main; their outputs are kept
    # shard -> output -> how storage no longer holds what was verified (gone, or another object)
    changed: dict[str, dict[str, str]] = field(default_factory=dict)
    under_way: str | None = None  # what is still running, if anything
    # resolution -> fidelity over the latest verification of every shard: rows compared, failing rows, rows per
    # score bin, the lowest score and the shards' median scores
    fidelity: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def failed_shards(self) -> list[str]:
        return sorted({rel for shards in self.failed.values() for rel in shards} | set(self.changed))

    @property
    def error(self) -> bool:
        finished_without_crop = (self.crop_missing or self.crop_stale) and self.under_way is None
        return bool(self.failed_shards or finished_without_crop)

    @property
    def complete(self) -> bool:
        incomplete = any(self.not_verified.get(r) for r in RESOLUTION_NAMES) or self.crop_missing or self.crop_stale
        return not (incomplete or self.orphans) and self.under_way is None and self.shards > 0

    @property
    def passed(self) -> bool:
        return self.complete and not self.error

    def verdict(self) -> str:
        return "FAILED" if self.error else "passed" if self.passed else "incomplete"

    def description(self, verdict: str | None = None) -> str:
        """The audit in words, under `verdict` (default: the overall one)."""
        if self.shards == 0:
            return f"{self.dataset}: no shards yet (the discovery sensor adds them as partitions)"
        parts = []
        for check, shards in sorted(self.failed.items()):
            parts.append(f"{check} FAILED on {len(shards)} shard(s): {_names(shards)}")
        if self.changed:
            shown = [f"{rel} ({'; '.join(problems.values())})" for rel, problems in sorted(self.changed.items())]
            parts.append(
                f"{len(self.changed)} shard(s) whose outputs on storage are not what was verified: {_names(shown)}"
            )
        if self.crop_missing:
            parts.append(f"{len(self.crop_missing)} verified shard(s) without crop_bbox: {_names(self.crop_missing)}")
        if self.crop_stale:
            parts.append(
                f"{len(self.crop_stale)} shard(s) whose crop_bbox is older than their latest verification: "
                f"{_names(self.crop_stale)}"
            )
        for resolution in RESOLUTION_NAMES:
            waiting = self.not_verified.get(resolution, [])
            if waiting:
                parts.append(f"{len(waiting)} shard(s) not verified at {resolution} yet: {_names(waiting)}")
        if self.orphans:
            parts.append(
                f"{len(self.orphans)} shard(s) removed from main, their outputs kept (orphans, never deleted "
                f"automatically): {_names(self.orphans)}"
            )
        if self.under_way:
            parts.append(f"under way: {self.under_way}")
        verdict = verdict or self.verdict()
        totals = "; ".join(
            f"{r}: {self.valid.get(r, 0)} valid, {self.invalid.get(r, 0)} invalid" for r in RESOLUTION_NAMES
        )
        head = f"{self.dataset} {verdict}: {self.shards} shards, {self.crop_shards} with crop_bbox; {totals}"
        return head + ("\n" + "\n".join(f"- {p}" for p in parts) if parts else "")

    def verdict_metadata(self) -> dict[str, dg.MetadataValue]:
        """What the check's verdict rests on: the problem shards first, then the counts behind them."""
        rows = [
            dg.TableRecord({"shard": rel, "problem": f"{check} failed"})
            for check, shards in sorted(self.failed.items())
            for rel in shards[:LISTED]
        ]
        rows += [
            dg.TableRecord({"shard": rel, "problem": "; ".join(problems.values())})
            for rel, problems in sorted(self.changed.items())[:LISTED]
        ]
        rows += [
            dg.TableRecord({"shard": rel, "problem": "verified, no crop_bbox"}) for rel in self.crop_missing[:LISTED]
        ]
        rows += [
            dg.TableRecord({"shard": rel, "problem": "crop_bbox older than its verification"})
            for rel in self.crop_stale[:LISTED]
        ]
        rows += [
            dg.TableRecord({"shard": rel, "problem": "removed from main, outputs kept"})
            for rel in self.orphans[:LISTED]
        ]
        schema = dg.TableSchema(columns=[dg.TableColumn("shard", "string"), dg.TableColumn("problem", "string")])
        numbers = {
            "orphaned_shards": len(self.orphans),
            "failed_shards": len(self.failed_shards),
            "changed_on_storage_shards": len(self.changed),
            "crop_bbox_missing": len(self.crop_missing),
            "crop_bbox_stale": len(self.crop_stale),
            "shards": self.shards,
            **{f"{r}_not_verified_shards": len(self.not_verified.get(r, [])) for r in RESOLUTION_NAMES},
        }
        return {
            "problem_shards": dg.MetadataValue.table(rows, schema=schema),
            **{name: dg.MetadataValue.int(n) for name, n in numbers.items()},
            "under_way": dg.MetadataValue.text(self.under_way or "nothing"),
        }

    def metadata(self) -> dict[str, dg.MetadataValue]:
        """Every count as a plain number (shown inline, plotted across materializations)."""
        numbers: dict[str, int] = {
            "shards": self.shards,
            "main_rows": self.main_rows,
            "main_bytes": self.main_bytes,
            "crop_bbox_shards": self.crop_shards,
            "failed_shards": len(self.failed_shards),
            "changed_on_storage_shards": len(self.changed),
            "crop_bbox_missing": len(self.crop_missing),
            "crop_bbox_stale": len(self.crop_stale),
            "orphaned_shards": len(self.orphans),
        }
        for r in RESOLUTION_NAMES:
            numbers[f"{r}_shards"] = self.built.get(r, 0)
            numbers[f"{r}_bytes"] = self.output_bytes.get(r, 0)
            numbers[f"{r}_verified_shards"] = self.verified.get(r, 0)
            numbers[f"{r}_not_verified_shards"] = len(self.not_verified.get(r, []))
            numbers[f"{r}_valid_rows"] = self.valid.get(r, 0)
            numbers[f"{r}_invalid_rows"] = self.invalid.get(r, 0)
            for code in ERROR_CODES:
                numbers[f"{r}_invalid_{code}"] = self.errors.get(r, Counter()).get(code, 0)
        metadata: dict[str, dg.MetadataValue] = {name: dg.MetadataValue.int(n) for name, n in numbers.items()}
        for r in RESOLUTION_NAMES:
            metadata.update(self.fidelity_metadata(r))
        return metadata

    def fidelity_metadata(self, resolution: str) -> dict[str, dg.MetadataValue]:
        """Fidelity over the dataset's latest verifications: rows compared and failing, rows per score
        bin, the lowest score and the median of the shards' median scores (numbers a plot draws)."""
        found = self.fidelity.get(resolution) or {"checked": 0, "failing": 0, "bins": {}, "min": None, "medians": []}
        prefix = f"{resolution}_fidelity"
        metadata: dict[str, dg.MetadataValue] = {
            f"{prefix}_rows_checked": dg.MetadataValue.int(found["checked"]),
            f"{prefix}_failing_rows": dg.MetadataValue.int(found["failing"]),
            **{f"{prefix}_score_{bin}": dg.MetadataValue.int(found["bins"].get(bin, 0)) for bin in SCORE_BINS},
        }
        lowest, medians = found["min"], found["medians"]
        metadata[f"{prefix}_min_score"] = dg.MetadataValue.null() if lowest is None else dg.MetadataValue.float(lowest)
        metadata[f"{prefix}_median_score"] = (
            dg.MetadataValue.float(round(statistics.median(medians), 2)) if medians else dg.MetadataValue.null()
        )
        return metadata


def evaluate(
    instance: dg.DagsterInstance,
    keys: DatasetKeys,
    state: AuditState,
    stored: Mapping[str, Mapping[str, str]] | None = None,
    own_run_id: str | None = None,
) -> DatasetAudit:
    """The audit over the current partitions, and the shards removed from main (orphans), by the
    ledger's rules. `stored`: output name ("resized_512", "crop_bbox") -> shard -> the stamp its listing
    shows now (`stored_outputs`); a shard whose verified outputs storage no longer holds as they were
    fails (None: storage not compared)."""
    audit = DatasetAudit(keys.dataset)
    ledgers = {rel: state.ledger(rel) for rel in state.shards}
    # Removed shards: their partitions are retired, their outputs kept (orphans).
    audit.orphans = sorted(rel for rel, shard_ledger in ledgers.items() if shard_ledger.removed)
    removed = set(audit.orphans)
    partitions = [rel for rel in instance.get_dynamic_partitions(keys.partitions) if rel not in removed]
    audit.shards = len(partitions)
    for resolution in RESOLUTION_NAMES:
        audit.built[resolution] = audit.output_bytes[resolution] = audit.verified[resolution] = 0
        audit.valid[resolution] = audit.invalid[resolution] = 0
        audit.errors[resolution] = Counter()
        audit.not_verified[resolution] = []
        audit.fidelity[resolution] = {"checked": 0, "failing": 0, "bins": Counter(), "min": None, "medians": []}
    for rel in partitions:
        shard, shard_ledger = state.shards.get(rel, {}), ledgers.get(rel) or ShardLedger(rel)
        rows, size = shard.get("main", [0, 0])
        audit.main_rows += rows
        audit.main_bytes += size
        failed = shard_ledger.failed_checks()
        for name in failed:
            audit.failed.setdefault(f"{keys.dataset}/{name}", []).append(rel)
        if stored is not None:
            now = {name: listing.get(rel) for name, listing in stored.items()}
            if problems := shard_ledger.storage_problems(now):
                audit.changed[rel] = problems
        for resolution in RESOLUTION_NAMES:
            if resolution in shard:
                audit.built[resolution] += 1
                audit.output_bytes[resolution] += shard[resolution]
            if (counts := shard.get(f"verify_{resolution}")) is not None:
                valid, invalid, errors = counts
                audit.valid[resolution] += valid
                audit.invalid[resolution] += invalid
                audit.errors[resolution].update(errors)
            _add_fidelity(audit.fidelity[resolution], shard.get(f"fidelity_{resolution}"))
            changed = ledger.resized(resolution) in audit.changed.get(rel, {})
            if shard_ledger.unverified(resolution) is None and not changed:
                audit.verified[resolution] += 1
            elif not any(name.startswith(f"{ledger.verifier(resolution)}:") for name in failed):
                audit.not_verified[resolution].append(rel)
        if shard_ledger.latest(ledger.CROP_BBOX) is not None:
            audit.crop_shards += 1
        if not shard_ledger.gate():
            if shard_ledger.latest(ledger.CROP_BBOX) is None:
                audit.crop_missing.append(rel)
            elif shard_ledger.crop_stale():
                audit.crop_stale.append(rel)
    audit.under_way = _under_way(instance, keys, own_run_id)
    return audit


def _add_fidelity(total: dict[str, Any], shard: dict[str, Any] | None) -> None:
    if not shard:
        return
    total["checked"] += shard["checked"]
    total["failing"] += shard["failing"]
    total["bins"].update(shard["bins"])
    if shard["min"] is not None:
        total["min"] = shard["min"] if total["min"] is None else min(total["min"], shard["min"])
    if shard["median"] is not None:
        total["medians"].append(shard["median"])


def _under_way(instance: dg.DagsterInstance, keys: DatasetKeys, own_run_id: str | None) -> str | None:
    """What of the dataset is still running: unfinished runs (by the dataset tag, the audit's own run
    aside) or backfills."""
    filters = dg.RunsFilter(statuses=UNFINISHED_RUNS, tags={DATASET_TAG: keys.dataset})
    runs = len([run_id for run_id in instance.get_run_ids(filters, limit=1000) if run_id != own_run_id])
    backfills = [
        backfill
        for backfill in instance.get_backfills(filters=BulkActionsFilter(statuses=[BulkActionStatus.REQUESTED]))
        if _targets(backfill, keys)
    ]
    if not runs and not backfills:
        return None
    return f"{runs} run(s) queued or running, {len(backfills)} backfill(s) in progress"


def _targets(backfill, keys: DatasetKeys) -> bool:
    if backfill.asset_selection:
        return any(key.path[0] == keys.dataset for key in backfill.asset_selection)
    return backfill.tags.get(DATASET_TAG) == keys.dataset or (backfill.job_name or "").startswith(f"{keys.dataset}__")


def _names(shards: list[str]) -> str:
    shown = ", ".join(shards[:LISTED])
    return shown + (f", ... ({len(shards) - LISTED} more)" if len(shards) > LISTED else "")


def stored_outputs(layout: DatasetLayout) -> dict[str, dict[str, str]]:
    """What storage holds of a dataset's outputs, as the ledger names them: output -> shard -> stamp (the
    fingerprint a verifier records). One listing per output prefix: at 100,000 shards on S3, about 100 LIST
    calls each, never a request per shard."""
    locations = {ledger.resized(name): output.location for name, output in layout.resized.items()}
    if layout.sidecar is not None:
        locations[ledger.CROP_BBOX] = layout.sidecar
    return {name: location.shard_stamps() for name, location in locations.items()}


def audit_dataset(
    instance: dg.DagsterInstance, keys: DatasetKeys, layout: DatasetLayout, own_run_id: str | None = None
) -> DatasetAudit:
    """Bring the dataset's audit state up to date and evaluate it against what storage holds of `layout`'s
    outputs (from the run `own_run_id`)."""
    state = history.storage_call(load_audit_state, instance, keys.dataset)
    update_state(instance, keys, state)
    history.storage_call(save_audit_state, instance, keys.dataset, state)
    return evaluate(instance, keys, state, stored_outputs(layout), own_run_id)
