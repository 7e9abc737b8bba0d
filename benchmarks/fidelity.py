"""Fidelity: score distributions of good and damaged outputs, and the verifier's cost with and without it.

    python -m benchmarks --fidelity [--fidelity-rows 200]

Scores: on varied sources (photos, graphics, greyscale, palette, transparency, EXIF-rotated, tiny
and huge), at both resolutions, the PSNR (core/fidelity.py) against the expected image of
- good outputs: the default build (WebP method 4), WebP methods 0 and 6, JPEG output;
- every damage of benchmarks/damage.py applied to the default output;
- moderate damage (MODERATE: WebP q60 and q30, a blur of radius 1.5), reported per source, not in the margins.
The threshold (FIDELITY_MIN_SCORE) must sit between the lowest good score and the highest damage
score with a wide margin on both sides.

Cost: one main shard of photo-like images (`--fidelity-rows`, of the "textured" corpus), built
fused (both resolutions), then verified at both resolutions with the default sample, with and
without the fidelity check: seconds per shard, and the verifier's share of the build.
"""

from __future__ import annotations

import io
import math
import random
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFilter

from benchmarks import corpus as corpus_mod
from benchmarks.common import log
from benchmarks.damage import DAMAGE, encode_damaged
from fixed_res_sidecar.core.fidelity import FIDELITY_MIN_SCORE, Rendering, Renders, decoded, score_output
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.pixels import process_image
from fixed_res_sidecar.core.resolutions import RESOLUTIONS
from fixed_res_sidecar.sample_data import make_photo

GOOD = {
    "webp_method_4 (default)": PixelOptions(),
    "webp_method_0": PixelOptions(webp_method=0),
    "webp_method_6": PixelOptions(webp_method=6),
    "jpeg_q95": PixelOptions(output_format="jpeg"),
}
SINGLE = "built_alone (one resolution)"
# Moderate damage, re-encoded as WebP q95 unless it is the re-compression itself: reported, not part of the
# margins (how much a re-compression loses against a fresh build depends on the picture; docs/fidelity.md).
MODERATE = {
    "recompressed_q60": lambda image: (image, 60),
    "recompressed_q30": lambda image: (image, 30),
    "blurred_r1.5": lambda image: (image.filter(ImageFilter.GaussianBlur(1.5)), PixelOptions().quality),
}


def _webp(image: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "WEBP", quality=quality)
    return out.getvalue()


AREAS = {name: resolution.area for name, resolution in RESOLUTIONS.items()}


def _jpeg(image: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, **save)
    return out.getvalue()


def _png(image: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **save)
    return out.getvalue()


