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
- `crop_bbox`: `shards.crop_bbox.build_crop_bbox_shard`, then `verify_crop_bbox_shard`, whose
  overlay pictures are written under the reports prefix and shown in the materialization.
  Gated: in the same run, a failed blocking check upstream skips it; across runs, its
  automation condition waits until both verifiers' blocking checks passed for the shard; and
  a run of it alone (from the UI) is refused unless both verifiers materialised the shard after
  its resized shards last did and all their checks passed on that verification (`gate_problems`).

No `from __future__ import annotations` here: Dagster reads the `context` annotation.
"""

import base64
import io
import time
from collections.abc import Iterator

import dagster as dg
from PIL import Image

from fixed_res_sidecar.defs.checks import (
    CROP_CHECKS,
    check_results,
    crop_check_specs,
    examples_markdown,
    report_counts,
    resized_check_specs,
    to_metadata,
)
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.keys import RESOLUTIONS, DatasetKeys
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard
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
            dataset.main,
            rel,
            [dataset.resized(r) for r in selected],
            key_column=dataset.key_column,
            image_column=dataset.image_column,
            options=dataset.pixel_options(),
            threads=sidecar.threads_for(dataset.threads_per_shard),
            skip_existing=sidecar.skip_existing,
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
    output = dataset.resized(resolution)
    reports = dataset.report_location(f"resized_{resolution}")

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
        report = verify.verify_resized_shard(
            dataset.main,
            rel,
            output.location,
            key_column=dataset.key_column,
            image_column=dataset.image_column,
            audit_prefix=output.audit_prefix,
            target_area=output.area,
            patch_size=dataset.patch_size,
            sample=dataset.verify_sample,
            square=dataset.square,
        )
        path = verify.write_report(reports, rel, report, protect=dataset.read_only)
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
            data = location.read_bytes(rel)
            lines.append(f"**{rel}**\n\n![{rel}](data:image/png;base64,{_thumbnail_png(data)})\n")
        except Exception as exc:  # noqa: BLE001 - a picture that cannot be shown must not fail the asset
            lines.append(f"**{rel}**: cannot be shown ({type(exc).__name__}: {exc})\n")
    lines.append("Full-size pictures:\n" + "\n".join(f"- `{uri}`" for uri in uris))
    return "\n".join(lines)


def _thumbnail_png(data: bytes) -> str:
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
        if image.width > OVERLAY_THUMBNAIL_WIDTH:
            height = max(1, round(image.height * OVERLAY_THUMBNAIL_WIDTH / image.width))
            image = image.resize((OVERLAY_THUMBNAIL_WIDTH, height), Image.Resampling.LANCZOS)
        out = io.BytesIO()
        # 256 colours keep a thumbnail near 100-200 KB; the boxes stay crisp.
        image.quantize(256, dither=Image.Dither.NONE).save(out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode("ascii")


def _latest_materialization(instance: dg.DagsterInstance, key: dg.AssetKey, rel: str) -> dg.EventLogRecord | None:
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[rel]), limit=1)
    return records.records[0] if records.records else None


def gate_problems(instance: dg.DagsterInstance, keys: DatasetKeys, rel: str) -> list[str]:
    """Why shard `rel` must not get its crop_bbox yet; empty when both verifiers passed on the current build.

    Per resolution: the verifier materialised this shard after the latest materialization of the
    resized shard it verifies (a resized shard rebuilt since is unverified), and each of its
    checks last passed on that verifier materialization (not on an older one).
    """
    check_keys = [dg.AssetCheckKey(keys.verify(r), name) for r in RESOLUTIONS for name in verify.RESIZED_CHECKS]
    infos = {
        info.check_key: info
        for info in instance.event_log_storage.get_asset_check_partition_info(check_keys, partition_keys=[rel])
    }
    problems = []
    for resolution in RESOLUTIONS:
        resized_key, verify_key = keys.resized(resolution), keys.verify(resolution)
        resized = _latest_materialization(instance, resized_key, rel)
        verified = _latest_materialization(instance, verify_key, rel)
        if resized is None:
            problems.append(f"{resized_key.to_user_string()} was never materialised for this shard")
        if verified is None:
            problems.append(f"{verify_key.to_user_string()} was never materialised for this shard")
        elif resized is not None and resized.storage_id > verified.storage_id:
            problems.append(
                f"{resized_key.to_user_string()} was materialised again (run {resized.run_id[:8]}) after "
                f"{verify_key.to_user_string()} last verified it (run {verified.run_id[:8]}): the passed checks "
                "describe an older build"
            )
        for name in verify.RESIZED_CHECKS:
            key = dg.AssetCheckKey(verify_key, name)
            info = infos.get(key)
            status = info.latest_execution_status.value.lower() if info is not None else "never run"
            if status != "succeeded":
                problems.append(f"{key.to_user_string()} {status}")
            elif verified is not None and not _evaluates(info, verified.storage_id):
                problems.append(
                    f"{key.to_user_string()} passed on an older materialization of {verify_key.to_user_string()}, "
                    "not on its latest"
                )
    return problems


def _evaluates(info, materialization_storage_id: int) -> bool:
    """Whether the check's latest evaluation belongs to that materialization (or a later one)."""
    target = info.latest_target_materialization_storage_id
    if target is not None:
        return target >= materialization_storage_id
    return info.latest_check_event_storage_id > materialization_storage_id


