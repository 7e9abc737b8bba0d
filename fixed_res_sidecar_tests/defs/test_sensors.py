"""The discovery sensor: new shards become partitions, across ticks, in bounded ticks, with runs;
changed shards are rebuilt and removed ones reported."""

import json
import os
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._time import get_current_datetime

from fixed_res_sidecar.defs.dagster_private import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.history import REMOVED
from fixed_res_sidecar.defs.names import DATASET_TAG, RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.defs.sensors import (
    STATE_KEY,
    ShardCursor,
    automation_sensor,
    discover_shards,
    discovery_sensor,
    discovery_tick,
    load_seen,
    save_seen,
)
from fixed_res_sidecar.demo import apply_sensor_result
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar_tests.defs.conftest import (
    QUIET,
    TINY_ROWS,
    TINY_SHARDS,
    dataset_entry,
    make_config,
    run_request,
    write_tiny,
)
from fixed_res_sidecar_tests.fixtures.datasets import recrawl_main_shard, tree_snapshot
from fixed_res_sidecar_tests.fixtures.permissions import permission_checks_enforced, unreadable


def tick(sensor: dg.SensorDefinition, instance: dg.DagsterInstance, cursor: str | None) -> dg.SensorResult:
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"sidecar": SidecarRuntime()})
    return sensor(context)


def requested(result: dg.SensorResult) -> list[str]:
    """The shards a tick's run requests cover, in order: a request is one shard, or a range of new ones."""
    added = [r for r in result.dynamic_partitions_requests or [] if isinstance(r, dg.AddDynamicPartitionsRequest)]
    new = [k for r in added for k in r.partition_keys]
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
    assert batch.job_name == "tiny__build_shards" and batch.partition_key is None
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


def test_the_tick_log_names_the_removed_shards(tmp_path):
    main = Location.parse(tmp_path / "main")
    write_stub_shards(main, ["a.parquet", "b.parquet"])
    dataset = make_config(dataset_entry("gone", main, tmp_path / "out")).datasets[0]
    first, seen = discovery_tick(dataset, [], None)

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, text):
            self.lines.append(("info", text))

        def warning(self, text):
            self.lines.append(("warning", text))

        error = warning

    Path(main.child("b.parquet")).unlink()
    log = Log()
    discovery_tick(dataset, ["a.parquet", "b.parquet"], first.cursor, seen, log=log)
    assert ("warning", f"removed from {main.uri} (partitions retired, outputs kept): b.parquet") in log.lines


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


def test_a_main_folder_that_cannot_be_listed_fails_the_tick_and_removes_nothing(tiny_main, tmp_path, instance):
    """Reported: a subfolder of main that could not be listed was dropped from the listing, and the
    sensor recorded its shards as removed. Now the tick fails, naming the folder, and records nothing."""
    dataset = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out")).datasets[0]
    sensor = discovery_sensor(dataset)
    first = tick(sensor, instance, None)
    apply_sensor_result(instance, first)
    seen_before = load_seen(instance, "tiny")
    folder = Path(tiny_main.child("nested"))

    with unreadable(folder), permission_checks_enforced(), pytest.raises(StorageError) as failure:
        tick(sensor, instance, first.cursor)
    assert f"storage failed listing {folder}" in str(failure.value) and "Permission denied" in str(failure.value)
    assert load_seen(instance, "tiny") == seen_before  # nothing recorded as removed
    observed = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=DatasetKeys("tiny").main), limit=10)
    assert not observed.records

    # Readable again: the shards were never gone.
    again = tick(sensor, instance, first.cursor)
    assert "no new, changed or removed shards" in str(again.skip_reason)


# -- main evolves: a rewritten shard is rebuilt, a removed one leaves orphans -----------------------


def stale_status(defs: dg.Definitions, instance, key: dg.AssetKey, rel: str) -> StaleStatus:
    """What the UI shows for one partition (Unsynced is STALE), from a fresh resolver as the webserver builds it."""
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(
        temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
        instance=instance,
        asset_graph=graph,
    )
    return CachingStaleStatusResolver(instance, graph, loading_context=view).get_status(key, rel)


