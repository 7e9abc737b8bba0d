"""The discovery sensor: new shards become partitions, across ticks, in bounded ticks, with runs (or one
backfill for many); changed shards are rebuilt and removed ones reported; requests the daemon never
applied are made again."""

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
    BACKFILL_ABOVE_RUNS,
    STATE_KEY,
    ShardCursor,
    discover_shards,
    discovery_sensor,
    discovery_tick,
    load_seen,
    save_seen,
)
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


def requested(result: dg.SensorResult, instance: dg.DagsterInstance, dataset: str) -> list[str]:
    """The shards a tick's run requests cover, in order: a request is one shard, or a range of partitions."""
    order = instance.get_dynamic_partitions(DatasetKeys(dataset).partitions)
    shards = []
    for request in result.run_requests or []:
        assert request.asset_graph_subset is None, "a backfill, not runs"
        if request.partition_key is not None:
            shards.append(request.partition_key)
        else:
            first, last = request.tags[ASSET_PARTITION_RANGE_START_TAG], request.tags[ASSET_PARTITION_RANGE_END_TAG]
            shards += order[order.index(first) : order.index(last) + 1]
    return shards


def main_records(instance: dg.DagsterInstance, dataset: str, kind: str = "materializations") -> list:
    """What ticks recorded on main, oldest first."""
    fetch = instance.fetch_materializations if kind == "materializations" else instance.fetch_observations
    return list(reversed(fetch(dg.AssetRecordsFilter(asset_key=DatasetKeys(dataset).main), limit=10_000).records))


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
    # The tick itself added the partitions (in listing order) and recorded main's shards; the daemon gets
    # only the run requests.
    assert instance.get_dynamic_partitions("tiny_shards") == expected
    assert not first.dynamic_partitions_requests and not first.asset_events
    (batch,) = first.run_requests  # both new shards in one run (shards_per_run is 8)
    assert batch.job_name is None and batch.partition_key is None  # the sensor's target: the shard assets
    assert sensor.asset_selection.resolve(build_definitions(config).resolve_asset_graph()) == set(keys.shard_assets)
    assert (batch.tags[ASSET_PARTITION_RANGE_START_TAG], batch.tags[ASSET_PARTITION_RANGE_END_TAG]) == tuple(expected)
    tags = batch.tags
    assert tags[DATASET_TAG] == "tiny"
    k8s = json.loads(tags["dagster-k8s/config"])
    assert k8s["container_config"]["resources"]["requests"] == {"cpu": "2", "memory": "3Gi"}
    assert json.loads(tags["dagster-ray/config"]) == {"num_cpus": 2.0, "memory": 3 * 2**30}
    # main's shards are recorded as runless materializations, per partition, with the fingerprint as the
    # data version (what automation and the UI's Unsynced state read).
    records = {r.partition_key: r for r in main_records(instance, "tiny")}
    assert set(records) == set(expected)
    for rel, record in records.items():
        materialization = record.asset_materialization
        assert record.run_id == "" and materialization.asset_key == keys.main
        assert materialization.metadata["dagster/row_count"].value == TINY_ROWS
        assert materialization.metadata["bytes"].value == tiny_main.size(rel) > 0
        assert materialization.tags["dagster/data_version"] == materialization.metadata["fingerprint"].value
    assert instance.get_materialized_partitions(keys.main) == set(expected)  # the UI shows them present

    second = tick(sensor, instance, first.cursor)
    assert not second.run_requests
    assert "no new, changed or removed shards" in str(second.skip_reason)
    assert len(main_records(instance, "tiny")) == 2

    write_tiny(tiny_main, shards=("nested/y/part-c.parquet",))
    third = tick(sensor, instance, second.cursor)
    assert requested(third, instance, "tiny") == ["nested/y/part-c.parquet"]
    assert instance.get_dynamic_partitions("tiny_shards") == [*expected, "nested/y/part-c.parquet"]
    assert [r.partition_key for r in main_records(instance, "tiny")][2:] == ["nested/y/part-c.parquet"]


