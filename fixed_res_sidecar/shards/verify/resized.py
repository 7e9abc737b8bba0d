"""SPEC 7 items 1-4 for a resized shard, and the crop sidecar's gate built on them.

  shard_complete    the output shard exists; its row count equals the main shard's;
                    every page of every column reads and matches its checksum; its
                    footer records main's current version and the expected build
                    settings (the dataset's, or the command's flags), not its own
  keys_match        the key column equals the main shard's, every row, in order
  sample_images     a deterministic sample of valid rows decodes, in the expected
                    format, with the audited size, multiples of p, near-target area
                    and the crop box's aspect
  audit_consistent  valid + invalid == rows; invalid rows have an error code and no
                    image; valid rows have an image; counts per code; examples
  fidelity          the sampled images show the expected picture: each scored against
                    the pipeline's render of its source with the expected settings
                    (shards/verify/fidelity.py, core/fidelity.py)

Images are read as Arrow arrays: presence is checked with Arrow compute, and only the
sampled rows' bytes are copied into Python. Storage that keeps failing raises StorageError
(no report); the gate passes it on, so a shard is refused only for what its data is.
"""

import bisect
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from fixed_res_sidecar.core.audit import (
    ERROR_CODES,
    AuditColumnsError,
    audit_column,
    audit_type_problems,
    audit_values,
)
from fixed_res_sidecar.core.decoding import open_image
from fixed_res_sidecar.core.fidelity import FIDELITY_MIN_SCORE
from fixed_res_sidecar.core.geometry import geometry, near_target_area
from fixed_res_sidecar.core.image_cell import has_image, image_bytes_array, is_image_type
from fixed_res_sidecar.core.pixel_settings import OUTPUT_FORMATS, PixelOptions
from fixed_res_sidecar.io.parquet import ShardError, describe, iter_batches, open_shard, read_columns
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput
from fixed_res_sidecar.shards.resize import build_settings
from fixed_res_sidecar.shards.settings import (
    read_settings,
    read_sources,
    resized_sources,
    settings_difference,
    stale_sources,
)
from fixed_res_sidecar.shards.verify.coverage import COVERAGE_STAT, Coverage, plan, row_order, window_rows
from fixed_res_sidecar.shards.verify.fidelity import FIDELITY, SharedRenders, StoredSample, check_fidelity
from fixed_res_sidecar.shards.verify.report import (
    KEYS_MATCH,
    MAX_EXAMPLES,
    SHARD_COMPLETE,
    CheckResult,
    ShardReport,
    check_keys,
    check_row_count,
    guarded,
    keys_or_nulls,
    main_keys,
    not_checked,
    problems_result,
    sample_rows,
)

SAMPLE_IMAGES = "sample_images"
AUDIT_CONSISTENT = "audit_consistent"
RESIZED_CHECKS = (SHARD_COMPLETE, KEYS_MATCH, SAMPLE_IMAGES, AUDIT_CONSISTENT, FIDELITY)
IMAGE_BATCH_ROWS = 64  # rows of encoded images in memory at once


class GateError(RuntimeError):
    """A shard's crop sidecar is refused: its resized shards have not passed the verifier (SPEC 7
    gate). The message names them and the failed checks."""


@dataclass(frozen=True)
class VerifyOptions:
    """How a resized dataset was built (what its footers must record and its images satisfy), and how much
    to decode."""

    # The settings it must have been built with: the dataset's (Dagster) or the command's flags (CLI), never
    # what a shard's footer says, which a wrong release or a copy from another build may have changed.
    pixels: PixelOptions = field(default_factory=PixelOptions)
    sample: int | None = 32  # images decoded per shard; None: every row
    fidelity: bool = True  # compare sampled images with the picture their source gives
    # Rows compared with their source per verification (at most `sample`), a window of rows not compared
    # before on the same bytes (shards/verify/coverage.py; None: `sample` rows). Each costs about 2.7x a row of the build (both
    # resolutions verified: the source decoded and rendered twice), so 8 keep the verifier near 3% of the
    # build of a 1,000-row shard (measured 2.8%: docs/fidelity.md, "Cost").
    fidelity_sample: int | None = 8
    fidelity_min_score: float = FIDELITY_MIN_SCORE

    @property
    def patch_size(self) -> int:
        return self.pixels.patch_size

    @property
    def square(self) -> bool:
        return self.pixels.square


