"""Asset checks: SPEC 7 per shard (partitioned, blocking) and per dataset.

The checks themselves are `fixed_res_sidecar.shards.verify`; this module only declares them
to Dagster and turns a `ShardReport` into check results:

- `<dataset>/verify_512` and `<dataset>/verify_1024` carry one blocking check per SPEC 7 item
  for resized shards (shard_complete, keys_match, sample_images, audit_consistent) and the
  fidelity check (the sampled images show the picture their source gives),
  partitioned like the shards, so each shard has its own result. A failed one fails the
  run and stops `crop_bbox` of that shard in the same run; across runs the automation
  sensor builds `crop_bbox` only once they passed (defs/automation.py).
- `<dataset>/crop_bbox` carries the sidecar checks (columns, keys, boxes, meta against the
  audits).
- `<dataset>/audit` carries `dataset_audit` (failed shards, ERROR) and `dataset_complete` (work left,
  WARN): the verdicts of the dataset audit (defs/dataset_audit.py).
"""

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.defs.dagster_private import AssetCheckEvaluationTargetMaterializationData
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar.shards.verify.fidelity import SCORE_BINS

RESIZED_CHECK_DESCRIPTIONS = {
    verify.SHARD_COMPLETE: (
        "SPEC 7.1: the output shard exists and its row count equals the main shard's; every page matches its "
        "checksum; its footer records main's current version and the dataset's build settings."
    ),
    verify.KEYS_MATCH: "SPEC 7.2: the key column equals the main shard's, every row, in order.",
    verify.SAMPLE_IMAGES: (
        "SPEC 7.3: a deterministic sample of rows decodes in the dataset's output format; each decoded size "
        "equals the audit width x height, "
        "both sides are multiples of the patch size, the area is near the target and the aspect ratio is within "
        "rounding of the crop box."
    ),
    verify.AUDIT_CONSISTENT: (
        "SPEC 7.4: valid + invalid == rows; every invalid row has an error code and a null image; every valid "
        "row has an image. Metadata: counts per error code and up to 20 invalid examples."
    ),
    verify.FIDELITY: (
        "The sampled images show the right picture: each is scored against the pipeline's render of its source "
        "with the dataset's settings (dB relative to a fresh build, 0 = as faithful; fails below "
        "-3 dB: turned, flipped, channel-swapped, blank, shifted, another row's or heavily re-compressed "
        "pictures). Metadata: min and median score, failing rows by key with their score, and expected | stored "
        "| difference pictures of failing rows."
    ),
}
CROP_CHECK_DESCRIPTIONS = {
    verify.SHARD_COMPLETE: "The sidecar shard exists and its row count equals the main shard's.",
    verify.SIDECAR_COLUMNS: "Both crop columns and bbox_resize_meta exist, as JSON text.",
    verify.KEYS_MATCH: "The key column equals the main shard's, every row, in order.",
    verify.BOXES_VALID: "Every non-null box in the crop columns is four integers in 0..1000 with min <= max.",
    verify.META_MATCHES_AUDIT: "bbox_resize_meta's validity, sizes, crop box and scale agree with both resize audits.",
    verify.BOXES_REDERIVED: (
        "For sampled rows, both crop captions and bbox_resize_meta made again from the caption, both resize audits "
        "and the recorded box keys and caption frame equal what the sidecar stores, byte for byte."
    ),
}
# A verifier materialization's rolling fidelity coverage (the dataset audit sums it per resolution).
COVERAGE_COMPARABLE = "fidelity_comparable_rows"  # valid rows of the output: what can be compared
COVERAGE_EVER = "fidelity_rows_compared_ever"  # of those, compared by some verification of these bytes
COVERAGE_SINCE = "fidelity_coverage_since"  # when these bytes were first verified (unix time)
# A verifier's (and crop_bbox's) materialization: the CPU seconds its verification took (the sweep's budget).
VERIFY_CPU_SECONDS = "verify_cpu_seconds"
DATASET_AUDIT_CHECK = "dataset_audit"
DATASET_COMPLETE_CHECK = "dataset_complete"


def partitioned_check_spec(
    name: str, asset: dg.AssetKey, description: str, partitions: dg.PartitionsDefinition
) -> dg.AssetCheckSpec:
    """A blocking check with one result per shard (partition)."""
    with warnings.catch_warnings():
        # Partitioned checks are "preview" in Dagster 1.13; they are what per-shard results need
        # (DAGSTER_NOTES), and the tests pin their behaviour.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset=asset, description=description, blocking=True, partitions_def=partitions)


