"""`sidecar-ops`: the command line. One module per command group registers its parsers."""

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from fixed_res_sidecar.cli import build, crop_bbox, demo, ui, verify
from fixed_res_sidecar.shards.runner import EXIT_TERMINATED, raise_terminated

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar-ops", description="Fixed-area resized sidecars of a sharded Parquet image dataset."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (build, crop_bbox, verify, demo, ui):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Ctrl-C exits 130 and SIGTERM 143, after workers are stopped and temporaries removed."""
    args = make_parser().parse_args(argv)
    with _sigterm_interrupts() as sigterm:
        try:
            return args.func(args)
        except KeyboardInterrupt:  # Terminated too, which some libraries (Ray) re-raise as a plain KeyboardInterrupt
            if sigterm:
                print("terminated (SIGTERM)", file=sys.stderr)
                return EXIT_TERMINATED
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[list[int]]:
    """SIGTERM raises Terminated, as SIGINT raises KeyboardInterrupt; yields the signals received
    (only the main thread can set handlers)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame) -> None:
        received.append(signum)
        raise_terminated(signum, frame)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
