"""`sidecar-ops demo`: the whole Dagster graph on a sample dataset on local disk.

1. Writes a sample main dataset (a few shards of generated photos with captions and some
   bad rows) under the work dir, unless it is already there.
2. Writes a datasets file for it (`<workdir>/datasets.yaml`) unless one exists, and loads
   the Dagster definitions from it, exactly as `dagster dev` would.
3. Opens a persistent Dagster instance (`DAGSTER_HOME`, default `<workdir>/dagster_home`),
   runs one tick of the discovery sensor in process (new shards become partitions, each is
   recorded on `sample/main`).
4. Runs the shard job (resize both resolutions, verify, crop) once per shard in process,
   skipping shards whose assets are all materialised, whose checks all passed and whose
   files are all there; outputs already built with the same settings are kept (SPEC 2
   skip-existing), so a second demo run does no work.
5. Runs the dataset check and prints a summary read back from the instance: shards built,
   valid and invalid rows per error code, check results, and where the overlay pictures are.
"""

import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.defs.config import DatasetConfig, load_config
from fixed_res_sidecar.defs.names import RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.sample_data import DEFAULT_SHARDS, write_sample_dataset

# The local instance settings (dagster.yaml) ship inside the package, next to the definitions.
INSTANCE_YAML = Path(__file__).resolve().parent / "defs" / "dagster.yaml"

DEFAULT_WORKDIR = Path("sidecar-demo")
# Where each demo was run from and where it went (`sidecar-ops ui` finds it from the same folder).
DEMOS_FILE = "fixed-res-sidecar/demos.json"
DATASET_NAME = "sample"
QUIET_RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


@dataclass
class ShardOutcome:
    rel: str
    status: str  # "built", "up to date", "failed"
    seconds: float = 0.0
    detail: str = ""


@dataclass
class DemoSummary:
    workdir: Path
    dagster_home: Path
    config_file: Path
    dataset: DatasetConfig
    created_sample: bool
    new_partitions: list[str]
    shards: list[ShardOutcome] = field(default_factory=list)
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)  # resolution -> valid, invalid, errors
    checks: dict[str, Counter] = field(default_factory=dict)  # asset/check -> Counter(passed/failed/missing)
    failed_checks: list[str] = field(default_factory=list)
    audit: tuple[bool, str, str] | None = None  # passed, severity, description of the dataset audit
    overlays: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            all(s.status != "failed" for s in self.shards)
            and not self.failed_checks
            and all(not c["failed"] and not c["not run"] for c in self.checks.values())
            and (self.audit is None or self.audit[0])
        )


def demo_config() -> dict[str, Any]:
    """The datasets file the demo writes: paths relative to the work dir."""
    return {
        "datasets": [
            {
                "name": DATASET_NAME,
                "main_prefix": "main/sample",
                "output_root": "out",
                "sensor": {"default_status": "running", "interval_seconds": 60},
            }
        ]
    }


def prepare_workdir(workdir: Path, shards: int, rows_per_shard: int, say: Callable[[str], None]) -> tuple[Path, bool]:
    """Sample data and datasets file; returns (config file, whether the sample was created now)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = workdir / "datasets.yaml"
    if not config_file.exists():
        header = "# Written by `sidecar-ops demo`; edit it freely (fields: see the repo's datasets.yaml).\n"
        config_file.write_text(header + yaml.safe_dump(demo_config(), sort_keys=False))
    main = load_config(config_file).datasets[0].main
    created = False
    if not main.list_shards():
        names = list(DEFAULT_SHARDS[:shards]) + [
            f"extra/part-{i:05d}.parquet" for i in range(len(DEFAULT_SHARDS), shards)
        ]
        say(f"writing a sample dataset: {len(names)} shards x {rows_per_shard} rows under {main.uri}")
        write_sample_dataset(main, shards=names, rows_per_shard=rows_per_shard)
        created = True
    return config_file, created


@contextmanager
def dagster_home(workdir: Path) -> Iterator[Path]:
    """DAGSTER_HOME as set, else `<workdir>/dagster_home` with the packaged dagster.yaml."""
    given = os.environ.get("DAGSTER_HOME")
    if given:
        home = Path(given).expanduser().resolve()
        home.mkdir(parents=True, exist_ok=True)
        yield home
        return
    home = (workdir / "dagster_home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        shutil.copyfile(INSTANCE_YAML, home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        yield home
    finally:
        os.environ.pop("DAGSTER_HOME", None)


def _demos_file() -> Path:
    """The user's record of demos: under $XDG_STATE_HOME (default ~/.local/state)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / DEMOS_FILE


def remember_demo(folder: Path, workdir: Path, home: Path) -> None:
    """Record that a demo run from `folder` went to `workdir` (Dagster home `home`); best effort."""
    path = _demos_file()
    try:
        demos = json.loads(path.read_text()) if path.exists() else {}
        demos = demos if isinstance(demos, dict) else {}
        demos[str(folder.resolve())] = {"workdir": str(workdir), "dagster_home": str(home)}
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(demos, indent=1))
        temporary.replace(path)
    except (OSError, ValueError):
        pass  # a record for convenience only: `sidecar-ops ui --workdir` always works