def crop_bbox_asset(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)
    output = dataset.output("crop_bbox")
    reports = dataset.report_location("crop_bbox")
    overlays = dataset.report_location("overlays") if dataset.overlay_sample > 0 else None
    expected_checks = CROP_CHECKS if overlays is not None else verify.CROP_BBOX_CHECKS

    @dg.asset(
        key=keys.crop_bbox,
        deps=[keys.resized("512"), keys.resized("1024"), keys.verify("512"), keys.verify("1024")],
        partitions_def=partitions,
        group_name=keys.group,
        check_specs=[s for s in crop_check_specs(keys, partitions) if s.name in expected_checks],
        automation_condition=CROP_BBOX_CONDITION,
        description=(
            "Crop-bbox sidecar: structured_description_crop_512, structured_description_crop_1024 and "
            f"bbox_resize_meta per row, at {output.uri}. Built for a shard only after both verifiers' blocking "
            "checks passed for it. Overlay pictures of sampled rows are in the materialization metadata."
        ),
        kinds={"parquet", "json"},
    )
    def _crop_bbox(context: dg.AssetExecutionContext, sidecar: SidecarRuntime) -> dg.MaterializeResult:
        rel = context.partition_key
        # The gate also holds for a run of crop_bbox alone (the UI allows one): Dagster's blocking
        # checks stop downstream steps only in their own run.
        problems = gate_problems(context.instance, keys, rel)
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
        common = {
            "key_column": dataset.key_column,
            "caption_column": dataset.caption_column,
            "caption_location": dataset.captions,
            "audit_prefix_512": dataset.audit_prefix_512,
            "audit_prefix_1024": dataset.audit_prefix_1024,
            "bbox_keys": dataset.bbox_keys,
            "caption_frame": dataset.caption_frame,
        }
        located = (dataset.main, rel, dataset.output("resized_512"), dataset.output("resized_1024"), output)
        result = build_crop_bbox_shard(*located, **common, skip_existing=sidecar.skip_existing)
        context.log.info(f"{rel}: crop_bbox {result.status_text}")
        report = verify.verify_crop_bbox_shard(
            *located,
            **common,
            image_column=dataset.image_column,
            overlay_dir=overlays,
            overlay_sample=dataset.overlay_sample,
        )
        path = verify.write_report(reports, rel, report, protect=dataset.read_only)
        pictures = list(report.stats.get("overlays") or [])
        metadata = {
            **_shard_metadata(output, rel),
            "dagster/row_count": dg.MetadataValue.int(result.rows),
            "status": dg.MetadataValue.text(result.status),
            "report": dg.MetadataValue.path(reports.child(path)),
            "passed": dg.MetadataValue.bool(report.passed),
            "failed_checks": dg.MetadataValue.json([c.name for c in report.failed_checks]),
            "captions": dg.MetadataValue.json(report.stats.get("caption_status", {})),
            "boxes": dg.MetadataValue.json(report.stats.get("boxes", {})),
            "seconds": dg.MetadataValue.float(round(time.monotonic() - started, 3)),
        }
        if overlays is not None:
            metadata["overlay_dir"] = dg.MetadataValue.path(overlays.uri)
            metadata["overlays"] = dg.MetadataValue.md(overlay_markdown(overlays, pictures, dataset.overlay_embed))
        return dg.MaterializeResult(metadata=metadata, check_results=check_results(report, keys.crop_bbox, expected_checks))

    return _crop_bbox


def dataset_assets(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> list[dg.AssetSpec | dg.AssetsDefinition]:
    """Every asset of one dataset, all on `partitions`."""
    return [
        main_spec(dataset, partitions),
        resized_assets(dataset, partitions),
        *(verify_asset(dataset, resolution, partitions) for resolution in RESOLUTIONS),
        crop_bbox_asset(dataset, partitions),
    ]
