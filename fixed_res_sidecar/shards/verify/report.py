"""What a verifier run finds about one shard, and the reading and checking both verifiers share.

A `ShardReport` holds one `CheckResult` per check, named after SPEC 7's items, so the CLI
prints them and Dagster turns each into an asset check. Damaged data never raises here: a
missing or unreadable shard, a damaged page, a missing column or a broken cell is a failed
check whose message names the shard. Storage that kept failing does raise (`StorageError`):
a check that could not be evaluated is neither failed nor passed, and the run is retried.
"""

import hashlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.core.keys import key_text, key_texts, raw_key_values
from fixed_res_sidecar.io.locations import SHARD_SUFFIX, Location
from fixed_res_sidecar.io.parquet import ShardError, describe, open_shard, read_columns, text_as_bytes
from fixed_res_sidecar.io.retry import StorageError

SHARD_COMPLETE = "shard_complete"
KEYS_MATCH = "keys_match"

MAX_EXAMPLES = 20  # invalid rows listed per shard report (SPEC 7)
MAX_PROBLEMS = 10  # offending rows kept in a failed check's metadata
REPORT_SUFFIX = ".verify.json"


@dataclass
class CheckResult:
    """One check on one shard; `metadata` is JSON-ready detail for reports and Dagster."""

    name: str
    passed: bool
    message: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ShardReport:
    """Every check of one shard of one output, plus the counts a reader wants first."""

    kind: str  # "resized" or "crop_bbox"
    rel: str
    shard: str  # URI of the checked output shard
    resolution: str | None = None  # "512", "1024" (or the area as text) for resized shards
    target_area: int | None = None
    audit_prefix: str | None = None
    rows: int | None = None
    valid: int | None = None
    invalid: int | None = None
    error_counts: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # kind-specific extras (box and caption counts)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failed_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def shard_stem(rel: str) -> str:
    """A shard's relative path without `.parquet`: where its report and overlay pictures go."""
    return rel.removesuffix(SHARD_SUFFIX)


def safe_name(key: Any) -> str:
    """A key as a file-name part (of an overlay or comparison picture): keys may hold slashes or anything else."""
    text = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(key))
    return text.strip(".")[:80] or "row"


def report_rel(rel: str) -> str:
    """Where a shard's report goes: `<rel without .parquet>.verify.json`."""
    return shard_stem(rel) + REPORT_SUFFIX


def write_report(location: Location, rel: str, report: ShardReport, protect: Sequence[Location] = ()) -> str:
    """Write `report` atomically at `report_rel(rel)` under `location`; returns that path."""
    target = report_rel(rel)
    location.write_bytes(target, report.to_json().encode(), protect=protect)
    return target


class ReportError(ValueError):
    """A verifier report that cannot be used: the message names the report and what is wrong in it."""


REPORT_KINDS = ("resized", "crop_bbox")