@dataclass
class _ResizedShard:
    uri: str
    rows: int
    stale: str | None  # how it is not made from main's current version, if it is not
    columns: pa.Table  # key + audit columns that exist
    has_image: list[bool] | None  # per row: a non-empty image cell; None without a usable image column
    sampled: dict[int, bytes]  # row -> encoded image, for the sampled rows
    settings: Any = None  # the build settings its footer records (a problem text when they are not JSON)
    image_problem: str | None = None  # why has_image is None
    compared: dict[int, bytes] = field(default_factory=dict)  # row -> encoded image, for the fidelity window
    coverage: Coverage | None = None  # the fidelity window this verification compares (None: fidelity off)


def verify_resized_shard(
    layout: DatasetLayout,
    rel: str,
    resolution: str,
    options: VerifyOptions = VerifyOptions(),
    shared: SharedRenders | None = None,
    previous_coverage: Mapping[str, Any] | None = None,
) -> ShardReport:
    """SPEC 7 items 1-4 for the resized shard of `resolution` against `main/rel`. `shared`: one per
    shard, given to the check of each of its resolutions, which then render their sources once.
    `previous_coverage`: what the previous verification of this output recorded (its report's
    `COVERAGE_STAT`): the fidelity check compares the window after it (shards/verify/coverage.py)."""
    output = layout.resized[resolution]
    report = ShardReport(
        kind="resized",
        rel=rel,
        shard=output.location.child(rel),
        resolution=output.resolution,
        target_area=output.area,
        audit_prefix=output.audit_prefix,
    )
    try:
        expected_keys = main_keys(layout.main, rel, layout.key_column)
    except ShardError as problem:
        report.checks = not_checked(RESIZED_CHECKS, problem)
        return report
    # Which object was verified: a later build that repairs failed shards rebuilds it only if it is still there.
    fingerprint = output.location.fingerprint(rel)
    window = _FidelityWindow(options, previous_coverage, fingerprint) if options.fidelity else None
    try:
        shard = _load_resized(layout, output, rel, options.sample, window)
    except ShardError as problem:
        report.checks = not_checked(RESIZED_CHECKS, problem, shard_incomplete=True)
        return report

    uri, key_column, prefix = shard.uri, layout.key_column, output.audit_prefix
    report.rows = shard.rows
    report.stats["output_fingerprint"] = fingerprint
    if shard.coverage is not None:
        report.stats[COVERAGE_STAT] = shard.coverage.to_json()
    expected = build_settings(output, options.pixels, key_column, layout.image_column)
    other_settings = settings_difference(shard.settings, expected)
    audit = guarded(AUDIT_CONSISTENT, uri, _check_audit, shard, key_column, prefix)
    complete = (uri, shard.rows, len(expected_keys), "output", shard.stale, other_settings)
    report.checks = [
        guarded(SHARD_COMPLETE, uri, check_row_count, *complete),
        guarded(KEYS_MATCH, uri, check_keys, uri, expected_keys, shard.columns, key_column),
        guarded(SAMPLE_IMAGES, uri, _check_sample_images, shard, key_column, prefix, output.area, options),
        audit,
        guarded(FIDELITY, uri, _check_fidelity, layout, rel, output, shard, options, shared),
    ]
    # What the audit says, whether or not it is consistent (the counts are what a reader wants first).
    report.valid, report.invalid = audit.metadata.get("valid"), audit.metadata.get("invalid")
    report.error_counts = audit.metadata.get("error_counts", {})
    report.examples = audit.metadata.get("invalid_examples", [])
    return report


