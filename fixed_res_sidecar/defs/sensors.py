"""Sensors: shard discovery per dataset, and the automation that gates `crop_bbox`.

Discovery (`<dataset>__discover_shards`, on the dataset's interval) lists the main prefix
page by page, adds only shards that are not partitions yet (in chunks of at most 10k keys),
records each new shard on `<dataset>/main` as a runless materialization (row count, bytes: the
UI then shows main's shards as present, and automation sees them as updated), and
requests one shard run per new shard. At most `sensor.max_new_shards_per_tick` new shards are
taken per tick; the cursor remembers where the listing stopped, so the next tick continues
there, and a listing that reached the end starts over (new shards can appear anywhere in key
order, e.g. a new date folder). 100,000 shards are therefore added over a few ticks, each
tick bounded in time and in storage writes.

Automation (`<dataset>__automation`, running by default): evaluates the assets'
automation conditions, so `crop_bbox` of a shard is built once both verifiers' blocking
checks passed for that shard, also when they pass in a later run.
"""

import json
from collections.abc import Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import dagster as dg
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.keys import DatasetKeys
from fixed_res_sidecar.defs.partitions import (
    add_requests,
    partition_key_problem,
    shard_partitions,
)
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.defs.run_resources import dataset_run_tags
from fixed_res_sidecar.io.locations import Location

LISTING_PAGE_SIZE = 1000
REFUSED_LOGGED = 20  # refused shard names written to the tick log, per tick
AUTOMATION_INTERVAL_SECONDS = 30


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
    refused: dict[str, str] = field(default_factory=dict)  # shard -> why it cannot be a partition
    examined: int = 0  # shards listed and compared this tick
    complete: bool = False  # the listing reached the end of the prefix
    cursor: ShardCursor = field(default_factory=ShardCursor)


def discover_shards(
    main: Location,
    known: Container[str],
    cursor: ShardCursor | None = None,
    max_new: int = 2000,
    page_size: int = LISTING_PAGE_SIZE,
) -> Discovery:
    """List `main` after the cursor, page by page, until `max_new` new shards were found.

    Shards already in `known` (the partitions) are passed over; paths that cannot be
    partition keys are refused with the reason. Listing order is key order on S3 and sorted
    order locally, so "after" is well defined for both.
    """
    cursor = cursor or ShardCursor()
    found = Discovery(cursor=ShardCursor(after=None, passes=cursor.passes))
    for page in main.iter_shard_pages(page_size=page_size, start_after=cursor.after):
        for rel in page:
            found.examined += 1
            if rel in known:
                continue
            problem = partition_key_problem(rel)
            if problem:
                found.refused[rel] = problem
                continue
            found.new.append(rel)
            if len(found.new) >= max_new:
                found.cursor.after = rel
                return found
    found.complete = True
    found.cursor.passes += 1
    return found


def observe_shards(main: Location, rels: list[str], threads: int = 16) -> dict[str, dict[str, dg.MetadataValue]]:
    """Per shard: its row count from the Parquet footer, and its bytes (footers read in parallel).

    A shard whose footer cannot be read is still observed, with the error; its shard run
    will fail with the full message.
    """

    def observe(rel: str) -> tuple[str, dict[str, dg.MetadataValue]]:
        metadata = {"uri": dg.MetadataValue.path(main.child(rel))}
        try:
            metadata["bytes"] = dg.MetadataValue.int(main.size(rel) or 0)
            metadata["dagster/row_count"] = dg.MetadataValue.int(main.parquet_file(rel).metadata.num_rows)
        except Exception as exc:  # noqa: BLE001 - unreadable: say so here, the shard run reports it in full
            metadata["error"] = dg.MetadataValue.text(describe_exception(exc, max_chars=500))
        return rel, metadata

    if not rels:
        return {}
    with ThreadPoolExecutor(max(1, min(threads, len(rels)))) as pool:
        return dict(pool.map(observe, rels))


def main_materializations(
    keys: DatasetKeys, main: Location, rels: list[str], threads: int = 16
) -> list[dg.AssetMaterialization]:
    """New shards of `<dataset>/main` as runless materializations (main is external), one per partition."""
    return [
        dg.AssetMaterialization(asset_key=keys.main, partition=rel, metadata=metadata)
        for rel, metadata in observe_shards(main, rels, threads).items()
    ]


def shard_run_requests(dataset: DatasetConfig, rels: list[str]) -> list[dg.RunRequest]:
    """Runs that resize, verify and crop `rels` (new partitions, in the order they were added), at most
    `shards_per_run` consecutive shards each: a run covers one range of partitions."""
    job, tags = DatasetKeys(dataset.name).shard_job, dataset_run_tags(dataset)
    requests = []
    for start in range(0, len(rels), dataset.shards_per_run):
        first, last = rels[start], rels[min(start + dataset.shards_per_run, len(rels)) - 1]
        if first == last:
            requests.append(dg.RunRequest(run_key=f"shard:{first}", partition_key=first, job_name=job, tags=tags))
        else:
            range_tags = {ASSET_PARTITION_RANGE_START_TAG: first, ASSET_PARTITION_RANGE_END_TAG: last}
            requests.append(dg.RunRequest(run_key=f"shards:{first}:{last}", job_name=job, tags={**tags, **range_tags}))
    return requests


def discovery_tick(
    dataset: DatasetConfig,
    known: Container[str],
    cursor: str | None,
    observe_threads: int = 16,
    log=None,
) -> dg.SensorResult:
    """Everything one discovery tick does, as a SensorResult (used by the sensor and the demo)."""
    keys = DatasetKeys(dataset.name)
    found = discover_shards(
        dataset.main, known, ShardCursor.parse(cursor), max_new=dataset.sensor.max_new_shards_per_tick
    )
    if found.refused and log is not None:
        for problem in list(found.refused.values())[:REFUSED_LOGGED]:
            log.error(problem)
        if len(found.refused) > REFUSED_LOGGED:
            log.error(f"... and {len(found.refused) - REFUSED_LOGGED} more shards refused as partition keys")
    if not found.new:
        where = "end of listing" if found.complete else f"stopped after {found.cursor.after!r}"
        refused = f"; {len(found.refused)} refused (see the tick log)" if found.refused else ""
        return dg.SensorResult(
            skip_reason=f"no new shards under {dataset.main.uri} ({found.examined} listed, {where}){refused}",
            cursor=found.cursor.to_json(),
        )
    if log is not None:
        log.info(f"{len(found.new)} new shard(s) under {dataset.main.uri}; first: {found.new[0]!r}")
    return dg.SensorResult(
        run_requests=shard_run_requests(dataset, found.new),
        dynamic_partitions_requests=add_requests(shard_partitions(keys), found.new),
        asset_events=main_materializations(keys, dataset.main, found.new, observe_threads),
        cursor=found.cursor.to_json(),
    )


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
            f"Lists {dataset.main.uri} every {dataset.sensor.interval_seconds} s, adds new shards as partitions "
            f"of {keys.partitions}, records them on {keys.main.to_user_string()} and requests a shard run for each."
        ),
    )
    def _discover(context: dg.SensorEvaluationContext, sidecar: SidecarRuntime) -> dg.SensorResult:
        known = set(context.instance.get_dynamic_partitions(keys.partitions))
        return discovery_tick(dataset, known, context.cursor, sidecar.observe_threads, context.log)

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
