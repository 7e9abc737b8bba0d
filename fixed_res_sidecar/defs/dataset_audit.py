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

What it read is kept by `defs/audit_state.py`, which never misses an event committed out of order.
"""

import statistics
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.defs import history, ledger, ui_links
from fixed_res_sidecar.defs.audit_state import (
    AuditState,
    load_audit_state,
    save_audit_state,
    update_state,
)
from fixed_res_sidecar.defs.dagster_private import BulkActionsFilter, BulkActionStatus
from fixed_res_sidecar.defs.ledger import ShardLedger
from fixed_res_sidecar.defs.names import DATASET_TAG, RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.shards.layout import DatasetLayout
from fixed_res_sidecar.shards.verify.fidelity import SCORE_BINS

LISTED = 20  # shards named per problem in the audit's text and tables
UNFINISHED_RUNS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


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
    foreign: list[str] = field(default_factory=list)  # partitions no listing of main ever had (added by hand?)
    under_way: str | None = None  # what is still running, if anything
    # resolution -> fidelity over the latest verification of every shard: rows compared, failing rows, rows per
    # score bin, the lowest score and the shards' median scores; and its rolling coverage: comparable rows,
    # rows compared ever on the current bytes, when the oldest shard not fully compared was first verified
    fidelity: dict[str, dict[str, Any]] = field(default_factory=dict)
    evaluated_at: float = field(default_factory=time.time, compare=False)  # when, not what: not compared

    @property
    def failed_shards(self) -> list[str]:
        return sorted({rel for shards in self.failed.values() for rel in shards} | set(self.changed))

    @property
    def error(self) -> bool:
        finished_without_crop = (self.crop_missing or self.crop_stale) and self.under_way is None
        return bool(self.failed_shards or finished_without_crop)

    @property
    def complete(self) -> bool:
        """Every shard built, verified and cropped (a failed shard is not), nothing else left, nothing under way."""
        incomplete = any(self.not_verified.get(r) for r in RESOLUTION_NAMES) or self.crop_missing or self.crop_stale
        left = incomplete or self.failed_shards or self.orphans or self.foreign
        return not left and self.under_way is None and self.shards > 0

    @property
    def passed(self) -> bool:
        return self.complete and not self.error

    def verdict(self) -> str:
        if self.error:
            return "FAILED"
        return "passed" if self.passed else "under way" if self.under_way else "incomplete"

    # -- presentation: the verdict first, then the failing shards (linked), the totals with units,
    # -- fidelity, the rest. Numbers are named so that the UI's plots (sorted by name) show failures first.

    def failures(self) -> list[tuple[str, list[str]]]:
        """(shard, the checks it failed), failed shards first by name."""
        by_shard: dict[str, list[str]] = {}
        for check, shards in sorted(self.failed.items()):
            for rel in shards:
                by_shard.setdefault(rel, []).append(check.split("/", 1)[1])
        for rel, problems in self.changed.items():  # an output verified that storage no longer holds as it was
            by_shard.setdefault(rel, []).extend(f"{output}: not on storage as verified" for output in sorted(problems))
        return sorted(by_shard.items())

    def headline(self, verdict: str | None = None) -> str:
        verdict = verdict or self.verdict()
        if self.shards == 0:
            return f"{self.dataset}: no shards yet (the discovery sensor adds them as partitions)"
        failed = f"{len(self.failed_shards)} of {self.shards} shard(s) failed a check" if self.failed_shards else ""
        parts = [failed] if failed else []
        if self.changed:
            parts.append(f"{len(self.changed)} shard(s) whose outputs on storage are not what was verified")
        if self.crop_missing or self.crop_stale:
            parts.append(f"{len(self.crop_missing) + len(self.crop_stale)} shard(s) lack a current crop_bbox")
        if self.under_way:
            parts.append(f"under way: {self.under_way}")
        if not parts:
            parts.append(f"{self.verified_everywhere()} of {self.shards} shard(s) verified and cropped")
        return f"{self.dataset} {verdict}: " + "; ".join(parts)

    def verified_everywhere(self) -> int:
        return min([self.verified.get(r, 0) for r in RESOLUTION_NAMES] + [self.crop_shards])

    def description(self, verdict: str | None = None) -> str:
        """The audit in words (markdown): verdict, failing shards linked to their pages and to their repair,
        totals with units, fidelity, the rest."""
        lines = [f"**{self.headline(verdict)}**"]
        if self.shards == 0:
            return lines[0]
        keys = DatasetKeys(self.dataset)
        if failures := self.failures():
            repair = ui_links.repair(keys, [rel for rel, _ in failures])
            lines += ["", f"Failed shards ([repair them: run them again]({repair})):"]
            lines += [
                f"- [{rel}]({ui_links.shard_page(keys.asset(checks[0].split(':')[0]), rel)}): {', '.join(checks)}"
                for rel, checks in failures[:LISTED]
            ]
            if len(failures) > LISTED:
                lines.append(f"- ... ({len(failures) - LISTED} more)")
        lines += ["", "Totals: " + "; ".join(self.totals()) + "."]
        lines += ["", "Fidelity: " + "; ".join(self.fidelity_words(r) for r in RESOLUTION_NAMES) + "."]
        rest = self.rest()
        if rest:
            lines += [""] + [f"- {line}" for line in rest]
        return "\n".join(lines)

    def totals(self) -> list[str]:
        totals = [f"main {self.shards} shards, {self.main_rows:,} rows, {_size(self.main_bytes)}"]
        for r in RESOLUTION_NAMES:
            totals.append(
                f"{r}: {self.built.get(r, 0)} built, {self.verified.get(r, 0)} verified, {self.valid.get(r, 0):,} valid "
                f"+ {self.invalid.get(r, 0):,} invalid rows, {_size(self.output_bytes.get(r, 0))}"
            )
        totals.append(f"crop_bbox: {self.crop_shards} shards")
        return totals

    def fidelity_words(self, resolution: str) -> str:
        found = self.fidelity.get(resolution) or {}
        if not found.get("checked"):
            return f"{resolution}: no row compared yet"
        words = (
            f"{resolution}: {found['checked']:,} rows compared in the latest verifications, {found['failing']} failing"
            f", lowest {found['min']:.2f} dB"
        )
        if (share := _coverage(found)) is not None:
            words += f"; {share:.0f}% of comparable rows ever compared"
            if (age := self.oldest_uncompared_hours(resolution)) is not None:
                words += f", the oldest never-compared row waiting {age:.1f} h"
        return words

    def oldest_uncompared_hours(self, resolution: str) -> float | None:
        since = (self.fidelity.get(resolution) or {}).get("oldest")
        return None if since is None else max(0.0, (self.evaluated_at - since) / 3600)

    def rest(self) -> list[str]:
        rest = [f"{rel}: {'; '.join(problems.values())}" for rel, problems in sorted(self.changed.items())[:LISTED]]
        if self.crop_missing:
            rest.append(f"{len(self.crop_missing)} verified shard(s) without crop_bbox: {_names(self.crop_missing)}")
        if self.crop_stale:
            rest.append(
                f"{len(self.crop_stale)} shard(s) whose crop_bbox is older than their latest verification: "
                f"{_names(self.crop_stale)}"
            )
        for resolution in RESOLUTION_NAMES:
            if waiting := self.not_verified.get(resolution, []):
                rest.append(f"{len(waiting)} shard(s) not verified at {resolution} yet: {_names(waiting)}")
        if self.orphans:
            rest.append(
                f"{len(self.orphans)} shard(s) removed from main, their outputs kept (orphans, never deleted "
                f"automatically): {_names(self.orphans)}"
            )
        if self.foreign:
            rest.append(
                f"{len(self.foreign)} partition(s) that no listing of main had (added by hand, e.g. with the UI's "
                f"Add partition?): {_names(self.foreign)}; runs skip them, the discovery sensor's next complete "
                "listing retires them"
            )
        if self.under_way:
            rest.append(f"under way: {self.under_way}")
        return rest

    def numbers(self) -> dict[str, int | float | None]:
        """Every number, named so that sorted by name (the UI's plots) failures come first, then totals,
        fidelity, rows per error code."""
        numbers: dict[str, int | float | None] = {
            "1. failed shards": len(self.failed_shards),
            "1. shards changed on storage since verified": len(self.changed),
            "1. shards without a current crop_bbox": len(self.crop_missing) + len(self.crop_stale),
            "1. orphaned shards (removed from main)": len(self.orphans),
            "1. partitions not in main": len(self.foreign),
            **{
                f"1. fidelity {r}: failing rows": (self.fidelity.get(r) or {}).get("failing", 0)
                for r in RESOLUTION_NAMES
            },
            "2. shards": self.shards,
            "2. main: rows": self.main_rows,
            "2. main: size (MB)": _megabytes(self.main_bytes),
            "2. crop_bbox: shards": self.crop_shards,
        }
        for r in RESOLUTION_NAMES:
            numbers[f"2. {r}: shards built"] = self.built.get(r, 0)
            numbers[f"2. {r}: shards verified"] = self.verified.get(r, 0)
            numbers[f"2. {r}: shards not verified yet"] = len(self.not_verified.get(r, []))
            numbers[f"2. {r}: size (MB)"] = _megabytes(self.output_bytes.get(r, 0))
        for r in RESOLUTION_NAMES:
            found = self.fidelity.get(r) or {}
            medians = found.get("medians") or []
            numbers[f"3. fidelity {r}: rows compared"] = found.get("checked", 0)
            numbers[f"3. fidelity {r}: lowest score (dB)"] = found.get("min")
            numbers[f"3. fidelity {r}: median score (dB)"] = round(statistics.median(medians), 2) if medians else None
            numbers[f"3. fidelity {r}: rows ever compared (%)"] = _coverage(found)
            numbers[f"3. fidelity {r}: oldest never-compared row (hours)"] = self.oldest_uncompared_hours(r)
            for bin in SCORE_BINS:
                numbers[f"3. fidelity {r}: rows scoring {bin.replace('_', ' ')} dB"] = (found.get("bins") or {}).get(
                    bin, 0
                )
        for r in RESOLUTION_NAMES:
            numbers[rows_label(r, "valid")] = self.valid.get(r, 0)
            numbers[rows_label(r, "invalid")] = self.invalid.get(r, 0)
            for code in ERROR_CODES:
                numbers[rows_label(r, f"invalid {code}")] = self.errors.get(r, Counter()).get(code, 0)
        return numbers

    def metadata(self) -> dict[str, dg.MetadataValue]:
        """The materialization's metadata, in reading order: the verdict, the failing shards (links to
        their pages) and their repair, the totals and fidelity in words with units, then every number
        (plotted across materializations)."""
        keys = DatasetKeys(self.dataset)
        metadata: dict[str, dg.MetadataValue] = {"verdict": dg.MetadataValue.text(self.headline())}
        if failures := self.failures():
            metadata["repair the failed shards"] = dg.MetadataValue.url(ui_links.repair(keys, [r for r, _ in failures]))
            for rel, checks in failures[:LISTED]:
                page = ui_links.shard_page(keys.asset(checks[0].split(":")[0]), rel)
                metadata[f"failed: {rel} ({', '.join(checks)})"] = dg.MetadataValue.url(page)
        metadata["totals"] = dg.MetadataValue.text("; ".join(self.totals()))
        metadata["fidelity"] = dg.MetadataValue.text("; ".join(self.fidelity_words(r) for r in RESOLUTION_NAMES))
        metadata["under way"] = dg.MetadataValue.text(self.under_way or "nothing")
        metadata.update(_metadata_numbers(dict(sorted(self.numbers().items()))))  # in the order the plots show
        return metadata

    def verdict_metadata(self) -> dict[str, dg.MetadataValue]:
        """What the checks' verdicts rest on: the problem shards (a table), then the counts behind them."""
        rows = [
            dg.TableRecord({"shard": rel, "problem": f"{self.dataset}/{check} failed"})
            for check, shards in sorted((c.split("/", 1)[1], s) for c, s in self.failed.items())
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
        rows += [dg.TableRecord({"shard": rel, "problem": "not a shard of main"}) for rel in self.foreign[:LISTED]]
        schema = dg.TableSchema(columns=[dg.TableColumn("shard", "string"), dg.TableColumn("problem", "string")])
        numbers = {name: value for name, value in self.numbers().items() if name.startswith(("1.", "2."))}
        return {
            "0. problem shards": dg.MetadataValue.table(rows, schema=schema),
            "0. under way": dg.MetadataValue.text(self.under_way or "nothing"),
            **_metadata_numbers(numbers),
        }


def rows_label(resolution: str, what: str) -> str:
    """The audit's number of rows of one resolution: "valid", "invalid", "invalid <error code>"."""
    return f"4. rows {resolution}: {what}"


def _metadata_numbers(numbers: dict[str, int | float | None]) -> dict[str, dg.MetadataValue]:
    return {
        name: dg.MetadataValue.null()
        if value is None
        else dg.MetadataValue.int(value)
        if isinstance(value, int)
        else dg.MetadataValue.float(value)
        for name, value in numbers.items()
    }


def _coverage(found: dict[str, Any]) -> float | None:
    """The share of comparable rows ever compared on the current bytes, in percent (None: nothing known)."""
    comparable = found.get("comparable", 0)
    return round(100 * found.get("ever", 0) / comparable, 1) if comparable else None


def _megabytes(size: int) -> float:
    return round(size / 1e6, 3)


def _size(size: int) -> str:
    """Bytes in the largest decimal unit below them: 3.4 MB (what `aws s3 ls --human-readable` would show, in SI)."""
    value, unit = float(size), "bytes"
    for next_unit in ("kB", "MB", "GB", "TB", "PB"):
        if value < 1000:
            break
        value, unit = value / 1000, next_unit
    return f"{size} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


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
    # A partition main never had (nothing recorded it on main): added by hand; not a shard.
    audit.foreign = sorted(
        rel for rel in partitions if (ledgers.get(rel) or ShardLedger(rel)).latest(ledger.MAIN) is None
    )
    foreign = set(audit.foreign)
    partitions = [rel for rel in partitions if rel not in foreign]
    audit.shards = len(partitions)
    for resolution in RESOLUTION_NAMES:
        audit.built[resolution] = audit.output_bytes[resolution] = audit.verified[resolution] = 0
        audit.valid[resolution] = audit.invalid[resolution] = 0
        audit.errors[resolution] = Counter()
        audit.not_verified[resolution] = []
        audit.fidelity[resolution] = {
            "checked": 0, "failing": 0, "bins": Counter(), "min": None, "medians": [],
            "comparable": 0, "ever": 0, "oldest": None,
        }  # fmt: skip
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
    comparable, ever, since = shard.get("comparable", 0), shard.get("ever", 0), shard.get("since")
    total["comparable"] += comparable
    total["ever"] += min(ever, comparable)
    if ever < comparable and since is not None:
        total["oldest"] = since if total["oldest"] is None else min(total["oldest"], since)


def _under_way(instance: dg.DagsterInstance, keys: DatasetKeys, own_run_id: str | None) -> str | None:
    """What of the dataset is still running: unfinished runs (by the dataset tag, the audit's own run
    aside) or backfills."""
    filters = dg.RunsFilter(statuses=UNFINISHED_RUNS, tags={DATASET_TAG: keys.dataset})
    runs = len([
        run for run in instance.get_runs(filters, limit=1000) if run.run_id != own_run_id and not is_audit_run(run, keys)
    ])  # fmt: skip
    backfills = [
        backfill
        for backfill in instance.get_backfills(filters=BulkActionsFilter(statuses=[BulkActionStatus.REQUESTED]))
        if targets_dataset(backfill, keys)
    ]
    if not runs and not backfills:
        return None
    return f"{runs} run(s) queued or running, {len(backfills)} backfill(s) in progress"


def is_audit_run(run: dg.DagsterRun, keys: DatasetKeys) -> bool:
    """Whether `run` only audits the dataset (its audit job, or the audit asset materialised alone): no
    work on shards, never "under way"."""
    return run.job_name == keys.audit_job or set(run.asset_selection or ()) == {keys.audit}


def targets_dataset(backfill, keys: DatasetKeys) -> bool:
    """Whether a backfill builds the dataset's shards (its assets, its job or its tag)."""
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
