"""`sidecar-ops verify-resized | verify-crop-bbox`: the SPEC 7 checks over a whole dataset.

Both print a short summary (counts, a few invalid examples, every failed check with its
shard) and exit 0 only when every check on every shard passed. `--report FILE` writes
the full JSON: per-shard reports and the dataset summary.
"""

import json
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fixed_res_sidecar.cli.common import main_shards, symlink_report, usage_error
from fixed_res_sidecar.core.bbox import CAPTION_FRAMES
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import (
    Location,
    LocationError,
    check_output_location,
)
from fixed_res_sidecar.shards.verify import (
    ShardReport,
    dataset_summary,
    default_target_area,
    verify_crop_bbox_shard,
    verify_resized_shard,
)

EXAMPLES_SHOWN = 5  # invalid rows printed in the summary; the JSON report keeps up to 20 per shard


def add_parser(subparsers) -> None:
    resized = subparsers.add_parser(
        "verify-resized",
        help="check a resized dataset against its main dataset (SPEC 7)",
        description="Check every shard of a resized dataset: rows, keys, sampled images, audit.",
    )
    resized.add_argument("--main-prefix", required=True, help="the main dataset: a folder or s3:// URI")
    resized.add_argument("--output-prefix", required=True, help="the resized dataset to check")
    resized.add_argument("--key-column", required=True)
    prefixes = " or ".join(r.audit_prefix for r in RESOLUTIONS.values())
    areas = ", ".join(f"{r.audit_prefix}: {r.area}" for r in RESOLUTIONS.values())
    resized.add_argument("--audit-prefix", required=True, help=f"e.g. {prefixes}")
    resized.add_argument("--image-column", default="image")
    resized.add_argument(
        "--target-area", type=int, default=None, help=f"pixel area; defaults from the audit prefix ({areas})"
    )
    resized.add_argument("--patch-size", type=int, default=32)
    resized.add_argument("--square", action="store_true", help="the dataset was built with --square")
    resized.add_argument("--sample", type=int, default=32, help="images decoded per shard")
    _add_common(resized)
    resized.set_defaults(func=run_verify_resized)

    crop = subparsers.add_parser(
        "verify-crop-bbox",
        help="check a crop-bbox sidecar against main and both resized datasets (SPEC 7)",
        description="Check every shard of a crop-bbox sidecar and draw overlay pictures of sampled rows.",
    )
    crop.add_argument("--main-prefix", required=True)
    crop.add_argument("--resized-512-prefix", required=True)
    crop.add_argument("--resized-1024-prefix", required=True)
    crop.add_argument("--sidecar-prefix", required=True)
    crop.add_argument("--key-column", required=True)
    crop.add_argument("--image-column", default="image")
    crop.add_argument("--caption-column", default="structured_description")
    crop.add_argument("--caption-prefix", default=None, help="caption dataset, when captions are not in main")
    crop.add_argument(
        "--caption-frame", choices=CAPTION_FRAMES, default=None,
        help="frame of the caption boxes (default: as recorded in the sidecar's build settings)",
    )
    crop.add_argument(
        "--bbox-key", dest="bbox_keys", action="append", default=None, metavar="KEY",
        help="a JSON key whose value is a box or a list of boxes; repeat for several "
        "(default: as recorded in the sidecar's build settings)",
    )
    crop.add_argument("--audit-prefix-512", default=RESOLUTIONS["512"].audit_prefix)
    crop.add_argument("--audit-prefix-1024", default=RESOLUTIONS["1024"].audit_prefix)
    crop.add_argument("--overlay-dir", default=None, help="write overlay PNGs of sampled rows here")
    crop.add_argument("--overlay-sample", type=int, default=4, help="overlay pictures per shard")
    _add_common(crop)
    crop.set_defaults(func=run_verify_crop_bbox)


def _add_common(parser) -> None:
    parser.add_argument("--report", default=None, help="write the full JSON report here (local path or s3:// URI)")
    parser.add_argument("--shard", action="append", default=None, help="check only this shard (repeatable)")
    parser.add_argument("--threads", type=int, default=4, help="shards checked at once")


def run_verify_resized(args) -> int:
    try:
        main = Location.parse(args.main_prefix)
        output = Location.parse(args.output_prefix)
        check_output_location(main, output)
        area = args.target_area if args.target_area is not None else default_target_area(args.audit_prefix)
        _check_positive(patch_size=args.patch_size, sample=args.sample, threads=args.threads, target_area=area)
        _check_report_path(args.report, main)
        shards = _shards(main, args.shard)
    except (ValueError, LocationError) as exc:
        return usage_error(exc)

    def verify_one(rel: str) -> ShardReport:
        return verify_resized_shard(
            main, rel, output,
            key_column=args.key_column,
            image_column=args.image_column,
            audit_prefix=args.audit_prefix,
            target_area=area,
            patch_size=args.patch_size,
            sample=args.sample,
            square=args.square,
        )

    reports = _run_all(shards, verify_one, args.threads)
    resolution = reports[0].resolution if reports else str(area)
    summary = dataset_summary(main, {resolution: output})
    header = f"verify-resized {output.uri} (area {area}, audit {args.audit_prefix}) against {main.uri}"
    return _finish("verify-resized", header, reports, summary, args.report, main)


