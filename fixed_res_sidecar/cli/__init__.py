"""`sidecar-ops`: the command line. One module per command group registers its parsers."""

import argparse
import sys
from collections.abc import Sequence

from fixed_res_sidecar.cli import build, crop_bbox, demo, ui, verify


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar-ops", description="Fixed-area resized sidecars of a sharded Parquet image dataset."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (build, crop_bbox, verify, demo, ui):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
