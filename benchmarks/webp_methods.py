"""WebP methods: encode time, bytes and PSNR of each method on the floor's outputs, and issue 6's rule for the default."""

from __future__ import annotations

import io
import math
import time
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks import corpus as corpus_mod
from benchmarks.common import QUALITY, log
from benchmarks.floor import cheapest_decode, encode_webp, resized_outputs
from benchmarks.report import corpus_info, machine_info

# Issue 6's rule for a faster default WebP method.
PSNR_TOLERANCE_DB = 0.1
BYTES_TOLERANCE = 0.01
# "Faster" in that rule means at least this much less encode time: smaller gaps are within
# the run-to-run noise of a shared machine (methods 3 and 4 typically land within 1% of each other).
MIN_TIME_GAIN = 0.05


def psnr(reference: np.ndarray, data: bytes) -> float:
    decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)
    mse = float(np.mean((decoded - reference) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _row(x: dict, n: int) -> dict:
    return {
        "encode_cpu_ms_per_image": 1000 * sum(x["cpu"]) / n,
        "encode_cpu_ms_512": 1000 * x["cpu"][0] / n,
        "encode_cpu_ms_1024": 1000 * x["cpu"][1] / n,
        "encode_wall_ms_per_image": 1000 * sum(x["wall"]) / n,
        "bytes_512": x["bytes"][0] / n,
        "bytes_1024": x["bytes"][1] / n,
        "psnr_512": float(np.mean(x["psnr"][0])),
        "psnr_1024": float(np.mean(x["psnr"][1])),
        "psnr_min_512": float(np.min(x["psnr"][0])),
        "psnr_min_1024": float(np.min(x["psnr"][1])),
    }


def run_webp_methods(
    workdir: Path,
    images: int,
    shards: int,
    methods: tuple[int, ...],
    *,
    seed=0,
    profile="photo",
    style="textured",
    limit=None,
) -> dict:
    corpus = corpus_mod.ensure_corpus(workdir, images, shards, seed=seed, profile=profile, style=style, log=log)
    per = {m: {"cpu": [0.0, 0.0], "wall": [0.0, 0.0], "bytes": [0, 0], "psnr": [[], []]} for m in methods}
    n = 0
    started = time.perf_counter()
    for shard in corpus.shards:
        for data in corpus_mod.shard_images(corpus.main, shard):
            if limit is not None and n >= limit:
                break
            image, orientation, plans = cheapest_decode(data)
            outputs = resized_outputs(image, orientation, plans)
            del image
            references = [np.asarray(o, dtype=np.float64) for o in outputs]
            # Rotated per image, so that no method always runs first (and takes whatever that position costs).
            order = methods[n % len(methods) :] + methods[: n % len(methods)]
            for m in order:
                for i, output in enumerate(outputs):
                    c, w = time.thread_time(), time.perf_counter()
                    encoded = encode_webp(output, m)
                    per[m]["wall"][i] += time.perf_counter() - w
                    per[m]["cpu"][i] += time.thread_time() - c
                    per[m]["bytes"][i] += len(encoded)
                    per[m]["psnr"][i].append(psnr(references[i], encoded))
            n += 1
            if n % 20 == 0:
                log(f"  webp methods: {n} images ({time.perf_counter() - started:.0f} s)")
    rows = {m: _row(per[m], n) for m in methods}
    return {
        "mode": "webp_methods",
        "machine": machine_info(),
        "corpus": corpus_info(corpus),
        "images": n,
        "quality": QUALITY,
        "methods": rows,
        "choice": choose_method(rows),
    }


def choose_method(rows: dict) -> dict:
    """Issue 6's rule: a method faster than 4 becomes default only if within 0.1 dB and +1% bytes of method 4."""
    if 4 not in rows:
        return {"default": None, "reason": "method 4 not measured"}
    ref = rows[4]
    verdicts = {}
    for m, x in rows.items():
        reasons = []
        gain = 1 - x["encode_cpu_ms_per_image"] / ref["encode_cpu_ms_per_image"]
        if gain < MIN_TIME_GAIN:
            reasons.append(
                "not faster" if gain <= 0 else f"only {100 * gain:.1f}% faster (< {100 * MIN_TIME_GAIN:.0f}%)"
            )
        for size in ("512", "1024"):
            drop = ref[f"psnr_{size}"] - x[f"psnr_{size}"]
            if drop > PSNR_TOLERANCE_DB:
                reasons.append(f"PSNR {size} {drop:.2f} dB lower")
            growth = x[f"bytes_{size}"] / ref[f"bytes_{size}"] - 1
            if growth > BYTES_TOLERANCE:
                reasons.append(f"{size} files {100 * growth:.1f}% larger")
        verdicts[m] = reasons
    eligible = [m for m, reasons in verdicts.items() if m != 4 and not reasons]
    best = min(eligible, key=lambda m: rows[m]["encode_cpu_ms_per_image"]) if eligible else 4
    return {
        "default": best,
        "eligible": eligible,
        "verdicts": {m: (r or ["eligible"]) if m != 4 else ["reference"] for m, r in verdicts.items()},
    }


def print_webp_methods(report: dict) -> None:
    rows, ref = report["methods"], report["methods"].get(4)
    print(f"\n## WebP methods (q{report['quality']}, {report['images']} images, encode of both outputs per image)\n")
    print(
        "| method | encode CPU ms/img | vs m4 | 512 bytes | vs m4 | 1024 bytes | vs m4 | PSNR 512 dB | PSNR 1024 dB "
        "| min PSNR 512 / 1024 | rule |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, x in rows.items():

        def rel(key: str, x: dict = x) -> str:
            return f"{x[key] / ref[key]:.2f}x" if ref else ""

        verdict = "; ".join(report["choice"].get("verdicts", {}).get(m, []))
        print(
            f"| {m} | {x['encode_cpu_ms_per_image']:.1f} | {rel('encode_cpu_ms_per_image')} | {x['bytes_512']:,.0f} | "
            f"{rel('bytes_512')} | {x['bytes_1024']:,.0f} | {rel('bytes_1024')} | {x['psnr_512']:.2f} | {x['psnr_1024']:.2f} | "
            f"{x['psnr_min_512']:.1f} / {x['psnr_min_1024']:.1f} | {verdict} |"
        )
    print(
        f"\nrule (at least {100 * MIN_TIME_GAIN:.0f}% less encode time, PSNR within {PSNR_TOLERANCE_DB} dB and files at most "
        f"{100 * BYTES_TOLERANCE:.0f}% larger than m4, for both outputs) -> default method {report['choice']['default']}"
    )
