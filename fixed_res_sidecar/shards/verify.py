"""The SPEC 7 verifier: per-shard checks of the resized outputs and the crop-bbox sidecar.

Each `verify_*_shard` function returns a `ShardReport` whose `checks` map one to one
onto the SPEC 7 items, so the CLI prints them and Dagster turns each into an asset
check. Damaged data never raises: a missing or unreadable shard, a missing column or a
broken cell is a failed check whose message names the shard.

Resized shard checks (SPEC 7, items 1-4):
  shard_complete    the output shard exists; its row count equals the main shard's
  keys_match        the key column equals the main shard's, every row, in order
  sample_images     a deterministic sample of valid rows decodes, with the audited
                    size, multiples of p, near-target area and the crop box's aspect
  audit_consistent  valid + invalid == rows; invalid rows have an error code and no
                    image; valid rows have an image; counts per code; examples

Crop-bbox sidecar checks:
  shard_complete, keys_match (as above), sidecar_columns (both crop columns and
  bbox_resize_meta exist), boxes_valid (every non-null box in the crop columns is four
  integers in 0..1000 with min <= max), meta_matches_audit (the meta's validity, sizes,
  crop box and scale agree with both resize audits), and overlays_written when an
  overlay folder is given. Which keys hold boxes and the frame of the captions are read
  from the sidecar shard's recorded build settings unless given.

Images are read as Arrow arrays: presence is checked with Arrow compute, and only the
sampled rows' bytes are copied into Python.
"""

import bisect
import hashlib
import io
import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from fixed_res_sidecar.core.audit import AUDIT_TYPES, ERROR_CODES, audit_column
from fixed_res_sidecar.core.bbox import (
    CAPTION_FRAMES,
    DEFAULT_BBOX_KEYS,
    box_slots,
    is_valid_crop_box,
)
from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.geometry import geometry, near_target_area
from fixed_res_sidecar.core.image_cell import (
    has_image,
    image_bytes,
    image_bytes_array,
    is_image_type,
)
from fixed_res_sidecar.core.resolutions import RESOLUTIONS, area_for_audit_prefix
from fixed_res_sidecar.io.locations import SHARD_SUFFIX, Location
from fixed_res_sidecar.shards import overlay
from fixed_res_sidecar.shards.crop_bbox import CROP_COLUMNS, META_COLUMN
from fixed_res_sidecar.shards.settings import read_settings

SHARD_COMPLETE = "shard_complete"
KEYS_MATCH = "keys_match"
SAMPLE_IMAGES = "sample_images"
AUDIT_CONSISTENT = "audit_consistent"
RESIZED_CHECKS = (SHARD_COMPLETE, KEYS_MATCH, SAMPLE_IMAGES, AUDIT_CONSISTENT)

SIDECAR_COLUMNS = "sidecar_columns"
BOXES_VALID = "boxes_valid"
META_MATCHES_AUDIT = "meta_matches_audit"
OVERLAYS_WRITTEN = "overlays_written"
CROP_BBOX_CHECKS = (SHARD_COMPLETE, SIDECAR_COLUMNS, KEYS_MATCH, BOXES_VALID, META_MATCHES_AUDIT)

MAX_EXAMPLES = 20  # invalid rows listed per shard report (SPEC 7)
MAX_PROBLEMS = 10  # offending rows kept in a failed check's metadata
MAX_MESSAGE_CHARS = 300  # exception text in a check message: its first line, at most this long
IMAGE_BATCH_ROWS = 64  # rows of encoded images in memory at once
REPORT_SUFFIX = ".verify.json"


# -- report structures -------------------------------------------------------------


@dataclass
class CheckResult:
    """One SPEC 7 check on one shard; `metadata` is JSON-ready detail for reports and Dagster."""

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
    stats: dict[str, Any] = field(default_factory=dict)  # kind-specific extras (box counts, overlays)

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


def report_rel(rel: str) -> str:
    """Where a shard's report goes: `<rel without .parquet>.verify.json`."""
    return shard_stem(rel) + REPORT_SUFFIX


def write_report(location: Location, rel: str, report: ShardReport, protect: Sequence[Location] = ()) -> str:
    """Write `report` atomically at `report_rel(rel)` under `location`; returns that path."""
    target = report_rel(rel)
    location.write_bytes(target, report.to_json().encode(), protect=protect)
    return target


def default_target_area(audit_prefix: str) -> int:
    """The target area the default audit prefixes stand for (SPEC 1)."""
    area = area_for_audit_prefix(audit_prefix)
    if area is None:
        defaults = {r.audit_prefix: r.area for r in RESOLUTIONS.values()}
        raise ValueError(
            f"no default target area for audit prefix {audit_prefix!r}; give it explicitly (defaults: {defaults})"
        )
    return area


def _resolution_name(area: int) -> str:
    """"512" / "1024" for the two fixed areas, else the area as text."""
    return next((r.name for r in RESOLUTIONS.values() if r.area == area), str(area))


# -- reading shards without raising -----------------------------------------------


class ShardProblem(Exception):
    """A shard that cannot be read; the message names it."""


