"""Smoke test of the benchmarks package on a tiny corpus: the machinery runs and reports every field.

No timing assertions: the figures themselves are only meaningful on the real corpus.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from benchmarks import cli, corpus, naive_worker
from benchmarks.common import DEFAULT_WORKDIR
from benchmarks.naive_venv import NAIVE_PILLOW_VERSION, NAIVE_VENV_NAME, NaiveVenvError, ensure_naive_venv

REPO = Path(__file__).resolve().parents[1]


def test_corpus_is_deterministic_and_photo_like():
    specs = corpus.corpus_specs(120)
    assert specs == corpus.corpus_specs(120)
    long_sides = [max(s.width, s.height) for s in specs]
    assert min(long_sides) >= 300 and max(long_sides) <= 6000
    megapixels = [s.megapixels for s in specs]
    assert sum(m for m in megapixels if 8 <= m <= 30) / sum(megapixels) > 0.7
    assert {s.format for s in specs} == {"JPEG", "PNG"}
    assert any(s.orientation != 1 for s in specs)
    tiny = corpus.corpus_specs(12, profile="tiny")
    assert tiny[5].format == "PNG"
    for spec in (tiny[3], tiny[5]):  # a rotated JPEG, a PNG
        assert corpus.encode_spec(spec) == corpus.encode_spec(spec)


def _naive_args() -> tuple[list[str], bool]:
    """The Pillow 13 venv of the default workdir when a benchmark run already made it, else the installed PIL.

    Never creates the venv (that downloads Pillow): --naive-venv-no-create.
    """
    venv = DEFAULT_WORKDIR / NAIVE_VENV_NAME
    try:
        ensure_naive_venv(venv, create=False)
    except NaiveVenvError:
        return ["--naive-on-installed-pil"], False
    return ["--naive-venv", str(venv), "--naive-venv-no-create"], True


def test_naive_worker_imports_only_pil_pyarrow_and_stdlib():
    """naive_worker.py must run in the Pillow 13 venv, where neither numpy nor the project can be imported."""
    source = Path(naive_worker.__file__).read_text()
    imported = {
        line.split()[1].split(".")[0]
        for line in source.splitlines()
        if line.startswith(("import ", "from ")) and not line.startswith("from __future__")
    }
    assert imported <= {"importlib", "io", "json", "os", "resource", "sys", "time", "pathlib", "pyarrow", "PIL"}, (
        imported
    )


@pytest.mark.heavy
def test_compare_webp_methods_and_memory_report_their_fields(tmp_path, capsys):
    out = tmp_path / "report.json"
    naive_args, naive_in_venv = _naive_args()
    report = cli.main(
        [
            "--profile",
            "tiny",
            "--images",
            "2",
            "--shards",
            "2",
            "--workdir",
            str(tmp_path / "work"),
            "--threads",
            "2",
            "--json",
            str(out),
            *naive_args,
            "--compare",
            "--webp-methods",
            "--methods",
            "0,4",
            "--webp-images",
            "2",
            "--memory",
            "--memory-gb",
            "0.0004",
            "--memory-threads",
            "2",
            "--memory-row-group-rows",
            "2",
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
        for field in (
            "images_per_s_per_core",
            "ms_per_image",
            "cpu_ms_per_image",
            "bytes_per_image_512",
            "bytes_per_image_1024",
            "peak_rss_mb",
        ):
            assert pipeline[field] > 0, field
    assert {"fused_m4_over_naive_m4", "fused_m4_over_floor_m4", "threads_speedup"} <= compare["ratios"].keys()
    assert all(math.isfinite(r["wall"]) and r["wall"] > 0 for r in compare["ratios"].values())
    assert {"fused_m4_at_least_1.6x_naive", "fused_m4_within_1.15x_floor", "threads_speedup_at_least_1.8x"} <= compare[
        "targets"
    ].keys()
    assert compare["machine"]["pil"].startswith(("pillow-simd", "Pillow"))
    # Which PIL ran each pipeline: the naive one on Pillow 13 (venv) or on the installed PIL.
    naive_pil, project_pil = compare["libraries"]["naive"], compare["libraries"]["project"]
    assert pipelines["naive_m4"]["pil"] == naive_pil and pipelines["fused_m4"]["pil"] == project_pil
    for info in (naive_pil, project_pil):
        assert info["webp"] and info["libwebp"] and isinstance(info["is_pillow_simd"], bool) and info["version"]
    if naive_in_venv:
        assert compare["naive_runtime"]["kind"] == "venv" and not compare["naive_runtime"]["created"]
        assert naive_pil["version"] == NAIVE_PILLOW_VERSION and not naive_pil["is_pillow_simd"]
        assert naive_pil["python"] != project_pil["python"]
    else:
        assert compare["naive_runtime"]["kind"] == "installed" and naive_pil == project_pil
    assert compare["libraries"]["same_libwebp"] == (naive_pil["libwebp"] == project_pil["libwebp"])
    # The naive time split into decode / resize / encode (and the floor's into decode / encode).
    naive = pipelines["naive_m4"]
    assert set(naive["phase_ms_per_image"]) == {"decode", "resize", "encode"}
    assert math.isclose(sum(naive["phase_ms_per_image"].values()), naive["ms_per_image"], rel_tol=1e-6)
    assert set(pipelines["floor_m4"]["phase_cpu_ms_per_image"]) == {"decode", "encode"}
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

    for heading in (
        "## Comparison",
        "## WebP methods",
        "## Memory",
        "| naive_m4 |",
        "img/s/core",
        "naive baseline: ",
        "time split",
    ):
        assert heading in printed


def test_naive_venv_is_never_created_when_not_allowed(tmp_path):
    with pytest.raises(NaiveVenvError, match="not allowed"):
        ensure_naive_venv(tmp_path / "no-venv", create=False)
    assert not (tmp_path / "no-venv").exists()


@pytest.mark.parametrize("command", [["-m", "benchmarks"], [str(REPO / "benchmarks" / "run.py")]], ids=["-m", "run.py"])
def test_both_invocations_reach_the_options(command, tmp_path):
    """`python -m benchmarks` from the repository root, and the run.py alias from anywhere, without PYTHONPATH."""
    cwd = REPO if command[0] == "-m" else tmp_path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, *command, "--help"], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    assert "--webp-methods" in done.stdout and "--naive-venv-no-create" in done.stdout


def _numbers(value, path: str = "") -> list[tuple[str, float]]:
    """Every number in a report, with its dotted path (booleans are not numbers here)."""
    if isinstance(value, dict):
        return [item for key, inner in value.items() for item in _numbers(inner, f"{path}{key}.")]
    if isinstance(value, list):
        return [item for i, inner in enumerate(value) for item in _numbers(inner, f"{path}{i}.")]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [(path.rstrip("."), value)]
    return []


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        if text in command:
            found.append(command)
    return found


@pytest.mark.benchmark
def test_dagster_scale_reports_every_figure(deployment_slot, tmp_path, capsys):
    """--dagster-scale at a tiny size, for real (PostgreSQL, code server, daemon, webserver): every figure
    is reported, finite and not negative, and nothing is left running. No timing is asserted.

    The deployment starts twice (once, then for the batch size; the up-to-date backfill restarts the daemon);
    the backfill loop and the automation sensor's interval are 5 s here instead of the shipped 30 s, which
    only the figures of a real run need. One batch size: a second would only run the same code again.
    """
    out = tmp_path / "scale.json"
    work = tmp_path / "work"
    # The built dataset is found in two ticks (the bound per tick shows); the metadata-only one in one tick
    # of 40 shards, 8 per run: more runs than a tick requests one by one, so one backfill.
    options = ["--partitions", "6", "--metadata-partitions", "40", "--sample-shards", "2", "--batch-sizes", "2"]
    options += ["--shards-per-tick", "3", "--metadata-shards-per-tick", "40", "--automation-ticks", "1"]
    options += ["--backfill-loop-seconds", "5", "--automation-interval", "5"]
    report = cli.main(["--dagster-scale", *options, "--workdir", str(work), "--json", str(out)])["dagster_scale"]
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["dagster_scale"].keys() == report.keys()
    assert not _processes_mentioning(str(work)), "processes of the deployment left running"
    assert not list(work.iterdir()), "the benchmark's data was not removed"

    sections = ("definitions", "discovery", "backfill_all", "backfill_all_metadata", "batches", "up_to_date")
    for section in (*sections, "graphql", "audit", "probes"):
        assert report[section], section
    assert set(report["discovery"]) == {"scale", "meta"}
    assert report["discovery"]["scale"]["partitions"] == 6 and report["discovery"]["meta"]["partitions"] == 40
    for discovery in report["discovery"].values():  # every shard by the sensor, in ticks of at most per_tick
        assert discovery["work_ticks"] >= discovery["partitions"] // discovery["per_tick"] and discovery["sensor_s"] > 0
        assert discovery["cpu_s"]["code_server"] > 0 and discovery["cpu_s"]["postgres"] > 0
        assert discovery["automation"]["ticks"] >= 1 and discovery["automation"]["max_s"] > 0
    assert report["discovery"]["meta"]["backfills_requested"] == report["discovery"]["meta"]["work_ticks"]
    assert report["backfill_all_metadata"]["partitions"] == 40 and report["backfill_all_metadata"]["runs_seen"] > 0
    assert set(report["batches"]) == {"2"}
    for size, batch in report["batches"].items():
        assert batch["shards"] == 2 and batch["runs"] == 2 // int(size) and batch["statuses"] == ["SUCCESS"]
        for field in ("launch_to_success_s", "queue_to_success_s", "work_per_shard_s", "wall_s", "shards_per_minute"):
            assert batch[field] > 0, (size, field)
        assert math.isfinite(batch["overhead_per_shard_s"]) and math.isfinite(batch["slot_overhead_per_shard_s"])
    up_to_date = report["up_to_date"]
    assert up_to_date["shards"] == 2 and up_to_date["wall_per_shard_s"] > 0
    assert up_to_date["rebuilt"] == 0, up_to_date["rebuilt_why"]
    assert {label.split(":")[0] for label in report["graphql"]} == {
        "asset partitions page",
        "asset check partitions",
        "backfill page",
        "asset page (definition)",
        "asset page (live data)",
    }
    for row in report["graphql"].values():
        assert len(row["seconds"]) == 3 and row["median_s"] > 0
    assert report["audit"]["scale"]["shards"] == 6 and report["audit"]["meta"]["shards"] == 40
    assert report["audit"]["scale"]["incremental_events"] > 0  # the shards built since the first audit
    for path, number in _numbers(report):
        assert math.isfinite(number) and number >= 0, path
    assert all(isinstance(met, bool) for met in report["targets"].values())
    assert "## Dagster scale" in printed and "| shards_per_run 2: overhead per shard |" in printed


@pytest.mark.benchmark
def test_fidelity_reports_score_distributions_and_verifier_cost(tmp_path, capsys):
    """--fidelity on a tiny corpus: every good variant and every damage has its scores, the threshold
    separates them, and the verifier's cost is reported with and without fidelity. No timings asserted."""
    from benchmarks.damage import DAMAGE
    from benchmarks.fidelity import GOOD, MODERATE, SINGLE

    args = ["--fidelity", "--fidelity-quick", "--fidelity-rows", "9", "--profile", "tiny"]
    report = cli.main([*args, "--workdir", str(tmp_path / "work")])["fidelity"]
    scores = report["scores"]
    assert set(scores["summary"]) == {*GOOD, SINGLE, *DAMAGE, *MODERATE}
    assert scores["lowest_good"] > scores["threshold"] > scores["highest_damage"]
    assert all(values["n"] >= 1 for values in scores["summary"].values())
    cost = report["cost"]
    assert cost["rows"] == 9 and cost["build_cpu_s"] > 0 and len(cost["verify_cpu_s"]) == 3
    assert all(share > 0 for share in cost["verify_share_of_build_1000_rows"].values())
    # Rolling coverage: 9 valid rows, a window of 8: every row compared after ceil(9 / 8) = 2 verifications.
    walk = report["coverage"]
    assert walk["comparable"] == {"512": 9, "1024": 9}
    assert walk["verifications_to_full_coverage"] == walk["expected"] == 2
    assert walk["cpu_s_per_verification"] > 0 and walk["sweep_shard_verifications_per_hour"] > 0
    printed = capsys.readouterr().out
    assert "Fidelity scores" in printed and "lowest good" in printed and "share at 1,000 rows" in printed
    assert "Moderate damage per source" in printed and "transparency_png" in printed
    assert "every row compared after 2 verifications" in printed and "Fidelity sweep at 600 CPU s per hour" in printed


@pytest.mark.postgres
def test_storage_pool_reports_both_paths(tmp_path, capsys):
    """--storage-pool at a few calls: each path's rounds are measured and every figure is finite and
    positive (`running_postgres` fails the run if its server or pooler outlives it). No ratio is asserted:
    that is a figure of a real run."""
    out = tmp_path / "pool.json"
    report = cli.main(["--storage-pool", "--storage-calls", "20", "--storage-rounds", "2", "--json", str(out)])
    pool = report["storage_pool"]
    assert json.loads(out.read_text())["storage_pool"].keys() == pool.keys()
    for path in ("direct", "pooled"):
        assert len(pool[path]["cpu_s"]) == len(pool[path]["wall_s"]) == 2
        assert all(value > 0 for value in pool[path]["wall_s"]) and pool["cpu_ms_per_call"][path] > 0
    assert math.isfinite(pool["pooled_to_direct"]) and pool["pooled_to_direct"] > 0
    assert "| pooled |" in capsys.readouterr().out
