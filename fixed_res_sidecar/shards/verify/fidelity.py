"""The fidelity check of a resized shard: do its sampled outputs show the right picture?

For each sampled valid row: the row's source image is read from main, the expected output is
derived with the pipeline and the expected settings (the dataset's, or the command's flags; never
the shard's footer, which may lie: core/fidelity.py), and the stored output is scored against it.
Per shard: the minimum and median score, the failing rows by key with their scores, and counts per
score bin (for the dataset audit).
For failing rows, `write_fidelity_pictures` draws expected | stored | difference.
"""

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from fixed_res_sidecar.core.fidelity import (
    FIDELITY_MIN_SCORE,
    Expected,
    Fidelity,
    Rendering,
    Renders,
    decoded,
    score_output,
)
from fixed_res_sidecar.core.image_cell import image_bytes
from fixed_res_sidecar.core.memory import MemoryBudget
from fixed_res_sidecar.core.overlay import comparison_picture
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.parquet import describe, open_shard
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput
from fixed_res_sidecar.shards.resize import DEFAULT_TASK_MEMORY_GB, decode_budget_bytes
from fixed_res_sidecar.shards.verify.report import (
    MAX_PROBLEMS,
    CheckResult,
    problems_result,
    read_rows,
    safe_name,
    shard_stem,
)

FIDELITY = "fidelity"
# The areas a build makes from one decode (build-both, Dagster): the expected image is made the same way.
FUSED_AREAS = tuple(resolution.area for resolution in RESOLUTIONS.values())
# Upper edges of the score bins the audit counts (dB); the last bin is everything from -0.25 up.
SCORE_BINS = {"below_-3": -3.0, "-3_to_-1": -1.0, "-1_to_-0.25": -0.25, "-0.25_up": float("inf")}


# A shard's other resolution reuses the sources and renders of at most this many compared rows (the
# renders are unencoded pixels: 5.2 MB a row at most, both areas as RGBA; 335 MB for 64 rows); past it,
# each check reads and renders its own.
SHARED_ROWS = 64


@dataclass
class SharedRenders:
    """What the fidelity checks of one shard's resolutions share: each compared row's source image
    and its expected renders. The check of the first resolution renders both (as the fused build
    does), the second one reads and renders nothing new for the same rows."""

    sources: dict[int, bytes | None] = field(default_factory=dict)
    renders: dict[int, Renders] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredSample:
    """What a fidelity check reads from the resized shard: the sampled rows' stored images (row ->
    encoded bytes) and every row's key."""

    images: Mapping[int, bytes]
    keys: list


@dataclass(frozen=True)
class Scoring:
    """How a fidelity check scores each row: the rendering expected of its shard, the score a row
    fails below, and the decode memory budget the expected images are rendered within (None: no limit)."""

    rendering: Rendering
    min_score: float
    budget: MemoryBudget | None = None


@dataclass(frozen=True)
class RowScore:
    row: int
    key: Any
    score: float | None  # None when the row could not be scored (its problem says why)
    psnr: float | None
    problem: str | None


def check_fidelity(
    layout: DatasetLayout,
    rel: str,
    output: ResizedOutput,
    stored: StoredSample,
    pixels: PixelOptions,
    min_score: float,
    shared: SharedRenders | None = None,
) -> CheckResult:
    """Score every sampled output (`stored.images`) against the picture it should show when built with
    `pixels`. `shared`: what the shard's other resolution's check read and rendered (reused, added to)."""
    uri = output.location.child(rel)
    rendering = expected_rendering(pixels, output)
    rows = sorted(stored.images)
    keep = shared is not None and len(rows) <= SHARED_ROWS
    if shared is None or not keep:  # nothing kept: the renders of every row of a large sample would not fit
        shared = SharedRenders()
    unread = [row for row in rows if row not in shared.sources]
    if unread:
        shared.sources.update(main_images(layout, rel, unread))
    scoring = Scoring(rendering, min_score, MemoryBudget(decode_budget_bytes(DEFAULT_TASK_MEMORY_GB)))
    scored = []
    for row in rows:
        renders = shared.renders.setdefault(row, Renders()) if keep else None
        source = shared.sources.get(row)
        scored.append(score_row(row, stored.keys[row], source, stored.images[row], scoring, renders))
    return fidelity_result(uri, scored, min_score)


def expected_rendering(pixels: PixelOptions, output: ResizedOutput) -> Rendering:
    """How an output of `output` built with `pixels` is rendered. Taken to be built as a fused build makes
    them (FUSED_AREAS): nothing says, and `score_output` tries the one-area path too."""
    return Rendering(output.area, pixels, FUSED_AREAS)


