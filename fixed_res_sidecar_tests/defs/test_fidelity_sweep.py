"""defs/fidelity_sweep.py: the sweep verifies complete shards again within its CPU budget, walking the
partitions from where it stopped; each of its verifications compares rows not compared before, and the
shard stays complete (its crop_bbox stays current)."""

import dagster as dg
import pytest

from fixed_res_sidecar.defs.checks import COVERAGE_EVER
from fixed_res_sidecar.defs.dataset_audit import audit_dataset
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.fidelity_sweep import (
    fidelity_sweep_schedule,
    next_shards,
    shard_cost,
    sweep_requests,
    sweep_tick,
)
from fixed_res_sidecar.defs.names import SWEEP_TAG, DatasetKeys
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar_tests.defs.conftest import (
    QUIET,
    dataset_entry,
    make_config,
    register,
    write_tiny,
)

KEYS = DatasetKeys("tiny")
ORDER = ["a", "b", "c", "d", "e"]


def test_the_walk_continues_where_it_stopped_and_takes_only_eligible_shards():
    assert next_shards(ORDER, {"a", "b", "d", "e"}, 0, 2) == (["a", "b"], 2)
    assert next_shards(ORDER, {"a", "b", "d", "e"}, 2, 2) == (["d", "e"], 0)  # c is not eligible
    assert next_shards(ORDER, {"a", "e"}, 3, 5) == (["e", "a"], 1)  # wraps around once
    assert next_shards(ORDER, set(), 1, 3) == ([], 1) and next_shards([], {"a"}, 4, 1) == ([], 0)


def test_the_runs_verify_and_crop_ranges_of_consecutive_shards(tiny_main, tmp_path):
    dataset = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", shards_per_run=2)).datasets[0]
    requests = sweep_requests(dataset, ORDER, ["a", "b", "c", "e"])
    assert [(r.partition_key, r.tags.get("dagster/asset_partition_range_start")) for r in requests] == [
        (None, "a"),  # a..b
        ("c", None),  # d is not chosen: c alone
        ("e", None),
    ]
    assert {tuple(k.to_user_string() for k in r.asset_selection or ()) for r in requests} == {
        ("tiny/verify_512", "tiny/verify_1024", "tiny/crop_bbox")
    }
    assert all(r.tags[SWEEP_TAG] == "true" and r.tags["fixed_res_sidecar/dataset"] == "tiny" for r in requests)
    schedule = fidelity_sweep_schedule(dataset)
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED and schedule.cron_schedule == "0 * * * *"


@pytest.mark.heavy
def test_a_sweep_run_compares_new_rows_and_the_shard_stays_complete(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    shards = ["s1.parquet", "s2.parquet"]
    write_tiny(main, shards=shards)
    # A window of 2 of the 6 valid rows: three verifications compare every row.
    entry = dataset_entry(
        "tiny", main, tmp_path / "out", verify_sample=2, fidelity_sweep={"cpu_seconds_per_hour": 0.001}
    )
    config = make_config(entry)
    dataset, defs = config.datasets[0], build_definitions(config)
    register(instance, config)
    job = defs.resolve_job_def(KEYS.shard_job)
    for rel in shards:
        assert job.execute_in_process(partition_key=rel, instance=instance, run_config=QUIET).success
    audit = audit_dataset(instance, KEYS, dataset.layout)
    assert audit.passed and audit.fidelity["512"]["ever"] == 2 * 2  # one window of each shard so far
    assert shard_cost(instance, KEYS) > 0

    requests = sweep_tick(instance, dataset)  # a tiny budget: one shard per tick, the first
    assert isinstance(requests, list) and [r.partition_key for r in requests] == ["s1.parquet"]
    (request,) = requests
    swept = job.execute_in_process(
        partition_key=request.partition_key,
        asset_selection=request.asset_selection,
        tags=request.tags,
        instance=instance,
        run_config=QUIET,
    )
    assert swept.success
    logs = [record.user_message for record in instance.all_logs(swept.run_id)]
    assert any(line.startswith("s1.parquet: fidelity sweep: ") for line in logs)
    verified = {
        e.materialization.asset_key: e.materialization.metadata for e in swept.get_asset_materialization_events()
    }
    assert verified[KEYS.verify("512")][COVERAGE_EVER].value == 4  # a second window: rows not compared before
    assert "restated_from_run" not in verified[KEYS.verify("512")]  # verified again, not restated
    audit = audit_dataset(instance, KEYS, dataset.layout)
    assert audit.passed and not audit.crop_stale and audit.fidelity["512"]["ever"] == 4 + 2

    assert [r.partition_key for r in sweep_tick(instance, dataset)] == ["s2.parquet"]  # the walk goes on
