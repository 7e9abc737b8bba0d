"""The crop-bbox sidecar's checks (SPEC 7), per shard, against main and both resized shards.

  shard_complete      the sidecar shard exists; its row count equals the main shard's
  sidecar_columns     both crop columns and bbox_resize_meta exist, as JSON text
  keys_match          the key column equals the main shard's, every row, in order
  boxes_valid         every non-null box in the crop columns is four integers in 0..1000,
                      min <= max
  meta_matches_audit  the meta's validity, sizes, crop box and scale agree with both
                      resize audits
  boxes_rederived     for sampled rows, both crop captions and the meta re-derived from the
                      caption, both audits and the recorded box keys and caption frame equal
                      what the sidecar stores, byte for byte

Which keys hold boxes and the frame of the captions are read from the sidecar shard's
recorded build settings unless the layout gives them.
"""

import json
import math
import reprlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from fixed_res_sidecar.core.audit import (
    AUDIT_TYPES,
    AuditColumnsError,
    audit_column,
    audit_values,
    read_audit_records,
)
from fixed_res_sidecar.core.bbox import (
    CROP_COLUMNS,
    META_COLUMN,
    AuditInconsistent,
    CaptionStatus,
    crop_captions_for_row,
    is_valid_crop_box,
    parse_caption,
    walk_box_slots,
)
from fixed_res_sidecar.io.parquet import ShardError, open_shard, read_columns
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput
from fixed_res_sidecar.shards.settings import SidecarReading, read_sources, sidecar_sources, stale_sources
from fixed_res_sidecar.shards.verify.report import (
    KEYS_MATCH,
    MAX_PROBLEMS,
    SHARD_COMPLETE,
    CheckResult,
    ShardReport,
    check_keys,
    check_row_count,
    column_or_nulls,
    guarded,
    keys_or_nulls,
    main_keys,
    not_checked,
    problems_result,
    read_rows,
    sample_rows,
)

SIDECAR_COLUMNS = "sidecar_columns"
BOXES_VALID = "boxes_valid"
META_MATCHES_AUDIT = "meta_matches_audit"
BOXES_REDERIVED = "boxes_rederived"
CROP_BBOX_CHECKS = (SHARD_COMPLETE, SIDECAR_COLUMNS, KEYS_MATCH, BOXES_VALID, META_MATCHES_AUDIT, BOXES_REDERIVED)
DEFAULT_SAMPLE = 32  # rows whose crop captions are re-derived


