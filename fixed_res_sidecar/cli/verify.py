"""`sidecar-ops verify-resized | verify-crop-bbox`: the SPEC 7 checks over a whole dataset.

Both print a short summary (counts, a few invalid examples, every failed check with its
shard) and exit 0 only when every check on every shard passed. `--report FILE` writes
the full JSON: per-shard reports and the dataset summary.

A shard whose storage kept failing (after retries) has no report: it is listed as not
checked, and the exit status is 3 (STORAGE_FAILED) unless a check failed elsewhere (1).
"""

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fixed_res_sidecar.cli.common import (
    STORAGE_FAILED,
    add_pixel_flags,
    check_positive,
    main_shards,
    pixel_options,
    storage_failed,
    symlink_report,
    usage_error,
)
from fixed_res_sidecar.cli.crop_bbox import sidecar_layout
from fixed_res_sidecar.core.bbox import CAPTION_FRAMES
from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.resolutions import RESOLUTIONS, area_for_audit_prefix
from fixed_res_sidecar.io.locations import Location, LocationError, check_writable
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput
from fixed_res_sidecar.shards.listing import dataset_summary
from fixed_res_sidecar.shards.overlay import write_overlays
from fixed_res_sidecar.shards.verify import (
    FIDELITY,
    ShardReport,
    VerifyOptions,
    previous_coverage,
    verify_crop_bbox_shard,
    verify_resized_shard,
    write_fidelity_pictures,
)
from fixed_res_sidecar.shards.verify.sidecar import DEFAULT_SAMPLE as DEFAULT_CROP_SAMPLE

T = TypeVar("T")
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
    # The settings the dataset must have been built with (the build's flags and defaults): the footer of each
    # shard must record them, and its pictures are compared with what they make.
    add_pixel_flags(resized.add_argument_group("expected build settings"), built=", as the dataset was built")
    resized.add_argument(
        "--sample",
        type=sample_count,
        default=VerifyOptions().sample,
        help="images decoded per shard, or 'all' (also compares every image with its source) (default %(default)s)",
    )
    resized.add_argument(
        "--fidelity-sample",
        type=sample_count,
        default=VerifyOptions().fidelity_sample,
        help="of the sampled images, how many are compared with their source, or 'all' (default %(default)s)",
    )
    resized.add_argument(
        "--no-fidelity", dest="fidelity", action="store_false", help="do not compare images with their source"
    )
    resized.add_argument(
        "--picture-dir", default=None, help="write expected | stored | difference PNGs of rows failing fidelity here"
    )
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
        "--caption-frame",
        choices=CAPTION_FRAMES,
        default=None,
        help="frame of the caption boxes (default: as recorded in the sidecar's build settings)",
    )
    crop.add_argument(
        "--bbox-key",
        dest="bbox_keys",
        action="append",
        default=None,
        metavar="KEY",
        help="a JSON key whose value is a box or a list of boxes; repeat for several "
        "(default: as recorded in the sidecar's build settings)",
    )
    crop.add_argument("--audit-prefix-512", default=RESOLUTIONS["512"].audit_prefix)
    crop.add_argument("--audit-prefix-1024", default=RESOLUTIONS["1024"].audit_prefix)
    crop.add_argument(
        "--sample",
        type=sample_count,
        default=DEFAULT_CROP_SAMPLE,
        help="rows whose crop captions are re-derived and compared per shard, or 'all' (default %(default)s)",
    )
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
        area = args.target_area if args.target_area is not None else area_for_audit_prefix(args.audit_prefix)
        if area is None:
            defaults = {r.audit_prefix: r.area for r in RESOLUTIONS.values()}
            raise ValueError(
                f"no default target area for audit prefix {args.audit_prefix!r}; give --target-area (defaults: {defaults})"
            )
        check_positive(threads=args.threads, target_area=area)
        counts = {name: getattr(args, name) for name in ("sample", "fidelity_sample")}
        check_positive(**{name: value for name, value in counts.items() if value is not None})
        pixels = pixel_options(args)
        output = ResizedOutput(Location.parse(args.output_prefix), area, args.audit_prefix)
        layout = DatasetLayout(
            Location.parse(args.main_prefix), {output.resolution: output},
            key_column=args.key_column, image_column=args.image_column,
        )  # fmt: skip
        layout.check_locations()
        _check_report_path(args.report, layout)
        picture_dir = Location.parse(args.picture_dir) if args.picture_dir else None
        if picture_dir is not None:
            check_writable(
                picture_dir, [*layout.described_read_only(), ("the output", output.location)], "--picture-dir"
            )
        shards = _shards(layout.main, args.shard)
    except (ValueError, LocationError) as exc:
        return usage_error(exc)
    except StorageError as exc:
        return storage_failed(exc)

    options = VerifyOptions(
        pixels=pixels,
        sample=args.sample,
        fidelity=args.fidelity,
        fidelity_sample=args.fidelity_sample,
    )

    # Each shard's fidelity window continues from the one the previous report (the same --report file) recorded.
    previous = _previous_coverages(args.report)

    def verify_shard(rel: str) -> ShardReport:
        shard = output.location.child(rel)
        report = verify_resized_shard(layout, rel, output.resolution, options, previous_coverage=previous.get(shard))
        if picture_dir is not None and not report.check(FIDELITY).passed:
            report.stats["fidelity_pictures"] = _fidelity_pictures(
                layout, rel, output.resolution, report, options, picture_dir
            )
        return report

    checked = _run_all(shards, _storage_guarded(verify_shard), args.threads)
    try:
        summary = dataset_summary(layout.main, {output.resolution: output.location})
    except StorageError as exc:
        return storage_failed(exc)
    header = f"verify-resized {output.location.uri} (area {area}, audit {args.audit_prefix}) against {layout.main.uri}"
    return _finish("verify-resized", header, checked, summary, args.report, layout)


