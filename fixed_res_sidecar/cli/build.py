"""`sidecar-ops build-0-262mp | build-1-05mp | build-both`: resize a main dataset shard by shard."""

import argparse
import functools
import sys
from collections import Counter

from fixed_res_sidecar.cli.common import (
    UsageError,
    add_pixel_flags,
    check_positive,
    clean_leftovers,
    main_shards,
    pixel_options,
    storage_failed,
    symlink_report,
    usage_error,
)
from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar.shards.layout import DatasetLayout, resized_output
from fixed_res_sidecar.shards.resize import (
    DECODE_MEMORY_SHARE,
    DEFAULT_TASK_MEMORY_GB,
    ResizeTargets,
    ShardResult,
    build_resized_shard,
)
from fixed_res_sidecar.shards.runner import (
    Progress,
    RunSummary,
    local_workers,
    run_shards,
)
from fixed_res_sidecar.shards.settings import SOURCES
from fixed_res_sidecar.shards.verify import failed_outputs, load_report, still_failed


def add_parser(subparsers) -> None:
    for command, resolution in (("build-0-262mp", "512"), ("build-1-05mp", "1024")):
        area = RESOLUTIONS[resolution].area
        parser = subparsers.add_parser(
            command, help=f"build the {area:,} px-area resized dataset", description=f"Resize to {area:,} px area."
        )
        parser.add_argument("--output-prefix", required=True, help="where the resized dataset goes")
        parser.add_argument(
            "--audit-prefix", default=RESOLUTIONS[resolution].audit_prefix, help="prefix of the audit columns"
        )
        parser.set_defaults(func=run, resolutions=[resolution])
        _add_common(parser)
    fused = subparsers.add_parser(
        "build-both", help="build the 512 and 1024 datasets from one decode per image (fused)"
    )
    fused.add_argument("--output-prefix-512", required=True)
    fused.add_argument("--output-prefix-1024", required=True)
    fused.add_argument("--audit-prefix-512", default=RESOLUTIONS["512"].audit_prefix)
    fused.add_argument("--audit-prefix-1024", default=RESOLUTIONS["1024"].audit_prefix)
    fused.set_defaults(func=run, resolutions=["512", "1024"])
    _add_common(fused)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--main-prefix", required=True, help="the main dataset (read only): a folder or s3:// URI")
    parser.add_argument("--key-column", default="image_key")
    parser.add_argument("--image-column", default="image")
    add_pixel_flags(parser)  # bounds and formats are the core's (core/pixel_settings.py), as the datasets file's are
    parser.add_argument("--skip-existing", action="store_true", help="skip shards already built with these settings")
    parser.add_argument(
        "--rebuild-failed",
        action="append",
        default=[],
        metavar="REPORT",
        help="a verify-resized --report JSON (repeatable): rebuild the shards it failed, even with --skip-existing "
        "(those rewritten since are left to --skip-existing)",
    )
    parser.add_argument("--max-inflight", type=int, default=8, help="shards in flight at once")
    parser.add_argument("--task-cpus", type=int, default=1, help="CPUs per shard task")
    parser.add_argument(
        "--task-memory-gb",
        type=float,
        default=DEFAULT_TASK_MEMORY_GB,
        help=f"memory per shard task in GiB (default {DEFAULT_TASK_MEMORY_GB:g}): Ray reserves it per task, and a "
        f"shard's decoded images in flight stay within {DECODE_MEMORY_SHARE * 100:.0f}%% of it; an image that alone "
        "needs more is audited too_large",
    )
    parser.add_argument("--threads-per-shard", type=int, default=1, help="resize threads inside one shard")
    parser.add_argument("--use-ray", action="store_true", help="run shards as Ray tasks")
    parser.add_argument("--ray-address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)")
    parser.add_argument("--max-attempts", type=int, default=3, help="tries per shard when a worker dies")


