"""The asset graph of one dataset, partitioned by its shards. Thin: the work is `shards.pipeline`.

    <name>/main ──> <name>/resized_512 ──> <name>/verify_512 ──┐
              └──> <name>/resized_1024 ─> <name>/verify_1024 ─┴──> <name>/crop_bbox ──> <name>/audit

- `main`: the main Parquet dataset, external (never materialised by a run); the discovery sensor
  records each shard as a runless materialization (row count, bytes).
- `resized_*`, `verify_*`, `crop_bbox`: one multi-asset, so one run of a batch of shards is one
  step. Per shard, in worker processes within the run's CPU budget, `shards.pipeline.run_stages`
  resizes (one decode for both resolutions), verifies (SPEC 7, blocking partitioned checks) and
  crops (the sidecar, its checks and overlay pictures) what the run selected. Every shard gets
  its own materializations and its own check results, also in a run over several shards.
  The gate is per shard: a shard whose verifier failed gets no crop_bbox, the others of its batch
  do; crop_bbox selected without its verifiers is refused unless both verifiers passed on the
  current resized shards in earlier runs (the shard's ledger, `defs/ledger.py`). A refused shard
  gets an observation saying why and no materialization; its checks do not run.
  A shard whose selected outputs are up to date and whose last results are on record is not
  redone: its selected assets are materialised again with their recorded metadata and its check
  results restated (footers read, nothing else), so every shard of a run is recorded whole, as if
  it had a run of its own. A shard that fails (a failed check, a refused crop, storage) fails the
  run, which names it alone; a shard no longer in main is skipped with an observation.
- `audit`: the dataset audit (defs/dataset_audit.py), one per dataset.

The shard step runs inside its run's fence (defs/fencing.py): every output it publishes (in this
process or in its shard worker processes) is published only while the run is still this worker's
(`io.locations.commit_guard`), and it records its shards only then; a run worker orphaned by a dead
raylet is killed before it writes again. So a run that monitoring failed and retried is built, and
recorded as built, by its retry alone.

No `from __future__ import annotations` here: Dagster reads the `context` annotation.
"""

import logging
from collections.abc import Iterator, Set
from dataclasses import replace

import dagster as dg

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.defs import ui_links
from fixed_res_sidecar.defs.checks import (
    VERIFY_CPU_SECONDS,
    audit_check_results,
    check_evaluations,
    crop_check_specs,
    dataset_audit_check_specs,
    examples_table,
    fidelity_numbers,
    report_counts,
    resized_check_specs,
    target_data,
)
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.dagster_private import DataFailure
from fixed_res_sidecar.defs.dataset_audit import audit_dataset
from fixed_res_sidecar.defs.fencing import current_fence, fenced
from fixed_res_sidecar.defs.history import (
    FAILED_VERIFICATION,
    RESTATED_FROM_ID,
    RESTATED_FROM_RUN,
    VERIFIED_FINGERPRINT,
    asset_keys,
    built_from_main,
    latest_materialization,
    read_ledgers,
    retry_run_on_failure,
    wait_for_storage,
)
from fixed_res_sidecar.defs.ledger import CHECKS, Action, CheckState, Decision, ShardLedger
from fixed_res_sidecar.defs.names import RESOLUTION_NAMES, SWEEP_TAG, DatasetKeys
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.defs.shard_metadata import (
    fidelity_picture_metadata,
    overlay_metadata,
    shard_metadata,
    text_or_null,
)
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar.shards.pipeline import (
    PipelineOptions,
    ShardOutcome,
    Stages,
    StagesJob,
    StoredOutputs,
)
from fixed_res_sidecar.shards.resize import RESIZE_OUTPUT_VERSION
from fixed_res_sidecar.shards.runner import Progress, run_shards

# The resized assets' code version: the UI marks shards built by another version Unsynced.
RESIZE_CODE_VERSION = str(RESIZE_OUTPUT_VERSION)


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