def test_a_rewritten_main_shard_is_marked_unsynced_then_rebuilt_verified_and_cropped(tiny_main, tmp_path, instance):
    """Sensor tick -> the shard's outputs are unsynced -> the requested run rebuilds, verifies and
    crops that shard alone -> in sync again; then a removed shard leaves its outputs, and the audit
    warns naming it."""
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out"))
    dataset, keys, defs = config.datasets[0], DatasetKeys("tiny"), build_definitions(config)
    sensor = discovery_sensor(dataset)
    first = tick(sensor, instance, None)
    apply_sensor_result(instance, first)
    assert all(run_request(defs, instance, request).success for request in first.run_requests)
    changed, other = "part-a.parquet", "nested/x/part-b.parquet"
    outputs = [dataset.output(name) for name in ("resized_512", "resized_1024", "crop_bbox")]
    before = [tree_snapshot(location.path) for location in outputs]
    resized = [keys.resized(resolution) for resolution in RESOLUTION_NAMES]
    assert {stale_status(defs, instance, key, changed) for key in resized} == {StaleStatus.FRESH}

    recrawl_main_shard(tiny_main, changed)
    second = tick(sensor, instance, first.cursor)
    assert requested(second) == [changed] and not second.dynamic_partitions_requests
    apply_sensor_result(instance, second)
    for key in resized:
        assert stale_status(defs, instance, key, changed) == StaleStatus.STALE, key.to_user_string()
        assert stale_status(defs, instance, key, other) == StaleStatus.FRESH, key.to_user_string()

    (request,) = second.run_requests
    result = run_request(defs, instance, request)
    assert result.success
    built = {
        (event.asset_key, event.partition): event.materialization.metadata["status"].value
        for event in result.get_asset_materialization_events()
        if event.asset_key in [*resized, keys.crop_bbox]
    }
    assert {built[(key, changed)] for key in [*resized, keys.crop_bbox]} == {"built"}
    checks = [e for e in result.get_asset_check_evaluations() if e.partition == changed]
    assert checks and all(e.passed for e in checks), [e.check_name for e in checks if not e.passed]
    assert {stale_status(defs, instance, key, changed) for key in resized} == {StaleStatus.FRESH}
    defs.resolve_job_def(keys.audit_job).execute_in_process(instance=instance, run_config=QUIET)
    assert stale_status(defs, instance, keys.audit, None) == StaleStatus.FRESH  # the audit is in sync too
    for location, old in zip(outputs, before):  # that shard, and only it, was written again
        new = tree_snapshot(location.path)
        assert {rel for rel in new if new[rel] != old.get(rel)} == {changed}, location.uri

    # Removed from main: recorded, its partition retired (no backfill asks for it again), its outputs
    # kept, and the audit warns naming it.
    Path(tiny_main.child(other)).unlink()
    third = tick(sensor, instance, second.cursor)
    assert not third.run_requests
    (removed,) = third.asset_events
    assert removed.partition == other and removed.metadata[REMOVED].value is True
    (retire,) = third.dynamic_partitions_requests
    assert isinstance(retire, dg.DeleteDynamicPartitionsRequest) and list(retire.partition_keys) == [other]
    apply_sensor_result(instance, third)
    assert instance.get_dynamic_partitions(keys.partitions) == [changed]
    assert all(location.exists(other) for location in outputs)
    audit = defs.resolve_job_def(keys.audit_job).execute_in_process(instance=instance, run_config=QUIET)
    (evaluation,) = [e for e in audit.get_asset_check_evaluations() if e.check_name == "dataset_complete"]
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
    assert "1 shard(s) removed from main, their outputs kept" in evaluation.description
    assert other in evaluation.description and changed not in evaluation.description

    # It comes back: a partition again, built again.
    write_tiny(tiny_main, shards=(other,))
    fourth = tick(sensor, instance, third.cursor)
    apply_sensor_result(instance, fourth)
    assert set(instance.get_dynamic_partitions(keys.partitions)) == {changed, other}
    assert requested(fourth) == [other]


@pytest.mark.stress
def test_100k_shards_are_taken_in_bounded_ticks_and_one_change_or_removal_among_them_is_found(tmp_path, instance):
    """The listing state of 100,000 shards: taken at most `max_new` per tick, kept in one small
    key-value row, and a later pass finds the one rewritten shard and the one removed shard."""
    root = tmp_path / "main"
    rels = [f"{i // 1000:03d}/part-{i:06d}.parquet" for i in range(100_000)]
    for folder in sorted({rel.split("/")[0] for rel in rels}):
        (root / folder).mkdir(parents=True)
    for rel in rels:  # empty files: listing only, no footer is read for shards that did not change
        os.close(os.open(root / rel, os.O_CREAT | os.O_WRONLY, 0o644))
    main = Location.parse(root)

    known, seen, cursor, ticks, complete = [], {}, None, [], False
    while not complete:
        found = discover_shards(main, set(known), cursor, max_new=20_000, seen=seen)
        known, seen, cursor, complete = known + found.new, found.seen, found.cursor, found.complete
        ticks.append(len(found.new))
    assert ticks == [20_000] * 5 + [0] and known == rels  # the last tick finds the end of the listing
    save_seen(instance, "big", seen)
    stored = instance.run_storage.get_cursor_values({STATE_KEY.format(dataset="big")})
    assert len(next(iter(stored.values()))) < 2_000_000  # one row of under 2 MB
    assert load_seen(instance, "big") == seen

    changed, removed = rels[54_321], rels[7]
    (root / changed).write_bytes(b"rewritten")
    (root / removed).unlink()
    found = discover_shards(main, set(known), cursor, max_new=2000, seen=load_seen(instance, "big"))
    assert (found.new, found.changed, found.removed) == ([], [changed], [removed])
    assert found.complete and found.examined == len(rels) - 1