def resized_check_specs(
    keys: DatasetKeys, resolution: str, partitions: dg.PartitionsDefinition
) -> list[dg.AssetCheckSpec]:
    return [
        partitioned_check_spec(name, keys.verify(resolution), description, partitions)
        for name, description in RESIZED_CHECK_DESCRIPTIONS.items()
    ]


def crop_check_specs(keys: DatasetKeys, partitions: dg.PartitionsDefinition) -> list[dg.AssetCheckSpec]:
    return [
        partitioned_check_spec(name, keys.crop_bbox, description, partitions)
        for name, description in CROP_CHECK_DESCRIPTIONS.items()
    ]


# -- report -> Dagster ------------------------------------------------------------------------


def metadata_value(value: Any) -> dg.MetadataValue:
    """A JSON-ready value as the closest Dagster metadata type."""
    if isinstance(value, bool):
        return dg.MetadataValue.bool(value)
    if isinstance(value, int):
        return dg.MetadataValue.int(value)
    if isinstance(value, float):
        return dg.MetadataValue.float(value)
    if isinstance(value, str):
        return dg.MetadataValue.text(value)
    if value is None:
        return dg.MetadataValue.null()
    return dg.MetadataValue.json(json.loads(json.dumps(value, default=str)))


def to_metadata(values: Mapping[str, Any]) -> dict[str, dg.MetadataValue]:
    return {str(k): metadata_value(v) for k, v in values.items()}


def examples_table(examples: Sequence[Mapping[str, Any]], limit: int = 20) -> dg.MetadataValue:
    """Invalid rows as a table the UI renders (row, key, error code, detail)."""
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn("row", "int"),
            dg.TableColumn("key", "string"),
            dg.TableColumn("error", "string"),
            dg.TableColumn("detail", "string"),
        ]
    )
    records = [
        dg.TableRecord(
            {
                "row": int(example.get("row") or 0),
                "key": str(example.get("key")),
                "error": str(example.get("error")),
                "detail": str(example.get("detail") or "")[:300],
            }
        )
        for example in list(examples)[:limit]
    ]
    return dg.MetadataValue.table(records, schema=schema)


def report_counts(report: verify.ShardReport) -> dict[str, dg.MetadataValue]:
    """The counts a reader wants first, as plain numbers (shown inline, one per error code). A shard
    that could not be read has no counts: it says so, rather than "rows 0"."""
    if report.rows is None:
        return {"rows": dg.MetadataValue.text("unknown: the shard could not be read")}
    counts = {"rows": report.rows}
    if report.valid is None or report.invalid is None:
        return {"rows": dg.MetadataValue.int(report.rows)}
    counts.update(valid=report.valid, invalid=report.invalid)
    counts.update({f"invalid_{code}": report.error_counts.get(code, 0) for code in ERROR_CODES})
    unknown = {code: n for code, n in report.error_counts.items() if code not in ERROR_CODES}
    metadata: dict[str, dg.MetadataValue] = {name: dg.MetadataValue.int(n) for name, n in counts.items()}
    if unknown:  # codes outside SPEC 5 (a damaged audit): shown, not dropped
        metadata["invalid_other_codes"] = dg.MetadataValue.json(unknown)
    return metadata


def fidelity_numbers(report: verify.ShardReport) -> dict[str, dg.MetadataValue]:
    """The fidelity check's numbers as plain metadata (the dataset audit sums them, the UI plots them):
    rows compared, rows failing, min and median score, rows per score bin."""
    check = next((c for c in report.checks if c.name == verify.FIDELITY), None)
    found = check.metadata if check is not None else {}
    numbers: dict[str, dg.MetadataValue] = {
        "fidelity_rows_checked": dg.MetadataValue.int(found.get("checked", 0)),
        "fidelity_failing_rows": dg.MetadataValue.int(found.get("failing_rows", 0)),
    }
    for name in ("min_score", "median_score"):
        value = found.get(name)
        numbers[f"fidelity_{name}"] = dg.MetadataValue.null() if value is None else dg.MetadataValue.float(value)
    numbers.update(
        {f"fidelity_score_{bin}": dg.MetadataValue.int(found.get("score_bins", {}).get(bin, 0)) for bin in SCORE_BINS}
    )
    coverage = report.stats.get(verify.COVERAGE_STAT)
    if isinstance(coverage, dict):  # the rolling sample (shards/verify/coverage.py)
        numbers[COVERAGE_COMPARABLE] = dg.MetadataValue.int(coverage.get("comparable", 0))
        numbers[COVERAGE_EVER] = dg.MetadataValue.int(coverage.get("compared_ever", 0))
        numbers[COVERAGE_SINCE] = dg.MetadataValue.float(float(coverage.get("since", 0.0)))
    return numbers