def _layout(args) -> DatasetLayout:
    if args.resolutions == ["512", "1024"]:
        outputs = {
            "512": resized_output("512", args.output_prefix_512, args.audit_prefix_512),
            "1024": resized_output("1024", args.output_prefix_1024, args.audit_prefix_1024),
        }
    else:
        (name,) = args.resolutions
        outputs = {name: resized_output(name, args.output_prefix, args.audit_prefix)}
    layout = DatasetLayout(
        Location.parse(args.main_prefix), outputs, key_column=args.key_column, image_column=args.image_column
    )
    layout.check_locations()
    return layout


IGNORED_LISTED = 20  # entries of --rebuild-failed reports named when they are not repaired


def _failed_in_reports(paths: list[str]) -> dict[str, tuple[str, str | None]]:
    """Shard URI -> (the report naming it, its recorded fingerprint) of every resized shard the verifier
    reports at `paths` failed. A report that is not one is a usage error naming what is wrong in it."""
    failed: dict[str, tuple[str, str | None]] = {}
    for path in paths:
        folder, name = Location.file(path)
        source = f"--rebuild-failed {path}"
        try:
            data = folder.read_bytes(name)
        except OSError as exc:
            raise UsageError(f"{source}: not a readable verifier report ({describe_exception(exc, 300)})") from None
        for uri, fingerprint in failed_outputs(load_report(data, source), source).items():
            failed[uri] = (path, fingerprint)
    return failed


def _repairs(
    failed: dict[str, tuple[str, str | None]], layout: DatasetLayout, shards: list[str], reports: list[str]
) -> dict[str, str | None]:
    """The failed shards of `--rebuild-failed` reports that this build makes (URI -> recorded fingerprint).
    The others are named on stderr with why; a usage error when there are some and none is this build's."""
    if not failed:
        if reports:
            print("--rebuild-failed: the reports name no failed resized shard: nothing to repair", file=sys.stderr)
        return {}
    in_main = set(shards)
    ignored = {uri: reason for uri in failed if (reason := _not_repaired(uri, layout, in_main))}
    lines = [f"  {uri} (in {failed[uri][0]}): {reason}" for uri, reason in list(ignored.items())[:IGNORED_LISTED]]
    if len(ignored) > IGNORED_LISTED:
        lines.append(f"  ... and {len(ignored) - IGNORED_LISTED} more")
    if len(ignored) == len(failed):
        outputs = ", ".join(output.location.uri for output in layout.resized.values())
        raise UsageError(
            f"--rebuild-failed: none of the {len(failed)} failed shard(s) in the report(s) is an output of this build "
            f"({outputs}; reports of another dataset or resolution?):\n" + "\n".join(lines)
        )
    if ignored:
        print(
            f"--rebuild-failed: {len(ignored)} failed shard(s) of the reports ignored:",
            *lines,
            sep="\n",
            file=sys.stderr,
        )
    print(f"--rebuild-failed: {len(failed) - len(ignored)} failed output(s) of this build to repair", file=sys.stderr)
    return {uri: fingerprint for uri, (_, fingerprint) in failed.items() if uri not in ignored}


def _not_repaired(uri: str, layout: DatasetLayout, shards: set[str]) -> str | None:
    """Why a failed shard `uri` of a report is not repaired by a build of `layout` over `shards`; None when it is."""
    if any(part in (".", "..") for part in uri.split("/")):
        return "its path holds '.' or '..' segments (a report names each output shard by its own URI)"
    if uri.startswith(layout.main.uri.rstrip("/") + "/"):
        return "it is in the main dataset, which is read only (a report names output shards)"
    for output in layout.resized.values():
        prefix = output.location.uri.rstrip("/") + "/"
        if uri.startswith(prefix):
            rel = uri[len(prefix) :]
            return None if rel in shards else f"the main dataset has no shard {rel!r} (removed since the report?)"
    outputs = ", ".join(output.location.uri for output in layout.resized.values())
    return f"not under this build's outputs ({outputs})"


def _build_shard(
    build, layout: DatasetLayout, rel: str, *, failed: dict[str, str | None], skip_existing: bool, **options
) -> ShardResult:
    """One shard's build by `build` (the builder travels with the job into worker processes and Ray
    tasks, as the function it was when the run started), rebuilding its outputs that a verifier
    report failed (`--rebuild-failed`)."""
    rebuild = still_failed(layout, rel, failed) if failed else ()
    return build(layout, rel, targets=ResizeTargets(skip_existing=skip_existing, rebuild=rebuild), **options)


