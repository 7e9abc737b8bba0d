"""The datasets of the Dagster scale benchmark: many shards, made in seconds.

Only the partition count is large. Every shard of a dataset is a hard link to one small Parquet
file, so 100,000 shards take seconds and no space: the discovery sensor lists them and reads
their footers, the shard runs build them (tiny pictures, so a shard's own work is small and
the orchestration's share is what the benchmark sees).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.defs.config import DatasetConfig
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.partitions import chunks
from fixed_res_sidecar.defs.sensors import Discovery, main_events
from fixed_res_sidecar.sample_data import sample_shard_table

SHARDS_PER_FOLDER = 1000
TINY_SIZES = ((96, 64), (64, 96))  # pictures of the built dataset; outputs are still 512- and 1024-area


def shard_names(count: int) -> list[str]:
    """`000/part-000000.parquet`, ...: listing order (sorted) is index order, so consecutive partitions
    (the order discovery adds them) are consecutive indices and a backfill of a block is one range."""
    return [f"{i // SHARDS_PER_FOLDER:03d}/part-{i:06d}.parquet" for i in range(count)]


def write_linked_dataset(root: Path, count: int, table: pa.Table) -> list[str]:
    """`count` shards under `root` holding `table`: the first shard of each folder is a copy of one
    Parquet file, the others hard links to it (a file takes at most ~65,000 links on ext4)."""
    names = shard_names(count)
    root.mkdir(parents=True, exist_ok=True)
    source = root.parent / f".{root.name}-source.parquet"  # outside the dataset: not a shard itself
    pq.write_table(table, source, row_group_size=4)
    first_in_folder: dict[str, Path] = {}
    for name in names:
        folder = name.split("/")[0]
        path = root / name
        if folder not in first_in_folder:
            path.parent.mkdir(exist_ok=True)
            shutil.copyfile(source, path)
            first_in_folder[folder] = path
        else:
            os.link(first_in_folder[folder], path)
    source.unlink()
    return names


def built_shard_table(rows: int) -> pa.Table:
    """A real main shard (photo-like JPEGs with captions and boxes), with small pictures."""
    return sample_shard_table(0, rows, sizes=TINY_SIZES, bad_rows=False)


def metadata_shard_table() -> pa.Table:
    """A valid but minimal shard for the metadata-only dataset: discovery reads footers, never images."""
    return pa.table({"image_key": ["k0", "k1"], "image": pa.array([None, None], pa.binary())})


def dataset_entries(root: Path, shards_per_run: int, per_tick: int, metadata_per_tick: int) -> list[dict]:
    """The datasets file's entries: `scale` (built in the run measurements) and `meta` (metadata only).

    Both sensors start stopped: the benchmark turns each on in turn (as the UI toggle does), so the
    two discoveries are timed apart.
    """
    common = {"output_root": str(root / "out"), "threads_per_shard": 1, "overlay_sample": 1}
    return [
        {
            "name": "scale",
            "main_prefix": str(root / "main" / "scale"),
            "shards_per_run": shards_per_run,
            "sensor": {"interval_seconds": 5, "default_status": "stopped", "max_new_shards_per_tick": per_tick},
            **common,
        },
        {
            "name": "meta",
            "main_prefix": str(root / "main" / "meta"),
            # Discovery requests runs of every new shard; few large ones here, never launched.
            "shards_per_run": 1000,
            "sensor": {
                "interval_seconds": 5,
                "default_status": "stopped",
                "max_new_shards_per_tick": metadata_per_tick,
            },
            **common,
        },
    ]


def register_in_bulk(instance, dataset: DatasetConfig, rels: list[str], chunk: int = 1000) -> None:
    """What the discovery sensor records for `rels` (partitions, and main's runless materialization of each
    shard with the same metadata), written in bulk: the partitions in chunks, the events as batch inserts.

    The sensor's own path (one event write and one partition lookup per shard, in the daemon) is measured
    on the last shards; this stands in for it on the others, which would take hours at 100,000 shards.
    """
    from dagster._core.events import DagsterEvent, DagsterEventType, StepMaterializationData
    from dagster._core.events.log import EventLogEntry
    from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID
    from dagster._time import get_current_timestamp

    keys = DatasetKeys(dataset.name)
    for part in chunks(rels, chunk):
        instance.add_dynamic_partitions(keys.partitions, part)
        entries = [
            EventLogEntry(
                user_message="",
                level="INFO",
                job_name=RUNLESS_JOB_NAME,
                run_id=RUNLESS_RUN_ID,
                error_info=None,
                timestamp=get_current_timestamp(),
                dagster_event=DagsterEvent(
                    event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
                    event_specific_data=StepMaterializationData(event),
                    job_name=RUNLESS_JOB_NAME,
                ),
            )
            for event in main_events(keys, dataset.main, Discovery(new=part))
        ]
        instance.event_log_storage.store_event_batch(entries)