def shard_specs(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> list[dg.AssetSpec]:
    keys, layout = DatasetKeys(dataset.name), dataset.layout
    common = {"partitions_def": partitions, "group_name": keys.group, "skippable": True}
    specs = [
        dg.AssetSpec(
            keys.resized(r),
            deps=[keys.main],
            description=(
                f"Images of {dataset.main.uri} at {layout.resized[r].area:,} px area, one shard per main shard, "
                f"with `{layout.resized[r].audit_prefix}_*` audit columns: {layout.resized[r].location.uri}"
            ),
            metadata={"uri": dg.MetadataValue.path(layout.resized[r].location.uri)},
            kinds={"parquet", dataset.output_format},
            code_version=RESIZE_CODE_VERSION,
            **common,
        )
        for r in RESOLUTION_NAMES
    ]
    specs += [
        dg.AssetSpec(
            keys.verify(r),
            deps=[keys.resized(r)],
            description=(
                f"SPEC 7 verifier report of {keys.resized(r).to_user_string()}, per shard, as JSON under "
                f"{layout.report_location(f'resized_{r}').uri}. Its blocking checks gate {keys.crop_bbox.to_user_string()}."
            ),
            kinds={"json"},
            **common,
        )
        for r in RESOLUTION_NAMES
    ]
    specs.append(
        dg.AssetSpec(
            keys.crop_bbox,
            deps=[*(keys.resized(r) for r in RESOLUTION_NAMES), *(keys.verify(r) for r in RESOLUTION_NAMES)],
            description=(
                "Crop-bbox sidecar: structured_description_crop_512, structured_description_crop_1024 and "
                f"bbox_resize_meta per row, at {layout.sidecar_location().uri}. Built for a shard only after both verifiers' "
                "blocking checks passed for it (a refused shard gets an observation saying why, and no "
                "materialization). Overlay pictures of sampled rows are in the materialization metadata."
            ),
            kinds={"parquet", "json"},
            **common,
        )
    )
    return specs


def shard_assets(dataset: DatasetConfig, partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)
    check_specs = [spec for r in RESOLUTION_NAMES for spec in resized_check_specs(keys, r, partitions)]
    check_specs += crop_check_specs(keys, partitions)

    # One multi-asset: its outputs and check results are optional (a refused shard emits neither),
    # and a run over a batch of shards is one step.
    @dg.multi_asset(
        name=keys.shard_op,
        specs=shard_specs(dataset, partitions),
        check_specs=check_specs,
        partitions_def=partitions,
        can_subset=True,
        backfill_policy=dg.BackfillPolicy.multi_run(dataset.shards_per_run),
    )
    @fenced
    def _shards(context: dg.AssetExecutionContext, sidecar: SidecarRuntime) -> Iterator:
        fence = current_fence()
        context.log.addFilter(_per_shard_check_results)
        stages = selected_stages(keys, context.selected_asset_keys)
        options = PipelineOptions(
            pixels=dataset.pixel_options(),
            verify=dataset.verify_options(),
            threads=sidecar.threads_for(dataset.threads_per_shard),
            skip_existing=sidecar.skip_existing,
            overlay_sample=dataset.overlay_sample,
        )
        sweep = context.run.tags.get(SWEEP_TAG) == "true"
        rels = list(context.partition_keys)
        layout = dataset.layout
        ledgers = read_ledgers(context.instance, keys, rels)
        infra: dict[str, list[str]] = {}  # shard -> why it failed, not the data's fault (a retry can redo it)
        data: dict[str, list[str]] = {}  # shard -> why its data failed (a retry would fail the same way)
        decisions: dict[str, Decision] = {}
        for rel in rels:
            try:
                in_main = dataset.main.exists(rel)
                decisions[rel] = ledgers[rel].decide(
                    stages, options.skip_existing, StoredOutputs(layout, rel, stages, options), in_main, sweep
                )
            except Exception as exc:  # noqa: BLE001 - one shard's failure must not stop the others
                infra[rel] = [describe_exception(exc, max_chars=500)]
        for rel, decision in decisions.items():
            if decision.action is Action.SKIP:
                yield from removed_observations(context, keys, dataset, rel, stages)
            elif decision.action is Action.RESTATE:
                context.log.info(f"{rel}: {decision.reason}")
                yield from restated_events(context, keys, ledgers[rel], stages)
            elif decision.action is Action.REFUSE:
                yield refusal(
                    keys, rel, list(decision.gate or ()), context, _crop_built_by(context.instance, keys, rel)
                )
                data[rel] = [f"crop_bbox refused: {'; '.join(decision.gate or ())}"]
            else:
                context.log.info(f"{rel}: {decision.reason}")
        todo = [rel for rel, decision in decisions.items() if decision.action is Action.BUILD]
        # The cross-run gate is the ledger's, read above; when this run verifies both resolutions
        # itself, run_stages gates the crop on this run's own reports (docs/performance.md, "Dagster at scale").
        gates = {rel: list(gate) for rel in todo if (gate := decisions[rel].gate) is not None}
        rebuilds = {rel: decisions[rel].rebuild for rel in todo if decisions[rel].rebuild}
        workers = max(1, min(len(todo), int(dataset.run_resources.cpu // max(1, options.threads))))
        options = replace(options, memory_gb=dataset.run_resources.memory_gb / workers)  # shared by the workers
        outcomes, failures = _run(dataset, todo, stages, options, (gates, rebuilds), workers, fence.commit_check)
        # The work may have outlasted a storage outage: record it once the event log answers again.
        wait_for_storage(context.instance)
        fence.check()  # a worker that lost its run meanwhile records nothing
        for rel, reason in failures.items():
            infra[rel] = [reason]
        for rel in todo:
            if rel in outcomes:
                yield from shard_events(context, dataset, keys, outcomes[rel], stages)
                if outcome_problems := outcomes[rel].problems():
                    data[rel] = outcome_problems
        if not (problems := {**data, **infra}):
            return
        # The run fails, naming each failed shard; every other shard of it is recorded whole (every
        # selected asset materialised, every check evaluated), so only failed shards show Failed.
        message = f"{len(problems)} of {len(rels)} shard(s) failed: " + "; ".join(
            f"{rel}: {', '.join(why)}" for rel, why in sorted(problems.items())
        )
        if infra:  # not only the data's: a retry may do better, and the stack trace may tell why
            raise dg.Failure(description=message, metadata={"failed_shards": dg.MetadataValue.json(sorted(problems))})
        retry_run_on_failure(context.instance, context.run.run_id, False)  # the data's failure: it would repeat
        context.log.warning(f"repair: {ui_links.repair(keys, sorted(problems))} (Materialize all…, then Launch)")
        # The data failed, not the code: one message, no stack trace.
        raise DataFailure(f"{message}. Run them again to repair them: the job rebuilds what failed.")

    return _shards


def _per_shard_check_results(record: logging.LogRecord) -> bool:
    """Drops Dagster's "did not yield or return expected outputs" line for the checks: it counts only
    check results returned for the step's own partition, and a step over a batch reports each
    shard's results as events (every selected check of every shard has one, or the run fails).
    The audit leaves `dataset_complete` unjudged on purpose while work is under way."""
    return "did not yield or return expected outputs" not in record.getMessage()


def selected_stages(keys: DatasetKeys, selected: Set[dg.AssetKey]) -> Stages:
    return Stages(
        resize=tuple(r for r in RESOLUTION_NAMES if keys.resized(r) in selected),
        verify=tuple(r for r in RESOLUTION_NAMES if keys.verify(r) in selected),
        crop=keys.crop_bbox in selected,
    )


def _run(
    dataset, rels, stages, options, plans, workers, commit_check=None
) -> tuple[dict[str, ShardOutcome], dict[str, str]]:
    """Run the stages for every shard: in this process, or in worker processes (spawned per run); each
    output is published only if `commit_check()` (the run fence's, picklable) does not raise. `plans`:
    per shard, the gate problems on record and the outputs to build again (the ledger's decision)."""
    if not rels:
        return {}, {}
    gates, rebuilds = plans
    job = StagesJob(dataset.layout, stages, options, gates, rebuilds, commit_check)
    if workers == 1:
        outcomes, failures = {}, {}
        for rel in rels:
            try:
                outcomes[rel] = job(rel)
            except Exception as exc:  # noqa: BLE001 - one shard's failure must not lose the others' results
                failures[rel] = describe_exception(exc, max_chars=500)
        return outcomes, failures
    summary = run_shards(job, rels, workers=workers, progress=Progress(len(rels), quiet=True))
    return summary.results, summary.failures


# -- events ------------------------------------------------------------------------------------


def shard_events(context, dataset: DatasetConfig, keys: DatasetKeys, outcome: ShardOutcome, stages: Stages) -> Iterator:
    """Materializations and check results of one shard, each check linked to its materialization."""
    rel, layout, instance = outcome.rel, dataset.layout, context.instance
    if outcome.resize_problem:
        context.log.error(f"{rel}: not resized: {outcome.resize_problem}")
    if outcome.resized is not None:
        main_fingerprint = outcome.resized.sources.get("main")
        provenance = (
            built_from_main(instance, keys, rel, main_fingerprint, RESIZE_CODE_VERSION) if main_fingerprint else None
        )
        for resolution, summary in zip(stages.resize, outcome.resized.outputs):
            metadata = {
                **shard_metadata(layout.resized[resolution].location, rel),
                "dagster/row_count": dg.MetadataValue.int(outcome.resized.rows),
                "status": dg.MetadataValue.text(summary.status),
                "seconds": dg.MetadataValue.float(round(outcome.resized.seconds, 3)),
            }
            if summary.status == "built":  # a skipped (up to date) shard was not read: its verifier has the counts
                metadata["valid"] = dg.MetadataValue.int(summary.valid)
                metadata["invalid"] = dg.MetadataValue.int(sum(summary.error_counts.values()))
                for code in ERROR_CODES:
                    metadata[f"invalid_{code}"] = dg.MetadataValue.int(summary.error_counts.get(code, 0))
            yield dg.AssetMaterialization(
                asset_key=keys.resized(resolution), partition=rel, metadata=metadata, tags=provenance
            )
    for resolution, report in outcome.reports.items():
        failed = [c.name for c in report.failed_checks]
        context.log.info(f"{rel} {resolution}: {'passed' if report.passed else 'FAILED ' + ', '.join(failed)}")
        metadata = {
            "report": dg.MetadataValue.path(outcome.report_paths[resolution]),
            "passed": dg.MetadataValue.bool(report.passed),
            VERIFIED_FINGERPRINT: text_or_null(outcome.fingerprints.get(f"resized_{resolution}")),
            "failed_checks": dg.MetadataValue.json(failed),
            **report_counts(report),
            **fidelity_numbers(report),
            VERIFY_CPU_SECONDS: dg.MetadataValue.float(round(outcome.verify_cpu_seconds.get(resolution, 0.0), 3)),
            "invalid_examples": examples_table(report.examples),
        }
        key = keys.verify(resolution)
        pictures = {verify.FIDELITY: fidelity_picture_metadata(dataset, outcome.fidelity_pictures.get(resolution))}
        yield from verified_events(context, keys, key, rel, report, metadata, verify.RESIZED_CHECKS, pictures)
    if outcome.crop_refused:
        yield refusal(keys, rel, outcome.crop_refused, context, _crop_built_by(instance, keys, rel))
    elif outcome.crop_problem:
        context.log.error(f"{rel}: crop_bbox not built: {outcome.crop_problem}")
    elif outcome.crop is not None:
        context.log.info(f"{rel}: crop_bbox {outcome.crop.status_text}")
        report = outcome.crop_report
        assert report is not None  # run_stages verifies every crop_bbox it builds
        # Overlay pictures first: the UI lists metadata in this order.
        metadata = overlay_metadata(layout.report_location("overlays"), outcome, dataset.overlay_embed)
        metadata |= {
            **shard_metadata(layout.sidecar_location(), rel),
            "dagster/row_count": dg.MetadataValue.int(outcome.crop.rows),
            "status": dg.MetadataValue.text(outcome.crop.status),
            "report": dg.MetadataValue.path(outcome.report_paths["crop_bbox"]),
            "passed": dg.MetadataValue.bool(report.passed),
            VERIFIED_FINGERPRINT: text_or_null(outcome.fingerprints.get("crop_bbox")),
            "failed_checks": dg.MetadataValue.json([c.name for c in report.failed_checks]),
            "captions": dg.MetadataValue.json(report.stats.get("caption_status", {})),
            "boxes": dg.MetadataValue.json(report.stats.get("boxes", {})),
            "seconds": dg.MetadataValue.float(round(outcome.seconds, 3)),
            VERIFY_CPU_SECONDS: dg.MetadataValue.float(round(outcome.verify_cpu_seconds.get("crop_bbox", 0.0), 3)),
        }
        yield from verified_events(context, keys, keys.crop_bbox, rel, report, metadata, verify.CROP_BBOX_CHECKS)


def verified_events(
    context,
    keys: DatasetKeys,
    key: dg.AssetKey,
    rel: str,
    report: verify.ShardReport,
    metadata: dict[str, dg.MetadataValue],
    expected: tuple[str, ...],
    extra: dict | None = None,
) -> Iterator:
    """A verified output's events: a materialization and its check results when every check passed;
    when one failed, an observation holding the same metadata (`history.FAILED_VERIFICATION`) and the
    check results, so that the asset reads Failed for that shard in every view (its run fails without
    materialising it), as its checks do. Each failed result links to the repair."""
    if report.passed:
        yield dg.AssetMaterialization(asset_key=key, partition=rel, metadata=metadata)
        target = latest_materialization(context.instance, key, rel)
        yield from check_evaluations(report, key, expected, rel, target, extra)
        return
    failed = ", ".join(c.name for c in report.failed_checks)
    yield dg.AssetObservation(
        asset_key=key,
        partition=rel,
        description=f"verification failed ({failed}): not materialised; the next run of this shard rebuilds it",
        metadata={
            FAILED_VERIFICATION: dg.MetadataValue.bool(True),
            "repair": dg.MetadataValue.url(ui_links.repair(keys, [rel])),
            **metadata,
        },
    )
    repair = {"repair": dg.MetadataValue.url(ui_links.repair(keys, [rel]))}
    extra = {name: {**repair, **(extra or {}).get(name, {})} for name in expected}
    # Linked to the shard's latest materialization of the asset (the last verification that passed, if any):
    # Dagster shows a partitioned check's result only when it is about the partition's latest materialization.
    target = latest_materialization(context.instance, key, rel)
    yield from check_evaluations(report, key, expected, rel, target, extra)


def _crop_built_by(instance, keys: DatasetKeys, rel: str) -> str | None:
    """The run that built the crop_bbox on record for shard `rel`, if any."""
    record = latest_materialization(instance, keys.crop_bbox, rel)
    if record is None:
        return None
    materialization = record.asset_materialization
    built_by = materialization.metadata.get(RESTATED_FROM_RUN) if materialization is not None else None
    return str(built_by.value) if built_by is not None else record.run_id


def refusal(
    keys: DatasetKeys, rel: str, problems: list[str], context, built_by: str | None = None
) -> dg.AssetObservation:
    """A refused crop_bbox: nothing built, no check run (the sidecar on disk did not change); this says why.

    Its `status` replaces the one of the crop_bbox on record in the UI's partition view (which shows
    the latest materialization's metadata under later observations of the same keys), so the view
    says one thing: not rebuilt, and whose the sidecar on disk is."""
    reason = (
        f"crop_bbox of {rel} is gated on the verifiers, whose checks have not all passed on the current resized "
        f"shards: {'; '.join(problems)}. Run the shard again (its job): the failed output is rebuilt, verified "
        "and then cropped."
    )
    context.log.warning(reason)
    on_disk = f"the sidecar on disk is from run {built_by[:8]}" if built_by else "no sidecar was ever built"
    return dg.AssetObservation(
        asset_key=keys.crop_bbox,
        partition=rel,
        description=reason[:2000],
        metadata={
            "status": dg.MetadataValue.text(f"refused by the gate: not rebuilt; {on_disk}"),
            "gate": dg.MetadataValue.text("refused: nothing built"),
            "shard": dg.MetadataValue.text(rel),
            "reason": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems)),
            "repair": dg.MetadataValue.url(ui_links.repair(keys, [rel])),
        },
    )


def restated_events(context, keys: DatasetKeys, shard: ShardLedger, stages: Stages) -> Iterator:
    """An up-to-date shard's selected assets materialised again with their recorded metadata (so every
    view of the shard, failed partitions included, is as fresh as this run), and its recorded check
    results restated against those new materializations."""
    rel, assets = shard.rel, asset_keys(keys)
    for name in shard.selected(stages):  # in graph order: resized, verify, crop_bbox
        key, entry = assets[name], shard.latest(name)
        record = latest_materialization(context.instance, key, rel)
        assert entry is not None and record is not None and record.asset_materialization is not None
        previous = record.asset_materialization
        yield dg.AssetMaterialization(
            asset_key=key,
            partition=rel,
            description=f"unchanged since {entry.described()}",
            metadata={
                **previous.metadata,
                RESTATED_FROM_RUN: dg.MetadataValue.text(entry.builder),
                RESTATED_FROM_ID: dg.MetadataValue.int(entry.order),
            },
            tags=previous.tags,
        )
        target = target_data(latest_materialization(context.instance, key, rel))
        for check_name in CHECKS.get(name, ()):
            result = shard.check(name, check_name)
            yield dg.AssetCheckEvaluation(
                asset_key=key,
                check_name=check_name,
                passed=result.state is CheckState.PASSED,
                partition=rel,
                target_materialization_data=target,
                severity=dg.AssetCheckSeverity.ERROR,
                blocking=True,
                description=(
                    f"restated, the shard is unchanged since {entry.described()}: {result.description or 'passed'}"
                )[:2000],
                metadata={RESTATED_FROM_RUN: dg.MetadataValue.text(entry.builder)},
            )


def removed_observations(context, keys: DatasetKeys, dataset: DatasetConfig, rel: str, stages: Stages) -> Iterator:
    """A shard of the run that is no longer in main: nothing to build, and nothing fails (the discovery
    sensor retires its partition); each selected asset says so."""
    reason = f"{dataset.main.child(rel)} is no longer in the main dataset: skipped, its outputs are kept"
    context.log.warning(reason)
    selected = [*(keys.resized(r) for r in stages.resize), *(keys.verify(r) for r in stages.verify)]
    for key in selected + ([keys.crop_bbox] if stages.crop else []):
        yield dg.AssetObservation(
            asset_key=key, partition=rel, description=reason, metadata={"skipped": dg.MetadataValue.text(reason)}
        )


def audit_asset(dataset: DatasetConfig) -> dg.AssetsDefinition:
    keys = DatasetKeys(dataset.name)

    # A multi-asset of one asset only so that a check may go unevaluated: `dataset_complete` is not judged
    # while work is under way (defs/checks.py `audit_check_results`).
    @dg.multi_asset(
        name=f"{dataset.name}__audit",
        specs=[
            dg.AssetSpec(
                keys.audit,
                # Not on main directly: main's shards carry data versions that Dagster cannot carry into an
                # unpartitioned asset, so the audit would read Unsynced forever after any change of main.
                # It follows main through the outputs, which are rebuilt when main changes.
                deps=[*(keys.verify(r) for r in RESOLUTION_NAMES), keys.crop_bbox],
                group_name=keys.group,
                description=(
                    f"The audit of {dataset.name}, from what the Dagster instance recorded, checked against a listing of "
                    "each output (no image is read): its "
                    "verdict first, the failing shards with links to their pages and to their repair, the totals "
                    "(shards, rows, sizes) and fidelity (rows compared, scores, the share of rows ever compared), "
                    "then every number, plotted across materializations (failures first). It runs within a minute "
                    "of every run of the dataset that ends, and hourly. Its check `dataset_audit` fails when a shard "
                    "failed a blocking check or lacks its crop_bbox; `dataset_complete` warns while work is left."
                ),
                kinds={"json"},
                skippable=True,
            )
        ],
        check_specs=dataset_audit_check_specs(keys),
        can_subset=True,
    )
    def _audit(context: dg.AssetExecutionContext) -> Iterator:
        context.log.addFilter(_per_shard_check_results)  # an unjudged dataset_complete is meant
        audit = audit_dataset(context.instance, keys, dataset.layout, own_run_id=context.run.run_id)
        context.log.info(audit.description())
        yield dg.MaterializeResult(
            asset_key=keys.audit, metadata=audit.metadata(), check_results=audit_check_results(keys, audit)
        )

    return _audit


def dataset_assets(
    dataset: DatasetConfig, partitions: dg.PartitionsDefinition
) -> list[dg.AssetSpec | dg.AssetsDefinition]:
    """Every asset of one dataset: main, the per-shard multi-asset, the audit."""
    return [main_spec(dataset, partitions), shard_assets(dataset, partitions), audit_asset(dataset)]
