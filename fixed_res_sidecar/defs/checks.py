"""Asset checks: SPEC 7 per shard (partitioned, blocking) and per dataset.

The checks themselves are `fixed_res_sidecar.shards.verify`; this module only declares them
to Dagster and turns a `ShardReport` into check results:

- `<dataset>/verify_512` and `<dataset>/verify_1024` carry one blocking check per SPEC 7 item
  for resized shards (shard_complete, keys_match, sample_images, audit_consistent),
  partitioned like the shards, so each shard has its own result. A failed one fails the
  run and stops `crop_bbox` of that shard in the same run; across runs the automation
  condition of `crop_bbox` waits for them to pass.
- `<dataset>/crop_bbox` carries the sidecar checks (columns, keys, boxes, meta against the
  audits).
- `<dataset>/main` carries `dataset_summary`: shard counts and bytes of main, 512, 1024 and
  the sidecar, and which shards are missing (WARN: missing shards are normal mid-backfill).
"""

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.keys import RESOLUTIONS, DatasetKeys
from fixed_res_sidecar.defs.partitions import partition_key_problem
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar.shards.listing import dataset_summary

RESIZED_CHECK_DESCRIPTIONS = {
    verify.SHARD_COMPLETE: "SPEC 7.1: the output shard exists and its row count equals the main shard's.",
    verify.KEYS_MATCH: "SPEC 7.2: the key column equals the main shard's, every row, in order.",
    verify.SAMPLE_IMAGES: (
        "SPEC 7.3: a deterministic sample of rows decodes; each decoded size equals the audit width x height, "
        "both sides are multiples of the patch size, the area is near the target and the aspect ratio is within "
        "rounding of the crop box."
    ),
    verify.AUDIT_CONSISTENT: (
        "SPEC 7.4: valid + invalid == rows; every invalid row has an error code and a null image; every valid "
        "row has an image. Metadata: counts per error code and up to 20 invalid examples."
    ),
}
CROP_CHECK_DESCRIPTIONS = {
    verify.SHARD_COMPLETE: "The sidecar shard exists and its row count equals the main shard's.",
    verify.SIDECAR_COLUMNS: "Both crop columns and bbox_resize_meta exist, as JSON text.",
    verify.KEYS_MATCH: "The key column equals the main shard's, every row, in order.",
    verify.BOXES_VALID: "Every non-null box in the crop columns is four integers in 0..1000 with min <= max.",
    verify.META_MATCHES_AUDIT: "bbox_resize_meta's validity, sizes, crop box and scale agree with both resize audits.",
}
DATASET_CHECK_NAME = "dataset_summary"
LISTED_MISSING = 50  # at most this many shard names per list in the dataset check's metadata
# Check metadata name -> dataset output, for the dataset check.
DATASET_CHECK_OUTPUTS = {**{r: f"resized_{r}" for r in RESOLUTIONS}, "crop_bbox": "crop_bbox"}


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


def examples_markdown(examples: Sequence[Mapping[str, Any]], limit: int = 20) -> str:
    """Invalid rows as a markdown table (row, key, error code, detail)."""
    if not examples:
        return "_no invalid rows_"
    lines = ["| row | key | error | detail |", "|---:|---|---|---|"]
    for example in list(examples)[:limit]:
        detail = str(example.get("detail") or "").replace("|", "\\|").replace("\n", " ")[:160]
        lines.append(f"| {example.get('row', '')} | `{example.get('key')}` | {example.get('error')} | {detail} |")
    return "\n".join(lines)


def report_counts(report: verify.ShardReport) -> dict[str, Any]:
    """The counts a reader wants first, shared by the asset and its checks."""
    return {
        "rows": report.rows,
        "valid": report.valid,
        "invalid": report.invalid,
        "error_counts": dict(sorted(report.error_counts.items())),
    }


