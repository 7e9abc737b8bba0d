#!/usr/bin/env python3
"""The naive baseline of issue 6, as a standalone benchmark worker process.

Per image: open, ImageOps.exif_transpose, convert("RGB"), ImageOps.fit(LANCZOS) to each
target size, WebP (quality, method) of each.

This file imports only the standard library, PIL and pyarrow, and nothing from its package,
so that the benchmark can run it as a script on the python of a separate virtual environment
holding plain Pillow 13 (issue 6 defines the baseline on Pillow 13, while the project's
environment has pillow-simd). The target sizes come from the project's
fixed_res_sidecar/core/geometry.py, which is pure stdlib: the parent sends its path and it is
loaded here by that path, without importing the fixed_res_sidecar package (whose other
modules need pillow-simd and numpy).

Protocol (the same as the floor and fused workers of workers.py): started as
`python naive_worker.py SPEC_JSON`; it writes one JSON line {"ready": true, ...} with the
PIL it runs on, then answers JSON-line requests read on stdin:
{"op": "warmup"}, {"op": "run", "shard": NAME}, {"op": "exit"}. Replies go to the real
stdout; anything else printed goes to stderr.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import resource
import sys
import time
from importlib import metadata
from pathlib import Path

import pyarrow.parquet as pq
from PIL import Image, ImageOps, features

PHASES = ("decode", "resize", "encode")


def load_geometry(path: str):
    """fixed_res_sidecar/core/geometry.py as a module of its own (it needs only the stdlib)."""
    spec = importlib.util.spec_from_file_location("fixed_res_bench_geometry", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def pil_info() -> dict:
    """Which PIL this process runs: distribution, version, pillow-simd or not, codec versions."""
    try:
        dists = metadata.packages_distributions().get("PIL") or []
    except Exception:  # pragma: no cover - very old importlib.metadata
        dists = []
    dist = dists[0] if dists else "unknown"
    try:
        dist_version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        dist_version = None
    import PIL

    return {
        "distribution": dist,
        "version": dist_version or PIL.__version__,
        "is_pillow_simd": dist.lower() == "pillow-simd",
        "pil_file": PIL.__file__,
        "python": sys.executable,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "webp": bool(features.check("webp")),
        "libwebp": features.version("webp"),
        "libjpeg_turbo": features.version_feature("libjpeg_turbo"),
        "pyarrow": metadata.version("pyarrow"),
    }


def _cpu() -> float:
    return time.process_time()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class NaiveWorker:
    def __init__(self, spec: dict) -> None:
        self.main = Path(spec["main"])
        self.image_column = spec["image_column"]
        self.areas = tuple(spec["areas"])
        self.patch = spec["patch"]
        self.quality = spec["quality"]
        self.method = spec["method"]
        self.target_size = load_geometry(spec["geometry_path"]).target_size

    def one(self, data: bytes, wall: dict, cpu: dict) -> list[int]:
        """The naive pipeline on one image; adds each phase's time to `wall`/`cpu`; returns the bytes per area."""
        c, w = _cpu(), time.perf_counter()
        image = Image.open(io.BytesIO(data))
        image = ImageOps.exif_transpose(image)  # loads (decodes) the image
        image = image.convert("RGB")
        image.load()
        c2, w2 = _cpu(), time.perf_counter()
        cpu["decode"] += c2 - c
        wall["decode"] += w2 - w
        sizes = []
        for area in self.areas:
            c, w = _cpu(), time.perf_counter()
            small = ImageOps.fit(
                image, self.target_size(image.width, image.height, area, self.patch), Image.Resampling.LANCZOS
            )
            c2, w2 = _cpu(), time.perf_counter()
            cpu["resize"] += c2 - c
            wall["resize"] += w2 - w
            out = io.BytesIO()
            small.save(out, "WEBP", quality=self.quality, method=self.method)
            cpu["encode"] += _cpu() - c2
            wall["encode"] += time.perf_counter() - w2
            sizes.append(out.tell())
        return sizes

    def warmup(self) -> dict:
        """Load the codecs on one small generated JPEG with an EXIF rotation (never a shard)."""
        picture = Image.merge("RGB", [Image.effect_noise((800, 600), 40 + 10 * i) for i in range(3)])
        exif = Image.Exif()
        exif[0x0112] = 6
        out = io.BytesIO()
        picture.save(out, "JPEG", quality=90, exif=exif.tobytes())
        self.one(out.getvalue(), dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0))
        return {"rss_mb": rss_mb()}

    def run(self, shard: str) -> dict:
        """Reading the shard is not timed (the naive pipeline gets its bytes for free)."""
        cpu_call, wall_call = _cpu(), time.perf_counter()
        totals = [0] * len(self.areas)
        wall, cpu = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
        n = 0
        source = pq.ParquetFile(self.main / shard)
        for index in range(source.metadata.num_row_groups):
            images = source.read_row_group(index, columns=[self.image_column]).column(0).to_pylist()
            for data in images:
                for i, size in enumerate(self.one(data, wall, cpu)):
                    totals[i] += size
            n += len(images)
            del images
        return {
            "wall": sum(wall.values()),
            "cpu": sum(cpu.values()),
            "phase_wall": wall,
            "phase_cpu": cpu,
            "images": n,
            "valid": n,
            "bytes": totals,
            "call_wall": time.perf_counter() - wall_call,
            "call_cpu": _cpu() - cpu_call,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        }


def serve(make_worker, handlers: dict) -> None:
    """Serve JSON-line requests on stdin with the worker `make_worker()` builds; `handlers` maps
    an op to `handler(worker, request) -> reply`. Replies go to the real stdout, anything else
    the process prints to stderr. Shared with the workers of workers.py: this file must stay
    importable on plain Pillow with the standard library only, so the protocol lives here."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        worker = make_worker()
        info = pil_info()
    except Exception as exc:
        protocol.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    protocol.write(json.dumps({"ready": True, "rss_mb": rss_mb(), "pil": info}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "exit":
            break
        try:
            handler = handlers.get(op)
            reply = handler(worker, request) if handler else {"error": f"unknown op {op!r}"}
        except Exception as exc:  # report, do not hang the parent
            import traceback

            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        protocol.write(json.dumps(reply) + "\n")


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    serve(
        lambda: NaiveWorker(spec),
        {
            "warmup": lambda worker, request: worker.warmup(),
            "run": lambda worker, request: worker.run(request["shard"]),
        },
    )


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--info":
        print(json.dumps(pil_info()))
    else:
        main(sys.argv[1])
