"""One long-lived worker process per pipeline, so each one's peak RSS is that process's own.

The parent side is `WorkerProcess`. Naive pipelines run naive_worker.py on a NaiveRuntime's
python (by default the Pillow 13 venv's); floor and fused pipelines run this module
(`python -m benchmarks.workers SPEC`). Both answer the JSON-line requests of
`naive_worker.serve`: warmup, run (one shard), exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import corpus, floor, naive_worker
from benchmarks.common import AREAS, PATCH, QUALITY
from benchmarks.naive_venv import NaiveRuntime
from fixed_res_sidecar.core import geometry as core_geometry

# The naive worker cannot import the project (it runs on plain Pillow), so it loads the core's
# geometry module, which needs only the standard library, by path: the one imported here.
GEOMETRY_PATH = Path(core_geometry.__file__).resolve()
# The checkout holding this package, first on a worker's PYTHONPATH: `python -m benchmarks.workers`
# then imports the parent's code whatever the working directory.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Pipeline:
    name: str
    kind: str  # "naive" | "floor" | "fused"
    method: int
    threads: int = 1
    label: str = ""


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _RssSampler:
    """Samples this process's RSS every `period` s while running (a timeline for diagnosis)."""

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.perf_counter() - self._start, naive_worker.rss_mb()))

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class _Worker:
    """The floor or fused pipeline inside its worker process."""

    def __init__(self, pipeline: Pipeline, main: Path, out: Path) -> None:
        self.method = method = pipeline.method
        if pipeline.kind == "floor":
            self._warm_up = floor.warm_up
            self._run = lambda shard: floor.run(corpus.shard_images(main, shard), method)
        else:
            # Imported only here, so that a floor worker's RSS does not include the shard builder's modules.
            from benchmarks import fused

            self._warm_up = fused.warm_up
            self._run = lambda shard: fused.run(main, shard, out, method, pipeline.threads)

    def warmup(self) -> dict:
        """Load the libraries on one small generated image (never a shard: that would count in the peak RSS)."""
        self._warm_up(corpus.encode_spec(corpus.ImageSpec(0, 800, 600, "JPEG", 6, 90, 0)), self.method)
        return {"rss_mb": naive_worker.rss_mb()}

    def run(self, shard: str, sample_rss: bool = False) -> dict:
        cpu_call, wall_call = time.process_time(), time.perf_counter()
        with _RssSampler() if sample_rss else contextlib.nullcontext() as sampler:
            result = self._run(shard)
        result["call_wall"] = time.perf_counter() - wall_call
        result["call_cpu"] = time.process_time() - cpu_call
        result["maxrss_mb"] = _maxrss_mb()
        if sampler is not None:
            result["rss_timeline"] = sampler.samples
        return result


def main(spec: str) -> None:
    """One floor or fused worker process, serving the parent's requests."""
    params = json.loads(spec)
    naive_worker.serve(
        lambda: _Worker(Pipeline(**params["pipeline"]), Path(params["main"]), Path(params["out"])),
        {
            "warmup": lambda worker, request: worker.warmup(),
            "run": lambda worker, request: worker.run(request["shard"], request.get("sample_rss", False)),
        },
    )


def _worker_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (the working directory may be anywhere)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), *([path] if path else [])])}


class WorkerProcess:
    """Parent side of one worker: a subprocess running one pipeline."""

    def __init__(self, pipeline: Pipeline, main: Path, out: Path, naive: NaiveRuntime | None = None) -> None:
        self.pipeline = pipeline
        if pipeline.kind == "naive":
            naive = naive or NaiveRuntime.installed()
            spec = {
                "main": str(main),
                "image_column": corpus.IMAGE_COLUMN,
                "areas": list(AREAS),
                "patch": PATCH,
                "quality": QUALITY,
                "method": pipeline.method,
                "geometry_path": str(GEOMETRY_PATH),
            }
            command, env = naive.worker_command(json.dumps(spec)), naive.env()
        else:
            spec = {"pipeline": dataclasses.asdict(pipeline), "main": str(main), "out": str(out)}
            command, env = [sys.executable, "-m", "benchmarks.workers", json.dumps(spec)], _worker_env()
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.ready = self._reply()
        if pipeline.kind == "naive" and naive.kind == "venv":
            naive.check(self.ready["pil"])  # the worker really runs on the venv's Pillow 13, not pillow-simd
        self.child_maxrss_mb: float | None = None

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.pipeline.name} died (exit {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker {self.pipeline.name}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def call(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        """Stop the worker and read its own peak RSS from the kernel (wait4 rusage)."""
        if self.proc.returncode is not None:
            return
        try:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
        except OSError:
            pass
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.child_maxrss_mb = usage.ru_maxrss / 1024


if __name__ == "__main__":
    main(sys.argv[1])
