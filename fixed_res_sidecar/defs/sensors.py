"""Sensors: shard discovery per dataset, and the automation that gates `crop_bbox`.

Discovery (`<dataset>__discover_shards`, on the dataset's interval) lists the main prefix page
by page and compares it with what it saw before (kept per shard in the instance's key-value
store: the listing's stamp, size and ETag or modification time, and the pass that last saw it):

- a new shard becomes a partition (added in chunks of at most 10k keys);
- a changed shard (another stamp: rewritten in place) is recorded again;
- a shard that a complete pass no longer lists is recorded as removed and its partition is
  retired (deleted), so no backfill asks for it again; its outputs are kept (the dataset audit
  lists them as orphans), and it becomes a partition again if it comes back.

New and changed shards are recorded on `<dataset>/main` as runless materializations (row count,
bytes, and their source fingerprint as the data version, so the UI shows main's shards as present
and automation sees them updated), changed ones also as observations (the UI then marks their
outputs unsynced), and get shard runs of at most `shards_per_run` shards each. Their outputs
record the fingerprint they were built from, so a run rebuilds what main changed. At most
`sensor.max_new_shards_per_tick` new or changed shards are taken per tick; the cursor remembers
where the listing stopped, the next tick continues there, and a listing that reached the end
starts over (new shards can appear anywhere in key order, e.g. a new date folder). 100,000
shards are therefore taken over a few ticks, each bounded in time and in storage writes.

Automation (`<dataset>__automation`, running by default): evaluates the assets'
automation conditions, so `crop_bbox` of a shard is built once both verifiers' blocking
checks passed for that shard, also when they pass in a later run.
"""

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import dagster as dg

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.defs import history
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.dagster_private import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.partitions import (
    add_requests,
    partition_key_problem,
    retire_requests,
    shard_partitions,
)
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.defs.run_resources import dataset_run_tags
from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.io.parquet import source_fingerprint

LISTING_PAGE_SIZE = 1000
REFUSED_LOGGED = 20  # refused shard names written to the tick log, per tick
AUTOMATION_INTERVAL_SECONDS = 30
STATE_KEY = "fixed_res_sidecar/discovery/{dataset}"


@dataclass
class ShardCursor:
    """Where discovery stands: resume the listing after `after` (None: from the start)."""

    after: str | None = None
    passes: int = 0  # listings that reached the end

    @classmethod
    def parse(cls, text: str | None) -> "ShardCursor":
        if not text:
            return cls()
        try:
            data = json.loads(text)
            return cls(after=data.get("after"), passes=int(data.get("passes", 0)))
        except (ValueError, TypeError, AttributeError):
            return cls()  # an unreadable cursor only costs one full listing

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class Discovery:
    """What one tick found."""

    new: list[str] = field(default_factory=list)  # shards to add, in listing order
    changed: list[str] = field(default_factory=list)  # known shards whose object was rewritten
    removed: list[str] = field(default_factory=list)  # known shards a complete pass no longer lists
    refused: dict[str, str] = field(default_factory=dict)  # shard -> why it cannot be a partition
    examined: int = 0  # shards listed and compared this tick
    complete: bool = False  # the listing reached the end of the prefix
    cursor: ShardCursor = field(default_factory=ShardCursor)
    # rel -> [stamp, pass that last listed it, removed]: what the next tick compares with
    seen: dict[str, list] = field(default_factory=dict)


def discover_shards(
    main: Location,
    known: Sequence[str] | set[str],
    cursor: ShardCursor | None = None,
    max_new: int = 2000,
    page_size: int = LISTING_PAGE_SIZE,
    seen: Mapping[str, list] | None = None,
) -> Discovery:
    """List `main` after the cursor, page by page, until `max_new` new or changed shards were found.

    `known` are the partitions, `seen` what earlier ticks listed (see Discovery.seen). A known shard
    listed with another stamp than before is changed (one never stamped before gets its stamp,
    with no change); paths that cannot be partition keys are refused with the reason. When the
    listing reaches the end, known shards this pass did not list are removed. Listing order is
    key order on S3 and sorted order locally, so "after" is well defined for both.
    """
    cursor = cursor or ShardCursor()
    found = Discovery(cursor=ShardCursor(after=None, passes=cursor.passes), seen=dict(seen or {}))
    this_pass = cursor.passes
    for page in main.iter_shard_entries(page_size=page_size, start_after=cursor.after):
        for entry in page:
            found.examined += 1
            before = found.seen.get(entry.rel)
            if entry.rel in known:
                if before is not None and (before[0] != entry.stamp or before[2]):
                    found.changed.append(entry.rel)
            else:
                problem = partition_key_problem(entry.rel)
                if problem:
                    found.refused[entry.rel] = problem
                    continue
                found.new.append(entry.rel)
            found.seen[entry.rel] = [entry.stamp, this_pass, False]
            if len(found.new) + len(found.changed) >= max_new:
                found.cursor.after = entry.rel
                return found
    found.complete = True
    found.cursor.passes += 1
    for rel in known:
        record = found.seen.get(rel)
        if record is None or (record[1] < this_pass and not record[2]):
            found.removed.append(rel)
            found.seen[rel] = [record[0] if record else None, record[1] if record else this_pass, True]
    return found


