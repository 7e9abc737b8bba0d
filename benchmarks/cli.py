"""Benchmark of the fused 512 + 1024 build against a naive pipeline and the decode+encode floor.

    python -m benchmarks [--images N] [--workdir D] [--threads 2] [--json out.json]
    python -m benchmarks --webp-methods      # time / bytes / PSNR per WebP method 0..6
    python -m benchmarks --memory            # peak RSS of one ~2 GB shard with 4 threads
    python -m benchmarks --cprofile          # CPU profile of the fused build of one shard
    python -m benchmarks --dagster-scale     # Dagster at 10k/100k partitions on Postgres (~13 min)
    python -m benchmarks --fidelity          # fidelity scores of good and damaged outputs; verifier cost
    python -m benchmarks --storage-pool      # Dagster's storage calls to PostgreSQL, direct and via PgBouncer

Run from the repository root. Without a mode option it runs the comparison; --compare adds
it to the other modes. Each mode lives in its own module (compare, webp_methods, memory,
profiling, dagster_scale, fidelity, storage_pool): a new mode adds its module and its option
here. benchmarks/README.md explains the figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import corpus
from benchmarks.common import DEFAULT_METHOD, DEFAULT_WORKDIR
from benchmarks.compare import run_compare
from benchmarks.dagster_scale import ScaleOptions, run_dagster_scale
from benchmarks.dagster_scale_metrics import print_dagster_scale
from benchmarks.fidelity import print_fidelity, run_fidelity
from benchmarks.memory import print_memory, run_memory
from benchmarks.naive_venv import NAIVE_PILLOW_VERSION, NAIVE_VENV_NAME, naive_runtime
from benchmarks.profiling import run_cprofile
from benchmarks.report import print_compare
from benchmarks.storage_pool import print_storage_pool, run_storage_pool
from benchmarks.webp_methods import print_webp_methods, run_webp_methods


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--images", type=int, default=120, help="corpus size (default 120: about 3 minutes on 2 cores)")
    parser.add_argument("--shards", type=int, default=6, help="corpus shards; pipelines are interleaved per shard")
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help=f"corpus cache and outputs (default {DEFAULT_WORKDIR})"
    )
    parser.add_argument("--threads", type=int, default=2, help="threads for the multi-threaded fused build (default 2)")
    parser.add_argument("--json", type=Path, help="also write the full report as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--style", choices=("textured", "sample"), default="textured", help="corpus content (see corpus.py)"
    )
    parser.add_argument("--profile", choices=("photo", "tiny"), default="photo", help=argparse.SUPPRESS)
    parser.add_argument(
        "--naive-on-installed-pil",
        action="store_true",
        help="run the naive baseline on the installed PIL (pillow-simd here) instead of Pillow 13 in its venv",
    )
    parser.add_argument(
        "--naive-venv",
        type=Path,
        help=f"virtual environment for the naive baseline (default WORKDIR/{NAIVE_VENV_NAME}; created with "
        f"pillow=={NAIVE_PILLOW_VERSION} when missing)",
    )
    parser.add_argument(
        "--naive-venv-no-create", action="store_true", help="fail instead of creating (downloading) the naive venv"
    )
    parser.add_argument(
        "--compare", action="store_true", help="run the comparison too when --webp-methods/--memory is given"
    )
    parser.add_argument("--webp-methods", action="store_true", help="time, bytes and PSNR per WebP method")
    parser.add_argument("--methods", default="0,1,2,3,4,5,6", help="methods for --webp-methods (default 0..6)")
    parser.add_argument("--webp-images", type=int, help="use only the first N corpus images for --webp-methods")
    parser.add_argument("--memory", action="store_true", help="peak RSS of a fused build of one ~2 GB shard")
    parser.add_argument("--memory-gb", type=float, default=2.0)
    parser.add_argument("--memory-threads", type=int, default=4)
    parser.add_argument(
        "--memory-row-group-rows",
        type=int,
        default=corpus.MEMORY_ROW_GROUP_ROWS,
        help="rows per row group of the memory shard (default 32, ~230 MB; 100 = Hugging Face's layout, ~720 MB here)",
    )
    parser.add_argument(
        "--cprofile", action="store_true", help="print a cProfile of the fused build of the first shard"
    )
    parser.add_argument(
        "--fidelity",
        action="store_true",
        help="fidelity score distributions and the verifier's cost with and without it",
    )
    parser.add_argument("--fidelity-rows", type=int, default=64, help="rows of the --fidelity cost shard (default 64)")
    parser.add_argument("--fidelity-quick", action="store_true", help=argparse.SUPPRESS)  # the smoke test
    parser.add_argument(
        "--storage-pool",
        action="store_true",
        help="machine CPU of Dagster's storage calls straight to PostgreSQL and through PgBouncer",
    )
    parser.add_argument("--storage-calls", type=int, default=800, help="calls per round of --storage-pool")
    parser.add_argument("--storage-rounds", type=int, default=3, help="rounds per path of --storage-pool")
    scale = parser.add_argument_group("--dagster-scale (see benchmarks/README.md, 'Dagster scale')")
    scale.add_argument(
        "--dagster-scale", action="store_true", help="Dagster on Postgres with a live daemon at many partitions"
    )
    defaults = ScaleOptions()
    scale.add_argument("--partitions", type=int, default=defaults.partitions, help="shards of the built dataset")
    scale.add_argument(
        "--metadata-partitions", type=int, default=defaults.metadata_partitions, help="shards of the metadata-only one"
    )
    scale.add_argument("--sample-shards", type=int, default=defaults.sample_shards, help="shards built per batch size")
    scale.add_argument(
        "--batch-sizes",
        default=",".join(map(str, defaults.batch_sizes)),
        help="shards_per_run values to measure (default %(default)s)",
    )
    scale.add_argument("--shard-rows", type=int, default=defaults.rows, help="rows per built shard")
    scale.add_argument(
        "--shards-per-tick", type=int, default=defaults.per_tick, help="discovery's max new shards per tick (built)"
    )
    scale.add_argument(
        "--metadata-shards-per-tick",
        type=int,
        default=defaults.metadata_per_tick,
        help="discovery's max new shards per tick (metadata-only dataset)",
    )
    scale.add_argument(
        "--automation-ticks",
        type=int,
        default=defaults.automation_ticks,
        help="automation sensor ticks measured after each discovery",
    )
    scale.add_argument(
        "--backfill-loop-seconds",
        type=int,
        default=defaults.backfill_loop_seconds,
        help="the backfill daemon's loop (default: Dagster's fixed 30 s; shorter for a quick run only: "
        "a backfill's first runs wait for it)",
    )
    scale.add_argument(
        "--automation-interval",
        type=int,
        default=defaults.automation_interval_seconds,
        help="the datasets' automation.interval_seconds (default %(default)s)",
    )
    return parser.parse_args(argv)


def scale_options(args: argparse.Namespace) -> ScaleOptions:
    return ScaleOptions(
        partitions=args.partitions,
        metadata_partitions=args.metadata_partitions,
        sample_shards=args.sample_shards,
        batch_sizes=tuple(int(size) for size in args.batch_sizes.split(",")),
        rows=args.shard_rows,
        per_tick=args.shards_per_tick,
        metadata_per_tick=args.metadata_shards_per_tick,
        automation_ticks=args.automation_ticks,
        backfill_loop_seconds=args.backfill_loop_seconds,
        automation_interval_seconds=args.automation_interval,
    )


def main(argv: list[str] | None = None) -> dict:
    """Runs the selected modes, prints their tables and returns the report (one entry per mode)."""
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    common = {"seed": args.seed, "profile": args.profile, "style": args.style}
    report: dict[str, Any] = {}
    modes = (args.webp_methods, args.memory, args.cprofile, args.dagster_scale, args.fidelity, args.storage_pool)
    if args.compare or not any(modes):
        naive = naive_runtime(
            args.workdir,
            on_installed_pil=args.naive_on_installed_pil,
            venv=args.naive_venv,
            create=not args.naive_venv_no_create,
        )
        report["compare"] = run_compare(args.workdir, args.images, args.shards, args.threads, naive=naive, **common)
        print_compare(report["compare"])
    if args.webp_methods:
        methods = tuple(int(m) for m in args.methods.split(","))
        report["webp_methods"] = run_webp_methods(
            args.workdir, args.images, args.shards, methods, limit=args.webp_images, **common
        )
        print_webp_methods(report["webp_methods"])
    if args.memory:
        specs = corpus.corpus_specs(3, args.seed, "tiny") if args.profile == "tiny" else None
        report["memory"] = run_memory(
            args.workdir, args.memory_gb, args.memory_threads, row_group_rows=args.memory_row_group_rows, specs=specs
        )
        print_memory(report["memory"])
    if args.cprofile:
        print(run_cprofile(args.workdir, args.images, args.shards, DEFAULT_METHOD, **common))
    if args.dagster_scale:
        report["dagster_scale"] = run_dagster_scale(args.workdir, scale_options(args))
        print_dagster_scale(report["dagster_scale"])
    if args.fidelity:
        report["fidelity"] = run_fidelity(
            args.workdir, args.fidelity_rows, quick=args.fidelity_quick, seed=args.seed, profile=args.profile
        )
        print_fidelity(report["fidelity"])
    if args.storage_pool:
        report["storage_pool"] = run_storage_pool(args.storage_calls, args.storage_rounds)
        print_storage_pool(report["storage_pool"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return report