def run(args) -> int:
    # Everything is validated before any shard is touched (bad configuration does no work).
    try:
        check_positive(
            max_inflight=args.max_inflight, task_cpus=args.task_cpus,
            threads_per_shard=args.threads_per_shard, max_attempts=args.max_attempts,
        )  # fmt: skip
        if args.task_memory_gb <= 0:
            raise ValueError("--task-memory-gb must be positive")
        layout = _layout(args)
        options = pixel_options(args)
        reported = _failed_in_reports(args.rebuild_failed)  # a bad report is refused before the listing
        shards = main_shards(layout.main)
        failed = _repairs(reported, layout, shards, args.rebuild_failed)
    except (ValueError, LocationError) as exc:
        return usage_error(exc)
    except StorageError as exc:  # e.g. a folder of main that cannot be listed: no shard is left out silently
        return storage_failed(exc)
    main = layout.main
    job = functools.partial(
        _build_shard,
        build_resized_shard,
        layout,
        failed=failed,
        options=options,
        threads=args.threads_per_shard,
        skip_existing=args.skip_existing,
        memory_gb=args.task_memory_gb,
    )
    targets = ", ".join(o.location.uri for o in layout.resized.values())
    print(f"{len(shards)} shards under {main.uri} -> {targets}", file=sys.stderr)
    clean_leftovers(o.location for o in layout.resized.values())
    progress = Progress(len(shards))
    if args.use_ray:
        try:
            from fixed_res_sidecar.shards import ray_runner
        except ImportError as exc:
            return usage_error(
                f"--use-ray needs Ray, which is not installed ({exc}); "
                "install it with: pip install 'fixed-resolution-sidecar[ray]'"
            )
        tasks = ray_runner.RayTaskOptions(
            max_inflight=args.max_inflight,
            task_cpus=args.task_cpus,
            task_memory_gb=args.task_memory_gb,
            max_attempts=args.max_attempts,
        )
        try:
            summary = ray_runner.run_shards_on_ray(
                job, shards, tasks=tasks, address=args.ray_address, progress=progress
            )
        except ray_runner.RayConnectionError as exc:
            return usage_error(exc)
    else:
        workers = local_workers(args.max_inflight, args.task_cpus)
        summary = run_shards(job, shards, workers=workers, max_attempts=args.max_attempts, progress=progress)
    print(format_summary(summary), file=sys.stdout)
    if links := symlink_report(main):
        print(links)
    return 0 if summary.ok else 1


def format_summary(summary: RunSummary) -> str:
    results = list(summary.results.values())
    built = sum(1 for r in results if r.built)
    lines = [
        f"shards: {len(results) + len(summary.failures)} total, {built} built, "
        f"{len(results) - built} skipped, {len(summary.failures)} failed "
        f"({sum(r.rows for r in results)} rows in {summary.seconds:.1f} s)"
    ]
    per_prefix: dict[str, Counter] = {}
    for result in results:
        for output in result.outputs:
            if output.status != "built":
                continue
            counts = per_prefix.setdefault(output.audit_prefix, Counter())
            counts["valid"] += output.valid
            counts.update(output.error_counts)
    for prefix, counts in per_prefix.items():
        errors = {k: v for k, v in sorted(counts.items()) if k != "valid"}
        detail = ", ".join(f"{k} {v}" for k, v in errors.items()) or "none"
        lines.append(f"  {prefix} (built shards): valid {counts['valid']}, invalid {sum(errors.values())} ({detail})")
    reasons = Counter(o.reason for r in results for o in r.outputs if o.status == "built" and o.reason)
    if reasons:  # with --skip-existing: why outputs that existed were built again
        lines.append("  rebuilt outputs: " + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items())))
    changed = sum(1 for r in results if any(o.reason == SOURCES for o in r.outputs))
    lines.append(f"  rebuilt because main changed: {changed} shard(s)")
    for rel, reason in sorted(summary.failures.items()):
        lines.append(f"  FAILED {rel}: {reason}")
    return "\n".join(lines)
