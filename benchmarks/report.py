"""The comparison's report: time ratios, issue 6's targets, the printed tables; machine and corpus facts for every mode."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

from benchmarks.corpus import Corpus
from fixed_res_sidecar.core.pixel_settings import library_versions

# Targets of issue 6.
TARGET_VS_NAIVE = 1.6  # fused (method 4, 1 thread) at least this many times faster than naive
TARGET_VS_FLOOR = 1.15  # fused time at most this many times the floor's
TARGET_THREADS = 1.8  # threads=2 throughput at least this many times threads=1
TARGET_RSS_MB = 1500
QUIET_LOAD_CORES = 0.25  # a shard measurement counts as "quiet" when other processes used less than this

PHASE_TEXT = {
    ("naive", "decode"): "open+decode+exif_transpose+RGB",
    ("naive", "resize"): "ImageOps.fit Lanczos x2",
    ("naive", "encode"): "WebP encode x2",
    ("floor", "decode"): "draft decode",
    ("floor", "encode"): "WebP encode x2",
}


def machine_info() -> dict:
    try:
        pyarrow = metadata.version("pyarrow")
    except metadata.PackageNotFoundError:
        pyarrow = None
    libraries = library_versions()  # the project's PIL, as its build settings record it
    return {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "pil": libraries["pillow_distribution"],
        "libwebp": libraries["libwebp"],
        "libjpeg_turbo": libraries["libjpeg_turbo"],
        "pyarrow": pyarrow,
    }


def corpus_info(corpus: Corpus) -> dict:
    specs = corpus.specs
    megapixels = [s.megapixels for s in specs]
    return {
        "path": str(corpus.root),
        "images": len(specs),
        "shards": len(corpus.shards),
        "jpeg": sum(s.format == "JPEG" for s in specs),
        "png": sum(s.format == "PNG" for s in specs),
        "exif_rotated": sum(s.orientation != 1 for s in specs),
        "long_side_min": min(max(s.width, s.height) for s in specs),
        "long_side_max": max(max(s.width, s.height) for s in specs),
        "megapixels_mean": sum(megapixels) / len(specs),
        "pixel_share_8_30mp": sum(m for m in megapixels if 8 <= m <= 30) / sum(megapixels),
        "source_bytes": corpus.source_bytes,
    }


# ============================================================================ ratios and targets


def _per_shard_ratio(a: dict, b: dict) -> list[float]:
    return [x / y for x, y in zip(a["per_shard_wall_s"], b["per_shard_wall_s"], strict=True)]


def _quiet_ratio(a: dict, b: dict) -> tuple[float | None, int]:
    """Wall-time ratio a/b over the shards where both measurements ran on a quiet machine."""
    quiet = [
        i
        for i, (fa, fb) in enumerate(
            zip(a["per_shard_foreign_load_cores"], b["per_shard_foreign_load_cores"], strict=True)
        )
        if fa < QUIET_LOAD_CORES and fb < QUIET_LOAD_CORES
    ]
    if not quiet:
        return None, 0
    return sum(a["per_shard_wall_s"][i] for i in quiet) / sum(b["per_shard_wall_s"][i] for i in quiet), len(quiet)


def _pair(a: dict, b: dict) -> dict:
    """Time ratio of pipeline results a / b."""
    per_shard = _per_shard_ratio(a, b)
    quiet, quiet_shards = _quiet_ratio(a, b)
    return {
        "wall": a["wall_s"] / b["wall_s"],
        "wall_quiet_shards": quiet,
        "quiet_shards": quiet_shards,
        "cpu": a["cpu_s"] / b["cpu_s"],
        "per_shard_wall_min": min(per_shard),
        "per_shard_wall_max": max(per_shard),
    }


def ratios(results: dict, default_method: int, threads: int) -> dict:
    naive, floor, fused = results["naive_m4"], results["floor_m4"], results["fused_m4"]
    out: dict[str, Any] = {
        "fused_m4_over_naive_m4": _pair(fused, naive),  # below 1/1.6 = 0.625 meets the target
        "fused_m4_over_floor_m4": _pair(fused, floor),  # at most 1.15 meets the target
    }
    single = results[f"fused_m{default_method}"]
    if default_method != 4:
        out[f"fused_m{default_method}_over_naive_m4"] = _pair(single, naive)
        out[f"fused_m{default_method}_over_floor_m{default_method}"] = _pair(
            single, results[f"floor_m{default_method}"]
        )
    if threads > 1:
        multi = results[f"fused_m{default_method}_t{threads}"]
        quiet, quiet_shards = _quiet_ratio(single, multi)
        speedups = [1 / r for r in _per_shard_ratio(multi, single)]
        out["threads_speedup"] = {
            "threads": threads,
            "wall": single["wall_s"] / multi["wall_s"],
            "wall_quiet_shards": quiet,
            "quiet_shards": quiet_shards,
            "per_shard_wall_min": min(speedups),
            "per_shard_wall_max": max(speedups),
            "cpu_utilisation": multi["cpu_utilisation"],
            "foreign_load_cores": multi["foreign_load_cores"],
        }
    return out


def compare_targets(r: dict) -> dict:
    vs_naive, vs_floor = r["fused_m4_over_naive_m4"], r["fused_m4_over_floor_m4"]
    speedup_wall, speedup_cpu = 1 / vs_naive["wall"], 1 / vs_naive["cpu"]
    targets = {
        "fused_m4_at_least_1.6x_naive": {
            "speedup_wall": speedup_wall,
            "speedup_cpu": speedup_cpu,
            "target": TARGET_VS_NAIVE,
            "met_wall": speedup_wall >= TARGET_VS_NAIVE,
            "met_cpu": speedup_cpu >= TARGET_VS_NAIVE,
        },
        "fused_m4_within_1.15x_floor": {
            "ratio_wall": vs_floor["wall"],
            "ratio_cpu": vs_floor["cpu"],
            "target": TARGET_VS_FLOOR,
            "met_wall": vs_floor["wall"] <= TARGET_VS_FLOOR,
            "met_cpu": vs_floor["cpu"] <= TARGET_VS_FLOOR,
        },
    }
    if "threads_speedup" in r:
        t = r["threads_speedup"]
        targets["threads_speedup_at_least_1.8x"] = {
            "speedup_wall": t["wall"],
            "target": TARGET_THREADS,
            "met_wall": t["wall"] >= TARGET_THREADS,
        }
    return targets


# ============================================================================ printing


def _fmt(value: float | None, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.3f}{suffix}"


def _pil_text(info: dict) -> str:
    simd = "pillow-simd" if info["is_pillow_simd"] else "not pillow-simd"
    return (
        f"{info['distribution']} {info['version']} ({simd}), libwebp {info['libwebp']}, "
        f"libjpeg-turbo {info['libjpeg_turbo']}, pyarrow {info['pyarrow']}"
    )


def _pil_short(info: dict) -> str:
    name = "pillow-simd" if info["is_pillow_simd"] else "Pillow"
    return f"{name} {info['version']} (libwebp {info['libwebp']})"


def print_compare(report: dict) -> None:
    m, c, res, r = report["machine"], report["corpus"], report["pipelines"], report["ratios"]
    print(f"\n## Comparison ({report['elapsed_s']:.0f} s)\n")
    lib = report["libraries"]
    print(
        f"machine: {m['affinity']} cores, python {m['python']}; load average {report['load_average_start'][0]:.2f} -> "
        f"{report['load_average_end'][0]:.2f}"
    )
    rt = report["naive_runtime"]
    if rt["kind"] == "venv":
        where = f"venv {rt['venv']}{' (created by this run)' if rt['created'] else ''}"
    else:
        where = "the installed PIL (--naive-on-installed-pil)"
    print(f"naive baseline: {_pil_text(lib['naive'])}; runs on {where}")
    print(f"floor and fused: {_pil_text(lib['project'])}; the project's installed PIL")
    if not lib["same_libwebp"] or not lib["same_libjpeg_turbo"]:
        print(
            "NOTE: the naive baseline's codecs differ from the project's (libwebp "
            f"{lib['naive']['libwebp']} vs {lib['project']['libwebp']}, libjpeg-turbo {lib['naive']['libjpeg_turbo']} vs "
            f"{lib['project']['libjpeg_turbo']}): compare the encode and decode shares below, not only the totals"
        )
    print(
        f"corpus: {c['images']} images ({c['jpeg']} JPEG, {c['png']} PNG, {c['exif_rotated']} EXIF-rotated), long sides "
        f"{c['long_side_min']}-{c['long_side_max']} px, mean {c['megapixels_mean']:.1f} MP, {100 * c['pixel_share_8_30mp']:.0f}% "
        f"of pixels in 8-30 MP images, {c['source_bytes'] / 1e6:.0f} MB; {c['shards']} shards, pipelines interleaved per shard"
    )
    print(
        f"settings: WebP q{report['settings']['quality']}, project default method {report['settings']['default_webp_method']}\n"
    )
    print(
        "| pipeline | PIL (libwebp) | threads | img/s/core | ms/img (wall) | CPU ms/img | 512 B/img | 1024 B/img "
        "| peak RSS MB | other load (cores) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, x in res.items():
        print(
            f"| {name} | {_pil_short(x['pil'])} | {x['threads']} | {x['images_per_s_per_core']:.2f} | {x['ms_per_image']:.0f} | "
            f"{x['cpu_ms_per_image']:.0f} | {x['bytes_per_image_512']:,.0f} | {x['bytes_per_image_1024']:,.0f} | "
            f"{x['peak_rss_mb']:.0f} | {x['foreign_load_cores']:.2f} |"
        )
    print("\ntime split, ms/img wall (CPU):")
    for name, x in res.items():
        if x["phase_ms_per_image"]:
            parts = ", ".join(
                f"{PHASE_TEXT.get((x['kind'], k), k)} {t:.0f} ({x['phase_cpu_ms_per_image'][k]:.0f})"
                for k, t in x["phase_ms_per_image"].items()
            )
            print(f"  {name} ({_pil_short(x['pil'])}): {parts}")
    print("\ntime ratios (project / reference; wall, CPU, per-shard wall range):")
    for name, x in r.items():
        if name == "threads_speedup":
            print(
                f"  threads={x['threads']} speed-up over threads=1: {x['wall']:.2f}x, {_fmt(x['wall_quiet_shards'], 'x')} on "
                f"{x['quiet_shards']} quiet shards (per shard {x['per_shard_wall_min']:.2f}-"
                f"{x['per_shard_wall_max']:.2f}; CPU use {x['cpu_utilisation']:.2f} cores; other load {x['foreign_load_cores']:.2f} cores)"
            )
        else:
            print(
                f"  {name}: {x['wall']:.3f} wall, {x['cpu']:.3f} CPU, {_fmt(x['wall_quiet_shards'])} wall on {x['quiet_shards']} "
                f"quiet shards (per shard wall {x['per_shard_wall_min']:.3f}-{x['per_shard_wall_max']:.3f})"
            )
    print("\ntargets:")
    for name, t in report["targets"].items():
        print(
            "  " + name + ": " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in t.items())
        )