def _open_shard(location: Location, rel: str, what: str) -> pq.ParquetFile:
    uri = location.child(rel)
    try:
        exists = location.exists(rel)
    except Exception as exc:
        raise ShardProblem(f"{what} shard {uri} could not be looked up: {_describe(exc)}") from exc
    if not exists:
        raise ShardProblem(f"{what} shard {uri} is missing")
    try:
        parquet_file = location.parquet_file(rel)
        parquet_file.schema_arrow  # noqa: B018 - parses the footer's schema now, not in a check
        return parquet_file
    except Exception as exc:
        raise ShardProblem(f"{what} shard {uri} is not a readable Parquet file: {_describe(exc)}") from exc


def _read_columns(parquet_file: pq.ParquetFile, columns: Sequence[str], uri: str) -> pa.Table:
    """The named columns that exist; the caller checks for the missing ones."""
    present = [c for c in columns if c in parquet_file.schema_arrow.names]
    try:
        return parquet_file.read(columns=present)
    except Exception as exc:
        raise ShardProblem(f"{uri}: columns {present} could not be read: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    return describe_exception(exc, max_chars=MAX_MESSAGE_CHARS)


def _image_bytes(cell: Any) -> bytes | None:
    """Encoded bytes of an image cell (plain binary or {bytes, path} struct); None when absent or empty."""
    return image_bytes(cell) or None


def _read_rows(parquet_file: pq.ParquetFile, rows: Sequence[int], columns: Sequence[str]) -> dict[int, dict[str, Any]]:
    """Only the row groups holding `rows` are read, so a few images from a big shard are cheap."""
    wanted = sorted(set(rows))
    found: dict[int, dict[str, Any]] = {}
    start = 0
    for group in range(parquet_file.num_row_groups):
        count = parquet_file.metadata.row_group(group).num_rows
        in_group = [r for r in wanted if start <= r < start + count]
        if in_group:
            table = parquet_file.read_row_group(group, columns=list(columns))
            for r in in_group:
                found[r] = {name: table.column(name)[r - start].as_py() for name in columns}
        start += count
    return found


def sample_rows(candidates: Sequence[int], sample: int, rel: str) -> list[int]:
    """A sample seeded from the shard path: the same rows every run, and for every resolution."""
    seed = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    if len(candidates) <= sample:
        return list(candidates)
    return sorted(random.Random(seed).sample(list(candidates), sample))


def _not_checked(names: Sequence[str], problem: ShardProblem, shard_incomplete: bool = False) -> list[CheckResult]:
    """Every check failed for want of a readable shard; shard_complete says why when it is the checked one."""
    results = []
    for name in names:
        message = str(problem) if shard_incomplete and name == SHARD_COMPLETE else f"not checked: {problem}"
        results.append(CheckResult(name, False, message))
    return results


# -- resized shards ----------------------------------------------------------------


@dataclass
class _ResizedShard:
    uri: str
    rows: int
    columns: pa.Table  # key + audit columns that exist
    image_type: pa.DataType | None
    has_image: list[bool] | None  # per row: a non-empty image cell; None without a usable image column
    sampled: dict[int, bytes]  # row -> encoded image, for the sampled rows
    image_problem: str | None = None  # why has_image is None


def verify_resized_shard(
    main: Location,
    rel: str,
    output: Location,
    *,
    key_column: str = "image_key",
    image_column: str = "image",
    audit_prefix: str,
    target_area: int | None = None,
    patch_size: int = 32,
    sample: int = 32,
    square: bool = False,
) -> ShardReport:
    """SPEC 7 items 1-4 for the resized shard `output/rel` against `main/rel`.

    `target_area` defaults from the audit prefix (0_26mp_process -> 262144,
    1_05mp_process -> 1048576). `square` is the dataset's explicit square setting.
    """
    area = target_area if target_area is not None else default_target_area(audit_prefix)
    report = ShardReport(
        kind="resized",
        rel=rel,
        shard=output.child(rel),
        resolution=_resolution_name(area),
        target_area=area,
        audit_prefix=audit_prefix,
    )
    try:
        main_keys = _main_keys(main, rel, key_column)
    except ShardProblem as problem:
        report.checks = _not_checked(RESIZED_CHECKS, problem)
        return report
    try:
        shard = _load_resized(output, rel, key_column, image_column, audit_prefix, sample)
    except ShardProblem as problem:
        report.checks = _not_checked(RESIZED_CHECKS, problem, shard_incomplete=True)
        return report

    report.rows = shard.rows
    report.checks = [
        _guarded(SHARD_COMPLETE, shard.uri, _check_row_count, shard.uri, shard.rows, len(main_keys), "output"),
        _guarded(KEYS_MATCH, shard.uri, _check_keys, shard.uri, main_keys, shard.columns, key_column),
        _guarded(
            SAMPLE_IMAGES, shard.uri, _check_sample_images, shard, key_column, audit_prefix, area, patch_size, square
        ),
        _guarded(AUDIT_CONSISTENT, shard.uri, _check_audit, shard, report, key_column, audit_prefix),
    ]
    return report


def resized_gate_problems(
    main: Location,
    rel: str,
    resized: dict[str, tuple[Location, str]],
    *,
    key_column: str = "image_key",
    image_column: str = "image",
    patch_size: int = 32,
    sample: int = 32,
    square: bool = False,
) -> list[str]:
    """SPEC 7 gate: why `rel`'s crop-bbox sidecar must not be built yet; empty when it may.

    `resized` maps "512" and "1024" to (location, audit prefix); each resized shard is checked
    with `verify_resized_shard` at its resolution's fixed area. One line per resized shard
    that fails, naming the shard and each failed check with its message.
    """
    problems = []
    for name, (location, audit_prefix) in resized.items():
        report = verify_resized_shard(
            main,
            rel,
            location,
            key_column=key_column,
            image_column=image_column,
            audit_prefix=audit_prefix,
            target_area=RESOLUTIONS[name].area,
            patch_size=patch_size,
            sample=sample,
            square=square,
        )
        if not report.passed:
            failed = "; ".join(f"{c.name} ({c.message})" for c in report.failed_checks)
            problems.append(f"resized {name} shard {report.shard} did not pass the verifier: {failed}")
    return problems


def _guarded(name: str, uri: str, check, *args) -> CheckResult:
    """Run one check; any error in it fails that check instead of the whole report."""
    try:
        return check(*args)
    except ShardProblem as problem:
        return CheckResult(name, False, str(problem))
    except Exception as exc:  # damaged data must fail a check, never crash a run over many shards
        return CheckResult(name, False, f"{uri}: {name} could not be checked: {_describe(exc)}")


def _problems_result(name: str, uri: str, what: str, problems: list[dict], metadata: dict) -> CheckResult:
    """A failed check whose message names the shard, the count and the first offending row."""
    first = problems[0]
    where = f"row {first['row']} ({first['key']!r}): " if first.get("row") is not None else ""
    metadata = {**metadata, "problems": len(problems), "examples": problems[:MAX_PROBLEMS]}
    return CheckResult(name, False, f"{uri}: {len(problems)} {what}; {where}{first['problem']}", metadata)


def _column_or_nulls(table: pa.Table, name: str) -> list:
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows


def _main_keys(main: Location, rel: str, key_column: str) -> pa.ChunkedArray:
    uri = main.child(rel)
    with _open_shard(main, rel, "main") as parquet_file:
        if key_column not in parquet_file.schema_arrow.names:
            raise ShardProblem(f"main shard {uri} has no key column {key_column!r}")
        return _read_columns(parquet_file, [key_column], uri).column(key_column)


def _load_resized(
    output: Location, rel: str, key_column: str, image_column: str, audit_prefix: str, sample: int
) -> _ResizedShard:
    uri = output.child(rel)
    with _open_shard(output, rel, "output") as parquet_file:
        rows = parquet_file.metadata.num_rows
        wanted = [key_column, *(audit_column(audit_prefix, f) for f in AUDIT_TYPES)]
        columns = _read_columns(parquet_file, wanted, uri)
        valid_name = audit_column(audit_prefix, "valid")
        valid = columns.column(valid_name).to_pylist() if valid_name in columns.column_names else [True] * rows
        sampled_rows = sample_rows([i for i, v in enumerate(valid) if v], sample, rel)  # sorted
        if image_column not in parquet_file.schema_arrow.names:
            return _ResizedShard(uri, rows, columns, None, None, {}, f"image column {image_column!r} is missing")
        image_type = parquet_file.schema_arrow.field(image_column).type
        if not is_image_type(image_type):
            problem = f"image column {image_column!r} has type {image_type}, not encoded bytes"
            return _ResizedShard(uri, rows, columns, image_type, None, {}, problem)
        present: list[bool] = []
        sampled: dict[int, bytes] = {}
        try:
            # One streaming pass: every row's presence by Arrow compute; only the sampled rows'
            # bytes are copied out of Arrow.
            for batch in parquet_file.iter_batches(batch_size=IMAGE_BATCH_ROWS, columns=[image_column]):
                start, cells = len(present), batch.column(0)
                present.extend(has_image(cells).to_pylist())
                first, last = bisect.bisect_left(sampled_rows, start), bisect.bisect_left(sampled_rows, len(present))
                in_batch = [row - start for row in sampled_rows[first:last]]
                if in_batch:
                    for offset, data in zip(in_batch, image_bytes_array(cells).take(in_batch).to_pylist()):
                        if data:
                            sampled[start + offset] = data
        except Exception as exc:
            raise ShardProblem(f"{uri}: image column {image_column!r} could not be read: {_describe(exc)}") from exc
        return _ResizedShard(uri, rows, columns, image_type, present, sampled)


def _check_row_count(uri: str, rows: int, main_rows: int, what: str) -> CheckResult:
    metadata = {"rows": rows, "main_rows": main_rows}
    if rows != main_rows:
        message = f"{what} shard {uri} has {rows} rows, the main shard has {main_rows}"
        return CheckResult(SHARD_COMPLETE, False, message, metadata)
    return CheckResult(SHARD_COMPLETE, True, f"{uri}: {rows} rows, as in main", metadata)


def _check_keys(uri: str, main_keys: pa.ChunkedArray, table: pa.Table, key_column: str) -> CheckResult:
    if key_column not in table.column_names:
        return CheckResult(KEYS_MATCH, False, f"{uri}: key column {key_column!r} is missing")
    keys = table.column(key_column)
    if keys.type != main_keys.type:
        message = f"{uri}: key column {key_column!r} has type {keys.type}, main has {main_keys.type}"
        return CheckResult(KEYS_MATCH, False, message)
    if keys.equals(main_keys):
        return CheckResult(KEYS_MATCH, True, f"{uri}: all {len(keys)} keys equal main's, in order", {"rows": len(keys)})
    ours, theirs = keys.to_pylist(), main_keys.to_pylist()
    common = min(len(ours), len(theirs))
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    metadata: dict[str, Any] = {"rows": len(ours), "main_rows": len(theirs), "mismatching_rows": len(mismatches)}
    if mismatches:
        first = mismatches[0]
        metadata.update(first_mismatch_row=first, key=ours[first], main_key=theirs[first])
        message = (
            f"{uri}: row {first} has key {ours[first]!r} where main has {theirs[first]!r} "
            f"({len(mismatches)} of {common} rows differ)"
        )
    else:
        metadata.update(first_mismatch_row=common)
        message = f"{uri}: the first {common} keys agree, but it has {len(ours)} rows and main has {len(theirs)}"
    return CheckResult(KEYS_MATCH, False, message, metadata)


def aspect_tolerance(target: tuple[int, int], crop_height: float) -> float:
    """Largest |tw/th - cw/ch| accepted between an output and its recorded crop box.

    SPEC 3 builds the crop box with exactly the output's aspect, cw/ch = R = tw/th; only
    rounding can separate them. Allow each side of the box to be off by up to one source
    pixel (an implementation that snaps the box to whole pixels): with cw = cw* + ew,
    ch = ch* + eh, |ew|, |eh| <= 1 and cw*/ch* = R,
        cw/ch - R = (ew - R*eh) / ch,  so  |cw/ch - R| <= (1 + R) / ch.
    Float noise (~1e-15) is far inside this; a crop that was skipped or taken along the
    wrong axis is far outside it except for tiny sources (4000x3000 at 512: 0.048 off,
    bound 0.0008), and those are caught by the exact SPEC 3 geometry comparison.
    """
    ratio = target[0] / target[1]
    return (1 + ratio) / crop_height + 1e-12


def _check_sample_images(
    shard: _ResizedShard, key_column: str, prefix: str, area: int, patch_size: int, square: bool
) -> CheckResult:
    if shard.has_image is None:
        return CheckResult(SAMPLE_IMAGES, False, f"{shard.uri}: {shard.image_problem}, nothing to decode")
    audit = _audit_dict(shard.columns, prefix, shard.uri)
    keys = _column_or_nulls(shard.columns, key_column)
    problems = []
    for row, data in sorted(shard.sampled.items()):
        problem = _sample_problem(data, {f: values[row] for f, values in audit.items()}, area, patch_size, square)
        if problem:
            problems.append({"row": row, "key": keys[row], "problem": problem})
    metadata = {"sampled": len(shard.sampled), "sampled_rows": sorted(shard.sampled)}
    if problems:
        what = f"of {len(shard.sampled)} sampled images failed"
        return _problems_result(SAMPLE_IMAGES, shard.uri, what, problems, metadata)
    message = f"{shard.uri}: {len(shard.sampled)} sampled images decode with their audited geometry"
    return CheckResult(SAMPLE_IMAGES, True, message, metadata)


def _audit_dict(table: pa.Table, prefix: str, uri: str) -> dict[str, list]:
    missing = [audit_column(prefix, f) for f in AUDIT_TYPES if audit_column(prefix, f) not in table.column_names]
    if missing:
        raise ShardProblem(f"{uri}: audit columns missing: {missing}")
    return {f: table.column(audit_column(prefix, f)).to_pylist() for f in AUDIT_TYPES}


def _sample_problem(data: bytes, audit: dict[str, Any], area: int, patch_size: int, square: bool) -> str | None:
    """What is wrong with one sampled image and its audit row, or None."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            size = image.size
    except Exception as exc:
        return f"does not decode: {_describe(exc)}"
    tw, th = audit["width"], audit["height"]
    if tw is None or th is None:
        return "audit width/height are null on a valid row"
    if size != (tw, th):
        return f"decoded size {size[0]}x{size[1]} differs from the audit's {tw}x{th}"
    if tw % patch_size or th % patch_size:
        return f"size {tw}x{th} is not a multiple of the patch size {patch_size}"
    src_w, src_h = audit["src_width"], audit["src_height"]
    if not src_w or not src_h:
        return "audit source size is null on a valid row"
    # A square dataset's target is the square of side sqrt(A), whatever the source's shape.
    area_w, area_h = (1, 1) if square else (src_w, src_h)
    if not near_target_area(tw, th, area_w, area_h, area, patch_size):
        return f"area {tw}x{th} = {tw * th} is not near the target {area} for a {src_w}x{src_h} source"
    box = [audit[f"crop_{c}"] for c in ("x0", "y0", "x1", "y1")]
    if any(v is None for v in box):
        return "audit crop box is null on a valid row"
    cw, ch = box[2] - box[0], box[3] - box[1]
    if cw <= 0 or ch <= 0:
        return f"crop box {box} is empty"
    if abs(tw / th - cw / ch) > aspect_tolerance((tw, th), ch):
        return f"aspect {tw}/{th} = {tw / th:.5f} differs from the crop box's {cw:.2f}/{ch:.2f} = {cw / ch:.5f}"
    # The independent checks above give readable messages; this one pins the exact SPEC 3 numbers.
    expected = geometry(src_w, src_h, area, patch_size, square)
    if expected.target_size != (tw, th):
        ew, eh = expected.target_size
        return f"size {tw}x{th} differs from SPEC 3's {ew}x{eh} for a {src_w}x{src_h} source"
    expected_box = expected.crop_box.as_tuple()
    if any(not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6) for a, b in zip(box, expected_box)):
        return f"crop box {box} differs from SPEC 3's {list(expected_box)}"
    if audit["scale"] is None or not math.isclose(audit["scale"], tw / cw, rel_tol=1e-9):
        return f"scale {audit['scale']} differs from tw/cw = {tw / cw}"
    return None


def _check_audit(
    shard: _ResizedShard, report: ShardReport, key_column: str, prefix: str
) -> CheckResult:
    table = shard.columns
    audit_names = {f: audit_column(prefix, f) for f in AUDIT_TYPES}
    missing = [name for name in audit_names.values() if name not in table.column_names]
    if missing:
        return CheckResult(AUDIT_CONSISTENT, False, f"{shard.uri}: audit columns missing: {missing}")
    wrong_types = {
        name: str(table.schema.field(name).type)
        for f, name in audit_names.items()
        if table.schema.field(name).type != AUDIT_TYPES[f]
    }
    if wrong_types:
        return CheckResult(AUDIT_CONSISTENT, False, f"{shard.uri}: audit columns with the wrong type: {wrong_types}")
    if shard.has_image is None:
        return CheckResult(AUDIT_CONSISTENT, False, f"{shard.uri}: {shard.image_problem}")

    keys = _column_or_nulls(table, key_column)
    valid = table.column(audit_names["valid"]).to_pylist()
    errors = table.column(audit_names["error"]).to_pylist()
    details = table.column(audit_names["error_detail"]).to_pylist()
    problems: list[dict[str, Any]] = []
    counts: Counter = Counter()
    examples: list[dict[str, Any]] = []

    def problem(row: int, text: str) -> None:
        problems.append({"row": row, "key": keys[row], "problem": text})

    for row, (is_valid, code, row_has_image) in enumerate(zip(valid, errors, shard.has_image)):
        if is_valid is None:
            problem(row, "valid flag is null")
        elif is_valid:
            if not row_has_image:
                problem(row, "valid row has no image")
            if code is not None:
                problem(row, f"valid row has error code {code!r}")
        else:
            counts[code if code is not None else "(none)"] += 1
            if code is None:
                problem(row, "invalid row has no error code")
            elif code not in ERROR_CODES:
                problem(row, f"invalid row has unknown error code {code!r}")
            if row_has_image:
                problem(row, "invalid row has an image")
            if len(examples) < MAX_EXAMPLES:
                examples.append({"row": row, "key": keys[row], "error": code, "detail": details[row]})

    report.valid = sum(1 for v in valid if v is True)
    report.invalid = sum(1 for v in valid if v is False)
    report.error_counts = dict(sorted(counts.items()))
    report.examples = examples
    if report.valid + report.invalid != shard.rows or len(shard.has_image) != shard.rows:
        text = f"valid {report.valid} + invalid {report.invalid} != rows {shard.rows}"
        problems.insert(0, {"row": None, "key": None, "problem": text})
    metadata = {
        "rows": shard.rows, "valid": report.valid, "invalid": report.invalid, "error_counts": report.error_counts
    }
    if problems:
        return _problems_result(AUDIT_CONSISTENT, shard.uri, "audit problem(s)", problems, metadata)
    summary = ", ".join(f"{code} {n}" for code, n in report.error_counts.items()) or "no errors"
    message = f"{shard.uri}: {report.valid} valid, {report.invalid} invalid ({summary})"
    return CheckResult(AUDIT_CONSISTENT, True, message, metadata)


# -- crop-bbox sidecar shards -----------------------------------------------------


def verify_crop_bbox_shard(
    main: Location,
    rel: str,
    resized_512: Location,
    resized_1024: Location,
    sidecar: Location,
    *,
    key_column: str = "image_key",
    audit_prefix_512: str = RESOLUTIONS["512"].audit_prefix,
    audit_prefix_1024: str = RESOLUTIONS["1024"].audit_prefix,
    image_column: str = "image",
    caption_column: str = "structured_description",
    caption_location: Location | None = None,
    bbox_keys: Sequence[str] | None = None,
    caption_frame: str | None = None,
    overlay_dir: Location | None = None,
    overlay_sample: int = 4,
    max_source_pixels: int | None = None,
) -> ShardReport:
    """SPEC 7's crop-sidecar checks for `sidecar/rel`; writes overlay PNGs when `overlay_dir` is set.

    The options mean what they mean for `build_crop_bbox_shard`. `bbox_keys` and
    `caption_frame` default to what the sidecar shard recorded in its build settings (else
    SPEC 6's defaults); the report's stats say which were used. Overlays go to
    `overlay_dir/<rel without .parquet>/<row>-<key>.png`, for up to `overlay_sample` rows,
    sampled as for images among the rows with boxes in both crop frames; rows whose resize
    was invalid are drawn only when no row has resized images. Overlay pictures decode no
    image with more than `max_source_pixels` pixels by its header (default: the limit the
    resized shards recorded, else the pixel pipeline's default).
    """
    uri = sidecar.child(rel)
    report = ShardReport(kind="crop_bbox", rel=rel, shard=uri)
    names = CROP_BBOX_CHECKS + ((OVERLAYS_WRITTEN,) if overlay_dir is not None else ())
    try:
        main_keys = _main_keys(main, rel, key_column)
    except ShardProblem as problem:
        report.checks = _not_checked(names, problem)
        return report
    try:
        with _open_shard(sidecar, rel, "sidecar") as parquet_file:
            rows = parquet_file.metadata.num_rows
            table = _read_columns(parquet_file, [key_column, *CROP_COLUMNS.values(), META_COLUMN], uri)
            recorded = _recorded_settings(parquet_file)
    except ShardProblem as problem:
        report.checks = _not_checked(names, problem, shard_incomplete=True)
        return report

    bbox_keys = tuple(bbox_keys) if bbox_keys is not None else _recorded_bbox_keys(recorded)
    caption_frame = caption_frame if caption_frame is not None else _recorded_caption_frame(recorded)
    report.stats["bbox_keys"] = list(bbox_keys)
    report.stats["caption_frame"] = caption_frame
    report.rows = rows
    audits = {"512": (resized_512, audit_prefix_512), "1024": (resized_1024, audit_prefix_1024)}
    report.checks = [
        _guarded(SHARD_COMPLETE, uri, _check_row_count, uri, rows, len(main_keys), "sidecar"),
        _guarded(SIDECAR_COLUMNS, uri, _check_sidecar_columns, uri, table),
        _guarded(KEYS_MATCH, uri, _check_keys, uri, main_keys, table, key_column),
        _guarded(BOXES_VALID, uri, _check_boxes, uri, table, key_column, bbox_keys),
        _guarded(META_MATCHES_AUDIT, uri, _check_meta, uri, rel, table, key_column, audits, report),
    ]
    if overlay_dir is not None:
        sources = _OverlaySources(
            main, caption_location or main, resized_512, resized_1024, image_column, caption_column
        )
        if max_source_pixels is None:
            max_source_pixels = _recorded_max_source_pixels(recorded)
        options = {"bbox_keys": bbox_keys, "caption_frame": caption_frame, "max_source_pixels": max_source_pixels}
        report.checks.append(
            _guarded(
                OVERLAYS_WRITTEN, uri, _write_overlays,
                uri, rel, table, key_column, sources, audits, overlay_dir, overlay_sample, options, report,
            )
        )
    return report


def _recorded_settings(parquet_file: pq.ParquetFile) -> dict[str, Any]:
    """The build settings a shard recorded in its footer; {} when none or unreadable."""
    try:
        settings = read_settings(parquet_file)
    except Exception:  # a foreign or damaged footer: fall back to the defaults
        return {}
    return settings if isinstance(settings, dict) else {}


def _recorded_bbox_keys(settings: dict[str, Any]) -> tuple[str, ...]:
    keys = settings.get("bbox_keys")
    if isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys):
        return tuple(keys)
    return DEFAULT_BBOX_KEYS


def _recorded_caption_frame(settings: dict[str, Any]) -> str:
    frame = settings.get("caption_frame")
    return frame if frame in CAPTION_FRAMES else CAPTION_FRAMES[0]


def _recorded_max_source_pixels(settings: dict[str, Any]) -> int:
    """The smallest source limit the resized shards were built with, else the pipeline's default."""
    resized = settings.get("resized_settings")
    limits = [
        s.get("max_source_pixels")
        for s in (resized.values() if isinstance(resized, dict) else ())
        if isinstance(s, dict)
    ]
    limits = [v for v in limits if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(limits) if limits else overlay.DEFAULT_MAX_SOURCE_PIXELS


def _check_sidecar_columns(uri: str, table: pa.Table) -> CheckResult:
    required = [*CROP_COLUMNS.values(), META_COLUMN]
    missing = [c for c in required if c not in table.column_names]
    if missing:
        return CheckResult(SIDECAR_COLUMNS, False, f"{uri}: column(s) missing: {missing}", {"missing": missing})
    not_text = {
        c: str(table.schema.field(c).type)
        for c in required
        if not (pa.types.is_string(table.schema.field(c).type) or pa.types.is_large_string(table.schema.field(c).type))
    }
    if not_text:
        return CheckResult(SIDECAR_COLUMNS, False, f"{uri}: column(s) are not JSON text: {not_text}")
    return CheckResult(SIDECAR_COLUMNS, True, f"{uri}: {', '.join(required)} present")


def _check_boxes(uri: str, table: pa.Table, key_column: str, bbox_keys: Sequence[str]) -> CheckResult:
    keys = _column_or_nulls(table, key_column)
    problems = []
    boxes: Counter = Counter()

    def problem(row: int | None, column: str, text: str) -> None:
        key = keys[row] if row is not None else None
        problems.append({"row": row, "key": key, "column": column, "problem": f"{column}: {text}"})

    for resolution, column in CROP_COLUMNS.items():
        if column not in table.column_names:
            problem(None, column, "column missing")
            continue
        for row, text in enumerate(table.column(column).to_pylist()):
            if text is None:
                continue
            try:
                caption = json.loads(text)
            except ValueError as exc:
                problem(row, column, f"invalid JSON: {exc}")
                continue
            for slot in box_slots(caption, bbox_keys, crop_frame=True):
                if slot.value is None:
                    boxes[f"{resolution}_null"] += 1
                elif is_valid_crop_box(slot.value):
                    boxes[f"{resolution}_valid"] += 1
                else:
                    boxes[f"{resolution}_invalid"] += 1
                    problem(row, column, f"{slot.path} = {slot.value!r} is not a valid box")
    metadata = {"boxes": dict(sorted(boxes.items())), "bbox_keys": list(bbox_keys)}
    if problems:
        return _problems_result(BOXES_VALID, uri, "bad box(es)", problems, metadata)
    valid = sum(n for name, n in boxes.items() if name.endswith("_valid"))
    return CheckResult(BOXES_VALID, True, f"{uri}: {valid} boxes valid", metadata)


def _read_audit(location: Location, rel: str, prefix: str, key_column: str) -> tuple[str, pa.Table]:
    uri = location.child(rel)
    with _open_shard(location, rel, "resized") as parquet_file:
        table = _read_columns(parquet_file, [key_column, *(audit_column(prefix, f) for f in AUDIT_TYPES)], uri)
    missing = [audit_column(prefix, f) for f in AUDIT_TYPES if audit_column(prefix, f) not in table.column_names]
    if missing:
        raise ShardProblem(f"resized shard {uri} lacks audit columns {missing}")
    return uri, table


def _valid_flags(location: Location, rel: str, prefix: str, rows: int) -> list[bool | None]:
    """The `valid` audit column of a resized shard (which must have `rows` rows)."""
    uri, name = location.child(rel), audit_column(prefix, "valid")
    with _open_shard(location, rel, "resized") as parquet_file:
        table = _read_columns(parquet_file, [name], uri)
    if name not in table.column_names:
        raise ShardProblem(f"resized shard {uri} lacks audit column {name!r}")
    if table.num_rows != rows:
        raise ShardProblem(f"resized shard {uri} has {table.num_rows} rows, the sidecar has {rows}")
    return table.column(name).to_pylist()


def _check_meta(
    uri: str, rel: str, table: pa.Table, key_column: str, audits: dict, report: ShardReport
) -> CheckResult:
    if META_COLUMN not in table.column_names:
        return CheckResult(META_MATCHES_AUDIT, False, f"{uri}: column {META_COLUMN!r} is missing")
    keys = _column_or_nulls(table, key_column)
    problems: list[dict[str, Any]] = []
    caption_status: Counter = Counter()
    box_counts: dict[str, Counter] = {resolution: Counter() for resolution in audits}
    invalid_rows = dict.fromkeys(audits, 0)

    def problem(row: int | None, text: str) -> None:
        problems.append({"row": row, "key": keys[row] if row is not None else None, "problem": text})

    metas: list[dict | None] = []
    for row, text in enumerate(table.column(META_COLUMN).to_pylist()):
        try:
            meta = json.loads(text) if text is not None else None
        except ValueError:
            meta = None
        if isinstance(meta, dict):
            caption_status[str(meta.get("caption_status"))] += 1
            metas.append(meta)
        else:
            problem(row, f"{META_COLUMN} is null or not a JSON object")
            metas.append(None)

    for resolution, (location, prefix) in audits.items():
        audit_uri, audit_table = _read_audit(location, rel, prefix, key_column)
        if audit_table.num_rows != table.num_rows:
            problem(None, f"{audit_uri} has {audit_table.num_rows} rows, the sidecar has {table.num_rows}")
            continue
        audit_keys = _column_or_nulls(audit_table, key_column)
        audit = {f: audit_table.column(audit_column(prefix, f)).to_pylist() for f in AUDIT_TYPES}
        crops = _column_or_nulls(table, CROP_COLUMNS[resolution])
        for row, meta in enumerate(metas):
            if not audit["valid"][row]:
                invalid_rows[resolution] += 1
            if meta is None:
                continue
            if audit_keys[row] != keys[row]:
                problem(row, f"{audit_uri} has key {audit_keys[row]!r} at this row")
                continue
            part = meta.get(resolution)
            if not isinstance(part, dict):
                problem(row, f"meta has no {resolution!r} entry")
                continue
            for name, value in (part.get("counts") or {}).items():
                if isinstance(value, int):
                    box_counts[resolution][name] += value
            row_audit = {f: audit[f][row] for f in AUDIT_TYPES}
            disagreement = _meta_disagreement(part, row_audit, crops[row])
            orientation = meta.get("exif_orientation", row_audit["exif_orientation"])
            if not disagreement and row_audit["valid"] and orientation != row_audit["exif_orientation"]:
                disagreement = f"meta exif_orientation={orientation} but audit {row_audit['exif_orientation']}"
            if disagreement:
                problem(row, f"{resolution}: {disagreement}")

    report.stats["caption_status"] = dict(sorted(caption_status.items()))
    report.stats["boxes"] = {resolution: dict(counts) for resolution, counts in box_counts.items()}
    report.stats["invalid_rows"] = invalid_rows
    report.error_counts = {f"caption_{s}": n for s, n in sorted(caption_status.items()) if s != "ok"}
    report.error_counts.update({f"{res}_invalid": n for res, n in invalid_rows.items() if n})
    if problems:
        return _problems_result(META_MATCHES_AUDIT, uri, "meta problem(s)", problems, dict(report.stats))
    message = f"{uri}: meta agrees with both resize audits on every row"
    return CheckResult(META_MATCHES_AUDIT, True, message, dict(report.stats))


def _meta_disagreement(part: dict[str, Any], audit: dict[str, Any], crop_text: str | None) -> str | None:
    """How one resolution's meta entry disagrees with its audit row, or None."""
    if bool(part.get("valid")) != bool(audit["valid"]):
        return f"meta valid={part.get('valid')} but audit valid={audit['valid']}"
    if not audit["valid"]:
        # SPEC 6: an invalid resolution has a null crop column and the meta says why.
        if crop_text is not None:
            return "the row is invalid but its crop column is not null"
        if part.get("error") != audit["error"]:
            return f"meta error={part.get('error')!r} but audit error={audit['error']!r}"
        return None
    for name in ("src_width", "src_height", "width", "height"):
        if part.get(name) != audit[name]:
            return f"meta {name}={part.get(name)} but audit {name}={audit[name]}"
    box = part.get("crop_box")
    audit_box = [audit["crop_x0"], audit["crop_y0"], audit["crop_x1"], audit["crop_y1"]]
    if not _numbers_close(box, audit_box, abs_tol=1e-6):
        return f"meta crop_box={box} but audit crop box={audit_box}"
    scale = part.get("scale")
    if not _numbers_close([scale], [audit["scale"]]):
        return f"meta scale={scale} but audit scale={audit['scale']}"
    return None


def _numbers_close(values: Any, expected: list, abs_tol: float = 0.0) -> bool:
    return (
        isinstance(values, list)
        and len(values) == len(expected)
        and all(
            isinstance(v, (int, float)) and e is not None and math.isclose(v, e, rel_tol=1e-9, abs_tol=abs_tol)
            for v, e in zip(values, expected)
        )
    )


@dataclass(frozen=True)
class _OverlaySources:
    main: Location
    captions: Location  # main, or the caption dataset
    resized_512: Location
    resized_1024: Location
    image_column: str
    caption_column: str


def _write_overlays(
    uri: str,
    rel: str,
    table: pa.Table,
    key_column: str,
    sources: _OverlaySources,
    audits: dict[str, tuple[Location, str]],
    overlay_dir: Location,
    overlay_sample: int,
    options: dict[str, Any],
    report: ShardReport,
) -> CheckResult:
    keys = _column_or_nulls(table, key_column)
    crops = {resolution: _column_or_nulls(table, column) for resolution, column in CROP_COLUMNS.items()}
    rows = sample_rows(_overlay_candidates(rel, table.num_rows, crops, audits), overlay_sample, rel)

    def cells(location: Location, column: str, what: str) -> dict[int, Any]:
        with _open_shard(location, rel, what) as parquet_file:
            if column not in parquet_file.schema_arrow.names:
                return {}
            return {row: values[column] for row, values in _read_rows(parquet_file, rows, [column]).items()}

    originals = cells(sources.main, sources.image_column, "main")
    captions = cells(sources.captions, sources.caption_column, "caption")
    images_512 = cells(sources.resized_512, sources.image_column, "resized 512")
    images_1024 = cells(sources.resized_1024, sources.image_column, "resized 1024")

    stem = shard_stem(rel)
    written = []
    for row in rows:
        png = overlay.overlay_picture(
            _image_bytes(originals.get(row)),
            captions.get(row),
            _image_bytes(images_512.get(row)),
            crops["512"][row],
            _image_bytes(images_1024.get(row)),
            crops["1024"][row],
            **options,
        )
        target = f"{stem}/{row:06d}-{_safe_name(keys[row])}.png"
        overlay_dir.write_bytes(target, png, protect=[sources.main, sources.captions])
        written.append(overlay_dir.child(target))
    report.stats["overlays"] = written
    message = f"{uri}: {len(written)} overlay picture(s) under {overlay_dir.child(stem)}"
    return CheckResult(OVERLAYS_WRITTEN, True, message, {"overlays": written})


def _overlay_candidates(
    rel: str, rows: int, crops: dict[str, list], audits: dict[str, tuple[Location, str]]
) -> list[int]:
    """Rows worth an overlay picture, from the first of these that has any.

    Rows with captions in both crop frames say the most; then rows valid at both resolutions,
    then at either. Rows whose resize was invalid (the source may be a bomb or garbage) are
    drawn only when no row has a resized image; even then nothing refused is decoded.
    """
    both = [r for r in range(rows) if crops["512"][r] is not None and crops["1024"][r] is not None]
    if both:
        return both
    valid = [_valid_flags(location, rel, prefix, rows) for location, prefix in audits.values()]
    for tier in (all, any):
        candidates = [r for r in range(rows) if tier(flags[r] is True for flags in valid)]
        if candidates:
            return candidates
    return list(range(rows))


def _safe_name(key: Any) -> str:
    """A key as a file-name part: keys may hold slashes or anything else."""
    text = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(key))
    return text.strip(".")[:80] or "row"


# -- dataset summary ---------------------------------------------------------------


def dataset_summary(
    main: Location, outputs: dict[str, Location], main_sizes: dict[str, int] | None = None
) -> dict[str, Any]:
    """Shard counts and total bytes of main and each output, and the shards each output lacks.

    `outputs` maps a name ("512", "1024", "sidecar", ...) to its location. `main_sizes` is a
    listing of main already taken (at 100,000 shards a listing is about 100 LIST calls).
    """
    main_sizes = main.shard_sizes() if main_sizes is None else main_sizes
    summary: dict[str, Any] = {
        "main": {"location": main.uri, "shards": len(main_sizes), "total_bytes": sum(main_sizes.values())},
        "outputs": {},
    }
    for name, location in outputs.items():
        sizes = location.shard_sizes()
        summary["outputs"][name] = {
            "location": location.uri,
            "shards": len(sizes),
            "total_bytes": sum(sizes.values()),
            "missing": sorted(set(main_sizes) - set(sizes)),
            "extra": sorted(set(sizes) - set(main_sizes)),
        }
    return summary