def load_report(data: bytes, source: str) -> Any:
    """A verifier report's JSON; ReportError naming `source` when it is not JSON, or nested too deeply to be
    a report (Python's parser would raise RecursionError)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ReportError(f"{source}: not a verifier report (its JSON is nested too deeply)") from None
    except ValueError as exc:
        raise ReportError(f"{source}: not a readable verifier report (not JSON: {describe(exc)})") from None


def failed_outputs(document: Any, source: str = "the report") -> dict[str, str | None]:
    """Shard URI -> the output fingerprint recorded when it was verified, for every resized shard that
    failed in a verifier report: one shard's report, or a `verify-resized --report` document. A document
    of another shape raises ReportError naming `source`, the entry and the field at fault."""
    if not isinstance(document, dict):
        raise ReportError(f"{source}: not a verifier report (a JSON object), got {_json_type(document)}")
    if "shards" in document:
        reports, where = document["shards"], "shards[{}]"
        if not isinstance(reports, list):
            raise ReportError(f"{source}: 'shards' must be a list of shard reports, got {_json_type(reports)}")
    elif "kind" in document:
        reports, where = [document], "the shard report"
    else:
        raise ReportError(
            f"{source}: not a verifier report: it has neither 'shards' (a verify-resized --report document) nor "
            "'kind' (one shard's report)"
        )
    failed = {}
    for index, report in enumerate(reports):
        entry = f"{source}: {where.format(index)}"
        if not isinstance(report, dict):
            raise ReportError(f"{entry} must be a shard report (a JSON object), got {_json_type(report)}")
        kind, passed, shard, stats = (report.get(name) for name in ("kind", "passed", "shard", "stats"))
        if kind not in REPORT_KINDS:
            raise ReportError(f"{entry}: 'kind' must be one of {list(REPORT_KINDS)}, got {_shown(kind)}")
        if not isinstance(passed, bool):
            raise ReportError(f"{entry}: 'passed' must be true or false, got {_shown(passed)}")
        if not isinstance(shard, str) or not shard:
            raise ReportError(f"{entry}: 'shard' must be the checked shard's URI (text), got {_shown(shard)}")
        if stats is None:
            stats = {}
        if not isinstance(stats, dict):
            raise ReportError(f"{entry}: 'stats' must be an object, got {_json_type(stats)}")
        fingerprint = stats.get("output_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise ReportError(f"{entry}: 'stats.output_fingerprint' must be text or null, got {_shown(fingerprint)}")
        if kind == "resized" and not passed:
            failed[shard] = fingerprint
    return failed


def _json_type(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "text", bool: "true or false", type(None): "null"}
    return next((name for kind, name in kinds.items() if isinstance(value, kind)), "a number")


def _shown(value: Any) -> str:
    """A report's value in a message: short JSON, or its type when it is an object or a list."""
    if value is None or isinstance(value, (dict, list)):
        return "nothing" if value is None else _json_type(value)
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def still_failed(layout, rel: str, failed: Mapping[str, str | None]) -> tuple[str, ...]:
    """The resolutions of shard `rel` whose output failed the verifier (`failed`, from `failed_outputs`)
    and is still the object that failed (same fingerprint; one stat or HEAD each): what a build told to
    repair failed shards rebuilds even when skip-existing finds it up to date."""
    return tuple(
        name
        for name, output in layout.resized.items()
        if (uri := output.location.child(rel)) in failed and failed[uri] in (None, output.location.fingerprint(rel))
    )


def sample_rows(candidates: Sequence[int], sample: int | None, rel: str) -> list[int]:
    """A sample seeded from the shard path: the same rows every run, and for every resolution; None: all."""
    seed = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    if sample is None or len(candidates) <= sample:
        return list(candidates)
    return sorted(random.Random(seed).sample(list(candidates), sample))


def read_rows(parquet_file: pq.ParquetFile, rows: Sequence[int], columns: Sequence[str]) -> dict[int, dict[str, Any]]:
    """Values of `rows`, text as the bytes stored (a value that is not UTF-8 is its row's problem, never
    the read's); only the row groups holding them are read, so a few images from a big shard are cheap."""
    wanted = sorted(set(rows))
    found: dict[int, dict[str, Any]] = {}
    start = 0
    for group in range(parquet_file.num_row_groups):
        count = parquet_file.metadata.row_group(group).num_rows
        in_group = [r for r in wanted if start <= r < start + count]
        if in_group:
            table = parquet_file.read_row_group(group, columns=list(columns))
            values = {name: text_as_bytes(table.column(name)) for name in columns}
            for r in in_group:
                found[r] = {name: column[r - start].as_py() for name, column in values.items()}
        start += count
    return found


# -- checks both verifiers run -----------------------------------------------------


def guarded(name: str, uri: str, check: Callable[..., CheckResult], *args) -> CheckResult:
    """Run one check; any error in it fails that check instead of the whole report, except
    StorageError, which is no verdict on the data and propagates."""
    try:
        return check(*args)
    except StorageError:
        raise
    except ShardError as problem:
        return CheckResult(name, False, str(problem))
    except Exception as exc:  # noqa: BLE001 - damaged data must fail a check, never crash a run over many shards
        return CheckResult(name, False, f"{uri}: {name} could not be checked: {describe(exc)}")


