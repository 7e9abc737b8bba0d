"""The fused pipeline: the project's real shard builder, Parquet in and Parquet out, both outputs from one decode."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks import corpus
from benchmarks.common import AREAS
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.pixels import process_image
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput, resized_output
from fixed_res_sidecar.shards.resize import ShardResult, build_resized_shard


def outputs(out: Path) -> list[ResizedOutput]:
    """One output dataset per resolution, in a folder under `out` named after its default audit prefix."""
    return [resized_output(name, Location.parse(out / r.audit_prefix)) for name, r in RESOLUTIONS.items()]


def build(main: Path, shard: str, out: Path, method: int, threads: int) -> ShardResult:
    layout = DatasetLayout(
        Location.parse(main),
        {o.resolution: o for o in outputs(out)},
        key_column=corpus.KEY_COLUMN,
        image_column=corpus.IMAGE_COLUMN,
    )
    return build_resized_shard(layout, shard, options=PixelOptions(webp_method=method), threads=threads)


def warm_up(data: bytes, method: int) -> None:
    process_image(data, AREAS, PixelOptions(webp_method=method))


def run(main: Path, shard: str, out: Path, method: int, threads: int) -> dict:
    """Build one shard; valid rows and output bytes are read back from the audit columns it wrote."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = build(main, shard, out, method, threads)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    totals, valid = [], []
    for output in outputs(out):
        prefix = output.audit_prefix
        table = pq.read_table(out / prefix / shard, columns=[f"{prefix}_valid", f"{prefix}_out_bytes"])
        valid.append(sum(table.column(0).to_pylist()))
        totals.append(sum(b or 0 for b in table.column(1).to_pylist()))
    return {"wall": wall, "cpu": cpu, "images": result.rows, "valid": min(valid), "bytes": totals}