def _graphic(width: int, height: int, seed: int) -> Image.Image:
    """Flat colours, hard edges and thin lines: a chart or a screenshot."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (250, 250, 245))
    draw = ImageDraw.Draw(image)
    for _ in range(30):
        x, y = rng.randrange(width), rng.randrange(height)
        w, h = rng.randrange(width // 20, width // 3), rng.randrange(height // 20, height // 3)
        colour = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            draw.rectangle((x, y, x + w, y + h), fill=colour)
        else:
            draw.line((x, y, x + w, y + h), fill=colour, width=rng.randrange(1, 4))
    for row in range(0, height, max(8, height // 30)):
        draw.text((5, row), "label 12.5% " * 4, fill=(20, 20, 20))
    return image


def _cut_out(width: int, height: int, seed: int, visible: float = 0.2) -> Image.Image:
    """A photo cut-out as product pictures are: an ellipse of `visible` of the area, soft edge, fully
    transparent around it (the kind whose damage scored 0.00 while the error was averaged over every pixel)."""
    photo = Image.open(io.BytesIO(make_photo(width, height, seed)[0])).convert("RGB")
    alpha = Image.new("L", (width, height), 0)
    scale = (visible * 4 / np.pi) ** 0.5  # the ellipse's axes as fractions of the sides
    box = (width * (1 - scale) / 2, height * (1 - scale) / 2, width * (1 + scale) / 2, height * (1 + scale) / 2)
    ImageDraw.Draw(alpha).ellipse(box, fill=255)
    photo.putalpha(alpha.filter(ImageFilter.GaussianBlur(4)))
    return photo


def _transparent(width: int, height: int, seed: int) -> Image.Image:
    """A photo cut-out: shapes on a fully transparent background, soft alpha edges."""
    photo = Image.open(io.BytesIO(make_photo(width, height, seed)[0])).convert("RGB")
    alpha = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(alpha)
    draw.ellipse((width // 8, height // 8, width * 7 // 8, height * 7 // 8), fill=255)
    gradient = Image.linear_gradient("L").resize((width, height))
    photo.putalpha(Image.composite(alpha, gradient.point(lambda v: v // 2), alpha))
    return photo


def varied_sources(huge: bool = True, quick: bool = False) -> dict[str, bytes]:
    """Name -> encoded source image of every kind the check must score fairly (`quick`: three small
    ones, for the smoke test)."""
    if quick:
        return {
            "photo_smooth_jpeg": make_photo(320, 240, 1)[0],
            "transparency_png": _png(_transparent(300, 200, 4)),
            "greyscale_jpeg": _jpeg(corpus_mod.textured_photo(300, 200, 7).convert("L")),
        }
    textured = corpus_mod.textured_photo(1600, 1200, 7)
    sources = {
        "photo_smooth_jpeg": make_photo(1200, 900, 1)[0],
        "photo_textured_jpeg": _jpeg(textured),
        "photo_portrait_jpeg": make_photo(900, 1400, 2)[0],
        "graphic_png": _png(_graphic(1280, 800, 3)),
        "greyscale_jpeg": _jpeg(textured.convert("L")),
        "palette_png": _png(textured.quantize(64)),
        "transparency_png": _png(_transparent(1000, 800, 4)),
        "cut_out_png": _png(_cut_out(1000, 800, 4)),
        "exif_rotated_6_jpeg": make_photo(1200, 800, 5, orientation=6)[0],
        "exif_rotated_3_jpeg": make_photo(1000, 1000, 6, orientation=3)[0],
        "tiny_jpeg": _jpeg(corpus_mod.textured_photo(48, 36, 8)),
    }
    if huge:
        sources["huge_jpeg_24mp"] = _jpeg(corpus_mod.textured_photo(6000, 4000, 9))
    return sources


def score_distributions(sources: dict[str, bytes]) -> dict:
    """Per good variant and per damage: every score (both resolutions, every source), min, median, max."""
    scores: dict[str, list[float]] = {name: [] for name in [*GOOD, SINGLE, *DAMAGE, *MODERATE]}
    detail: list[dict] = []
    names = list(sources)
    defaults = {name: process_image(data, list(AREAS.values()), PixelOptions()) for name, data in sources.items()}
    fused = list(AREAS.values())

    def score(
        data: bytes, renders: Renders, stored: Image.Image, area: int, options: PixelOptions = PixelOptions()
    ) -> float:
        """As the verifier scores (core/fidelity.py `score_output`): the fused path, else the one-area path.
        `renders`: the source's expected renders and outputs, made once for all its scores."""
        scored = score_output(data, stored, Rendering(area, options, built_with=fused), renders=renders)
        if isinstance(scored, str):
            raise RuntimeError(scored)
        return scored[0].score

    for index, (name, data) in enumerate(sources.items()):
        other_name = names[(index + 1) % len(names)]
        renders = Renders()
        built = {  # each good variant's fused build (the default's is made above)
            variant: defaults[name] if options == PixelOptions() else process_image(data, fused, options)
            for variant, options in GOOD.items()
        }
        for position, (resolution, area) in enumerate(AREAS.items()):
            row = {"source": name, "resolution": resolution}
            # Built alone (build-0-262mp / build-1-05mp): another resampling path than the fused one.
            (alone,) = process_image(data, [area], PixelOptions())
            row[SINGLE] = score(data, renders, decoded(alone.image), area)
            for variant, options in GOOD.items():
                # Built with `options`, compared with what the default settings expect: another encoder
                # effort stands in for another libwebp (with its own settings the score is 0 by construction).
                # JPEG output is compared with its own settings (alpha composited on white, as it expects).
                reference = PixelOptions() if options.output_format == "webp" else options
                row[variant] = score(data, renders, decoded(built[variant][position].image), area, reference)
            stored = decoded(defaults[name][position].image)
            others = {
                "other": decoded(defaults[other_name][position].image),
                "other_resolution": decoded(defaults[name][1 - position].image),
            }
            for damage in DAMAGE:
                if damage != "heavy_recompression" and _unchanged(DAMAGE[damage](stored, **others), stored):
                    continue  # e.g. the channels of a grey picture reversed: the same picture, nothing to catch
                damaged = decoded(encode_damaged(damage, stored, "webp", PixelOptions().quality, **others))
                row[damage] = score(data, renders, damaged, area)
            for damage, make in MODERATE.items():
                row[damage] = score(data, renders, decoded(_webp(*make(stored))), area)
            for variant, value in row.items():
                if variant in scores:
                    scores[variant].append(value)
            detail.append(row)
    summary = {
        name: {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
        for name, values in scores.items()
    }
    good_min = min(summary[name]["min"] for name in [*GOOD, SINGLE])
    damage_max = max(summary[name]["max"] for name in DAMAGE)
    return {
        "threshold": FIDELITY_MIN_SCORE,
        "lowest_good": good_min,
        "highest_damage": damage_max,
        "margins_db": {"good": good_min - FIDELITY_MIN_SCORE, "damage": FIDELITY_MIN_SCORE - damage_max},
        "summary": summary,
        "per_source": detail,
    }


def _unchanged(damaged: Image.Image, stored: Image.Image) -> bool:
    if damaged.size != stored.size:
        return False
    return np.array_equal(np.asarray(damaged.convert("RGBA")), np.asarray(stored.convert("RGBA")))


def verifier_cost(workdir: Path, rows: int, seed: int = 0, profile: str = "photo") -> dict:
    """Build one shard of `rows` photo-like images (fused, one thread), then verify both resolutions
    without fidelity, with it at the default sample, and comparing all 32 decoded images; CPU seconds
    (the process's: the shared machine's other load does not count), and the verifier's share of the
    build, measured and for a 1,000-row shard of the same images (the verifier's cost does not grow
    with the rows once they exceed the sample; the build's does)."""
    from fixed_res_sidecar.io.locations import Location
    from fixed_res_sidecar.shards.layout import DatasetLayout, resized_output
    from fixed_res_sidecar.shards.resize import build_resized_shard
    from fixed_res_sidecar.shards.verify import SharedRenders, VerifyOptions, verify_resized_shard

    root = workdir / f"fidelity-cost-{profile}-{rows}-{seed}"
    main = root / "main"
    if not (main / "shard.parquet").exists():
        shutil.rmtree(root, ignore_errors=True)
        main.mkdir(parents=True)
        log(f"fidelity cost: writing a main shard of {rows} images")
        images = [corpus_mod.encode_spec(spec) for spec in corpus_mod.corpus_specs(rows, seed, profile)]
        table = pa.table({"image_key": [f"k{i:05d}" for i in range(rows)], "image": images})
        pq.write_table(table, main / "shard.parquet", row_group_size=corpus_mod.ROW_GROUP_ROWS)
    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    layout = DatasetLayout(
        Location.parse(main),
        {name: resized_output(name, Location.parse(out / name)) for name in RESOLUTIONS},
    )
    started = time.process_time()
    build_resized_shard(layout, "shard.parquet", threads=1)
    build = time.process_time() - started
    defaults = VerifyOptions()
    variants = {
        "without_fidelity": replace(defaults, fidelity=False),
        f"default (fidelity on {defaults.fidelity_sample} of {defaults.sample})": defaults,
        f"fidelity on all {defaults.sample} sampled": replace(defaults, fidelity_sample=None),
    }
    verify = {}
    for label, options in variants.items():
        log(f"fidelity cost: verifying, {label}")
        started = time.process_time()
        shared = SharedRenders()  # as the pipeline verifies a shard's two resolutions
        for name in RESOLUTIONS:
            report = verify_resized_shard(layout, "shard.parquet", name, options, shared)
            if not report.passed:
                raise RuntimeError(f"the good shard failed: {[c.message for c in report.failed_checks]}")
        verify[label] = time.process_time() - started
    per_row = build / rows
    return {
        "rows": rows,
        "profile": profile,
        "sample": defaults.sample,
        "fidelity_sample": defaults.fidelity_sample,
        "build_cpu_s": build,
        "build_cpu_s_per_row": per_row,
        "verify_cpu_s": verify,
        "verify_share_of_build": {label: seconds / build for label, seconds in verify.items()},
        "verify_share_of_build_1000_rows": {label: seconds / (per_row * 1000) for label, seconds in verify.items()},
    }


def coverage_walk(workdir: Path, rows: int, seed: int = 0, profile: str = "photo", budget: float = 600.0) -> dict:
    """Successive default verifications of the shard `verifier_cost` built (both resolutions, each continuing
    the rolling fidelity window of the previous one: shards/verify/coverage.py) until every valid row was
    compared: how many it takes (ceil(valid / window)), the CPU seconds of each, and what a fidelity sweep
    with `budget` CPU seconds per hour covers: shard verifications per hour, and the hours a dataset of
    10,000 shards of 1,000 rows of these images takes to have every row compared (one verification of a
    shard costs about the same whatever its rows: the window is fixed)."""
    from fixed_res_sidecar.io.locations import Location
    from fixed_res_sidecar.shards.layout import DatasetLayout, resized_output
    from fixed_res_sidecar.shards.verify import COVERAGE_STAT, SharedRenders, VerifyOptions, verify_resized_shard

    root = workdir / f"fidelity-cost-{profile}-{rows}-{seed}"
    layout = DatasetLayout(
        Location.parse(root / "main"),
        {name: resized_output(name, Location.parse(root / "out" / name)) for name in RESOLUTIONS},
    )
    options, previous = VerifyOptions(), dict.fromkeys(RESOLUTIONS)
    seconds, coverage = [], {}
    while True:
        started = time.process_time()
        shared = SharedRenders()
        for name in RESOLUTIONS:
            report = verify_resized_shard(layout, "shard.parquet", name, options, shared, previous[name])
            if not report.passed:
                raise RuntimeError(f"the good shard failed: {[c.message for c in report.failed_checks]}")
            coverage[name] = previous[name] = report.stats[COVERAGE_STAT]
        seconds.append(time.process_time() - started)
        log(f"fidelity coverage: verification {len(seconds)}: {[c['compared_ever'] for c in coverage.values()]} rows")
        if all(c["compared_ever"] >= c["comparable"] for c in coverage.values()):
            break
    per_verification = statistics.median(seconds)
    windows_1000 = math.ceil(1000 / options.fidelity_sample) if options.fidelity_sample else 1
    per_hour = budget / per_verification
    return {
        "rows": rows,
        "window": options.fidelity_sample,
        "comparable": {name: c["comparable"] for name, c in coverage.items()},
        "verifications_to_full_coverage": len(seconds),
        "expected": max(math.ceil(c["comparable"] / options.fidelity_sample) for c in coverage.values()),
        "cpu_s_per_verification": per_verification,
        "cpu_s_to_full_coverage": sum(seconds),
        "sweep_budget_cpu_s_per_hour": budget,
        "sweep_shard_verifications_per_hour": per_hour,
        "sweep_hours_10000_shards_of_1000_rows": 10_000 * windows_1000 / per_hour,
    }


def run_fidelity(workdir: Path, rows: int, quick: bool = False, seed: int = 0, profile: str = "photo") -> dict:
    log("fidelity: scoring good and damaged outputs")
    report = {"scores": score_distributions(varied_sources(quick=quick))}
    log("fidelity: verifier cost")
    report["cost"] = verifier_cost(workdir, rows, seed, profile)
    log("fidelity: rolling coverage")
    report["coverage"] = coverage_walk(workdir, rows, seed, profile)
    return report


def print_fidelity(report: dict) -> None:
    scores = report["scores"]
    print(f"Fidelity scores (dB against a fresh build of the expected image; failing below {scores['threshold']:g} dB)")
    print(f"{'output':<28}{'n':>4}{'min':>9}{'median':>9}{'max':>9}")
    for name, values in scores["summary"].items():
        print(f"{name:<28}{values['n']:>4}{values['min']:>9.2f}{values['median']:>9.2f}{values['max']:>9.2f}")
    margins = scores["margins_db"]
    print(
        f"lowest good {scores['lowest_good']:.2f} dB ({margins['good']:.2f} dB above the threshold), "
        f"highest damage {scores['highest_damage']:.2f} dB ({margins['damage']:.2f} dB below it; "
        f"moderate damage ({', '.join(MODERATE)}) is not in the margins)"
    )
    print(f"Moderate damage per source (512 / 1024): {', '.join(MODERATE)}")
    by_source: dict[str, list[dict]] = {}
    for row in scores["per_source"]:
        by_source.setdefault(row["source"], []).append(row)
    for source, rows in by_source.items():
        cells = ["/".join(f"{row[name]:.2f}" for row in rows) for name in MODERATE]
        print(f"  {source:<26}" + "".join(f"{cell:>16}" for cell in cells))
    cost = report["cost"]
    print(
        f"Verifier cost, one shard of {cost['rows']} {cost['profile']} rows, both resolutions, CPU seconds: "
        f"build {cost['build_cpu_s']:.1f} s ({1000 * cost['build_cpu_s_per_row']:.0f} ms per row)"
    )
    print(f"{'verify':<36}{'cpu s':>8}{'share':>8}{'share at 1,000 rows':>21}")
    for label, seconds in cost["verify_cpu_s"].items():
        share, share_1000 = cost["verify_share_of_build"][label], cost["verify_share_of_build_1000_rows"][label]
        print(f"{label:<36}{seconds:>8.2f}{100 * share:>7.1f}%{100 * share_1000:>20.1f}%")
    walk = report.get("coverage")
    if walk:
        print(
            f"Rolling fidelity coverage, the same shard ({walk['comparable']} comparable rows, window "
            f"{walk['window']}): every row compared after {walk['verifications_to_full_coverage']} verifications "
            f"(ceil(rows / window) = {walk['expected']}), {walk['cpu_s_per_verification']:.2f} CPU s each (both "
            f"resolutions), {walk['cpu_s_to_full_coverage']:.1f} CPU s in all"
        )
        print(
            f"Fidelity sweep at {walk['sweep_budget_cpu_s_per_hour']:g} CPU s per hour: "
            f"{walk['sweep_shard_verifications_per_hour']:.0f} shard verifications per hour; 10,000 shards of 1,000 "
            f"such rows fully compared in {walk['sweep_hours_10000_shards_of_1000_rows']:,.0f} hours"
        )
