"""The asset graph of one dataset, partitioned by its shards. Thin: every step calls a shard job.

    <name>/main ──> <name>/resized_512 ──> <name>/verify_512 ──┐
              └──> <name>/resized_1024 ─> <name>/verify_1024 ─┴──> <name>/crop_bbox
                  (one multi-asset, one decode)

- `main`: the main Parquet dataset, external (never materialised here); the discovery sensor
  records one observation per shard (row count, bytes).
- `resized_512` + `resized_1024`: one multi-asset over `shards.resize.build_resized_shard`, so
  one decode feeds both; either can be selected alone.
- `verify_512` / `verify_1024`: `shards.verify.verify_resized_shard`; the JSON report is written
  under the dataset's reports prefix; SPEC 7 items are blocking partitioned checks.
- `crop_bbox`: `shards.crop_bbox.build_crop_bbox_shard`, then `verify_crop_bbox_shard`; overlay
  pictures (`shards.overlay.write_overlays`, not a check) are written under the reports prefix
  and shown in the materialization.
  Gated: in the same run, a failed blocking check upstream skips it; across runs, its
  automation condition waits until both verifiers' blocking checks passed for the shard; and
  a run of it alone (from the UI) is refused unless both verifiers materialised the shard after
  its resized shards last did and all their checks passed on that verification
  (`history.unverified_resized_problems`).

No `from __future__ import annotations` here: Dagster reads the `context` annotation.
"""

import base64
import time
from collections.abc import Iterator

import dagster as dg

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.overlay import thumbnail_png
from fixed_res_sidecar.defs.checks import (
    check_results,
    crop_check_specs,
    examples_markdown,
    report_counts,
    resized_check_specs,
    to_metadata,
)
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.history import unverified_resized_problems
from fixed_res_sidecar.defs.keys import RESOLUTIONS, DatasetKeys
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard
from fixed_res_sidecar.shards.overlay import write_overlays
from fixed_res_sidecar.shards.resize import build_resized_shard

# Inline thumbnails cost about 60-130 KB of event log each (base64 PNG at this width); the
# full-size PNGs stay under the reports prefix. `overlay_embed` sets how many per shard.
OVERLAY_THUMBNAIL_WIDTH = 720

# crop_bbox of a shard runs when its inputs updated (or it is missing), none of them is missing
# or in progress, and every blocking check of its parents passed for that shard.
CROP_BBOX_CONDITION = (
    dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()
).with_label("eager, once the verifiers' blocking checks passed")
# A verifier re-runs after its resized shard was rebuilt in a run that did not verify it.
VERIFY_CONDITION = dg.AutomationCondition.eager()


