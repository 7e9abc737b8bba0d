"""`sidecar-ops demo`: the whole graph through Dagster on a local sample; a second run does no work."""

import os
from collections import Counter

import dagster as dg
import pytest

from fixed_res_sidecar import demo
from fixed_res_sidecar.cli import main as cli_main
from fixed_res_sidecar.defs.config import parse_config
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.demo import demo_config


@pytest.mark.heavy
def test_demo_builds_every_shard_then_skips_finished_work(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("SIDECAR_DATASETS", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    workdir = tmp_path / "demo"
    said: list[str] = []

    first = demo.run_demo(workdir, shards=2, rows_per_shard=6, say=said.append)
    assert first.created_sample and first.ok
    # Remembered for `sidecar-ops ui` run from the same folder.
    assert demo.remembered_demo(tmp_path) == (workdir, workdir / "dagster_home")
    assert [s.status for s in first.shards] == ["built", "built"]
    assert sorted(first.new_partitions) == ["part-00000.parquet", "part-00001.parquet"]
    assert first.dagster_home == workdir / "dagster_home"
    assert (first.dagster_home / "dagster.yaml").exists()  # the repo's instance settings
    assert "DAGSTER_HOME" not in os.environ  # restored
    for resolution in ("512", "1024"):
        rows = first.rows[resolution]
        assert rows["valid"] + rows["invalid"] == 12 and rows["invalid"] == sum(rows["errors"].values()) >= 1
    assert len(first.checks) == 5 + 5 + 6
    assert all(counter["passed"] == 2 for counter in first.checks.values())
    assert first.audit is not None and first.audit[0], first.audit
    assert first.overlays and all(path.endswith(".png") for path in first.overlays)
    text = demo.format_summary(first)
    assert "2 built now, 0 already up to date, 0 failed" in text and "result: OK" in text
    assert "overlay pictures" in text and str(workdir / "out" / "verifier_reports" / "sample" / "overlays") in text

    # The instance is persistent: the runs and partitions are there for `dagster dev`.
    monkeypatch.setenv("DAGSTER_HOME", str(first.dagster_home))
    with dg.DagsterInstance.get() as instance:
        assert sorted(instance.get_dynamic_partitions("sample_shards")) == sorted(first.new_partitions)
        assert instance.get_materialized_partitions(DatasetKeys("sample").crop_bbox) == set(first.new_partitions)
        runs_before = len(instance.get_run_records())
    monkeypatch.delenv("DAGSTER_HOME")

    # Second run, through the real CLI entry point: nothing to build, only the dataset check runs.
    assert cli_main(["demo", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "0 built now, 2 already up to date, 0 failed" in out and "result: OK" in out
    monkeypatch.setenv("DAGSTER_HOME", str(first.dagster_home))
    with dg.DagsterInstance.get() as instance:
        assert len(instance.get_run_records()) == runs_before + 1


class CountingInstance:
    """Stands in for a DagsterInstance: every shard materialised, calls counted per asset."""

    def __init__(self, rels):
        self.rels, self.calls = set(rels), Counter()

    def get_materialized_partitions(self, key):
        self.calls[key] += 1
        return set(self.rels)


def test_finished_shards_asks_once_per_asset_whatever_the_shard_count(tmp_path):
    config = parse_config({"datasets": [demo_config()["datasets"][0]]}, base_dir=tmp_path)
    dataset = config.datasets[0]
    rels = [f"p/part-{i:05d}.parquet" for i in range(300)]
    for name in ("resized_512", "resized_1024", "crop_bbox"):
        for rel in rels[:-1]:  # the last shard lacks its files
            dataset.output(name).write_bytes(rel, b"x")
    statuses = {(check, rel): "SUCCEEDED" for rel in rels for check in ("a:c1", "b:c2")}
    statuses[("b:c2", rels[0])] = "FAILED"
    instance = CountingInstance(rels[:-2] + rels[-1:])  # rels[-2] is not materialised

    done = demo.finished_shards(instance, dataset, rels, statuses)
    assert done == set(rels[1:-2])
    assert len(instance.calls) == 5 and set(instance.calls.values()) == {1}