def test_ticks_are_bounded_and_the_cursor_continues_the_listing(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    write_stub_shards(main, [f"p{i}.parquet" for i in range(5)])
    dataset = make_config(dataset_entry("big", main, tmp_path / "out", sensor={"max_new_shards_per_tick": 2})).datasets[
        0
    ]
    sensor = discovery_sensor(dataset)
    cursor = None
    for expected in (["p0.parquet", "p1.parquet"], ["p2.parquet", "p3.parquet"], ["p4.parquet"]):
        result = tick(sensor, instance, cursor)
        assert requested(result, instance, "big") == expected
        assert instance.get_dynamic_partitions("big_shards")[-len(expected) :] == expected
        cursor = result.cursor
    assert ShardCursor.parse(cursor) == ShardCursor(after=None, passes=1, tick=3)
    # A shard that appears before the resume point is found by the next full pass.
    write_stub_shards(main, ["a-early.parquet"])
    result = tick(sensor, instance, cursor)
    assert requested(result, instance, "big") == ["a-early.parquet"]
    assert ShardCursor.parse(result.cursor).passes == 2


def test_a_tick_needing_many_runs_requests_one_backfill_of_them(tmp_path, instance):
    """Up to BACKFILL_ABOVE_RUNS runs of `shards_per_run` shards are requested as runs; more as one backfill
    of the shard assets, tagged as the dataset's runs are (the backfill's runs take its tags)."""
    main = Location.parse(tmp_path / "main")
    per_run = 2
    rels = [f"p{i:02d}.parquet" for i in range(per_run * (2 * BACKFILL_ABOVE_RUNS) + 1)]
    write_stub_shards(main, rels[: per_run * BACKFILL_ABOVE_RUNS])
    dataset = make_config(dataset_entry("many", main, tmp_path / "out", shards_per_run=per_run)).datasets[0]
    keys, sensor = DatasetKeys("many"), discovery_sensor(dataset)
    first = tick(sensor, instance, None)
    assert len(first.run_requests) == BACKFILL_ABOVE_RUNS
    assert requested(first, instance, "many") == rels[: per_run * BACKFILL_ABOVE_RUNS]

    write_stub_shards(main, rels[per_run * BACKFILL_ABOVE_RUNS :])
    recrawl_main_shard(main, rels[0])  # a changed shard goes into the same backfill
    second = tick(sensor, instance, first.cursor)
    (backfill,) = second.run_requests
    assert backfill.requires_backfill_daemon() and backfill.tags[DATASET_TAG] == "many"
    subset = backfill.asset_graph_subset
    assert subset.asset_keys == set(keys.shard_assets)
    wanted = {rels[0], *rels[per_run * BACKFILL_ABOVE_RUNS :]}
    for key in keys.shard_assets:
        assert set(subset.get_partitions_subset(key).get_partition_keys()) == wanted, key.to_user_string()
    assert instance.get_dynamic_partitions(keys.partitions) == rels


def test_requests_the_daemon_did_not_apply_are_made_again(tiny_main, tmp_path, instance):
    """The daemon keeps a tick's cursor only once it applied the tick's run requests. A tick whose cursor
    was not kept (its result lost) had its shards recorded and added already, so they are no longer new:
    the next tick requests them again, and once a cursor carrying them was kept, never again."""
    dataset = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out")).datasets[0]
    sensor = discovery_sensor(dataset)
    lost = tick(sensor, instance, None)
    assert requested(lost, instance, "tiny") == sorted(TINY_SHARDS)
    again = tick(sensor, instance, None)  # the cursor of `lost` was never kept
    assert requested(again, instance, "tiny") == sorted(TINY_SHARDS)
    assert len(main_records(instance, "tiny")) == 2  # recorded once: the shards are not new any more
    assert ShardCursor.parse(again.cursor).tick == ShardCursor.parse(lost.cursor).tick + 1
    applied = tick(sensor, instance, again.cursor)
    assert not applied.run_requests and "no new, changed or removed shards" in str(applied.skip_reason)
    # A shard removed meanwhile is not requested again.
    Path(tiny_main.child("part-a.parquet")).unlink()
    recrawl_main_shard(tiny_main, "nested/x/part-b.parquet")
    changed = tick(sensor, instance, applied.cursor)
    assert requested(changed, instance, "tiny") == ["nested/x/part-b.parquet"]
    removed_since = tick(sensor, instance, applied.cursor)  # lost again: only what is still a partition
    assert requested(removed_since, instance, "tiny") == ["nested/x/part-b.parquet"]


def test_after_the_demo_registered_the_shards_itself_the_sensor_requests_none_of_them(tiny_main, tmp_path, instance):
    """Reported: the demo's ticks (in process; it runs the shards itself) left their shards pending, so the
    live sensor, on a cursor of its own, requested every one of them again: runs nobody asked for."""
    from fixed_res_sidecar.demo import register_shards

    dataset = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out")).datasets[0]
    assert register_shards(instance, dataset) == sorted(TINY_SHARDS)
    live = tick(discovery_sensor(dataset), instance, None)
    assert not live.run_requests and "no new, changed or removed shards" in str(live.skip_reason)


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
    result = discovery_tick(dataset, instance, None, log=log)
    assert requested(result, instance, "odd") == ["good.parquet"]
    assert instance.get_dynamic_partitions("odd_shards") == ["good.parquet"]
    assert len(log.errors) == 2
    assert any("'bad,name.parquet'" in e and "','" in e for e in log.errors)
    assert any("'odd...name.parquet'" in e and "'...'" in e for e in log.errors)
    # The sensor itself refuses them the same way, on every pass.
    with dg.instance_for_test() as fresh:
        result = tick(discovery_sensor(dataset), fresh, None)
        assert fresh.get_dynamic_partitions("odd_shards") == ["good.parquet"]
        assert requested(result, fresh, "odd") == ["good.parquet"]


def test_the_tick_log_names_the_removed_shards(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    write_stub_shards(main, ["a.parquet", "b.parquet"])
    dataset = make_config(dataset_entry("gone", main, tmp_path / "out")).datasets[0]
    first = discovery_tick(dataset, instance, None)

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
    discovery_tick(dataset, instance, first.cursor, log=log)
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
    assert requested(result, instance, "s3ds") == rels
    assert {r.asset_materialization.metadata["dagster/row_count"].value for r in main_records(instance, "s3ds")} == {2}


def test_unreadable_shard_is_observed_with_its_error(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    main.write_bytes("broken.parquet", b"not parquet")
    dataset = make_config(dataset_entry("broken", main, tmp_path / "out")).datasets[0]
    result = discovery_tick(dataset, instance, None)
    (record,) = main_records(instance, "broken")
    metadata = record.asset_materialization.metadata
    assert "error" in metadata and "dagster/row_count" not in metadata
    assert requested(result, instance, "broken") == ["broken.parquet"]  # its run reports the failure


def test_sensor_statuses(tiny_config, tmp_path, tiny_main):
    dataset = tiny_config.datasets[0]
    assert discovery_sensor(dataset).default_status == dg.DefaultSensorStatus.STOPPED
    running = make_config(
        dataset_entry(
            "on", tiny_main, tmp_path / "o2", sensor={"default_status": "running", "interval_seconds": 15},
        )
    )  # fmt: skip
    sensor = discovery_sensor(running.datasets[0])
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert sensor.minimum_interval_seconds == 15


@pytest.mark.parametrize("text", [None, "", "garbage", "[1, 2]", '{"after": "x", "passes": "many"}'])
def test_unreadable_cursor_starts_a_fresh_listing(text):
    assert ShardCursor.parse(text) == ShardCursor()


def test_a_main_folder_that_cannot_be_listed_fails_the_tick_and_removes_nothing(tiny_main, tmp_path, instance):
    """Reported: a subfolder of main that could not be listed was dropped from the listing, and the
    sensor recorded its shards as removed. Now the tick fails, naming the folder, and records nothing."""
    dataset = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out")).datasets[0]
    sensor = discovery_sensor(dataset)
    first = tick(sensor, instance, None)
    seen_before = load_seen(instance, "tiny")
    folder = Path(tiny_main.child("nested"))

    with unreadable(folder), permission_checks_enforced(), pytest.raises(StorageError) as failure:
        tick(sensor, instance, first.cursor)
    assert f"storage failed listing {folder}" in str(failure.value) and "Permission denied" in str(failure.value)
    assert load_seen(instance, "tiny") == seen_before  # nothing recorded as removed
    assert not main_records(instance, "tiny", "observations")
    assert len(instance.get_dynamic_partitions("tiny_shards")) == 2

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


@pytest.mark.heavy
def test_a_rewritten_main_shard_is_marked_unsynced_then_rebuilt_verified_and_cropped(tiny_main, tmp_path, instance):
    """Sensor tick -> the shard's outputs are unsynced -> the requested run rebuilds, verifies and
    crops that shard alone -> in sync again; then a removed shard leaves its outputs, and the audit
    warns naming it."""
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out"))
    dataset, keys, defs = config.datasets[0], DatasetKeys("tiny"), build_definitions(config)
    sensor = discovery_sensor(dataset)
    first = tick(sensor, instance, None)
    assert all(run_request(defs, instance, request).success for request in first.run_requests)
    changed, other = "part-a.parquet", "nested/x/part-b.parquet"
    outputs = [dataset.output(name) for name in ("resized_512", "resized_1024", "crop_bbox")]
    before = [tree_snapshot(location.path) for location in outputs]
    resized = [keys.resized(resolution) for resolution in RESOLUTION_NAMES]
    assert {stale_status(defs, instance, key, changed) for key in resized} == {StaleStatus.FRESH}

    recrawl_main_shard(tiny_main, changed)
    second = tick(sensor, instance, first.cursor)
    assert requested(second, instance, "tiny") == [changed]
    assert sorted(instance.get_dynamic_partitions(keys.partitions)) == sorted(TINY_SHARDS)  # none added
    (observed,) = main_records(instance, "tiny", "observations")
    (rematerialised,) = [r for r in main_records(instance, "tiny")[2:]]
    assert observed.partition_key == rematerialised.partition_key == changed
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
    removed = main_records(instance, "tiny", "observations")[-1].asset_observation
    assert removed.partition == other and removed.metadata[REMOVED].value is True
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
    assert set(instance.get_dynamic_partitions(keys.partitions)) == {changed, other}
    assert requested(fourth, instance, "tiny") == [other]


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