def observe_shards(main: Location, rels: list[str], threads: int = 16) -> dict[str, dict[str, dg.MetadataValue]]:
    """Per shard: row count, bytes and source fingerprint from the listing and the Parquet footer (footers
    read in parallel, never an image).

    A shard whose footer cannot be read is still recorded, with the error; its shard run will
    fail with the full message.
    """

    def observe(rel: str) -> tuple[str, dict[str, dg.MetadataValue]]:
        metadata: dict[str, dg.MetadataValue] = {"uri": dg.MetadataValue.path(main.child(rel))}
        try:
            parquet_file = main.parquet_file(rel)
            metadata["bytes"] = dg.MetadataValue.int(main.size(rel) or 0)
            metadata["dagster/row_count"] = dg.MetadataValue.int(parquet_file.metadata.num_rows)
            metadata["fingerprint"] = dg.MetadataValue.text(source_fingerprint(main, rel, parquet_file))
        except Exception as exc:  # noqa: BLE001 - unreadable: say so here, the shard run reports it in full
            metadata["error"] = dg.MetadataValue.text(describe_exception(exc, max_chars=500))
        return rel, metadata

    if not rels:
        return {}
    with ThreadPoolExecutor(max(1, min(threads, len(rels)))) as pool:
        return dict(pool.map(observe, rels))


def main_events(
    keys: DatasetKeys, main: Location, found: Discovery, threads: int = 16
) -> list[dg.AssetMaterialization | dg.AssetObservation]:
    """What a tick records on `<dataset>/main` (external: runless events), per partition.

    New and changed shards: a materialization with their fingerprint as the data version; changed
    ones also an observation with it, which marks what was built from the old version unsynced.
    Removed shards: an observation saying so.
    """
    events: list[dg.AssetMaterialization | dg.AssetObservation] = []
    for rel, metadata in observe_shards(main, [*found.new, *found.changed], threads).items():
        version = metadata.get("fingerprint")
        # observe_shards records the fingerprint as text
        tags = {"dagster/data_version": version.value} if isinstance(version, dg.TextMetadataValue) else None
        events.append(dg.AssetMaterialization(asset_key=keys.main, partition=rel, metadata=metadata, tags=tags))
        if rel in found.changed and tags:
            events.append(dg.AssetObservation(asset_key=keys.main, partition=rel, metadata=metadata, tags=tags))
    for rel in found.removed:
        events.append(
            dg.AssetObservation(
                asset_key=keys.main,
                partition=rel,
                description=f"{main.child(rel)} is no longer in the main dataset; its outputs are kept",
                metadata={history.REMOVED: dg.MetadataValue.bool(True), "uri": dg.MetadataValue.path(main.child(rel))},
            )
        )
    return events


def shard_run_requests(dataset: DatasetConfig, rels: list[str], order: Sequence[str]) -> list[dg.RunRequest]:
    """Runs that resize, verify and crop `rels`: a run covers one range of consecutive partitions (in
    `order`, the order they were added), at most `shards_per_run` of them."""
    job, tags = DatasetKeys(dataset.name).shard_job, dataset_run_tags(dataset)
    position = {rel: i for i, rel in enumerate(order)}
    ranges: list[list[str]] = []
    for rel in sorted(rels, key=position.__getitem__):
        batch = ranges[-1] if ranges else None
        if batch and position[rel] == position[batch[-1]] + 1 and len(batch) < dataset.shards_per_run:
            batch.append(rel)
        else:
            ranges.append([rel])
    requests = []
    for batch in ranges:
        first, last = batch[0], batch[-1]
        if first == last:
            requests.append(dg.RunRequest(run_key=None, partition_key=first, job_name=job, tags=tags))
        else:
            range_tags = {ASSET_PARTITION_RANGE_START_TAG: first, ASSET_PARTITION_RANGE_END_TAG: last}
            requests.append(dg.RunRequest(run_key=None, job_name=job, tags={**tags, **range_tags}))
    return requests


