"""Smoke test of benchmarks/run.py on a tiny corpus: the machinery runs and reports every field.

No timing assertions: the figures themselves are only meaningful on the real corpus.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("fixed_res_benchmarks_run", BENCHMARKS / "run.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("fixed_res_benchmarks_run", None)
        sys.path.remove(str(BENCHMARKS))


def test_corpus_is_deterministic_and_photo_like(bench):
    corpus = bench.corpus_mod
    specs = corpus.corpus_specs(120)
    assert specs == corpus.corpus_specs(120)
    long_sides = [max(s.width, s.height) for s in specs]
    assert 300 <= min(long_sides) and max(long_sides) <= 6000
    megapixels = [s.megapixels for s in specs]
    assert sum(m for m in megapixels if 8 <= m <= 30) / sum(megapixels) > 0.7
    assert {s.format for s in specs} == {"JPEG", "PNG"}
    assert any(s.orientation != 1 for s in specs)
    tiny = corpus.corpus_specs(12, profile="tiny")
    assert tiny[5].format == "PNG"
    for spec in (tiny[3], tiny[5]):  # a rotated JPEG, a PNG
        assert corpus.encode_spec(spec) == corpus.encode_spec(spec)


def test_compare_webp_methods_and_memory_report_their_fields(bench, tmp_path, capsys):
    out = tmp_path / "report.json"
    report = bench.main(
        [
            "--profile", "tiny", "--images", "2", "--shards", "2", "--workdir", str(tmp_path / "work"),
            "--threads", "2", "--json", str(out),
            "--compare", "--webp-methods", "--methods", "0,4", "--webp-images", "2",
            "--memory", "--memory-gb", "0.0004", "--memory-threads", "2", "--memory-row-group-rows", "2",
        ]
    )
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()).keys() == report.keys() == {"compare", "webp_methods", "memory"}

    compare = report["compare"]
    pipelines = compare["pipelines"]
    assert {"naive_m4", "floor_m4", "fused_m4"} <= pipelines.keys()
    assert any(p["threads"] == 2 for p in pipelines.values())
    for pipeline in pipelines.values():
        assert pipeline["images"] == 2 and pipeline["valid"] == 2
        for field in ("images_per_s_per_core", "ms_per_image", "cpu_ms_per_image", "bytes_per_image_512", "bytes_per_image_1024", "peak_rss_mb"):
            assert pipeline[field] > 0, field
    assert {"fused_m4_over_naive_m4", "fused_m4_over_floor_m4", "threads_speedup"} <= compare["ratios"].keys()
    assert all(math.isfinite(r["wall"]) and r["wall"] > 0 for r in compare["ratios"].values())
    assert {"fused_m4_at_least_1.6x_naive", "fused_m4_within_1.15x_floor", "threads_speedup_at_least_1.8x"} <= compare["targets"].keys()
    assert compare["machine"]["pil"].startswith(("pillow-simd", "Pillow"))
    # The fused build really went through the shard builder: Parquet outputs with the audit columns.
    built = pq.read_table(tmp_path / "work" / "out" / "fused_m4" / "1_05mp_process" / "part-00000.parquet")
    assert "1_05mp_process_valid" in built.column_names and all(built.column("1_05mp_process_valid").to_pylist())

    methods = report["webp_methods"]
    assert set(methods["methods"]) == {0, 4} and methods["images"] == 2
    for row in methods["methods"].values():
        assert row["encode_cpu_ms_per_image"] > 0 and row["bytes_512"] > 0 and row["bytes_1024"] > 0
        assert 25 < row["psnr_512"] < 100 and 25 < row["psnr_1024"] < 100
    assert methods["choice"]["default"] in (0, 4)

    memory = report["memory"]
    assert memory["valid"] == memory["rows"] > 0
    assert memory["peak_rss_mb"] > memory["baseline_rss_mb"] * 0.5 > 0
    assert isinstance(memory["met"], bool)

    for heading in ("## Comparison", "## WebP methods", "## Memory", "| naive_m4 |", "img/s/core"):
        assert heading in printed