def run_verify_crop_bbox(args) -> int:
    try:
        check_positive(overlay_sample=args.overlay_sample, threads=args.threads)
        if args.sample is not None:
            check_positive(sample=args.sample)
        layout = sidecar_layout(args, args.sidecar_prefix)
        overlay_dir = Location.parse(args.overlay_dir) if args.overlay_dir else None
        if overlay_dir is not None:
            others = [(f"the {name} location", location) for name, location in layout.outputs().items()]
            check_writable(overlay_dir, [*layout.described_read_only(), *others], "--overlay-dir")
        _check_report_path(args.report, layout)
        shards = _shards(layout.main, args.shard)
    except (ValueError, LocationError) as exc:
        return usage_error(exc)
    except StorageError as exc:
        return storage_failed(exc)

    verify_shard = _storage_guarded(lambda rel: verify_crop_bbox_shard(layout, rel, args.sample))
    checked = _run_all(shards, verify_shard, args.threads)
    outputs = {name: output.location for name, output in layout.resized.items()}
    try:
        summary = dataset_summary(layout.main, {**outputs, "sidecar": layout.sidecar_location()})
    except StorageError as exc:
        return storage_failed(exc)
    header = f"verify-crop-bbox {layout.sidecar_location().uri} against {layout.main.uri}"
    overlay_failures: dict[str, str] = {}
    if overlay_dir is not None:
        written, overlay_failures, storage = _draw_overlays(
            layout, shards, overlay_dir, args.overlay_sample, args.threads
        )
        checked += [(f"{rel} (overlay pictures)", reason) for rel, reason in storage.items()]
        header += f"\noverlays: {written} picture(s) under {overlay_dir.uri}"
    return _finish("verify-crop-bbox", header, checked, summary, args.report, layout, overlay_failures)


