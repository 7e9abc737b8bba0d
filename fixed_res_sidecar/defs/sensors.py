"""The shard discovery sensor of each dataset.

Discovery (`<dataset>__discover_shards`, on the dataset's interval) lists the main prefix page
by page and compares it with what it saw before (kept per shard in the instance's key-value
store: the listing's stamp, size and ETag or size, times and inode, and the pass that last saw it):

- a new shard becomes a partition (added in chunks of at most 10k keys);
- a changed shard (another stamp: rewritten in place) is recorded again;
- a shard that a complete pass no longer lists is recorded as removed and its partition is
  retired (deleted), so no backfill asks for it again; its outputs are kept (the dataset audit
  lists them as orphans), and it becomes a partition again if it comes back.

New and changed shards are recorded on `<dataset>/main` as runless materializations (row count,
bytes, and their source fingerprint as the data version, so the UI shows main's shards as present
and automation sees them updated), changed ones also as observations (the UI then marks their
outputs unsynced), and their shards get built: up to `BACKFILL_ABOVE_RUNS` runs of at most
`shards_per_run` shards each are requested as runs of the shard job, more as one backfill (whose
runs take `shards_per_run` shards each too, as the assets' BackfillPolicy says). Their outputs
record the fingerprint they were built from, so a run rebuilds what main changed. At most
`sensor.max_new_shards_per_tick` new or changed shards are taken per tick; the cursor remembers
where the listing stopped, the next tick continues there, and a listing that reached the end
starts over (new shards can appear anywhere in key order, e.g. a new date folder). 100,000
shards are therefore taken over a few ticks, each bounded in time and in storage writes.

The tick records what it found itself, in batches (`record_discovery`): main's events
`dagster_private.EVENT_BATCH` per write, partitions `ADD_CHUNK` per write. A SensorResult's
`asset_events` and `dynamic_partitions_requests` would have the daemon write one event at a time
and look up each new key before adding it (75 s per 1,000 new shards at 100,000 listed); only the
run requests go back to the daemon. The daemon keeps a tick's cursor only once it applied the
tick's requests, so the cursor carries the tick's number and the shards it requested are kept
until then (`PENDING_KEY`): a tick whose requests were lost requests them again in the next one.

The runs that follow a shard's runs (a verifier, crop_bbox) are the automation sensor's (automation.py).
"""

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import dagster as dg

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.defs import history
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.dagster_private import (
    backfill_request,
    store_runless_events,
)
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.partitions import (
    chunks,
    consecutive_ranges,
    partition_key_problem,
    range_tags,
    shard_partitions,
)
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.defs.run_resources import dataset_run_tags
from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.io.parquet import source_fingerprint

LISTING_PAGE_SIZE = 1000
REFUSED_LOGGED = 20  # refused shard names written to the tick log, per tick
STATE_KEY = "fixed_res_sidecar/discovery/{dataset}"
PENDING_KEY = "fixed_res_sidecar/discovery/{dataset}/requested"  # {"tick": n, "rels": [...]}
# A tick that needs more runs than this requests one backfill instead: the daemon creates a run over
# a range of dynamic partitions in seconds (Dagster resolves the range from every key of the
# partition set for each asset and check it plans), which hundreds of runs would hold the tick for.
BACKFILL_ABOVE_RUNS = 4


@dataclass
class ShardCursor:
    """Where discovery stands: resume the listing after `after` (None: from the start)."""

    after: str | None = None
    passes: int = 0  # listings that reached the end
    tick: int = 0  # the last tick that recorded something (the daemon keeps its cursor once it applied it)

    @classmethod
    def parse(cls, text: str | None) -> "ShardCursor":
        if not text:
            return cls()
        try:
            data = json.loads(text)
            return cls(after=data.get("after"), passes=int(data.get("passes", 0)), tick=int(data.get("tick", 0)))
        except (ValueError, TypeError, AttributeError):
            return cls()  # an unreadable cursor only costs one full listing (and requests again what is pending)

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
    found = Discovery(cursor=ShardCursor(after=None, passes=cursor.passes, tick=cursor.tick), seen=dict(seen or {}))
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


def shard_run_requests(
    dataset: DatasetConfig,
    rels: list[str],
    order: Sequence[str],
    assets: Sequence[dg.AssetKey] | None = None,
    tags: Mapping[str, str] | None = None,
) -> list[dg.RunRequest]:
    """Runs that build `assets` (default: resize, verify and crop) of `rels`: a run covers one range of
    consecutive partitions (in `order`, the order they were added), at most `shards_per_run` of them.
    More than `BACKFILL_ABOVE_RUNS` such runs: one backfill of `rels` instead. `tags` add to the dataset's."""
    keys, tags = DatasetKeys(dataset.name), {**dataset_run_tags(dataset), **(tags or {})}
    ranges = consecutive_ranges(rels, order, dataset.shards_per_run)
    if len(ranges) > BACKFILL_ABOVE_RUNS:
        shards = [rel for batch in ranges for rel in batch]
        return [backfill_request(shard_partitions(keys), dict.fromkeys(assets or keys.shard_assets, shards), tags)]
    return [
        dg.RunRequest(
            run_key=None,
            partition_key=batch[0] if len(batch) == 1 else None,
            asset_selection=list(assets) if assets else None,
            tags={**tags, **range_tags(batch)},
        )
        for batch in ranges
    ]


