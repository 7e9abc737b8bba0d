"""The comparison: naive, floor and fused pipelines over one corpus, interleaved shard by shard.

Every pipeline has its own worker process; they take turns on each shard in a rotating order,
so that a busy moment on a shared machine falls on all of them alike.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks import corpus as corpus_mod
from benchmarks import report
from benchmarks.common import DEFAULT_METHOD, PATCH, QUALITY, log
from benchmarks.naive_venv import NaiveRuntime, naive_runtime
from benchmarks.workers import Pipeline, WorkerProcess

# Per-shard sums of what each worker reports.
_SUMMED = ("wall", "cpu", "images", "valid", "call_wall")


def _cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pipelines_for(default_method: int, threads: int) -> list[Pipeline]:
    pipes = [
        Pipeline(
            "naive_m4",
            "naive",
            4,
            1,
            "naive (open, exif_transpose, RGB, ImageOps.fit Lanczos x2, WebP m4), see naive_worker.py",
        ),
        Pipeline("floor_m4", "floor", 4, 1, "floor (draft decode + WebP m4 encode of both, nothing else)"),
        Pipeline("fused_m4", "fused", 4, 1, "project fused build_resized_shard, m4, threads=1"),
    ]
    if default_method != 4:
        pipes += [
            Pipeline(
                f"floor_m{default_method}", "floor", default_method, 1, f"floor at the default method {default_method}"
            ),
            Pipeline(
                f"fused_m{default_method}",
                "fused",
                default_method,
                1,
                f"project fused, default m{default_method}, threads=1",
            ),
        ]
    if threads > 1:
        name = f"fused_m{default_method}_t{threads}"
        pipes.append(
            Pipeline(
                name, "fused", default_method, threads, f"project fused, default m{default_method}, threads={threads}"
            )
        )
    return pipes


def _start(pipes: list[Pipeline], main: Path, out_root: Path, naive: NaiveRuntime) -> dict[str, WorkerProcess]:
    workers: dict[str, WorkerProcess] = {}
    try:
        for p in pipes:
            workers[p.name] = WorkerProcess(p, main, out_root / p.name, naive)
    except BaseException:
        for worker in workers.values():
            worker.close()
        raise
    return workers


def _add(s: dict[str, Any], r: dict, busy: float) -> None:
    """Add one shard's measurement `r` to the pipeline's sums `s`; `busy` is the machine's busy CPU meanwhile."""
    for field in _SUMMED:
        s[field] += r[field]
    s["bytes"] = [a + b for a, b in zip(s["bytes"], r["bytes"], strict=True)]
    for key in ("phase_wall", "phase_cpu"):
        for phase, t in r.get(key, {}).items():
            s[key][phase] = s[key].get(phase, 0.0) + t
    foreign = max(0.0, busy - r["call_cpu"])  # CPU that other processes used during the call
    s["foreign_cpu"] += foreign
    s["per_shard"].append(r["wall"])
    s["per_shard_cpu"].append(r["cpu"])
    s["per_shard_foreign"].append(foreign / r["call_wall"])
    s["maxrss_mb"] = r["maxrss_mb"]


def _summary(p: Pipeline, s: dict[str, Any], pil: dict) -> dict:
    n = s["images"]
    return {
        "label": p.label,
        "kind": p.kind,
        "webp_method": p.method,
        "threads": p.threads,
        "images": n,
        "valid": s["valid"],
        "wall_s": s["wall"],
        "cpu_s": s["cpu"],
        "ms_per_image": 1000 * s["wall"] / n,
        "cpu_ms_per_image": 1000 * s["cpu"] / n,
        "images_per_s_per_core": n / (s["wall"] * p.threads),
        "images_per_s": n / s["wall"],
        "cpu_utilisation": s["cpu"] / s["wall"],
        "bytes_per_image_512": s["bytes"][0] / n,
        "bytes_per_image_1024": s["bytes"][1] / n,
        "peak_rss_mb": s["maxrss_mb"],
        "baseline_rss_mb": s["baseline_rss_mb"],
        "foreign_load_cores": s["foreign_cpu"] / s["call_wall"],
        "per_shard_wall_s": s["per_shard"],
        "per_shard_cpu_s": s["per_shard_cpu"],
        "per_shard_foreign_load_cores": s["per_shard_foreign"],
        "pil": pil,
        "phase_ms_per_image": {k: 1000 * t / n for k, t in s["phase_wall"].items()},
        "phase_cpu_ms_per_image": {k: 1000 * t / n for k, t in s["phase_cpu"].items()},
    }


def run_compare(
    workdir: Path,
    images: int,
    shards: int,
    threads: int,
    *,
    seed: int = 0,
    profile: str = "photo",
    style: str = "textured",
    naive: NaiveRuntime | None = None,
) -> dict:
    corpus = corpus_mod.ensure_corpus(workdir, images, shards, seed=seed, profile=profile, style=style, log=log)
    naive = naive or naive_runtime(workdir)
    pipes = pipelines_for(DEFAULT_METHOD, threads)
    log(
        f"compare: {corpus.images} images in {len(corpus.shards)} shards, pipelines: {', '.join(p.name for p in pipes)}"
    )
    log(f"compare: naive pipeline on {naive.info['distribution']} {naive.info['version']} ({naive.python})")
    workers = _start(pipes, corpus.main, workdir / "out", naive)
    stats: dict[str, dict[str, Any]] = {
        p.name: {
            **dict.fromkeys(_SUMMED, 0),
            "bytes": [0, 0],
            "per_shard": [],
            "per_shard_cpu": [],
            "per_shard_foreign": [],
            "foreign_cpu": 0.0,
            "phase_wall": {},
            "phase_cpu": {},
        }
        for p in pipes
    }
    load_start = os.getloadavg()
    started = time.perf_counter()
    try:
        for name, worker in workers.items():
            stats[name]["baseline_rss_mb"] = worker.call(op="warmup")["rss_mb"]
        for k, shard in enumerate(corpus.shards):
            for p in pipes[k % len(pipes) :] + pipes[: k % len(pipes)]:
                busy = _cpu_busy_seconds()
                r = workers[p.name].call(op="run", shard=shard)
                _add(stats[p.name], r, _cpu_busy_seconds() - busy)
            log(f"  shard {k + 1}/{len(corpus.shards)} done ({time.perf_counter() - started:.0f} s)")
    finally:
        for worker in workers.values():
            worker.close()
    for name, worker in workers.items():
        stats[name]["maxrss_mb"] = worker.child_maxrss_mb or stats[name].get("maxrss_mb")

    results = {p.name: _summary(p, stats[p.name], workers[p.name].ready["pil"]) for p in pipes}
    project_pil = results[f"fused_m{DEFAULT_METHOD}"]["pil"]
    naive_pil = results["naive_m4"]["pil"]
    ratios = report.ratios(results, DEFAULT_METHOD, threads)
    return {
        "mode": "compare",
        "machine": report.machine_info(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "elapsed_s": time.perf_counter() - started,
        "corpus": report.corpus_info(corpus),
        "settings": {
            "quality": QUALITY,
            "default_webp_method": DEFAULT_METHOD,
            "patch_size": PATCH,
            "threads": threads,
        },
        "naive_runtime": naive.describe(),
        "libraries": {
            "naive": naive_pil,
            "project": project_pil,
            "same_libwebp": naive_pil["libwebp"] == project_pil["libwebp"],
            "same_libjpeg_turbo": naive_pil["libjpeg_turbo"] == project_pil["libjpeg_turbo"],
        },
        "pipelines": results,
        "ratios": ratios,
        "targets": report.compare_targets(ratios),
    }