def run_verify_crop_bbox(args) -> int:
    try:
        main = Location.parse(args.main_prefix)
        resized_512 = Location.parse(args.resized_512_prefix)
        resized_1024 = Location.parse(args.resized_1024_prefix)
        sidecar = Location.parse(args.sidecar_prefix)
        captions = Location.parse(args.caption_prefix) if args.caption_prefix else None
        overlay_dir = Location.parse(args.overlay_dir) if args.overlay_dir else None
        written_or_read = {"resized 512": resized_512, "resized 1024": resized_1024, "sidecar": sidecar}
        if overlay_dir is not None:
            written_or_read["overlay"] = overlay_dir
        for name, location in written_or_read.items():
            check_output_location(main, location, name)
        _check_positive(overlay_sample=args.overlay_sample, threads=args.threads)
        _check_report_path(args.report, main)
        shards = _shards(main, args.shard)
    except (ValueError, LocationError) as exc:
        return usage_error(exc)

    def verify_one(rel: str) -> ShardReport:
        return verify_crop_bbox_shard(
            main, rel, resized_512, resized_1024, sidecar,
            key_column=args.key_column,
            audit_prefix_512=args.audit_prefix_512,
            audit_prefix_1024=args.audit_prefix_1024,
            image_column=args.image_column,
            caption_column=args.caption_column,
            caption_location=captions,
            bbox_keys=args.bbox_keys,
            caption_frame=args.caption_frame,
            overlay_dir=overlay_dir,
            overlay_sample=args.overlay_sample,
        )

    reports = _run_all(shards, verify_one, args.threads)
    summary = dataset_summary(main, {"512": resized_512, "1024": resized_1024, "sidecar": sidecar})
    header = f"verify-crop-bbox {sidecar.uri} against {main.uri}"
    if overlay_dir is not None:
        count = sum(len(r.stats.get("overlays", [])) for r in reports)
        header += f"\noverlays: {count} picture(s) under {overlay_dir.uri}"
    return _finish("verify-crop-bbox", header, reports, summary, args.report, main)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _check_report_path(path: str | None, main: Location) -> None:
    if path and Location.parse(path).overlaps(main):
        raise ValueError(f"--report {path} is inside the main dataset {main.uri}, which is read-only")


def _shards(main: Location, selected: Sequence[str] | None) -> list[str]:
    shards = main_shards(main)
    if selected:
        wanted = set(selected)
        unknown = sorted(wanted.difference(shards))
        if unknown:
            raise ValueError(f"not shards of {main.uri}: {unknown}")
        shards = [rel for rel in shards if rel in wanted]
    return shards


def _run_all(shards: list[str], verify_one: Callable[[str], ShardReport], threads: int) -> list[ShardReport]:
    # Checking is mostly waiting on storage and decoding (which releases the GIL): threads suffice.
    if threads == 1 or len(shards) == 1:
        return [verify_one(rel) for rel in shards]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(verify_one, shards))


def _finish(
    command: str,
    header: str,
    reports: list[ShardReport],
    summary: dict[str, Any],
    report_path: str | None,
    main: Location,
) -> int:
    passed = all(r.passed for r in reports)
    print(header)
    _print_summary(reports, summary)
    if links := symlink_report(main):
        print(links)
    if report_path:
        document = {
            "command": command,
            "passed": passed,
            "shards": [r.to_dict() for r in reports],
            "dataset": summary,
        }
        try:
            _write_text(report_path, json.dumps(document, indent=2, sort_keys=False), protect=[main])
        except (OSError, ValueError) as exc:
            return usage_error(f"could not write the report {report_path}: {exc}")
        print(f"report: {report_path}")
    print("PASSED" if passed else "FAILED")
    return 0 if passed else 1


def _print_summary(reports: list[ShardReport], summary: dict[str, Any]) -> None:
    failed = [r for r in reports if not r.passed]
    rows = sum(r.rows or 0 for r in reports)
    print(f"shards: {len(reports)} checked, {len(reports) - len(failed)} passed, {len(failed)} failed; rows: {rows}")
    if any(r.valid is not None for r in reports):
        valid = sum(r.valid or 0 for r in reports)
        invalid = sum(r.invalid or 0 for r in reports)
        print(f"valid: {valid}, invalid: {invalid}")
    counts: Counter = Counter()
    for report in reports:
        counts.update(report.error_counts)
    if counts:
        print("counts: " + ", ".join(f"{code} {n}" for code, n in sorted(counts.items())))
    examples = [(r.rel, e) for r in reports for e in r.examples][:EXAMPLES_SHOWN]
    if examples:
        print("invalid examples:")
        for rel, example in examples:
            code = example["error"] or "(no code)"
            print(f"  {rel} row {example['row']} {example['key']!r}: {code}: {_short(example.get('detail'))}")
    print(f"main: {summary['main']['shards']} shards, {summary['main']['total_bytes']:,} bytes")
    for name, output in summary["outputs"].items():
        line = f"{name}: {output['shards']} shards, {output['total_bytes']:,} bytes"
        missing = output["missing"]
        if missing:
            line += f"; missing {len(missing)}: {', '.join(missing[:5])}" + (", ..." if len(missing) > 5 else "")
        print(line)
    for report in failed:
        for check in report.failed_checks:
            print(f"FAILED {check.name} on {report.rel}: {check.message}")


def _short(text: Any, limit: int = 120) -> str:
    text = "" if text is None else str(text).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _write_text(path: str, text: str, protect: Sequence[Location]) -> None:
    """A local file (written atomically), or an S3 object written in one PUT; never inside main."""
    target = Location.parse(path)
    for protected in protect:
        _check_report_path(path, protected)
    if target.is_s3:
        parent, _, name = path.rstrip("/").rpartition("/")
        if not name or parent in ("s3:", "s3:/"):
            raise ValueError(f"{path!r} needs a key under a bucket")
        Location.parse(parent).write_bytes(name, text.encode(), protect=protect)
        return
    file_path = Path(target.path)
    Location.parse(file_path.parent).write_bytes(file_path.name, text.encode(), protect=protect)
