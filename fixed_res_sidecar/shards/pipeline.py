"""One shard through the stages a run asks for: resize, verify, crop (with overlays).

This is what one partition of a dataset's Dagster assets is. It runs in a worker process as
well as in the caller's (arguments and results pickle), and it raises only for what is not the
data's fault (a storage failure, a crash): a shard that cannot be read or fails its checks is
an outcome to record, so one shard of a batch never stops the others.
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.io.locations import commit_guard
from fixed_res_sidecar.io.parquet import ShardError
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar.shards.crop_bbox import CropBboxResult, build_crop_bbox_shard
from fixed_res_sidecar.shards.layout import DatasetLayout
from fixed_res_sidecar.shards.overlay import write_overlays
from fixed_res_sidecar.shards.resize import DEFAULT_TASK_MEMORY_GB, ResizeTargets, ShardResult, build_resized_shard
from fixed_res_sidecar.shards.verify import (
    FIDELITY,
    ReportError,
    ShardReport,
    SharedRenders,
    VerifyOptions,
    load_report,
    previous_coverage,
    report_rel,
    verify_crop_bbox_shard,
    verify_resized_shard,
    write_fidelity_pictures,
    write_report,
)

MESSAGE_CHARS = 500


@dataclass(frozen=True)
class Stages:
    """What to do for a shard: which resolutions to resize and to verify, and whether to crop."""

    resize: tuple[str, ...] = ()
    verify: tuple[str, ...] = ()
    crop: bool = False


@dataclass(frozen=True)
class PipelineOptions:
    pixels: PixelOptions = field(default_factory=PixelOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    threads: int = 1
    skip_existing: bool = True
    overlay_sample: int = 0  # overlay pictures per shard; 0 draws none
    memory_gb: float = DEFAULT_TASK_MEMORY_GB  # memory of the task building one shard


@dataclass
class ShardOutcome:
    """What happened to one shard; `problem` fields hold why a stage produced nothing."""

    rel: str
    resized: ShardResult | None = None
    resize_problem: str | None = None
    reports: dict[str, ShardReport] = field(default_factory=dict)  # resolution -> verifier report
    report_paths: dict[str, str] = field(default_factory=dict)  # "512", "1024", "crop_bbox" -> report URI
    crop: CropBboxResult | None = None
    crop_report: ShardReport | None = None
    crop_refused: list[str] = field(default_factory=list)  # why the gate refused the sidecar
    crop_problem: str | None = None
    overlays: list[str] = field(default_factory=list)
    overlay_problem: str | None = None
    # resolution -> expected | stored | difference pictures of the rows failing fidelity (or why there are none)
    fidelity_pictures: dict[str, list[str] | str] = field(default_factory=dict)
    # output name ("resized_512", "crop_bbox") -> its fingerprint when it was verified here
    fingerprints: dict[str, str | None] = field(default_factory=dict)
    # "512", "1024", "crop_bbox" -> CPU seconds its verification took (what the fidelity sweep budgets)
    verify_cpu_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def problems(self) -> list[str]:
        """Why this shard did not come through every stage it was asked for, one line per stage
        (empty when it did): what fails this shard, and only this shard, in a run over many."""
        problems = [f"not resized: {self.resize_problem}"] if self.resize_problem else []
        for resolution, report in self.reports.items():
            if not report.passed:
                problems.append(f"verify_{resolution} failed {', '.join(c.name for c in report.failed_checks)}")
        if self.crop_refused:
            problems.append(f"crop_bbox refused: {'; '.join(self.crop_refused)}")
        elif self.crop_problem:
            problems.append(f"crop_bbox not built: {self.crop_problem}")
        elif self.crop_report is not None and not self.crop_report.passed:
            problems.append(f"crop_bbox failed {', '.join(c.name for c in self.crop_report.failed_checks)}")
        return problems


@dataclass(frozen=True)
class StagesJob:
    """`run_stages` for one shard, with what the caller knows per shard (`gates`: the gate problems on
    record; `rebuilds`: the outputs to build again), as the picklable job a process pool takes. Its
    workers import this shard layer, not the Dagster definitions. Each output is published only if
    `commit_check()` does not raise (`io.locations.commit_guard`)."""

    layout: DatasetLayout
    stages: Stages
    options: PipelineOptions
    gates: Mapping[str, list[str]]
    rebuilds: Mapping[str, tuple[str, ...]]
    commit_check: Callable[[], None] | None = None

    def __call__(self, rel: str) -> ShardOutcome:
        with commit_guard(self.commit_check):
            return run_stages(
                self.layout, rel, self.stages, self.options, self.gates.get(rel), self.rebuilds.get(rel, ())
            )


def run_stages(
    layout: DatasetLayout,
    rel: str,
    stages: Stages,
    options: PipelineOptions = PipelineOptions(),
    recorded_gate_problems: list[str] | None = None,
    rebuild: tuple[str, ...] = (),
) -> ShardOutcome:
    """Run `stages` for shard `rel`.

    The crop stage is gated (SPEC 7): on this run's verifier reports for the resolutions verified here,
    and on `recorded_gate_problems` for the others (what the caller knows from earlier runs; None when
    it knows nothing, which refuses). `rebuild`: outputs ("512", "1024", "crop_bbox")
    built again even when skip-existing finds them up to date (their latest verification failed).
    """
    started = time.monotonic()
    check_output_names(layout, rel, stages)
    outcome = ShardOutcome(rel)
    if stages.resize:
        try:
            outcome.resized = build_resized_shard(
                layout,
                rel,
                targets=ResizeTargets(
                    resolutions=stages.resize,
                    skip_existing=options.skip_existing,
                    rebuild=tuple(r for r in stages.resize if r in rebuild),
                ),
                options=options.pixels,
                threads=options.threads,
                memory_gb=options.memory_gb,
            )
        except ShardError as exc:  # the data's fault: the verifier records it per check
            outcome.resize_problem = describe_exception(exc, max_chars=MESSAGE_CHARS)
    shared = SharedRenders()  # the fidelity checks of both resolutions render each source once
    for resolution in stages.verify:
        outcome.fingerprints[f"resized_{resolution}"] = layout.resized[resolution].location.fingerprint(rel)
        reports = layout.report_location(f"resized_{resolution}")
        previous = previous_coverage(_previous_report(reports, rel))  # its fidelity check continues from it
        cpu = time.process_time()
        report = verify_resized_shard(layout, rel, resolution, options.verify, shared, previous)
        outcome.verify_cpu_seconds[resolution] = time.process_time() - cpu
        outcome.reports[resolution] = report
        outcome.report_paths[resolution] = reports.child(write_report(reports, rel, report, protect=layout.read_only))
        if not report.check(FIDELITY).passed:
            outcome.fidelity_pictures[resolution] = _fidelity_pictures(layout, rel, resolution, report, options)
    if stages.crop:
        _crop(layout, rel, stages, options, recorded_gate_problems, outcome, "crop_bbox" in rebuild)
    outcome.seconds = time.monotonic() - started
    return outcome


def check_output_names(layout: DatasetLayout, rel: str, stages: Stages) -> None:
    """Raise LocationError, before any work, when a file `stages` would write for `rel` cannot have its
    name there (a report is named `<shard>.verify.json`, 4 bytes longer than the shard's own name)."""
    written = [(layout.resized[r].location, rel) for r in stages.resize]
    written += [(layout.report_location(f"resized_{r}"), report_rel(rel)) for r in stages.verify]
    if stages.crop:
        written += [(layout.sidecar, rel), (layout.report_location("crop_bbox"), report_rel(rel))]
    for location, name in written:
        location.check_name(name)


def _previous_report(reports, rel: str) -> dict | None:
    """The shard's last report under `reports`, if there is a readable one."""
    name = report_rel(rel)
    if not reports.exists(name):
        return None
    try:
        document = load_report(reports.read_bytes(name), reports.child(name))
    except ReportError:  # an unreadable report says nothing: the rotation starts over
        return None
    return document if isinstance(document, dict) else None


def _fidelity_pictures(
    layout: DatasetLayout, rel: str, resolution: str, report: ShardReport, options: PipelineOptions
) -> list[str] | str:
    try:
        return write_fidelity_pictures(
            layout, rel, resolution, report.check(FIDELITY), options.verify.pixels, layout.report_location("fidelity")
        )
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - pictures are for people: the checks decide pass or fail
        return describe_exception(exc, max_chars=MESSAGE_CHARS)


def _crop(layout, rel, stages, options, recorded_gate_problems, outcome: ShardOutcome, rebuild: bool) -> None:
    # This run's own reports gate the resolutions it verified; the record (`recorded_gate_problems`) the others.
    failed_here = [
        f"{report.shard} did not pass the verifier: {', '.join(c.name for c in report.failed_checks)} "
        f"({report.failed_checks[0].message})"
        for report in outcome.reports.values()
        if not report.passed
    ]
    if set(stages.verify) == set(layout.resized):
        outcome.crop_refused = failed_here
    elif recorded_gate_problems is None:
        outcome.crop_refused = ["no verification of this shard is known"]
    else:
        outcome.crop_refused = failed_here + list(recorded_gate_problems)
    if outcome.crop_refused:
        return
    try:
        outcome.crop = build_crop_bbox_shard(layout, rel, skip_existing=options.skip_existing and not rebuild)
    except ShardError as exc:
        outcome.crop_problem = describe_exception(exc, max_chars=MESSAGE_CHARS)
        return
    outcome.fingerprints["crop_bbox"] = layout.sidecar.fingerprint(rel)
    cpu = time.process_time()
    outcome.crop_report = verify_crop_bbox_shard(layout, rel, options.verify.sample)
    outcome.verify_cpu_seconds["crop_bbox"] = time.process_time() - cpu
    reports = layout.report_location("crop_bbox")
    outcome.report_paths["crop_bbox"] = reports.child(
        write_report(reports, rel, outcome.crop_report, protect=layout.read_only)
    )
    if options.overlay_sample > 0:
        try:
            outcome.overlays = write_overlays(layout, rel, layout.report_location("overlays"), options.overlay_sample)
        except Exception as exc:  # noqa: BLE001 - pictures are for people: the checks decide pass or fail
            outcome.overlay_problem = describe_exception(exc, max_chars=MESSAGE_CHARS)


@dataclass(frozen=True)
class StoredOutputs:
    """What storage holds of one shard's outputs, as a run's decision asks it (`defs/ledger.OutputCheck`):
    whether they are still the objects that were verified, and up to date (SPEC 2's skip rule, from
    stats and footers alone: no image is read)."""

    layout: DatasetLayout
    rel: str
    stages: Stages
    options: PipelineOptions

    def changed(self, fingerprints: Mapping[str, str | None]) -> list[str]:
        """The outputs named in `fingerprints` ("resized_512", "crop_bbox") that are no longer the object
        with that fingerprint: one stat or HEAD each."""
        locations = {f"resized_{name}": o.location for name, o in self.layout.resized.items()}
        if self.layout.sidecar is not None:
            locations["crop_bbox"] = self.layout.sidecar
        return [
            name
            for name, value in fingerprints.items()
            if value is None or locations[name].fingerprint(self.rel) != value
        ]

    def outdated(self) -> str | None:
        """Why an output the stages would write is not up to date (the first found); None when all are."""
        from fixed_res_sidecar.io.parquet import open_shard
        from fixed_res_sidecar.shards.crop_bbox import crop_bbox_settings
        from fixed_res_sidecar.shards.resize import build_settings
        from fixed_res_sidecar.shards.settings import read_settings, resized_sources, sidecar_sources, staleness

        layout, rel = self.layout, self.rel
        main = open_shard(layout.main, rel, "main")
        rows = main.metadata.num_rows
        for name in sorted({*self.stages.resize, *self.stages.verify}, key=list(layout.resized).index):
            output = layout.resized[name]
            settings = build_settings(output, self.options.pixels, layout.key_column, layout.image_column)
            if why := staleness(output.location, rel, rows, settings, resized_sources(layout, rel, main)):
                return f"its {name} output is {_stale_words(why)}"
        if self.stages.crop:
            recorded = {name: read_settings(o.location.parquet_file(rel)) for name, o in layout.resized.items()}
            settings = crop_bbox_settings(layout, recorded)
            if why := staleness(layout.sidecar, rel, rows, settings, sidecar_sources(layout, rel, main)):
                return f"its crop_bbox is {_stale_words(why, 'its main or resized shards')}"
        return None


def _stale_words(why: str, sources: str = "main's shard") -> str:
    """A staleness reason (shards/settings.py) as words after "is"."""
    from fixed_res_sidecar.shards import settings

    return {
        settings.ROWS: "of another row count than main's shard",
        settings.SETTINGS: "built with other settings",
        settings.SOURCES: f"built from another version of {sources}",
    }.get(why, why)