def check_results(
    report: verify.ShardReport, asset_key: dg.AssetKey, expected: Sequence[str]
) -> list[dg.AssetCheckResult]:
    """One result per expected check name; a check the report lacks fails (never silently passes)."""
    by_name = {c.name: c for c in report.checks}
    counts = report_counts(report)
    results = []
    for name in expected:
        result = by_name.get(name)
        if result is None:
            result = verify.CheckResult(name, False, f"{report.shard}: the verifier did not run check {name!r}")
        metadata = {"shard": report.shard, "message": result.message, **result.metadata}
        if report.kind == "resized":
            metadata.update(counts)
            if name == verify.AUDIT_CONSISTENT:
                metadata["invalid_examples"] = report.examples
                metadata["invalid_examples_table"] = dg.MetadataValue.md(examples_markdown(report.examples))
        results.append(
            dg.AssetCheckResult(
                asset_key=asset_key,
                check_name=name,
                passed=result.passed,
                severity=dg.AssetCheckSeverity.ERROR,
                description=result.message[:2000],
                metadata={k: v if isinstance(v, dg.MetadataValue) else metadata_value(v) for k, v in metadata.items()},
            )
        )
    return results


# -- the dataset check -----------------------------------------------------------------------


def first(items: Sequence[str], limit: int = LISTED_MISSING) -> list[str]:
    return list(items[:limit])


def summarize_dataset(dataset: DatasetConfig) -> tuple[bool, dict[str, Any], str]:
    """(passed, metadata, description) of the dataset check.

    The metadata holds counts, bytes and at most LISTED_MISSING shard names per list (the
    check runs hourly per dataset: full lists of 100,000 shards would be megabytes of event
    log each time). `sidecar-ops verify-crop-bbox --report FILE` writes the full lists.
    """
    main_sizes = dataset.main.shard_sizes()  # listed once: also needed for unusable keys below
    locations = {name: dataset.output(output) for name, output in DATASET_CHECK_OUTPUTS.items()}
    full = dataset_summary(dataset.main, locations, main_sizes=main_sizes)
    main_shards = full["main"]["shards"]
    metadata: dict[str, Any] = {"main_shards": main_shards, "main_bytes": full["main"]["total_bytes"]}
    summary: dict[str, Any] = {"main": full["main"], "outputs": {}, "listed_at_most": LISTED_MISSING}
    problems = []
    for name, part in full["outputs"].items():
        missing, extra = part["missing"], part["extra"]
        summary["outputs"][name] = {**part, "missing": len(missing), "extra": len(extra)}
        metadata[f"{name}_shards"] = part["shards"]
        metadata[f"{name}_bytes"] = part["total_bytes"]
        metadata[f"{name}_missing"] = len(missing)
        metadata[f"{name}_extra"] = len(extra)
        if missing:
            metadata[f"{name}_missing_shards"] = first(missing)
            problems.append(f"{name}: {len(missing)} of {main_shards} shards missing")
        if extra:
            metadata[f"{name}_extra_shards"] = first(extra)
            problems.append(f"{name}: {len(extra)} shards with no main shard")
    unusable = [rel for rel in main_sizes if partition_key_problem(rel)]
    if unusable:
        metadata["unpartitionable"] = len(unusable)
        metadata["unpartitionable_shards"] = first(unusable)
        problems.append(f"{len(unusable)} main shards cannot be partition keys (see the discovery sensor's log)")
    metadata["summary"] = summary
    passed = main_shards > 0 and not problems
    if main_shards == 0:
        problems.insert(0, f"no shards under {dataset.main.uri}")
    description = "; ".join(problems) if problems else f"all {main_shards} shards present in 512, 1024 and crop_bbox"
    return passed, metadata, description


def dataset_check(dataset: DatasetConfig) -> dg.AssetChecksDefinition:
    keys = DatasetKeys(dataset.name)

    @dg.asset_check(
        asset=keys.main,
        name=DATASET_CHECK_NAME,
        description=(
            "Shard counts and total bytes of main, 512, 1024 and the crop sidecar (what `aws s3 ls --recursive "
            "--summarize` shows), and which shards each output is missing. WARN when anything is missing."
        ),
        blocking=False,
    )
    def _dataset_summary() -> dg.AssetCheckResult:
        passed, metadata, description = summarize_dataset(dataset)
        return dg.AssetCheckResult(
            passed=passed,
            severity=dg.AssetCheckSeverity.WARN,
            description=description,
            metadata=to_metadata(metadata),
        )

    return _dataset_summary