def main_spec(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> dg.AssetSpec:
    keys = DatasetKeys(dataset.name)
    return dg.AssetSpec(
        keys.main,
        partitions_def=partitions,
        group_name=keys.group,
        description=(
            f"The main dataset {dataset.main.uri} (read only, never materialised here). One partition per "
            "shard; the discovery sensor records each shard's row count and bytes as an observation."
        ),
        metadata={"uri": dg.MetadataValue.path(dataset.main.uri), "key_column": dataset.key_column},
        kinds={"parquet"},
    )


def _shard_metadata(location: Location, rel: str) -> dict[str, dg.MetadataValue]:
    size = location.size(rel)
    return {
        "dagster/uri": dg.MetadataValue.path(location.child(rel)),
        "bytes": dg.MetadataValue.int(size if size is not None else 0),
    }


def resized_assets(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)
    specs = [
        dg.AssetSpec(
            keys.resized(resolution),
            deps=[keys.main],
            partitions_def=partitions,
            group_name=keys.group,
            skippable=True,
            description=(
                f"Images of {dataset.main.uri} at {dataset.resized(resolution).area:,} px area, one shard per main "
                f"shard, with `{dataset.resized(resolution).audit_prefix}_*` audit columns: "
                f"{dataset.resized(resolution).location.uri}"
            ),
            metadata={"uri": dg.MetadataValue.path(dataset.resized(resolution).location.uri)},
            kinds={"parquet", dataset.output_format},
        )
        for resolution in RESOLUTIONS
    ]

    @dg.multi_asset(name=keys.resized_op, specs=specs, partitions_def=partitions, can_subset=True)
    def _resized(context: dg.AssetExecutionContext, sidecar: SidecarRuntime) -> Iterator[dg.MaterializeResult]:
        rel = context.partition_key
        selected = [r for r in RESOLUTIONS if keys.resized(r) in context.selected_asset_keys]
        result = build_resized_shard(
            dataset.layout,
            rel,
            resolutions=selected,
            options=dataset.pixel_options(),
            threads=sidecar.threads_for(dataset.threads_per_shard),
            skip_existing=sidecar.skip_existing,
            memory_gb=dataset.run_resources.memory_gb,
        )
        context.log.info(f"{rel}: {result.status_text}")
        for resolution, summary in zip(selected, result.outputs):
            metadata = {
                **_shard_metadata(dataset.resized(resolution).location, rel),
                "dagster/row_count": dg.MetadataValue.int(result.rows),
                "status": dg.MetadataValue.text(summary.status),
                "seconds": dg.MetadataValue.float(round(result.seconds, 3)),
            }
            if summary.status == "built":  # a skipped (up to date) shard was not read: its verifier has the counts
                metadata["valid"] = dg.MetadataValue.int(summary.valid)
                metadata["invalid"] = dg.MetadataValue.int(sum(summary.error_counts.values()))
                metadata["error_counts"] = dg.MetadataValue.json(dict(sorted(summary.error_counts.items())))
            yield dg.MaterializeResult(asset_key=keys.resized(resolution), metadata=metadata)

    return _resized


def verify_asset(dataset: DatasetConfig, resolution: str, partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)
    reports = dataset.layout.report_location(f"resized_{resolution}")

    @dg.asset(
        key=keys.verify(resolution),
        deps=[keys.resized(resolution)],
        partitions_def=partitions,
        group_name=keys.group,
        check_specs=resized_check_specs(keys, resolution, partitions),
        automation_condition=VERIFY_CONDITION,
        description=(
            f"SPEC 7 verifier report of {keys.resized(resolution).to_user_string()}, per shard, as JSON under "
            f"{reports.uri}. Its blocking checks gate {keys.crop_bbox.to_user_string()}."
        ),
        kinds={"json"},
    )
    def _verify(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        rel = context.partition_key
        report = verify.verify_resized_shard(dataset.layout, rel, resolution, dataset.verify_options())
        path = verify.write_report(reports, rel, report, protect=dataset.layout.read_only)
        failed = [c.name for c in report.failed_checks]
        context.log.info(f"{rel} {resolution}: {'passed' if report.passed else 'FAILED ' + ', '.join(failed)}")
        return dg.MaterializeResult(
            metadata={
                "report": dg.MetadataValue.path(reports.child(path)),
                "passed": dg.MetadataValue.bool(report.passed),
                "failed_checks": dg.MetadataValue.json(failed),
                **to_metadata(report_counts(report)),
                "invalid_examples": dg.MetadataValue.md(examples_markdown(report.examples)),
            },
            check_results=check_results(report, keys.verify(resolution), verify.RESIZED_CHECKS),
        )

    return _verify


def overlay_markdown(location: Location, uris: list[str], limit: int) -> str:
    """Overlay pictures as markdown: inline PNG thumbnails (data URIs) and where the full ones are."""
    lines = []
    root = location.uri.rstrip("/") + "/"
    for uri in uris[:limit]:
        rel = uri.removeprefix(root)
        try:
            thumbnail = base64.b64encode(thumbnail_png(location.read_bytes(rel), OVERLAY_THUMBNAIL_WIDTH)).decode(
                "ascii"
            )
            lines.append(f"**{rel}**\n\n![{rel}](data:image/png;base64,{thumbnail})\n")
        except Exception as exc:  # noqa: BLE001 - a picture that cannot be shown must not fail the asset
            lines.append(f"**{rel}**: cannot be shown ({describe_exception(exc, max_chars=300)})\n")
    lines.append("Full-size pictures:\n" + "\n".join(f"- `{uri}`" for uri in uris))
    return "\n".join(lines)


def crop_bbox_asset(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)
    layout = dataset.layout
    reports = layout.report_location("crop_bbox")
    overlays = layout.report_location("overlays") if dataset.overlay_sample > 0 else None

    @dg.asset(
        key=keys.crop_bbox,
        deps=[keys.resized("512"), keys.resized("1024"), keys.verify("512"), keys.verify("1024")],
        partitions_def=partitions,
        group_name=keys.group,
        check_specs=crop_check_specs(keys, partitions),
        automation_condition=CROP_BBOX_CONDITION,
        description=(
            "Crop-bbox sidecar: structured_description_crop_512, structured_description_crop_1024 and "
            f"bbox_resize_meta per row, at {layout.sidecar.uri}. Built for a shard only after both verifiers' blocking "
            "checks passed for it. Overlay pictures of sampled rows are in the materialization metadata."
        ),
        kinds={"parquet", "json"},
    )
    def _crop_bbox(context: dg.AssetExecutionContext, sidecar: SidecarRuntime) -> dg.MaterializeResult:
        rel = context.partition_key
        # The gate also holds for a run of crop_bbox alone (the UI allows one): Dagster's blocking
        # checks stop downstream steps only in their own run.
        problems = unverified_resized_problems(context.instance, keys, rel)
        if problems:
            raise dg.Failure(
                description=(
                    f"crop_bbox of {rel} is gated on the verifiers, whose checks have not all passed on the "
                    f"current resized shards: {'; '.join(problems)}. Fix or rebuild the resized shard, re-run "
                    "verify_512/verify_1024 for it, then crop_bbox."
                ),
                allow_retries=False,
            )
        started = time.monotonic()
        result = build_crop_bbox_shard(layout, rel, skip_existing=sidecar.skip_existing)
        context.log.info(f"{rel}: crop_bbox {result.status_text}")
        report = verify.verify_crop_bbox_shard(layout, rel)
        path = verify.write_report(reports, rel, report, protect=layout.read_only)
        metadata = {
            **_shard_metadata(layout.sidecar, rel),
            "dagster/row_count": dg.MetadataValue.int(result.rows),
            "status": dg.MetadataValue.text(result.status),
            "report": dg.MetadataValue.path(reports.child(path)),
            "passed": dg.MetadataValue.bool(report.passed),
            "failed_checks": dg.MetadataValue.json([c.name for c in report.failed_checks]),
            "captions": dg.MetadataValue.json(report.stats.get("caption_status", {})),
            "boxes": dg.MetadataValue.json(report.stats.get("boxes", {})),
        }
        if overlays is not None:
            metadata["overlay_dir"] = dg.MetadataValue.path(overlays.uri)
            metadata["overlays"] = dg.MetadataValue.md(_overlays(context, layout, rel, overlays, dataset))
        metadata["seconds"] = dg.MetadataValue.float(round(time.monotonic() - started, 3))
        return dg.MaterializeResult(
            metadata=metadata, check_results=check_results(report, keys.crop_bbox, verify.CROP_BBOX_CHECKS)
        )

    return _crop_bbox


def _overlays(context, layout, rel: str, overlays: Location, dataset: DatasetConfig) -> str:
    """Markdown of the shard's overlay pictures; pictures that cannot be drawn are a warning, not a failure."""
    try:
        pictures = write_overlays(layout, rel, overlays, dataset.overlay_sample)
    except Exception as exc:  # noqa: BLE001 - pictures are for people: the checks decide pass or fail
        message = f"{rel}: overlay pictures could not be drawn: {describe_exception(exc, max_chars=300)}"
        context.log.warning(message)
        return message
    return overlay_markdown(overlays, pictures, dataset.overlay_embed)


def dataset_assets(
    dataset: DatasetConfig, partitions: dg.PartitionsDefinition
) -> list[dg.AssetSpec | dg.AssetsDefinition]:
    """Every asset of one dataset, all on `partitions`."""
    return [
        main_spec(dataset, partitions),
        resized_assets(dataset, partitions),
        *(verify_asset(dataset, resolution, partitions) for resolution in RESOLUTIONS),
        crop_bbox_asset(dataset, partitions),
    ]