def record_discovery(
    instance: dg.DagsterInstance,
    keys: DatasetKeys,
    found: Discovery,
    events: Sequence[dg.AssetMaterialization | dg.AssetObservation],
) -> None:
    """Write what a tick found, in batches, in an order that a failure at any point leaves right for the
    next tick: main's events (written again if the tick is redone: the same facts), the removed shards'
    partitions retired, what was listed kept, then the new partitions added (a new shard whose partition
    is missing is new again next tick)."""
    store_runless_events(instance, events)
    for rel in found.removed:
        instance.delete_dynamic_partition(keys.partitions, rel)
    save_seen(instance, keys.dataset, found.seen)
    for chunk in chunks(found.new):
        instance.add_dynamic_partitions(keys.partitions, chunk)


def discovery_tick(
    dataset: DatasetConfig,
    instance: dg.DagsterInstance,
    cursor: str | None,
    observe_threads: int = 16,
    log=None,
    daemon_applies: bool = True,
) -> dg.SensorResult:
    """One discovery tick: list, record what changed in the instance (`record_discovery`), and return the
    run requests for the new and changed shards (and for those an earlier tick requested that were never
    applied) with the cursor. Used by the sensor and the demo; `daemon_applies` False: the caller runs
    the shards itself (the demo), so no later tick may request them again."""
    keys = DatasetKeys(dataset.name)
    if problem := dataset.main_problem():  # the tick fails, naming the folder; nothing is recorded as removed
        raise LocationError(problem)
    known = instance.get_dynamic_partitions(keys.partitions)
    position = ShardCursor.parse(cursor)
    found = discover_shards(
        dataset.main,
        set(known),
        position,
        dataset.sensor.max_new_shards_per_tick,
        seen=load_seen(instance, dataset.name),
    )
    if found.refused and log is not None:
        for problem in list(found.refused.values())[:REFUSED_LOGGED]:
            log.error(problem)
        if len(found.refused) > REFUSED_LOGGED:
            log.error(f"... and {len(found.refused) - REFUSED_LOGGED} more shards refused as partition keys")
    pending = history.load_json(instance, PENDING_KEY.format(dataset=dataset.name)) or {}
    # The daemon never kept the cursor of the tick that requested these: its requests were not applied.
    unapplied = pending.get("rels", []) if pending.get("tick", 0) != position.tick else []
    still_there = set(known) - set(found.removed)
    requested = list(dict.fromkeys([*found.new, *found.changed, *(r for r in unapplied if r in still_there)]))
    if not (requested or found.removed):
        where = "end of listing" if found.complete else f"stopped after {found.cursor.after!r}"
        refused = f"; {len(found.refused)} refused (see the tick log)" if found.refused else ""
        reason = (
            f"no new, changed or removed shards under {dataset.main.uri} ({found.examined} listed, {where}){refused}"
        )
        return dg.SensorResult(skip_reason=reason, cursor=found.cursor.to_json())
    if log is not None:
        again = f", {len(requested) - len(found.new) - len(found.changed)} requested again" if unapplied else ""
        log.info(
            f"{len(found.new)} new, {len(found.changed)} changed, {len(found.removed)} removed shard(s) under "
            f"{dataset.main.uri}{again}"
        )
        if found.removed:  # named: the operator needs to know which, not how many
            log.warning(f"removed from {dataset.main.uri} (partitions retired, outputs kept): {_named(found.removed)}")
        if found.changed:
            log.info(f"changed (to be rebuilt): {_named(found.changed)}")
    found.cursor.tick = max(position.tick, pending.get("tick", 0)) + 1
    # Kept first: whatever fails from here on, the next tick requests these shards again.
    pending_rels = requested if daemon_applies else []
    history.save_json(
        instance, PENDING_KEY.format(dataset=dataset.name), {"tick": found.cursor.tick, "rels": pending_rels}
    )
    record_discovery(instance, keys, found, main_events(keys, dataset.main, found, observe_threads))
    # New partitions were added in listing order, after the known ones: that is their order from now on.
    return dg.SensorResult(
        run_requests=shard_run_requests(dataset, requested, [*known, *found.new]), cursor=found.cursor.to_json()
    )


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
        # The shard assets, not the shard job: only a sensor that targets assets may request a backfill.
        # Its runs are therefore runs of Dagster's implicit asset job, tagged as the shard job's are.
        asset_selection=dg.AssetSelection.assets(*keys.shard_assets),
        minimum_interval_seconds=dataset.sensor.interval_seconds,
        default_status=status,
        description=(
            f"Lists {dataset.main.uri} every {dataset.sensor.interval_seconds} s: adds new shards as partitions of "
            f"{keys.partitions}, records new, changed and removed shards on {keys.main.to_user_string()}, and "
            "requests shard runs (or one backfill, for many) for the new and changed ones."
        ),
    )
    def _discover(context: dg.SensorEvaluationContext, sidecar: SidecarRuntime) -> dg.SensorResult:
        return discovery_tick(dataset, context.instance, context.cursor, sidecar.observe_threads, context.log)

    return _discover
