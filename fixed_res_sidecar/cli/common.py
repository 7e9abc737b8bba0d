"""What every `sidecar-ops` command does the same way."""

import argparse
import sys
from collections.abc import Callable, Iterable

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.pixel_settings import OUTPUT_FORMATS, SETTING_BOUNDS, PixelOptions
from fixed_res_sidecar.io.leftovers import Cleanup, remove_temp_dir_leftovers
from fixed_res_sidecar.io.locations import Location

SYMLINKS_LISTED = 20
STORAGE_FAILED = 3  # exit status: storage kept failing, nothing was decided about the data; rerun
LEFTOVERS_LISTED = 5


class UsageError(ValueError):
    """Bad configuration or arguments: refused before any work, exit status 2."""


def usage_error(message: object) -> int:
    print(f"sidecar-ops: error: {message}", file=sys.stderr)
    return 2


def storage_failed(problem: object) -> int:
    """Report storage that kept failing (after retries) or refused access; nothing was decided about
    the data, and the command can be rerun as it is once storage works."""
    print(f"sidecar-ops: storage failed (nothing was decided; rerun once it works): {problem}", file=sys.stderr)
    return STORAGE_FAILED


def main_shards(main: Location) -> list[str]:
    """The main dataset's shards; an empty dataset is a usage error, not a success."""
    shards = main.list_shards()
    if not shards:
        raise UsageError(f"no *.parquet shards under {main.uri}")
    return shards


def check_positive(**values: int) -> None:
    """Refuse `--name` options below 1."""
    for name, value in values.items():
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def bounded(setting: str) -> Callable[[str], int | float]:
    """An argparse `type` for the flag of a pixel setting: its value parsed and held to the setting's bound
    in the core (`SETTING_BOUNDS`), so the command line refuses, naming the flag, exactly what the
    pipeline and the datasets file refuse (exit status 2, before any work)."""
    bound = SETTING_BOUNDS[setting]

    def parse(text: str) -> int | float:
        try:
            value = int(text) if bound.integer else float(text)
        except ValueError:
            value = None
        if value is None or not bound.admits(value):
            raise argparse.ArgumentTypeError(f"must be {bound.description}, got {text!r}")
        return value

    parse.__name__ = setting  # what argparse names in its own messages
    return parse


def add_pixel_flags(parser, built: str = "") -> None:
    """The flags of every pixel setting (core/pixel_settings.PixelOptions), with the pipeline's defaults and
    bounds: what a build makes, and what a verifier expects the build to have made (`built`: the words
    after each help text saying so)."""
    defaults = PixelOptions()
    rules = {name: bound.description for name, bound in SETTING_BOUNDS.items()}
    parser.add_argument(
        "--patch-size", type=bounded("patch_size"), default=defaults.patch_size, help=rules["patch_size"] + built
    )
    parser.add_argument("--square", action="store_true", help="centred square crop (tw = th)" + built)
    parser.add_argument(
        "--output-format", default=defaults.output_format, choices=list(OUTPUT_FORMATS), help=built.strip(" ,;")
    )
    parser.add_argument("--quality", type=bounded("quality"), default=defaults.quality, help=rules["quality"] + built)
    parser.add_argument(
        "--webp-method",
        type=bounded("webp_method"),
        default=defaults.webp_method,
        help=f"WebP effort, {rules['webp_method']}{built}",
    )
    for setting in ("max_source_pixels", "max_aspect_ratio", "min_source_side"):
        flag = "--" + setting.replace("_", "-")
        parser.add_argument(
            flag, type=bounded(setting), default=getattr(defaults, setting), help=rules[setting] + built
        )
    parser.add_argument(
        "--background", default=None, help="composite transparency on R,G,B instead of keeping it" + built
    )


def pixel_options(args) -> PixelOptions:
    """The pixel settings the flags of `add_pixel_flags` give (ValueError: a usage error)."""
    background = None
    if args.background:
        try:
            background = tuple(int(v) for v in args.background.split(","))
        except ValueError:
            raise UsageError(f"--background must be R,G,B integers, got {args.background!r}") from None
    return PixelOptions.from_values({**vars(args), "background": background})


def symlink_report(main: Location) -> str:
    """Summary lines naming the symbolic links in a local main dataset, which are never followed."""
    links = main.skipped_symlinks()
    if not links:
        return ""
    lines = [
        f"skipped {len(links)} symbolic link(s) in the main dataset (a main dataset is what is stored under "
        "its folder; links are never followed, so their shards are not built):"
    ]
    lines += [f"  {rel} -> {target}" for rel, target in list(links.items())[:SYMLINKS_LISTED]]
    if len(links) > SYMLINKS_LISTED:
        lines.append(f"  ... and {len(links) - SYMLINKS_LISTED} more")
    return "\n".join(lines)


def clean_leftovers(outputs: Iterable[Location]) -> Cleanup:
    """Before a build: remove what interrupted runs left under its outputs and in TMPDIR (stderr says what).

    Never fails the command: what cannot be removed is a warning, and a later run tries again.
    """
    cleanup = Cleanup()
    for sweep in [remove_temp_dir_leftovers, *(output.remove_leftovers for output in outputs)]:
        try:
            cleanup.add(sweep())
        except Exception as exc:  # noqa: BLE001 - e.g. no permission to list incomplete uploads
            cleanup.problems.append(describe_exception(exc, max_chars=300))
    if cleanup.removed:
        shown = ", ".join(cleanup.removed[:LEFTOVERS_LISTED])
        more = f" and {len(cleanup.removed) - LEFTOVERS_LISTED} more" if len(cleanup.removed) > LEFTOVERS_LISTED else ""
        print(f"removed {len(cleanup.removed)} leftover(s) of interrupted runs: {shown}{more}", file=sys.stderr)
    for problem in cleanup.problems:
        print(f"warning: a leftover of an interrupted run was not removed: {problem}", file=sys.stderr)
    return cleanup