def resized_verification_problems(layout: DatasetLayout, rel: str, options: VerifyOptions) -> list[str]:
    """Why shard `rel`'s crop sidecar must not be built yet: one line per resized shard that fails
    the verifier now, naming it and each failed check. Empty when both pass."""
    problems, shared = [], SharedRenders()
    for resolution in layout.resized:
        report = verify_resized_shard(layout, rel, resolution, options, shared)
        if not report.passed:
            failed = "; ".join(f"{c.name} ({c.message})" for c in report.failed_checks)
            problems.append(f"resized {resolution} shard {report.shard} did not pass the verifier: {failed}")
    return problems


def require_verified(layout: DatasetLayout, rel: str, options: VerifyOptions) -> None:
    """The crop sidecar's gate (SPEC 7) for the command line: raise GateError unless both resized
    shards of `rel` pass the verifier now."""
    problems = resized_verification_problems(layout, rel, options)
    if problems:
        raise GateError("; ".join(problems) + "; its crop-bbox sidecar is not built")


@dataclass(frozen=True)
class _FidelityWindow:
    """How to pick the rows the fidelity check compares: the window after the previous verification's."""

    options: VerifyOptions
    previous: Mapping[str, Any] | None
    fingerprint: str | None

    def plan(self, rel: str, candidates: list[int]) -> tuple[Coverage | None, list[int]]:
        """(the coverage, the rows to compare) among the comparable rows `candidates`; (None, []) when the
        sample decodes no image (`--verify-sample 0`): nothing to compare, no window moved."""
        sample, window = self.options.sample, self.options.fidelity_sample
        size = None if sample is None else min(window, sample) if window else sample
        if size == 0:
            return None, []
        coverage = plan(self.previous, len(candidates), size, self.fingerprint, time.time())
        return coverage, window_rows(row_order(rel, candidates), coverage.size, coverage.window)


def _load_resized(
    layout: DatasetLayout, output: ResizedOutput, rel: str, sample: int | None, window: _FidelityWindow | None = None
) -> _ResizedShard:
    uri, image_column = output.location.child(rel), layout.image_column
    with open_shard(output.location, rel, "output") as parquet_file:
        rows = parquet_file.metadata.num_rows
        stale = stale_sources(read_sources(parquet_file), resized_sources(layout, rel))
        try:
            settings = read_settings(parquet_file)
        except ValueError:  # recorded settings that are not JSON: shard_complete says so
            settings = "not JSON"
        # Every column but the images (key and audit columns, anything else too), so with the image
        # pass below every page of the shard is read and checked against its checksum.
        columns = read_columns(parquet_file, [n for n in parquet_file.schema_arrow.names if n != image_column], uri)
        valid_name = audit_column(output.audit_prefix, "valid")
        valid = columns.column(valid_name).to_pylist() if valid_name in columns.column_names else [True] * rows
        candidates = [i for i, v in enumerate(valid) if v]
        sample_only = sample_rows(candidates, sample, rel)  # sorted
        coverage, compared_rows = window.plan(rel, candidates) if window is not None else (None, [])
        sampled_rows = sorted({*sample_only, *compared_rows})
        if image_column not in parquet_file.schema_arrow.names:
            problem = f"image column {image_column!r} is missing"
            return _ResizedShard(uri, rows, stale, columns, None, {}, settings, problem, coverage=coverage)
        image_type = parquet_file.schema_arrow.field(image_column).type
        if not is_image_type(image_type):
            problem = f"image column {image_column!r} has type {image_type}, not encoded bytes"
            return _ResizedShard(uri, rows, stale, columns, None, {}, settings, problem, coverage=coverage)
        present: list[bool] = []
        sampled: dict[int, bytes] = {}
        # One streaming pass: every row's presence by Arrow compute; only the sampled rows'
        # bytes are copied out of Arrow.
        for batch in iter_batches(parquet_file, [image_column], uri, IMAGE_BATCH_ROWS):
            start, cells = len(present), batch.column(0)
            present.extend(has_image(cells).to_pylist())
            first, last = bisect.bisect_left(sampled_rows, start), bisect.bisect_left(sampled_rows, len(present))
            in_batch = [row - start for row in sampled_rows[first:last]]
            if in_batch:
                for offset, data in zip(in_batch, image_bytes_array(cells).take(in_batch).to_pylist()):
                    if data:
                        sampled[start + offset] = data
        decoded = {row: sampled[row] for row in sample_only if row in sampled}
        compared = {row: sampled[row] for row in compared_rows if row in sampled}
        return _ResizedShard(
            uri, rows, stale, columns, present, decoded, settings, compared=compared, coverage=coverage
        )


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
    shard: _ResizedShard, key_column: str, prefix: str, area: int, options: VerifyOptions
) -> CheckResult:
    if shard.has_image is None:
        return CheckResult(SAMPLE_IMAGES, False, f"{shard.uri}: {shard.image_problem}, nothing to decode")
    try:
        audit = audit_values(shard.columns, prefix)
    except AuditColumnsError as exc:
        raise ShardError(f"{shard.uri}: {exc}") from None
    keys = keys_or_nulls(shard.columns, key_column)
    problems = []
    for row, data in sorted(shard.sampled.items()):
        problem = _sample_problem(data, {f: values[row] for f, values in audit.items()}, area, options)
        if problem:
            problems.append({"row": row, "key": keys[row], "problem": problem})
    metadata = {"sampled": len(shard.sampled), "sampled_rows": sorted(shard.sampled)}
    if problems:
        what = f"of {len(shard.sampled)} sampled images failed"
        return problems_result(SAMPLE_IMAGES, shard.uri, what, problems, metadata)
    message = f"{shard.uri}: {len(shard.sampled)} sampled images decode with their audited geometry"
    return CheckResult(SAMPLE_IMAGES, True, message, metadata)


