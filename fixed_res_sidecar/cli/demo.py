"""`sidecar-ops demo`: build the whole Dagster graph for a local sample dataset, then summarise.

Dagster is imported only when the command runs, so the other commands start fast.
"""

import argparse

from fixed_res_sidecar.cli.common import usage_error
from fixed_res_sidecar.sample_data import DEFAULT_SHARDS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the Dagster pipeline end to end on a local sample dataset",
        description=(
            "Create a sample main dataset under the work dir, register its shards as Dagster partitions on a "
            "local persistent instance (DAGSTER_HOME, default <workdir>/dagster_home), materialise resize, "
            "verify and crop_bbox for every shard through Dagster, and print a summary. Running it again "
            "skips finished work."
        ),
    )
    parser.add_argument(
        "--workdir",
        default="sidecar-demo",
        help="where the sample data, outputs and Dagster home go (default: ./sidecar-demo)",
    )
    parser.add_argument(
        "--shards", type=int, default=len(DEFAULT_SHARDS), help="shards in a newly written sample dataset"
    )
    parser.add_argument(
        "--rows-per-shard", type=int, default=12, help="rows per shard in a newly written sample dataset"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.shards < 1 or args.rows_per_shard < 1:
        return usage_error("--shards and --rows-per-shard must be at least 1")
    from fixed_res_sidecar import demo
    from fixed_res_sidecar.defs.config import ConfigError

    try:
        return demo.main(args.workdir, args.shards, args.rows_per_shard)
    except ConfigError as exc:
        return usage_error(exc)
