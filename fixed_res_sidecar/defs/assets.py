"""The asset graph of one dataset, partitioned by its shards. Thin: every step calls a shard job.

    <name>/main ──> <name>/resized_512 ──> <name>/verify_512 ──┐
              └──> <name>/resized_1024 ─> <name>/verify_1024 ─┴──> <name>/crop_bbox
                  (one multi-asset, one decode)

- `main`: the main Parquet dataset, external (never materialised here); the discovery sensor
  records each shard as a runless materialization (row count, bytes).
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

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.overlay import embeddable
from fixed_res_sidecar.defs.audit import audit_dataset
from fixed_res_sidecar.defs.checks import (
    audit_check_result,
    check_results,
    crop_check_specs,
    dataset_audit_check_spec,
    examples_table,
    report_counts,
    resized_check_specs,
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

# Each inline picture costs about 60-120 KB of event log (base64 WebP, 640 px wide); the full-size
# PNGs stay under the reports prefix. `overlay_embed` sets how many per shard.
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
            "shard; the discovery sensor records each shard (row count, bytes) as a runless materialization."
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
                for code in ERROR_CODES:
                    metadata[f"invalid_{code}"] = dg.MetadataValue.int(summary.error_counts.get(code, 0))
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
                **report_counts(report),
                "invalid_examples": examples_table(report.examples),
            },
            check_results=check_results(report, keys.verify(resolution), verify.RESIZED_CHECKS),
        )

    return _verify


def overlay_markdown(location: Location, uris: list[str], limit: int) -> str:
    """Overlay pictures as markdown: the first `limit` inline (data URIs), and a link to every full-size one."""
    lines = []
    root = location.uri.rstrip("/") + "/"
    for uri in uris[:limit]:
        rel = uri.removeprefix(root)
        try:
            picture = base64.b64encode(embeddable(location.read_bytes(rel))).decode("ascii")
            lines.append(f"**{rel}**\n\n![{rel}](data:image/webp;base64,{picture})\n")
        except Exception as exc:  # noqa: BLE001 - a picture that cannot be shown must not fail the asset
            lines.append(f"**{rel}**: cannot be shown ({describe_exception(exc, max_chars=300)})\n")
    lines.append("Full-size pictures:\n" + "\n".join(_picture_link(location, uri.removeprefix(root)) for uri in uris))
    return "\n".join(lines)


def _picture_link(location: Location, rel: str) -> str:
    link = location.link(rel)
    return f"- [{rel}]({link})" if link.startswith("https://") or link.startswith("http://") else f"- `{link}`"


def crop_bbox_asset(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)
    layout = dataset.layout
    reports = layout.report_location("crop_bbox")
    overlays = layout.report_location("overlays") if dataset.overlay_sample > 0 else None

    spec = dg.AssetSpec(
        keys.crop_bbox,
        deps=[keys.resized("512"), keys.resized("1024"), keys.verify("512"), keys.verify("1024")],
        partitions_def=partitions,
        group_name=keys.group,
        automation_condition=CROP_BBOX_CONDITION,
        description=(
            "Crop-bbox sidecar: structured_description_crop_512, structured_description_crop_1024 and "
            f"bbox_resize_meta per row, at {layout.sidecar.uri}. Built for a shard only after both verifiers' blocking "
            "checks passed for it (a refused shard gets an observation saying why, and no materialization). "
            "Overlay pictures of sampled rows are in the materialization metadata."
        ),
        kinds={"parquet", "json"},
        skippable=True,
    )

    # A multi-asset, not an asset: its outputs and check results are optional, so a refused shard
    # emits neither (an asset's check results are required, and would show as failed).
    @dg.multi_asset(
        name=keys.crop_bbox_op,
        specs=[spec],
        check_specs=crop_check_specs(keys, partitions),
        partitions_def=partitions,
        can_subset=True,
    )
    def _crop_bbox(context: dg.AssetExecutionContext, sidecar: SidecarRuntime) -> Iterator:
        rel = context.partition_key
        # The gate also holds for a run of crop_bbox alone (the UI allows one): Dagster's blocking
        # checks stop downstream steps only in their own run.
        problems = unverified_resized_problems(context.instance, keys, rel)
        if problems:
            # Nothing is built and no check runs (the UI shows them skipped, not failed: the sidecar on
            # disk did not change); the refusal is recorded on the shard, where the UI shows it.
            reason = (
                f"crop_bbox of {rel} is gated on the verifiers, whose checks have not all passed on the current "
                f"resized shards: {'; '.join(problems)}. Fix or rebuild the resized shard, re-run "
                "verify_512/verify_1024 for it, then crop_bbox."
            )
            context.log.warning(reason)
            yield dg.AssetObservation(
                asset_key=keys.crop_bbox,
                partition=rel,
                description=reason[:2000],
                metadata={
                    "gate": dg.MetadataValue.text("refused: nothing built"),
                    "shard": dg.MetadataValue.text(rel),
                    "reason": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems)),
                },
            )
            return
        started = time.monotonic()
        result = build_crop_bbox_shard(layout, rel, skip_existing=sidecar.skip_existing)
        context.log.info(f"{rel}: crop_bbox {result.status_text}")
        report = verify.verify_crop_bbox_shard(layout, rel)
        path = verify.write_report(reports, rel, report, protect=layout.read_only)
        # Overlay pictures first: the UI lists metadata in this order.
        metadata = _overlays(context, layout, rel, overlays, dataset) if overlays is not None else {}
        metadata |= {
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
        metadata["seconds"] = dg.MetadataValue.float(round(time.monotonic() - started, 3))
        yield dg.MaterializeResult(
            metadata=metadata, check_results=check_results(report, keys.crop_bbox, verify.CROP_BBOX_CHECKS)
        )

    return _crop_bbox


def _overlays(context, layout, rel: str, overlays: Location, dataset: DatasetConfig) -> dict[str, dg.MetadataValue]:
    """The shard's overlay pictures as metadata: inline pictures, and a link to the first full-size one.

    Pictures that cannot be drawn are a warning, not a failure: the checks decide pass or fail.
    """
    try:
        pictures = write_overlays(layout, rel, overlays, dataset.overlay_sample)
    except Exception as exc:  # noqa: BLE001 - pictures are for people
        message = f"{rel}: overlay pictures could not be drawn: {describe_exception(exc, max_chars=300)}"
        context.log.warning(message)
        return {"overlays": dg.MetadataValue.text(message)}
    metadata = {"overlays": dg.MetadataValue.md(overlay_markdown(overlays, pictures, dataset.overlay_embed))}
    if pictures:
        link = overlays.link(pictures[0].removeprefix(overlays.uri.rstrip("/") + "/"))
        local = not overlays.is_s3
        metadata["overlay_full_size"] = dg.MetadataValue.path(link) if local else dg.MetadataValue.url(link)
    return metadata


def audit_asset(dataset: DatasetConfig) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)

    @dg.asset(
        key=keys.audit,
        deps=[keys.main, *(keys.verify(r) for r in RESOLUTIONS), keys.crop_bbox],
        group_name=keys.group,
        check_specs=[dataset_audit_check_spec(keys)],
        description=(
            f"The audit of {dataset.name}: shards, rows and bytes of main and every output, valid and invalid rows "
            "per error code and resolution, and the shards whose checks failed or whose crop_bbox is missing, "
            "from what the Dagster instance recorded (no data is read). Its numbers are plotted across "
            "materializations; its check fails when a shard failed a blocking check or lacks its crop_bbox."
        ),
        kinds={"json"},
    )
    def _audit(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        audit = audit_dataset(context.instance, keys, own_run_id=context.run_id)
        context.log.info(audit.description())
        return dg.MaterializeResult(metadata=audit.metadata(), check_results=[audit_check_result(keys, audit)])

    return _audit


def dataset_assets(
    dataset: DatasetConfig, partitions: dg.PartitionsDefinition
) -> list[dg.AssetSpec | dg.AssetsDefinition]:
    """Every asset of one dataset, all on `partitions`."""
    return [
        main_spec(dataset, partitions),
        resized_assets(dataset, partitions),
        *(verify_asset(dataset, resolution, partitions) for resolution in RESOLUTIONS),
        crop_bbox_asset(dataset, partitions),
        audit_asset(dataset),
    ]