def not_checked(names: Sequence[str], problem: ShardError, shard_incomplete: bool = False) -> list[CheckResult]:
    """Every check failed for want of a readable shard; shard_complete says why when it is the checked one."""
    return [
        CheckResult(
            name, False, str(problem) if shard_incomplete and name == SHARD_COMPLETE else f"not checked: {problem}"
        )
        for name in names
    ]


def problems_result(
    name: str, uri: str, what: str, problems: list[dict], metadata: dict, count: int | None = None
) -> CheckResult:
    """A failed check whose message names the shard, the count and the first offending row.

    `count` is the number of problems when `problems` holds only the first of them."""
    count = len(problems) if count is None else count
    first = problems[0]
    where = f"row {first['row']} ({first['key']!r}): " if first.get("row") is not None else ""
    metadata = {**metadata, "problems": count, "examples": problems[:MAX_PROBLEMS]}
    return CheckResult(name, False, f"{uri}: {count} {what}; {where}{first['problem']}", metadata)


def column_or_nulls(table: pa.Table, name: str) -> list:
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows


def keys_or_nulls(table: pa.Table, name: str) -> list:
    """A key column as reports show keys (core/keys.py: never failing on what the bytes hold)."""
    return key_texts(table.column(name)) if name in table.column_names else [None] * table.num_rows


def main_keys(main: Location, rel: str, key_column: str) -> pa.ChunkedArray:
    with open_shard(main, rel, "main", columns=[key_column]) as parquet_file:
        return read_columns(parquet_file, [key_column], main.child(rel)).column(key_column)


def check_row_count(
    uri: str, rows: int, main_rows: int, what: str, stale: str | None = None, other_settings: str | None = None
) -> CheckResult:
    """The shard is complete: as many rows as main's, made from main's current version (`stale`, when
    given, says how it is not) and, when the caller knows which, with the expected build settings
    (`other_settings` says how its footer differs)."""
    metadata: dict[str, Any] = {"rows": rows, "main_rows": main_rows, "stale": stale is not None}
    if other_settings is not None:
        metadata["other_settings"] = other_settings
    if rows != main_rows:
        message = f"{what} shard {uri} has {rows} rows, the main shard has {main_rows}"
        return CheckResult(SHARD_COMPLETE, False, message, metadata)
    if stale is not None:
        return CheckResult(SHARD_COMPLETE, False, f"{what} shard {uri} is stale: {stale}", metadata)
    if other_settings is not None:
        return CheckResult(
            SHARD_COMPLETE, False, f"{what} shard {uri} was not built as expected: {other_settings}", metadata
        )
    return CheckResult(SHARD_COMPLETE, True, f"{uri}: {rows} rows, as in main, made from its current version", metadata)


def check_keys(uri: str, expected: pa.ChunkedArray, table: pa.Table, key_column: str) -> CheckResult:
    if key_column not in table.column_names:
        return CheckResult(KEYS_MATCH, False, f"{uri}: key column {key_column!r} is missing")
    keys = table.column(key_column)
    if keys.type != expected.type:
        message = f"{uri}: key column {key_column!r} has type {keys.type}, main has {expected.type}"
        return CheckResult(KEYS_MATCH, False, message)
    if keys.equals(expected):
        return CheckResult(KEYS_MATCH, True, f"{uri}: all {len(keys)} keys equal main's, in order", {"rows": len(keys)})
    ours, theirs = raw_key_values(keys), raw_key_values(expected)
    common = min(len(ours), len(theirs))
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    metadata: dict[str, Any] = {"rows": len(ours), "main_rows": len(theirs), "mismatching_rows": len(mismatches)}
    if mismatches:
        first = mismatches[0]
        key, main_key = key_text(ours[first]), key_text(theirs[first])
        metadata.update(first_mismatch_row=first, key=key, main_key=main_key)
        message = (
            f"{uri}: row {first} has key {key!r} where main has {main_key!r} "
            f"({len(mismatches)} of {common} rows differ)"
        )
    else:
        metadata.update(first_mismatch_row=common)
        message = f"{uri}: the first {common} keys agree, but it has {len(ours)} rows and main has {len(theirs)}"
    return CheckResult(KEYS_MATCH, False, message, metadata)