def _previous_coverages(report_path: str | None) -> dict[str, Any]:
    """Shard URI -> the fidelity coverage a previous `--report` file recorded for it (none if there is no
    readable one: the windows start over)."""
    if not report_path:
        return {}
    try:
        folder, name = Location.file(report_path)
        document = json.loads(folder.read_bytes(name)) if folder.exists(name) else {}
    except (OSError, ValueError, LocationError):
        return {}
    shards = document.get("shards") if isinstance(document, dict) else None
    return {
        report["shard"]: coverage
        for report in shards or []
        if isinstance(report, dict) and (coverage := previous_coverage(report)) is not None
    }


def sample_count(text: str) -> int | None:
    """`--sample`: a count (checked like every count, before any work), or 'all' (None: every row)."""
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'all', got {text!r}") from None


def _fidelity_pictures(
    layout: DatasetLayout, rel: str, resolution: str, report: ShardReport, options: VerifyOptions, directory
) -> Any:
    """The comparison pictures of a shard's failing rows; pictures are for people: a failure to draw
    them is reported in their place and changes no verdict (storage failures still propagate)."""
    try:
        return write_fidelity_pictures(layout, rel, resolution, report.check(FIDELITY), options.pixels, directory)
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001
        return f"could not be drawn: {describe_exception(exc, max_chars=300)}"


def _storage_guarded(verify_shard: Callable[[str], ShardReport]) -> Callable[[str], tuple[str, ShardReport | str]]:
    """`verify_shard` as rel -> (rel, its report, or why storage failed): such a shard has no report."""

    def run(rel: str) -> tuple[str, ShardReport | str]:
        try:
            return rel, verify_shard(rel)
        except StorageError as exc:
            return rel, str(exc)

    return run


def _draw_overlays(
    layout: DatasetLayout, shards: list[str], overlay_dir: Location, sample: int, threads: int
) -> tuple[int, dict[str, str], dict[str, str]]:
    """(pictures written, shard -> why its pictures could not be drawn, shard -> why storage failed)."""

    def draw(rel: str) -> tuple[str, list[str] | str | StorageError]:
        try:
            return rel, write_overlays(layout, rel, overlay_dir, sample)
        except StorageError as exc:
            return rel, exc
        except Exception as exc:  # noqa: BLE001 - a shard whose pictures cannot be drawn is reported, the others go on
            return rel, describe_exception(exc, max_chars=300)

    outcomes = _run_all(shards, draw, threads)
    failures = {rel: outcome for rel, outcome in outcomes if isinstance(outcome, str)}
    storage = {rel: str(outcome) for rel, outcome in outcomes if isinstance(outcome, StorageError)}
    return sum(len(outcome) for _, outcome in outcomes if isinstance(outcome, list)), failures, storage


def _check_report_path(path: str | None, layout: DatasetLayout) -> None:
    if path:
        check_writable(Location.parse(path), layout.described_read_only(), "--report")
        folder, name = Location.file(path)
        folder.check_name(name)  # a name the storage cannot hold is refused now, not after the checks


def _shards(main: Location, selected: Sequence[str] | None) -> list[str]:
    shards = main_shards(main)
    if selected:
        wanted = set(selected)
        unknown = sorted(wanted.difference(shards))
        if unknown:
            raise ValueError(f"not shards of {main.uri}: {unknown}")
        shards = [rel for rel in shards if rel in wanted]
    return shards


def _run_all(shards: list[str], one: Callable[[str], T], threads: int) -> list[T]:
    # Checking is mostly waiting on storage and decoding (which releases the GIL): threads suffice.
    if threads == 1 or len(shards) == 1:
        return [one(rel) for rel in shards]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, shards))