def check_evaluations(
    report: verify.ShardReport,
    asset_key: dg.AssetKey,
    expected: Sequence[str],
    partition: str,
    target: dg.EventLogRecord | None,
    extra: Mapping[str, Mapping[str, dg.MetadataValue]] | None = None,
) -> list[dg.AssetCheckEvaluation]:
    """One result per expected check name, for shard `partition`, linked to the materialization
    `target` it describes; a check the report lacks fails (never silently passes). `extra`: more
    metadata per check name (pictures)."""
    by_name = {c.name: c for c in report.checks}
    counts = report_counts(report)
    results = []
    for name in expected:
        result = by_name.get(name)
        if result is None:
            result = verify.CheckResult(name, False, f"{report.shard}: the verifier did not run check {name!r}")
        metadata = {"shard": report.shard, "message": result.message, **result.metadata}
        metadata.pop("invalid_examples", None)  # shown as a table instead
        if report.kind == "resized":
            metadata.update(counts)
            if name == verify.AUDIT_CONSISTENT:
                metadata["invalid_examples"] = examples_table(report.examples)
        metadata.update((extra or {}).get(name, {}))
        results.append(
            dg.AssetCheckEvaluation(
                asset_key=asset_key,
                check_name=name,
                passed=result.passed,
                partition=partition,
                target_materialization_data=target_data(target),
                severity=dg.AssetCheckSeverity.ERROR,
                blocking=True,
                description=result.message[:2000],
                metadata={k: v if isinstance(v, dg.MetadataValue) else metadata_value(v) for k, v in metadata.items()},
            )
        )
    return results


def target_data(record: dg.EventLogRecord | None):
    """The link from a check result to the materialization it checked (the UI shows results only so)."""
    if record is None:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=record.storage_id, run_id=record.run_id, timestamp=record.timestamp
    )


# -- the dataset audit ----------------------------------------------------------------------


def dataset_audit_check_specs(keys: DatasetKeys) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(
            DATASET_AUDIT_CHECK,
            asset=keys.audit,
            description=(
                "The dataset audit (defs/dataset_audit.py): fails when a shard's latest blocking check failed or a finished "
                "shard lacks its crop_bbox (or has one older than its verification)."
            ),
        ),
        dg.AssetCheckSpec(
            DATASET_COMPLETE_CHECK,
            asset=keys.audit,
            description=(
                "Whether the dataset is complete: every shard built, verified and cropped, no shard removed from "
                "main with outputs left (orphans), no partition that is not a shard of main. A warning, never an "
                "error. Not evaluated (skipped) while runs of the dataset are under way: the audit then says so, and "
                "runs again when they end."
            ),
        ),
    ]


def audit_check_results(keys: DatasetKeys, audit) -> list[dg.AssetCheckResult]:
    """The audit's two verdicts: failed shards (ERROR) and completeness (WARN), each labelled for what it says.

    While work of the dataset is under way, completeness is not judged (the check is not evaluated:
    the UI shows it skipped, the audit's verdict says "under way"): work in progress is not a failure.
    The run-status sensor audits again as soon as the work ends (defs/audit_triggers.py)."""
    metadata = audit.verdict_metadata()
    results = [
        dg.AssetCheckResult(
            asset_key=keys.audit,
            check_name=DATASET_AUDIT_CHECK,
            passed=not audit.error,
            severity=dg.AssetCheckSeverity.ERROR,
            description=audit.description("FAILED" if audit.error else "passed")[:4000],
            metadata=metadata,
        )
    ]
    if audit.under_way is None:
        results.append(
            dg.AssetCheckResult(
                asset_key=keys.audit,
                check_name=DATASET_COMPLETE_CHECK,
                passed=audit.complete,
                severity=dg.AssetCheckSeverity.WARN,
                description=audit.description("complete" if audit.complete else "incomplete")[:4000],
                metadata=metadata,
            )
        )
    return results