def main_images(layout: DatasetLayout, rel: str, rows: list[int]) -> dict[int, bytes | None]:
    """The source images of `rows` from main (only the row groups holding them are read)."""
    with open_shard(layout.main, rel, "main", columns=[layout.image_column]) as parquet_file:
        found = read_rows(parquet_file, rows, [layout.image_column])
    return {row: image_bytes(values[layout.image_column]) or None for row, values in found.items()}


def score_row(
    row: int, key: Any, source: bytes | None, stored: bytes, scoring: Scoring, renders: Renders | None = None
) -> RowScore:
    scored = scored_images(source, stored, scoring, renders)
    if isinstance(scored, str):
        return RowScore(row, key, None, None, scored)
    result = scored[0]
    return RowScore(row, key, result.score, result.psnr, result.problem)


def scored_images(
    source: bytes | None, stored: bytes, scoring: Scoring, renders: Renders | None = None
) -> tuple[Fidelity, Expected, Image.Image] | str:
    """(the score, the expected output, the stored one decoded), or why they cannot be compared."""
    try:
        stored_image = decoded(stored)
    except Exception as exc:  # noqa: BLE001 - a stored image that does not decode fails this row
        return f"the stored image does not decode: {describe(exc)}"
    scored = score_output(source, stored_image, scoring.rendering, scoring.budget, scoring.min_score, renders)
    if isinstance(scored, str):
        return scored
    return (*scored, stored_image)


def fidelity_result(uri: str, scored: list[RowScore], min_score: float) -> CheckResult:
    scores = [s.score for s in scored if s.score is not None]
    failing = [s for s in scored if s.problem is not None]
    bins = dict.fromkeys(SCORE_BINS, 0)
    for score in scores:
        bins[next(name for name, upper in SCORE_BINS.items() if score < upper)] += 1
    metadata = {
        "checked": len(scored),
        "failing_rows": len(failing),
        "min_score": min(scores) if scores else None,
        "median_score": round(statistics.median(scores), 2) if scores else None,
        "min_score_allowed": min_score,
        "score_bins": bins,
        "failing": [
            {"row": s.row, "key": s.key, "score": s.score, "psnr": s.psnr, "problem": s.problem} for s in failing
        ],
    }
    if failing:
        problems = [{"row": s.row, "key": s.key, "problem": s.problem} for s in failing]
        return problems_result(
            FIDELITY, uri, f"of {len(scored)} sampled images are not the expected picture", problems, metadata
        )
    if not scored:
        return CheckResult(FIDELITY, True, f"{uri}: no valid row to compare", metadata)
    message = (
        f"{uri}: {len(scored)} sampled images show the expected picture "
        f"(score min {metadata['min_score']:.2f} dB, median {metadata['median_score']:.2f} dB, "
        f"fail below {min_score:g} dB)"
    )
    return CheckResult(FIDELITY, True, message, metadata)


def _dB(score: float | None) -> str:
    return "none" if score is None else f"{score:.2f} dB"


def write_fidelity_pictures(
    layout: DatasetLayout, rel: str, resolution: str, check: CheckResult, pixels: PixelOptions, directory: Location
) -> list[str]:
    """For each failing row of a fidelity `check` (the first MAX_PROBLEMS), its expected image (with `pixels`)
    | stored | difference, as PNG under `directory/<rel without .parquet>/<resolution>/<row>-<key>.png`;
    returns their URIs. Rows whose images cannot be made get no picture."""
    min_score = check.metadata.get("min_score_allowed", FIDELITY_MIN_SCORE)
    failing = check.metadata.get("failing", [])[:MAX_PROBLEMS]
    if not failing:
        return []
    output = layout.resized[resolution]
    rows = [f["row"] for f in failing]
    with open_shard(output.location, rel, "output") as parquet_file:
        stored = read_rows(parquet_file, rows, [layout.image_column])
    scoring = Scoring(expected_rendering(pixels, output), min_score)
    sources = main_images(layout, rel, rows)
    written = []
    for entry in failing:
        row = entry["row"]
        stored_bytes = image_bytes(stored[row][layout.image_column])
        if stored_bytes is None:  # no stored image: nothing to compare
            continue
        scored = scored_images(sources.get(row), stored_bytes, scoring)
        if isinstance(scored, str):
            continue
        result, expected, stored_image = scored
        picture = comparison_picture(expected.image, stored_image, f"score {_dB(result.score)}")
        target = f"{shard_stem(rel)}/{resolution}/{row:06d}-{safe_name(entry['key'])}.png"
        directory.write_bytes(target, picture, protect=layout.read_only)
        written.append(directory.child(target))
    return written
