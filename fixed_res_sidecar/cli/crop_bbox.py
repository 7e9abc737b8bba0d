"""`sidecar-ops build-crop-bbox`: the crop-bbox sidecar of every shard of a main dataset (SPEC 6).

SPEC 7 gate: a shard's sidecar is built only after both of its resized shards pass the
verifier (`verify_resized_shard`, with `--verify-sample` images decoded per resolution);
otherwise that shard fails, naming the failed checks, and the others go on. A shard whose
storage kept failing (after retries) fails naming the object it could not read, not the gate.
"""

import argparse
import functools
import sys
from collections import Counter

from fixed_res_sidecar.cli.common import (
    add_pixel_flags,
    check_positive,
    clean_leftovers,
    main_shards,
    pixel_options,
    storage_failed,
    symlink_report,
    usage_error,
)
from fixed_res_sidecar.core.bbox import CAPTION_FRAMES, DEFAULT_BBOX_KEYS
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar.shards.crop_bbox import CropBboxResult, build_crop_bbox_shard
from fixed_res_sidecar.shards.layout import DatasetLayout, resized_output
from fixed_res_sidecar.shards.runner import Progress, RunSummary, run_shards
from fixed_res_sidecar.shards.settings import SOURCES
from fixed_res_sidecar.shards.verify import VerifyOptions, require_verified


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "build-crop-bbox",
        help="move caption boxes into the 512 and 1024 crop frames (the crop-bbox sidecar)",
        description=(
            "Read the captions of the main dataset (or of --caption-prefix) and the audit columns of both "
            "resized datasets, and write structured_description_crop_512, structured_description_crop_1024 "
            "and bbox_resize_meta per shard. A shard is built only when both its resized shards pass the "
            "verifier (rows, keys, audit, the build settings, and --verify-sample decoded images each)."
        ),
    )
    parser.add_argument("--main-prefix", required=True, help="the main dataset (read only): a folder or s3:// URI")
    parser.add_argument("--resized-512-prefix", required=True, help="the 0.26 MP resized dataset")
    parser.add_argument("--resized-1024-prefix", required=True, help="the 1.05 MP resized dataset")
    parser.add_argument("--output-prefix", required=True, help="where the sidecar dataset goes")
    parser.add_argument("--key-column", required=True, help="the key column, e.g. image_key")
    parser.add_argument("--caption-column", default="structured_description")
    parser.add_argument(
        "--caption-prefix", default=None, help="a caption dataset with the main's layout and keys (default: the main)"
    )
    parser.add_argument("--audit-prefix-512", default=RESOLUTIONS["512"].audit_prefix)
    parser.add_argument("--audit-prefix-1024", default=RESOLUTIONS["1024"].audit_prefix)
    parser.add_argument(
        "--bbox-key",
        dest="bbox_keys",
        action="append",
        default=None,
        metavar="KEY",
        help=(
            "a JSON key whose value is a box or a list of boxes; repeat for several "
            f"(default: {', '.join(DEFAULT_BBOX_KEYS)})"
        ),
    )
    parser.add_argument(
        "--caption-frame",
        choices=CAPTION_FRAMES,
        default="oriented",
        help="frame of the caption boxes: as displayed (oriented), or the stored pixels before EXIF rotation (raw)",
    )
    parser.add_argument("--skip-existing", action="store_true", help="skip shards already built with these settings")
    parser.add_argument("--threads", type=int, default=4, help="shards processed at once")
    gate = parser.add_argument_group("verifier gate", "how the resized shards are checked before a shard is built")
    gate.add_argument(
        "--verify-sample",
        type=int,
        default=32,
        metavar="N",
        help="images decoded per resized shard (default: 32; 0: rows, keys and audit only)",
    )
    gate.add_argument("--image-column", default="image", help="the resized datasets' image column")
    add_pixel_flags(gate, built=", as the resized datasets were built")
    parser.set_defaults(func=run)


def sidecar_layout(args: argparse.Namespace, sidecar_prefix: str) -> DatasetLayout:
    """The layout `build-crop-bbox` and `verify-crop-bbox` read their options into; its locations checked."""
    layout = DatasetLayout(
        Location.parse(args.main_prefix),
        {
            "512": resized_output("512", args.resized_512_prefix, args.audit_prefix_512),
            "1024": resized_output("1024", args.resized_1024_prefix, args.audit_prefix_1024),
        },
        sidecar=Location.parse(sidecar_prefix),
        captions=Location.parse(args.caption_prefix) if args.caption_prefix else None,
        key_column=args.key_column,
        image_column=args.image_column,
        caption_column=args.caption_column,
        bbox_keys=tuple(args.bbox_keys) if args.bbox_keys else None,
        caption_frame=args.caption_frame,
    )
    layout.check_locations()
    return layout


def run(args: argparse.Namespace) -> int:
    """Build every shard; 0 when all succeeded, 1 when any failed, 2 on bad configuration."""
    # Configuration is checked before any shard is touched.
    try:
        check_positive(threads=args.threads)
        if args.verify_sample < 0:
            raise ValueError("--verify-sample must be at least 0")
        layout = sidecar_layout(args, args.output_prefix)
        pixels = pixel_options(args)
        shards = main_shards(layout.main)
    except (ValueError, LocationError) as exc:
        return usage_error(exc)
    except StorageError as exc:
        return storage_failed(exc)

    verify_options = VerifyOptions(pixels=pixels, sample=args.verify_sample)
    gate = functools.partial(require_verified, layout, options=verify_options)
    job = functools.partial(build_crop_bbox_shard, layout, skip_existing=args.skip_existing, gate=gate)
    print(f"{len(shards)} shards under {layout.main.uri} -> {layout.sidecar_location().uri}", file=sys.stderr)
    clean_leftovers([layout.sidecar_location()])
    summary = run_shards(job, shards, workers=args.threads, threads=True, progress=Progress(len(shards)))
    print(format_summary(summary))
    if links := symlink_report(layout.main):
        print(links)
    return 0 if summary.ok else 1


def format_summary(summary: RunSummary) -> str:
    results: list[CropBboxResult] = list(summary.results.values())
    built = [r for r in results if r.built]
    lines = [
        f"crop-bbox shards: {len(results) + len(summary.failures)} total, {len(built)} built, "
        f"{len(results) - len(built)} skipped, {len(summary.failures)} failed "
        f"({sum(r.rows for r in results)} rows in {summary.seconds:.1f} s)"
    ]
    if built:
        captions = {status: sum(r.counts["captions"][status] for r in built) for status in built[0].counts["captions"]}
        lines.append("  captions (built shards): " + ", ".join(f"{status} {n}" for status, n in captions.items()))
        for name in RESOLUTIONS:
            totals = {field: sum(r.counts[name][field] for r in built) for field in built[0].counts[name]}
            lines.append(f"  {name} (built shards): " + ", ".join(f"{field} {n}" for field, n in totals.items()))
    # A sidecar shard's sources are its main (or caption) shard and both resized shards.
    reasons = Counter("sources changed" if r.reason == SOURCES else r.reason for r in built if r.reason)
    if reasons:  # with --skip-existing: why shards that existed were built again
        lines.append("  rebuilt shards: " + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items())))
    lines.append(f"  rebuilt because their sources changed: {reasons['sources changed']} shard(s)")
    for rel, reason in sorted(summary.failures.items()):
        lines.append(f"  FAILED {rel}: {reason}")
    return "\n".join(lines)