def _sample_problem(data: bytes, audit: dict[str, Any], area: int, options: VerifyOptions) -> str | None:
    """What is wrong with one sampled image and its audit row, or None."""
    try:
        with open_image(data) as image:
            image.load()
            size, stored_format = image.size, image.format
    except Exception as exc:  # noqa: BLE001 - an image that does not decode fails the sample check
        return f"does not decode: {describe(exc)}"
    expected_format = OUTPUT_FORMATS[options.pixels.output_format]
    if stored_format != expected_format:
        return f"stored as {stored_format}, the expected output format is {expected_format}"
    tw, th = audit["width"], audit["height"]
    if tw is None or th is None:
        return "audit width/height are null on a valid row"
    if size != (tw, th):
        return f"decoded size {size[0]}x{size[1]} differs from the audit's {tw}x{th}"
    patch_size = options.patch_size
    if tw % patch_size or th % patch_size:
        return f"size {tw}x{th} is not a multiple of the patch size {patch_size}"
    src_w, src_h = audit["src_width"], audit["src_height"]
    if not src_w or not src_h:
        return "audit source size is null on a valid row"
    # A square dataset's target is the square of side sqrt(A), whatever the source's shape.
    area_w, area_h = (1, 1) if options.square else (src_w, src_h)
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
    expected = geometry(src_w, src_h, area, patch_size, options.square)
    if expected.target_size != (tw, th):
        ew, eh = expected.target_size
        return f"size {tw}x{th} differs from SPEC 3's {ew}x{eh} for a {src_w}x{src_h} source"
    expected_box = expected.crop_box.as_tuple()
    if any(not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6) for a, b in zip(box, expected_box)):
        return f"crop box {box} differs from SPEC 3's {list(expected_box)}"
    if audit["scale"] is None or not math.isclose(audit["scale"], tw / cw, rel_tol=1e-9):
        return f"scale {audit['scale']} differs from tw/cw = {tw / cw}"
    return None


