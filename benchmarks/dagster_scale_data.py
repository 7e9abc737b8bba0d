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

from fixed_res_sidecar.defs.config import DEFAULT_SHARDS_PER_RUN
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


def dataset_entries(
    root: Path, shards_per_run: int, per_tick: int, metadata_per_tick: int, automation: dict
) -> list[dict]:
    """The datasets file's entries: `scale` (built in the run measurements) and `meta` (metadata only).

    Both sensors start stopped: the benchmark turns each on in turn (as the UI toggle does), so the
    two discoveries are timed apart.
    """
    common = {
        "output_root": str(root / "out"),
        "threads_per_shard": 1,
        "overlay_sample": 1,
        "automation": automation,
    }
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
            # The default batch size: discovery's backfills and the big backfill create runs as users' would
            # (held in the queue, never launched).
            "shards_per_run": DEFAULT_SHARDS_PER_RUN,
            "sensor": {
                "interval_seconds": 5,
                "default_status": "stopped",
                "max_new_shards_per_tick": metadata_per_tick,
            },
            **common,
        },
    ]
