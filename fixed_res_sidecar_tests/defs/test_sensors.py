"""The discovery sensor: only new shards become partitions, across ticks, in bounded ticks, with runs."""

import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from fixed_res_sidecar.defs.keys import DATASET_TAG, DatasetKeys
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.defs.sensors import (
    ShardCursor,
    automation_sensor,
    discover_shards,
    discovery_sensor,
    discovery_tick,
)
from fixed_res_sidecar.demo import apply_sensor_result
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar_tests.defs.conftest import (
    TINY_ROWS,
    TINY_SHARDS,
    dataset_entry,
    make_config,
    write_tiny,
)


def tick(sensor: dg.SensorDefinition, instance: dg.DagsterInstance, cursor: str | None) -> dg.SensorResult:
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"sidecar": SidecarRuntime()})
    return sensor(context)


def requested(result: dg.SensorResult) -> list[str]:
    """The shards a tick's run requests cover, in order: a request is one shard, or a range of new ones."""
    new = [k for r in result.dynamic_partitions_requests or [] for k in r.partition_keys]
    shards = []
    for request in result.run_requests or []:
        if request.partition_key is not None:
            shards.append(request.partition_key)
        else:
            first, last = request.tags[ASSET_PARTITION_RANGE_START_TAG], request.tags[ASSET_PARTITION_RANGE_END_TAG]
            shards += new[new.index(first) : new.index(last) + 1]
    return shards


def write_stub_shards(location: Location, rels) -> None:
    """Minimal shards: discovery reads footers only."""
    table = pa.table({"image_key": ["k0", "k1"], "image": pa.array([b"x", None], pa.binary())})
    for rel in rels:
        with location.write_atomic(rel) as tmp:
            pq.write_table(table, tmp)


def test_sensor_adds_only_new_shards_across_ticks_and_requests_runs(tiny_main, tmp_path, instance):
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", run_resources={"cpu": 2, "memory_gb": 3}))
    dataset = config.datasets[0]
    keys = DatasetKeys("tiny")
    sensor = discovery_sensor(dataset)

    first = tick(sensor, instance, None)
    expected = sorted(TINY_SHARDS)
    assert [k for r in first.dynamic_partitions_requests for k in r.partition_keys] == expected
    assert {r.partitions_def_name for r in first.dynamic_partitions_requests} == {"tiny_shards"}
    (batch,) = first.run_requests  # both new shards in one run (shards_per_run is 8)
    assert batch.job_name == "tiny__shard" and batch.partition_key is None
    assert (batch.tags[ASSET_PARTITION_RANGE_START_TAG], batch.tags[ASSET_PARTITION_RANGE_END_TAG]) == tuple(expected)
    tags = batch.tags
    assert tags[DATASET_TAG] == "tiny"
    k8s = json.loads(tags["dagster-k8s/config"])
    assert k8s["container_config"]["resources"]["requests"] == {"cpu": "2", "memory": "3Gi"}
    assert json.loads(tags["dagster-ray/config"]) == {"num_cpus": 2.0, "memory": 3 * 2**30}
    observations = {e.partition: e for e in first.asset_events}
    assert set(observations) == set(expected)
    for rel, observation in observations.items():
        assert observation.asset_key == keys.main
        assert observation.metadata["dagster/row_count"].value == TINY_ROWS
        assert observation.metadata["bytes"].value == tiny_main.size(rel) > 0
    assert apply_sensor_result(instance, first) == expected  # what the daemon does with the result
    assert sorted(instance.get_dynamic_partitions("tiny_shards")) == expected

    second = tick(sensor, instance, first.cursor)
    assert not second.run_requests and not second.dynamic_partitions_requests
    assert "no new, changed or removed shards" in str(second.skip_reason)

    write_tiny(tiny_main, shards=("nested/y/part-c.parquet",))
    third = tick(sensor, instance, second.cursor)
    assert requested(third) == ["nested/y/part-c.parquet"]
    assert [k for r in third.dynamic_partitions_requests for k in r.partition_keys] == ["nested/y/part-c.parquet"]
    apply_sensor_result(instance, third)
    assert len(instance.get_dynamic_partitions("tiny_shards")) == 3
    # main's shards are recorded as runless materializations, per partition.
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=keys.main, asset_partitions=["nested/y/part-c.parquet"]), limit=5
    ).records
    assert len(records) == 1