def _finish(
    command: str,
    header: str,
    checked: list[tuple[str, ShardReport | str]],
    summary: dict[str, Any],
    report_path: str | None,
    layout: DatasetLayout,
    overlay_failures: dict[str, str] | None = None,
) -> int:
    reports = [outcome for _, outcome in checked if isinstance(outcome, ShardReport)]
    storage_failures = {rel: outcome for rel, outcome in checked if isinstance(outcome, str)}
    checks_failed = any(not r.passed for r in reports)
    # None: nothing failed, but not everything could be checked, so no verdict.
    passed = False if checks_failed else None if storage_failures else True
    print(header)
    _print_summary(reports, summary)
    for rel, reason in sorted(storage_failures.items()):
        print(f"STORAGE FAILED on {rel}, not checked: {reason}")
    for rel, reason in sorted((overlay_failures or {}).items()):
        print(f"OVERLAYS FAILED on {rel}: {reason}")
    if links := symlink_report(layout.main):
        print(links)
    if report_path:
        document = {
            "command": command,
            "passed": passed,
            "shards": [r.to_dict() for r in reports],
            "storage_failures": storage_failures,  # shards not checked: no report claims they failed or passed
            "dataset": summary,
        }
        if overlay_failures is not None:
            document["overlay_failures"] = overlay_failures
        try:
            folder, name = Location.file(report_path)
            folder.write_bytes(name, json.dumps(document, indent=2, sort_keys=False).encode(), protect=layout.read_only)
        except (OSError, ValueError) as exc:
            return usage_error(f"could not write the report {report_path}: {exc}")
        print(f"report: {report_path}")
    if passed is None and not overlay_failures:
        print(f"INCOMPLETE: storage kept failing (after retries) on {len(storage_failures)} shard(s); rerun")
        return STORAGE_FAILED
    print("PASSED" if passed else "FAILED")
    return 0 if passed and not overlay_failures else 1


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
    _print_fidelity(reports)
    for report in failed:
        for check in report.failed_checks:
            print(f"FAILED {check.name} on {report.rel}: {check.message}")


def _print_fidelity(reports: list[ShardReport]) -> None:
    """Fidelity per shard (score min and median) and every failing row by key with its score."""
    results = [(r, c) for r in reports for c in r.checks if c.name == FIDELITY and c.metadata.get("checked")]
    if not results:
        return
    checked = sum(c.metadata["checked"] for _, c in results)
    failing = sum(c.metadata.get("failing_rows", 0) for _, c in results)
    medians = [c.metadata["median_score"] for _, c in results if c.metadata.get("median_score") is not None]
    lowest = min((c.metadata["min_score"] for _, c in results if c.metadata.get("min_score") is not None), default=None)
    limit = results[0][1].metadata.get("min_score_allowed")
    scores = f"; lowest score {lowest:.2f} dB, median of shard medians {statistics.median(medians):.2f} dB"
    print(
        f"fidelity: {checked} rows compared with their source, {failing} failing (score below {limit:g} dB)"
        + (scores if medians else "")
    )
    # Per shard: every failing one, and the lowest-scoring others (the JSON report has them all).
    by_score = sorted(
        results, key=lambda rc: (rc[1].metadata.get("min_score") is not None, rc[1].metadata.get("min_score") or 0)
    )
    for rank, (report, check) in enumerate(by_score):
        metadata = check.metadata
        if rank >= EXAMPLES_SHOWN and not metadata.get("failing_rows"):
            continue
        print(
            f"  {report.rel}: {metadata['checked']} compared, score min {_score(metadata.get('min_score'))}, "
            f"median {_score(metadata.get('median_score'))}, {metadata.get('failing_rows', 0)} failing"
        )
        if metadata.get("failing_rows"):
            for row in metadata["failing"][:EXAMPLES_SHOWN]:
                print(f"    row {row['row']} {row['key']!r}: {row['problem']}")
        pictures = report.stats.get("fidelity_pictures")  # their paths, or why they could not be drawn
        if isinstance(pictures, list) and pictures:
            print(f"    pictures: {', '.join(pictures[:3])}" + (" ..." if len(pictures) > 3 else ""))
        elif pictures:
            print(f"    pictures: {pictures}")


def _score(value: float | None) -> str:
    return "none" if value is None else f"{value:.2f} dB"


def _short(text: Any, limit: int = 120) -> str:
    text = "" if text is None else str(text).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