def discovery_tick(
    dataset: DatasetConfig,
    known: Sequence[str],
    cursor: str | None,
    seen: Mapping[str, list] | None = None,
    observe_threads: int = 16,
    log=None,
) -> tuple[dg.SensorResult, dict[str, list]]:
    """Everything one discovery tick does, as a SensorResult, and what it saw (to keep for the next).

    `known` are the partitions in the order they were added. Used by the sensor and the demo.
    """
    keys = DatasetKeys(dataset.name)
    if problem := dataset.main_problem():  # the tick fails, naming the folder; nothing is recorded as removed
        raise LocationError(problem)
    known_set = set(known)
    found = discover_shards(
        dataset.main, known_set, ShardCursor.parse(cursor), dataset.sensor.max_new_shards_per_tick, seen=seen
    )
    if found.refused and log is not None:
        for problem in list(found.refused.values())[:REFUSED_LOGGED]:
            log.error(problem)
        if len(found.refused) > REFUSED_LOGGED:
            log.error(f"... and {len(found.refused) - REFUSED_LOGGED} more shards refused as partition keys")
    if not (found.new or found.changed or found.removed):
        where = "end of listing" if found.complete else f"stopped after {found.cursor.after!r}"
        refused = f"; {len(found.refused)} refused (see the tick log)" if found.refused else ""
        reason = (
            f"no new, changed or removed shards under {dataset.main.uri} ({found.examined} listed, {where}){refused}"
        )
        return dg.SensorResult(skip_reason=reason, cursor=found.cursor.to_json()), found.seen
    if log is not None:
        log.info(
            f"{len(found.new)} new, {len(found.changed)} changed, {len(found.removed)} removed shard(s) under "
            f"{dataset.main.uri}"
        )
        if found.removed:  # named: the operator needs to know which, not how many
            log.warning(f"removed from {dataset.main.uri} (partitions retired, outputs kept): {_named(found.removed)}")
        if found.changed:
            log.info(f"changed (to be rebuilt): {_named(found.changed)}")
    # New partitions are added in listing order, after the known ones: that is their order from now on.
    order = [*known, *found.new]
    result = dg.SensorResult(
        run_requests=shard_run_requests(dataset, [*found.new, *found.changed], order),
        dynamic_partitions_requests=[
            *add_requests(shard_partitions(keys), found.new),
            *retire_requests(shard_partitions(keys), found.removed),
        ],
        asset_events=main_events(keys, dataset.main, found, observe_threads),
        cursor=found.cursor.to_json(),
    )
    return result, found.seen


def _named(rels: list[str]) -> str:
    shown = ", ".join(rels[:REFUSED_LOGGED])
    return shown + (f", ... and {len(rels) - REFUSED_LOGGED} more" if len(rels) > REFUSED_LOGGED else "")


def load_seen(instance: dg.DagsterInstance, dataset: str) -> dict[str, list]:
    return history.load_json(instance, STATE_KEY.format(dataset=dataset)) or {}


def save_seen(instance: dg.DagsterInstance, dataset: str, seen: dict[str, list]) -> None:
    history.save_json(instance, STATE_KEY.format(dataset=dataset), seen)


def discovery_sensor(dataset: DatasetConfig) -> dg.SensorDefinition:
    keys = DatasetKeys(dataset.name)
    status = (
        dg.DefaultSensorStatus.RUNNING if dataset.sensor.default_status == "running" else dg.DefaultSensorStatus.STOPPED
    )

    @dg.sensor(
        name=keys.discovery_sensor,
        job_name=keys.shard_job,
        minimum_interval_seconds=dataset.sensor.interval_seconds,
        default_status=status,
        description=(
            f"Lists {dataset.main.uri} every {dataset.sensor.interval_seconds} s: adds new shards as partitions of "
            f"{keys.partitions}, records new, changed and removed shards on {keys.main.to_user_string()}, and "
            "requests shard runs for the new and changed ones."
        ),
    )
    def _discover(context: dg.SensorEvaluationContext, sidecar: SidecarRuntime) -> dg.SensorResult:
        known = context.instance.get_dynamic_partitions(keys.partitions)
        seen = load_seen(context.instance, dataset.name)
        result, seen = discovery_tick(dataset, known, context.cursor, seen, sidecar.observe_threads, context.log)
        # Kept before the daemon applies the result: a tick that fails to apply is listed again as new
        # or changed only if its partitions were not added, and runs of the same shard are idempotent.
        save_seen(context.instance, dataset.name, seen)
        return result

    return _discover


def automation_sensor(dataset: DatasetConfig) -> dg.AutomationConditionSensorDefinition:
    """Evaluates the automation conditions of one dataset's assets; running by default.

    Open-source Dagster ships its default automation sensor stopped; this one starts with
    the code location, so the cross-run gate on `crop_bbox` works without a click.
    """
    keys = DatasetKeys(dataset.name)
    return dg.AutomationConditionSensorDefinition(
        name=keys.automation_sensor,
        target=dg.AssetSelection.groups(keys.group),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=AUTOMATION_INTERVAL_SECONDS,
        run_tags=dataset_run_tags(dataset),
        description=(
            f"Builds {keys.crop_bbox.to_user_string()} of a shard once both verifiers' blocking checks passed "
            "for it (and re-verifies shards whose resized outputs were rebuilt)."
        ),
    )