def remembered_demo(folder: Path) -> tuple[Path, Path] | None:
    """(work dir, Dagster home) of the last demo run from `folder`, if it is still there."""
    try:
        entry = json.loads(_demos_file().read_text()).get(str(folder.resolve()))
        workdir, home = Path(entry["workdir"]), Path(entry["dagster_home"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return (workdir, home) if (workdir / "datasets.yaml").is_file() else None


def register_shards(instance, dataset: DatasetConfig) -> list[str]:
    """Discovery ticks in process, until the listing is complete; returns the new partitions. The tick
    records main's shards and adds their partitions itself; the demo runs the shards itself."""
    from fixed_res_sidecar.defs.sensors import ShardCursor, discovery_tick

    keys = DatasetKeys(dataset.name)
    before = set(instance.get_dynamic_partitions(keys.partitions))
    cursor = None
    while True:
        log = logging.getLogger("sidecar-demo")
        cursor = discovery_tick(dataset, instance, cursor, log=log, daemon_applies=False).cursor
        if ShardCursor.parse(cursor).after is None:
            return [rel for rel in instance.get_dynamic_partitions(keys.partitions) if rel not in before]


def _check_statuses(instance, defs, dataset: DatasetConfig, rels: list[str]) -> dict[tuple[str, str], str]:
    """(check key text, shard) -> SUCCEEDED / FAILED / PLANNED, for every partitioned check."""
    from fixed_res_sidecar.defs.history import check_statuses

    keys = DatasetKeys(dataset.name)
    asset_keys = {keys.verify(r) for r in RESOLUTION_NAMES} | {keys.crop_bbox}
    check_keys = [k for k in defs.resolve_asset_graph().asset_check_keys if k.asset_key in asset_keys]
    return check_statuses(instance, check_keys, rels)


def finished_shards(instance, dataset: DatasetConfig, rels: list[str], statuses: dict) -> set[str]:
    """The shards of `rels` whose assets are all materialised, checks all passed and output files all there.

    One query per asset and one listing per output, whatever the number of shards.
    """
    keys = DatasetKeys(dataset.name)
    done = set(rels)
    for key in (
        *(keys.resized(r) for r in RESOLUTION_NAMES),
        *(keys.verify(r) for r in RESOLUTION_NAMES),
        keys.crop_bbox,
    ):
        done &= instance.get_materialized_partitions(key)
    passed: dict[str, bool] = {}
    for (_, shard), status in statuses.items():
        passed[shard] = passed.get(shard, True) and status == "SUCCEEDED"
    done = {rel for rel in done if passed.get(rel, False)}
    for name in (*(f"resized_{r}" for r in RESOLUTION_NAMES), "crop_bbox"):
        if not done:
            break
        done &= set(dataset.output(name).list_shards())
    return done


def run_demo(
    workdir: str | os.PathLike = DEFAULT_WORKDIR,
    shards: int = len(DEFAULT_SHARDS),
    rows_per_shard: int = 12,
    say: Callable[[str], None] = print,
) -> DemoSummary:
    workdir = Path(workdir).expanduser().resolve()
    config_file, created = prepare_workdir(workdir, shards, rows_per_shard, say)

    import dagster as dg

    from fixed_res_sidecar.defs.dataset_definitions import build_definitions

    config = load_config(config_file)
    dataset = config.datasets[0]
    keys = DatasetKeys(dataset.name)
    defs = build_definitions(config)
    logging.getLogger("dagster").setLevel(logging.WARNING)

    with dagster_home(workdir) as home, dg.DagsterInstance.get() as instance:
        remember_demo(Path.cwd(), workdir, home)
        new = register_shards(instance, dataset)
        rels = sorted(instance.get_dynamic_partitions(keys.partitions))
        say(f"{len(rels)} shards are partitions of {keys.partitions} ({len(new)} new); Dagster home {home}")
        summary = DemoSummary(workdir, home, config_file, dataset, created, new)
        job = defs.resolve_job_def(keys.shard_job)
        finished = finished_shards(instance, dataset, rels, _check_statuses(instance, defs, dataset, rels))
        for index, rel in enumerate(rels, 1):
            if rel in finished:
                summary.shards.append(ShardOutcome(rel, "up to date"))
                say(f"[{index}/{len(rels)}] {rel}: up to date (materialised, checks passed), skipped")
                continue
            started = time.monotonic()
            result = job.execute_in_process(
                partition_key=rel, instance=instance, raise_on_error=False, run_config=QUIET_RUN_CONFIG
            )
            seconds = time.monotonic() - started
            if result.success:
                summary.shards.append(ShardOutcome(rel, "built", seconds))
                say(f"[{index}/{len(rels)}] {rel}: built in {seconds:.1f} s (run {result.run_id[:8]})")
            else:
                failed = [e.check_name for e in result.get_asset_check_evaluations() if not e.passed]
                steps = [e.step_key for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
                detail = f"failed steps {steps}" + (f", failed checks {failed}" if failed else "")
                summary.shards.append(ShardOutcome(rel, "failed", seconds, detail))
                say(f"[{index}/{len(rels)}] {rel}: FAILED in {seconds:.1f} s: {detail} (run {result.run_id})")

        audit_run = defs.resolve_job_def(keys.audit_job).execute_in_process(
            instance=instance, raise_on_error=False, run_config=QUIET_RUN_CONFIG
        )
        for evaluation in audit_run.get_asset_check_evaluations():
            if evaluation.check_name == keys.dataset_audit.name:  # failed shards; completeness is the other
                summary.audit = (evaluation.passed, evaluation.severity.value, evaluation.description or "")
        totals = {
            k: v.value
            for e in audit_run.get_asset_materialization_events()
            for k, v in e.materialization.metadata.items()
        }
        _collect(summary, instance, defs, dataset, rels, totals)
    return summary


def _collect(
    summary: DemoSummary, instance, defs, dataset: DatasetConfig, rels: list[str], totals: dict[str, Any]
) -> None:
    """Rows per resolution from the dataset audit's totals; check results per shard from the instance."""
    from fixed_res_sidecar.defs.dataset_audit import rows_label

    for resolution in RESOLUTION_NAMES:
        errors = {code: totals.get(rows_label(resolution, f"invalid {code}"), 0) for code in ERROR_CODES}
        summary.rows[resolution] = {
            "audit_prefix": dataset.resized(resolution).audit_prefix,
            "valid": totals.get(rows_label(resolution, "valid"), 0),
            "invalid": totals.get(rows_label(resolution, "invalid"), 0),
            "errors": {code: n for code, n in errors.items() if n},
        }
    statuses = _check_statuses(instance, defs, dataset, rels)
    check_names = sorted({name for name, _ in statuses})
    for name in check_names:
        counter: Counter = Counter(passed=0, failed=0, **{"not run": 0})
        for rel in rels:
            status = statuses.get((name, rel))
            counter["passed" if status == "SUCCEEDED" else "failed" if status == "FAILED" else "not run"] += 1
            if status == "FAILED":
                summary.failed_checks.append(f"{name} on {rel}")
        summary.checks[name] = counter
    overlays = dataset.layout.report_location("overlays")
    summary.overlays = [overlays.child(rel) for rel in overlays.list_shards(suffix=".png")]


def format_summary(summary: DemoSummary) -> str:
    dataset = summary.dataset
    keys = DatasetKeys(dataset.name)
    built = sum(1 for s in summary.shards if s.status == "built")
    fresh = sum(1 for s in summary.shards if s.status == "up to date")
    failed = [s for s in summary.shards if s.status == "failed"]
    lines = [
        "",
        f"sidecar demo summary ({summary.workdir})",
        f"  main dataset   {dataset.main.uri}" + ("  (sample written now)" if summary.created_sample else ""),
        f"  datasets file  {summary.config_file}",
        f"  Dagster home   {summary.dagster_home}",
        f"  shards         {len(summary.shards)} total: {built} built now, {fresh} already up to date, {len(failed)} failed",
    ]
    for shard in failed:
        lines.append(f"    FAILED {shard.rel}: {shard.detail}")
    lines.append("  rows (all shards):")
    for resolution, rows in summary.rows.items():
        errors = ", ".join(f"{code} {n}" for code, n in rows["errors"].items()) or "none"
        lines.append(
            f"    {resolution:>4} ({rows['audit_prefix']}): {rows['valid']} valid, {rows['invalid']} invalid ({errors})"
        )
    lines.append("  checks (latest result per shard):")
    for name, counter in summary.checks.items():
        extra = "".join(f", {counter[k]} {k}" for k in ("failed", "not run") if counter[k])
        lines.append(f"    {name:<38} {counter['passed']}/{len(summary.shards)} passed{extra}")
    if summary.audit is not None:
        passed, severity, text = summary.audit
        verdict = "passed" if passed else severity
        lines.append(f"  dataset audit ({keys.dataset_audit.to_user_string()}): {verdict}")
        lines += [f"    {line}" for line in text.splitlines()]
    for text in summary.failed_checks[:20]:
        lines.append(f"    FAILED {text}")
    overlay_dir = dataset.layout.report_location("overlays").uri
    lines.append(
        f"  overlay pictures ({len(summary.overlays)} PNGs: original | 512 | 1024 with their boxes): {overlay_dir}"
    )
    for path in summary.overlays[:3]:
        lines.append(f"    {path}")
    lines.append(f"  verifier reports: {dataset.output('reports').uri}")
    lines.append(
        f"  browse it: sidecar-ops ui --workdir {summary.workdir}   (Ctrl-C stops it; --detach runs it in the "
        "background, --stop stops that)"
    )
    lines.append("  result: " + ("OK" if summary.ok else "PROBLEMS (see above)"))
    return "\n".join(lines)


def main(
    workdir: str | os.PathLike = DEFAULT_WORKDIR, shards: int = len(DEFAULT_SHARDS), rows_per_shard: int = 12
) -> int:
    summary = run_demo(workdir, shards, rows_per_shard, say=lambda text: print(text, file=sys.stderr, flush=True))
    print(format_summary(summary))
    return 0 if summary.ok else 1