def verify_crop_bbox_shard(layout: DatasetLayout, rel: str, sample: int | None = DEFAULT_SAMPLE) -> ShardReport:
    """SPEC 7's crop-sidecar checks for `sidecar/rel`; `sample` rows (None: all) are re-derived.

    `layout.bbox_keys` and `layout.caption_frame` default to what the sidecar shard recorded
    in its build settings (else SPEC 6's defaults); the report's stats say which were used.
    """
    sidecar_location = layout.sidecar_location()
    uri = sidecar_location.child(rel)
    report = ShardReport(kind="crop_bbox", rel=rel, shard=uri)
    key_column = layout.key_column
    try:
        expected_keys = main_keys(layout.main, rel, key_column)
    except ShardError as problem:
        report.checks = not_checked(CROP_BBOX_CHECKS, problem)
        return report
    try:
        with open_shard(sidecar_location, rel, "sidecar") as parquet_file:
            rows = parquet_file.metadata.num_rows
            table = read_columns(parquet_file, [key_column, *CROP_COLUMNS.values(), META_COLUMN], uri)
            recorded = SidecarReading.of(parquet_file)
            stale = stale_sources(read_sources(parquet_file), sidecar_sources(layout, rel))
    except ShardError as problem:
        report.checks = not_checked(CROP_BBOX_CHECKS, problem, shard_incomplete=True)
        return report

    bbox_keys = layout.bbox_keys or recorded.bbox_keys
    caption_frame = layout.caption_frame or recorded.caption_frame
    report.stats["bbox_keys"] = list(bbox_keys)
    report.stats["caption_frame"] = caption_frame
    report.rows = rows
    meta = guarded(META_MATCHES_AUDIT, uri, _check_meta, uri, rel, table, key_column, layout.resized)
    reading = (recorded.bbox_keys, recorded.caption_frame)  # re-derived as it was built
    report.checks = [
        guarded(SHARD_COMPLETE, uri, check_row_count, uri, rows, len(expected_keys), "sidecar", stale),
        guarded(SIDECAR_COLUMNS, uri, _check_sidecar_columns, uri, table),
        guarded(KEYS_MATCH, uri, check_keys, uri, expected_keys, table, key_column),
        guarded(BOXES_VALID, uri, _check_boxes, uri, table, key_column, bbox_keys),
        meta,
        guarded(BOXES_REDERIVED, uri, _check_rederived, layout, rel, uri, table, reading, sample),
    ]
    # What the meta says about the rows, whether or not it agrees with the audits.
    for name in ("caption_status", "boxes", "invalid_rows"):
        if name in meta.metadata:
            report.stats[name] = meta.metadata[name]
    caption_status, invalid_rows = report.stats.get("caption_status", {}), report.stats.get("invalid_rows", {})
    report.error_counts = {f"caption_{s}": n for s, n in sorted(caption_status.items()) if s != "ok"}
    report.error_counts.update({f"{res}_invalid": n for res, n in invalid_rows.items() if n})
    return report


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
    """Every box slot of both crop columns, in one walk per caption (core/bbox.py's). Bad boxes
    are all counted; the first MAX_PROBLEMS are described."""
    keys = keys_or_nulls(table, key_column)
    problems: list[dict[str, Any]] = []
    bad = 0
    boxes: Counter = Counter()

    def problem(row: int | None, column: str, text: str) -> None:
        nonlocal bad
        bad += 1
        if len(problems) < MAX_PROBLEMS:
            key = keys[row] if row is not None else None
            problems.append({"row": row, "key": key, "column": column, "problem": f"{column}: {text}"})

    for resolution, column in CROP_COLUMNS.items():
        if column not in table.column_names:
            problem(None, column, "column missing")
            continue
        valid = null = 0
        for row, text in enumerate(table.column(column).to_pylist()):
            if text is None:
                continue
            status, caption = parse_caption(text)
            if status is not CaptionStatus.OK:
                problem(row, column, f"not a JSON caption ({status.value})")
                continue
            for slot in walk_box_slots(caption, bbox_keys, crop_frame=True):
                if slot.value is None:
                    null += 1
                elif is_valid_crop_box(slot.value):
                    valid += 1
                else:
                    boxes[f"{resolution}_invalid"] += 1
                    problem(row, column, f"{slot.path} = {_short_repr(slot.value)} is not a valid box")
        boxes.update({f"{resolution}_valid": valid, f"{resolution}_null": null})
    metadata = {"boxes": {name: n for name, n in sorted(boxes.items()) if n}, "bbox_keys": list(bbox_keys)}
    if problems:
        return problems_result(BOXES_VALID, uri, "bad box(es)", problems, metadata, count=bad)
    valid = sum(n for name, n in boxes.items() if name.endswith("_valid"))
    return CheckResult(BOXES_VALID, True, f"{uri}: {valid} boxes valid", metadata)


def _short_repr(value: Any) -> str:
    """A value as a problem shows it: its repr, abridged (a bad box may be huge or deep)."""
    return _BOX_REPR.repr(value)


_BOX_REPR = reprlib.Repr()
_BOX_REPR.maxlevel, _BOX_REPR.maxlist, _BOX_REPR.maxdict, _BOX_REPR.maxstring = 3, 6, 6, 60


