"""cProfile (CPU time) of the fused build of one shard with threads=1, in this process."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

from benchmarks import corpus as corpus_mod
from benchmarks import fused
from benchmarks.common import log


def run_cprofile(
    workdir: Path, images: int, shards: int, method: int, *, seed=0, profile="photo", style="textured", top=30
) -> str:
    corpus = corpus_mod.ensure_corpus(workdir, images, shards, seed=seed, profile=profile, style=style, log=log)
    profiler = cProfile.Profile(time.process_time)  # CPU time: robust to other load (threads=1)
    profiler.enable()
    fused.build(corpus.main, corpus.shards[0], workdir / "out" / "cprofile", method, threads=1)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
