"""Memory: peak RSS of the fused build of one large shard, in its own worker process."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from benchmarks import corpus as corpus_mod
from benchmarks.common import DEFAULT_METHOD, log
from benchmarks.report import TARGET_RSS_MB, machine_info
from benchmarks.workers import Pipeline, WorkerProcess


def run_memory(
    workdir: Path,
    gigabytes: float,
    threads: int,
    *,
    distinct: int = 8,
    row_group_rows: int = corpus_mod.MEMORY_ROW_GROUP_ROWS,
    specs=None,
) -> dict:
    distinct = len(specs) if specs is not None else distinct
    corpus = corpus_mod.ensure_memory_corpus(
        workdir, int(gigabytes * 1e9), distinct=distinct, row_group_rows=row_group_rows, specs=specs, log=log
    )
    pipeline = Pipeline(
        f"memory_fused_m{DEFAULT_METHOD}_t{threads}", "fused", DEFAULT_METHOD, threads, "fused build of one large shard"
    )
    log(f"memory: {corpus.images} rows, {corpus.source_bytes / 1e9:.2f} GB of JPEG in one shard, threads={threads}")
    worker = WorkerProcess(pipeline, corpus.main, workdir / "out" / pipeline.name)
    try:
        warm = worker.call(op="warmup")
        result = worker.call(op="run", shard=corpus.shards[0], sample_rss=True)
    finally:
        worker.close()
    timeline = result.pop("rss_timeline")
    step = max(1, len(timeline) // 40)
    metadata = pq.ParquetFile(corpus.main / corpus.shards[0]).metadata
    return {
        "mode": "memory",
        "machine": machine_info(),
        "rows": corpus.images,
        "row_groups": metadata.num_row_groups,
        "largest_row_group_mb": max(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
        / 1e6,
        "source_bytes": corpus.source_bytes,
        "distinct_images": [f"{s['width']}x{s['height']}" for s in corpus.manifest["specs"][:distinct]],
        "threads": threads,
        "webp_method": DEFAULT_METHOD,
        "valid": result["valid"],
        "wall_s": result["wall"],
        "images_per_s": result["images"] / result["wall"],
        "baseline_rss_mb": warm["rss_mb"],
        "peak_rss_mb": worker.child_maxrss_mb,
        "peak_rss_mb_self_reported": result["maxrss_mb"],
        "target_mb": TARGET_RSS_MB,
        "met": worker.child_maxrss_mb < TARGET_RSS_MB,
        "rss_timeline": timeline[::step],
    }


def print_memory(report: dict) -> None:
    print(
        f"\n## Memory ({report['source_bytes'] / 1e9:.2f} GB shard, {report['rows']} rows in {report['row_groups']} row groups "
        f"of up to {report['largest_row_group_mb']:.0f} MB, threads={report['threads']})\n"
    )
    print(
        f"peak RSS {report['peak_rss_mb']:.0f} MB (process after imports and warm-up: {report['baseline_rss_mb']:.0f} MB), "
        f"target < {report['target_mb']} MB: {'met' if report['met'] else 'MISSED'}; {report['valid']}/{report['rows']} valid, "
        f"{report['wall_s']:.0f} s, {report['images_per_s']:.2f} img/s"
    )
    print("RSS timeline (s, MB): " + ", ".join(f"{t:.0f}:{r:.0f}" for t, r in report["rss_timeline"]))
