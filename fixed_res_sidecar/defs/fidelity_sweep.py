"""The fidelity sweep: over time, every row of the dataset compared with its source (off by default).

A verification compares a window of rows not compared before on the same bytes
(shards/verify/coverage.py), so verifying a shard again and again walks all its rows. The schedule
`<name>__fidelity_sweep` (hourly; stopped until turned on in the UI or with `fidelity_sweep:
{default_status: running}`) spends at most `fidelity_sweep.cpu_seconds_per_hour` of verifier CPU per
hour: it estimates a shard's verification from the latest ones recorded (`verify_cpu_seconds` of both
verifiers and crop_bbox), takes as many shards as the budget pays for, walking the partitions in
order from where the previous tick stopped (kept in the instance's key-value store), and requests runs
of `verify_512`, `verify_1024` and `crop_bbox` for them (ranges of up to `shards_per_run` consecutive
shards) tagged `sidecar/fidelity_sweep`. Only complete shards are swept (a failed one needs its
repair, an unbuilt one its build). In those runs each shard is verified again although its results
are on record (`ShardLedger.decide(sweep=True)`); its crop_bbox is found up to date and verified
again, so it stays current. A wrong picture the new window finds fails the shard as any verification
does: the audit names it and the next run of the shard rebuilds it.
"""

import statistics
from collections.abc import Sequence

import dagster as dg

from fixed_res_sidecar.defs import history
from fixed_res_sidecar.defs.audit_state import load_audit_state
from fixed_res_sidecar.defs.checks import VERIFY_CPU_SECONDS
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.ledger import ShardState
from fixed_res_sidecar.defs.names import RESOLUTION_NAMES, SWEEP_TAG, DatasetKeys
from fixed_res_sidecar.defs.partitions import consecutive_ranges, range_tags
from fixed_res_sidecar.defs.run_resources import dataset_run_tags

CRON = "0 * * * *"  # hourly: the budget is per hour
STATE_KEY = "fixed_res_sidecar/fidelity_sweep/{dataset}"
RECENT = 20  # verifications whose CPU seconds estimate the next ones
UNKNOWN_COST = 30.0  # CPU seconds assumed for a shard's verification before any was measured


def fidelity_sweep_schedule(dataset: DatasetConfig) -> dg.ScheduleDefinition:
    keys = DatasetKeys(dataset.name)
    status = (
        dg.DefaultScheduleStatus.RUNNING
        if dataset.fidelity_sweep.default_status == "running"
        else dg.DefaultScheduleStatus.STOPPED
    )

    @dg.schedule(
        name=keys.fidelity_sweep,
        job_name=keys.shard_job,
        cron_schedule=CRON,
        default_status=status,
        description=(
            f"Verifies complete shards of {dataset.name} again, each verification comparing rows not compared "
            f"before, within {dataset.fidelity_sweep.cpu_seconds_per_hour:g} CPU seconds per hour: over time every "
            "row is compared with its source."
        ),
    )
    def _sweep(context: dg.ScheduleEvaluationContext):
        return sweep_tick(context.instance, dataset)

    return _sweep


def sweep_tick(instance: dg.DagsterInstance, dataset: DatasetConfig) -> list[dg.RunRequest] | dg.SkipReason:
    """One hour's sweep: the runs that verify the next complete shards the budget pays for."""
    keys = DatasetKeys(dataset.name)
    order = instance.get_dynamic_partitions(keys.partitions)
    state = load_audit_state(instance, dataset.name)  # the ledgers as of the latest audit
    complete = {rel for rel in order if rel in state.shards and state.ledger(rel).state() is ShardState.COMPLETE}
    if not complete:
        return dg.SkipReason(f"no complete shard of {dataset.name} to sweep (as of its latest audit)")
    cost = shard_cost(instance, keys)
    count = max(1, int(dataset.fidelity_sweep.cpu_seconds_per_hour // cost))
    start = (history.load_json(instance, STATE_KEY.format(dataset=dataset.name)) or {}).get("next", 0)
    chosen, following = next_shards(order, complete, start, count)
    history.save_json(instance, STATE_KEY.format(dataset=dataset.name), {"next": following})
    return sweep_requests(dataset, order, chosen)


def shard_cost(instance: dg.DagsterInstance, keys: DatasetKeys) -> float:
    """CPU seconds of one shard's verifications (both resolutions and crop_bbox), the median of the
    latest recorded ones; UNKNOWN_COST before any was."""
    total = 0.0
    for key in (*(keys.verify(r) for r in RESOLUTION_NAMES), keys.crop_bbox):
        records = history.storage_call(
            instance.fetch_materializations, dg.AssetRecordsFilter(asset_key=key), limit=RECENT
        )
        seconds = [
            float(value.value)
            for record in records.records
            if record.asset_materialization is not None
            and (value := record.asset_materialization.metadata.get(VERIFY_CPU_SECONDS)) is not None
            and isinstance(value.value, int | float)
        ]
        if not seconds:
            return UNKNOWN_COST
        total += statistics.median(seconds)
    return max(total, 0.01)


def next_shards(order: Sequence[str], eligible: set[str], start: int, count: int) -> tuple[list[str], int]:
    """Up to `count` eligible shards from position `start` of `order` on (wrapping around once), and the
    position after the last one taken (where the next tick starts)."""
    if not order:
        return [], 0
    chosen, after = [], start % len(order)
    for step in range(len(order)):
        index = (start + step) % len(order)
        if order[index] in eligible:
            chosen.append(order[index])
            after = (index + 1) % len(order)
            if len(chosen) >= count:
                break
    return chosen, after


def sweep_requests(dataset: DatasetConfig, order: Sequence[str], chosen: Sequence[str]) -> list[dg.RunRequest]:
    """Runs of the verifiers and crop_bbox over `chosen`: ranges of consecutive partitions (in `order`), at
    most `shards_per_run` each, tagged as the sweep's."""
    keys = DatasetKeys(dataset.name)
    selection = [*(keys.verify(r) for r in RESOLUTION_NAMES), keys.crop_bbox]
    tags = {**dataset_run_tags(dataset), SWEEP_TAG: "true"}
    return [
        dg.RunRequest(
            run_key=None,
            partition_key=batch[0] if len(batch) == 1 else None,
            asset_selection=selection,
            tags={**tags, **range_tags(batch)},
        )
        for batch in consecutive_ranges(chosen, order, dataset.shards_per_run)
    ]