def _check_fidelity(
    layout: DatasetLayout,
    rel: str,
    output: ResizedOutput,
    shard: _ResizedShard,
    options: VerifyOptions,
    shared: SharedRenders | None,
) -> CheckResult:
    if not options.fidelity:
        return CheckResult(FIDELITY, True, f"{shard.uri}: not checked (fidelity is off)", {"checked": 0})
    if shard.has_image is None:
        return CheckResult(FIDELITY, False, f"{shard.uri}: {shard.image_problem}, nothing to compare")
    keys = keys_or_nulls(shard.columns, layout.key_column)
    # The window of rows not compared before on these bytes (shards/verify/coverage.py).
    stored = StoredSample(dict(shard.compared), keys)
    result = check_fidelity(layout, rel, output, stored, options.pixels, options.fidelity_min_score, shared)
    if shard.coverage is not None:
        coverage = shard.coverage
        result.metadata["coverage"] = (
            f"window {coverage.window + 1} of {coverage.windows}: {coverage.compared_ever} of {coverage.comparable} "
            "comparable rows compared on these bytes so far"
        )
    return result


def _check_audit(shard: _ResizedShard, key_column: str, prefix: str) -> CheckResult:
    """SPEC 7.4. Its metadata holds what the audit says: valid, invalid, counts per code, examples."""
    table = shard.columns
    try:
        audit = audit_values(table, prefix)
    except AuditColumnsError as exc:
        return CheckResult(AUDIT_CONSISTENT, False, f"{shard.uri}: {exc}")
    wrong_types = audit_type_problems(table.schema, prefix)
    if wrong_types:
        return CheckResult(AUDIT_CONSISTENT, False, f"{shard.uri}: audit columns with the wrong type: {wrong_types}")
    if shard.has_image is None:
        return CheckResult(AUDIT_CONSISTENT, False, f"{shard.uri}: {shard.image_problem}")

    keys = keys_or_nulls(table, key_column)
    problems: list[dict[str, Any]] = []
    per_code: Counter = Counter()
    examples: list[dict[str, Any]] = []

    def problem(row: int, text: str) -> None:
        problems.append({"row": row, "key": keys[row], "problem": text})

    for row, (is_valid, code, row_has_image) in enumerate(zip(audit["valid"], audit["error"], shard.has_image)):
        if is_valid is None:
            problem(row, "valid flag is null")
        elif is_valid:
            if not row_has_image:
                problem(row, "valid row has no image")
            if code is not None:
                problem(row, f"valid row has error code {code!r}")
        else:
            per_code[code if code is not None else "(none)"] += 1
            if code is None:
                problem(row, "invalid row has no error code")
            elif code not in ERROR_CODES:
                problem(row, f"invalid row has unknown error code {code!r}")
            if row_has_image:
                problem(row, "invalid row has an image")
            if len(examples) < MAX_EXAMPLES:
                examples.append({"row": row, "key": keys[row], "error": code, "detail": audit["error_detail"][row]})

    valid = sum(1 for v in audit["valid"] if v is True)
    invalid = sum(1 for v in audit["valid"] if v is False)
    error_counts = dict(sorted(per_code.items()))
    if valid + invalid != shard.rows or len(shard.has_image) != shard.rows:
        problems.insert(
            0, {"row": None, "key": None, "problem": f"valid {valid} + invalid {invalid} != rows {shard.rows}"}
        )
    metadata = {
        "rows": shard.rows,
        "valid": valid,
        "invalid": invalid,
        "error_counts": error_counts,
        "invalid_examples": examples,
    }
    if problems:
        return problems_result(AUDIT_CONSISTENT, shard.uri, "audit problem(s)", problems, metadata)
    summary = ", ".join(f"{code} {n}" for code, n in error_counts.items()) or "no errors"
    message = f"{shard.uri}: {valid} valid, {invalid} invalid ({summary})"
    return CheckResult(AUDIT_CONSISTENT, True, message, metadata)