def _check_rederived(
    layout: DatasetLayout,
    rel: str,
    uri: str,
    table: pa.Table,
    reading: tuple[tuple[str, ...], str],
    sample: int | None,
) -> CheckResult:
    """Sampled rows' crop captions and meta, made again as the builder made them (core/bbox.py's
    `crop_captions_for_row`, with the box keys and caption frame its footer records) from the caption
    and both audits, against what the sidecar stores."""
    bbox_keys, caption_frame = reading
    missing = [c for c in (*CROP_COLUMNS.values(), META_COLUMN) if c not in table.column_names]
    if missing:
        return CheckResult(BOXES_REDERIVED, False, f"{uri}: column(s) missing: {missing}")
    rows = sample_rows(range(table.num_rows), sample, rel)
    captions = _captions(layout, rel, rows)
    audits = {name: _read_audit_records(output, rel, layout.key_column) for name, output in layout.resized.items()}
    keys = keys_or_nulls(table, layout.key_column)
    problems = []
    for row in rows:
        try:
            expected = crop_captions_for_row(
                captions.get(row), {name: records[row] for name, records in audits.items()}, bbox_keys, caption_frame
            )
        except AuditInconsistent as exc:
            problems.append({"row": row, "key": keys[row], "problem": f"cannot be re-derived: {exc}"})
            continue
        stored = {name: table.column(column)[row].as_py() for name, column in CROP_COLUMNS.items()}
        differing = [CROP_COLUMNS[name] for name in CROP_COLUMNS if stored[name] != expected.crops.get(name)]
        if table.column(META_COLUMN)[row].as_py() != expected.meta_json():
            differing.append(META_COLUMN)
        if differing:
            problems.append(
                {"row": row, "key": keys[row], "problem": f"{', '.join(differing)} differ from the re-derived"}
            )
    metadata = {"rederived_rows": len(rows)}
    if problems:
        return problems_result(BOXES_REDERIVED, uri, f"of {len(rows)} sampled rows differ", problems, metadata)
    message = f"{uri}: {len(rows)} sampled rows re-derived from caption and audits equal the stored ones exactly"
    return CheckResult(BOXES_REDERIVED, True, message, metadata)


def _captions(layout: DatasetLayout, rel: str, rows: list[int]) -> dict[int, Any]:
    """The captions of `rows` (none when main has no caption column and no caption dataset is set, as the builder)."""
    source, column = layout.caption_source, layout.caption_column
    with open_shard(source, rel, "caption") as parquet_file:
        if column not in parquet_file.schema_arrow.names:
            if layout.captions is not None:
                raise ShardError(f"caption shard {source.child(rel)} has no column {column!r}")
            return {}
        return {row: values[column] for row, values in read_rows(parquet_file, rows, [column]).items()}


def _read_audit_records(output: ResizedOutput, rel: str, key_column: str) -> list:
    uri, prefix = output.location.child(rel), output.audit_prefix
    with open_shard(output.location, rel, "resized") as parquet_file:
        table = read_columns(parquet_file, [audit_column(prefix, f) for f in AUDIT_TYPES], uri)
    try:
        return read_audit_records(table, prefix)
    except AuditColumnsError as exc:
        raise ShardError(f"resized shard {uri}: {exc}") from None


def _read_audit(output: ResizedOutput, rel: str, key_column: str) -> tuple[str, list, dict[str, list]]:
    """(shard URI, its keys, field -> audit values) of one resized shard."""
    uri, prefix = output.location.child(rel), output.audit_prefix
    with open_shard(output.location, rel, "resized") as parquet_file:
        table = read_columns(parquet_file, [key_column, *(audit_column(prefix, f) for f in AUDIT_TYPES)], uri)
    try:
        return uri, keys_or_nulls(table, key_column), audit_values(table, prefix)
    except AuditColumnsError as exc:
        raise ShardError(f"resized shard {uri}: {exc}") from None


def _check_meta(uri: str, rel: str, table: pa.Table, key_column: str, resized: dict[str, ResizedOutput]) -> CheckResult:
    """Each row's meta against both audits. Its metadata holds what the meta says: caption
    statuses, box counts and invalid rows per resolution."""
    if META_COLUMN not in table.column_names:
        return CheckResult(META_MATCHES_AUDIT, False, f"{uri}: column {META_COLUMN!r} is missing")
    keys = keys_or_nulls(table, key_column)
    problems: list[dict[str, Any]] = []
    caption_status: Counter = Counter()
    box_counts: dict[str, Counter] = {resolution: Counter() for resolution in resized}
    invalid_rows = dict.fromkeys(resized, 0)

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

    for resolution, output in resized.items():
        audit_uri, audit_keys, audit = _read_audit(output, rel, key_column)
        if len(audit_keys) != table.num_rows:
            problem(None, f"{audit_uri} has {len(audit_keys)} rows, the sidecar has {table.num_rows}")
            continue
        crops = column_or_nulls(table, CROP_COLUMNS[resolution])
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

    found = {
        "caption_status": dict(sorted(caption_status.items())),
        "boxes": {resolution: dict(counts) for resolution, counts in box_counts.items()},
        "invalid_rows": invalid_rows,
    }
    if problems:
        return problems_result(META_MATCHES_AUDIT, uri, "meta problem(s)", problems, found)
    return CheckResult(META_MATCHES_AUDIT, True, f"{uri}: meta agrees with both resize audits on every row", found)


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