def test_ticks_are_bounded_and_the_cursor_continues_the_listing(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    write_stub_shards(main, [f"p{i}.parquet" for i in range(5)])
    dataset = make_config(dataset_entry("big", main, tmp_path / "out", sensor={"max_new_shards_per_tick": 2})).datasets[
        0
    ]
    sensor = discovery_sensor(dataset)
    cursor, added = None, []
    for expected in (["p0.parquet", "p1.parquet"], ["p2.parquet", "p3.parquet"], ["p4.parquet"]):
        result = tick(sensor, instance, cursor)
        assert requested(result) == expected
        added += apply_sensor_result(instance, result)
        cursor = result.cursor
    assert ShardCursor.parse(cursor) == ShardCursor(after=None, passes=1)
    # A shard that appears before the resume point is found by the next full pass.
    write_stub_shards(main, ["a-early.parquet"])
    result = tick(sensor, instance, cursor)
    assert requested(result) == ["a-early.parquet"]
    assert ShardCursor.parse(result.cursor).passes == 2


def test_shards_that_cannot_be_keys_are_refused_and_logged(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    write_stub_shards(main, ["good.parquet", "bad,name.parquet", "odd...name.parquet"])
    dataset = make_config(dataset_entry("odd", main, tmp_path / "out")).datasets[0]

    class Log:
        def __init__(self):
            self.errors, self.infos = [], []

        def error(self, text):
            self.errors.append(text)

        def info(self, text):
            self.infos.append(text)

    log = Log()
    result, _ = discovery_tick(dataset, [], None, log=log)
    assert requested(result) == ["good.parquet"]
    assert len(log.errors) == 2
    assert any("'bad,name.parquet'" in e and "','" in e for e in log.errors)
    assert any("'odd...name.parquet'" in e and "'...'" in e for e in log.errors)
    # The sensor itself refuses them the same way.
    result = tick(discovery_sensor(dataset), instance, None)
    assert [k for r in result.dynamic_partitions_requests for k in r.partition_keys] == ["good.parquet"]


def test_discovery_on_s3_pages_through_the_listing(s3_bucket, instance):
    main = Location.parse(f"s3://{s3_bucket}/datasets/main")
    rels = [f"2026/{i:02d}/part.parquet" for i in range(5)]
    write_stub_shards(main, rels)
    # Several pages of 2, resumed after a cap of 3.
    found = discover_shards(main, set(), None, max_new=3, page_size=2)
    assert found.new == rels[:3] and not found.complete
    rest = discover_shards(main, set(found.new), found.cursor, max_new=3, page_size=2)
    assert rest.new == rels[3:] and rest.complete
    dataset = make_config(dataset_entry("s3ds", main, f"s3://{s3_bucket}/datasets/out")).datasets[0]
    result = tick(discovery_sensor(dataset), instance, None)
    assert requested(result) == rels
    assert {e.metadata["dagster/row_count"].value for e in result.asset_events} == {2}


def test_unreadable_shard_is_observed_with_its_error(tmp_path):
    main = Location.parse(tmp_path / "main")
    main.write_bytes("broken.parquet", b"not parquet")
    dataset = make_config(dataset_entry("broken", main, tmp_path / "out")).datasets[0]
    result, _ = discovery_tick(dataset, [], None)
    (event,) = result.asset_events
    assert "error" in event.metadata and "dagster/row_count" not in event.metadata
    assert requested(result) == ["broken.parquet"]  # its run reports the failure


def test_sensor_statuses(tiny_config, tmp_path, tiny_main):
    dataset = tiny_config.datasets[0]
    assert discovery_sensor(dataset).default_status == dg.DefaultSensorStatus.STOPPED
    running = make_config(
        dataset_entry("on", tiny_main, tmp_path / "o2", sensor={"default_status": "running", "interval_seconds": 15})
    )
    sensor = discovery_sensor(running.datasets[0])
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert sensor.minimum_interval_seconds == 15
    automation = automation_sensor(dataset)
    assert isinstance(automation, dg.AutomationConditionSensorDefinition)
    assert automation.default_status == dg.DefaultSensorStatus.RUNNING
    assert automation.name == "tiny__automation"


@pytest.mark.parametrize("text", [None, "", "garbage", "[1, 2]", '{"after": "x", "passes": "many"}'])
def test_unreadable_cursor_starts_a_fresh_listing(text):
    assert ShardCursor.parse(text) == ShardCursor()
