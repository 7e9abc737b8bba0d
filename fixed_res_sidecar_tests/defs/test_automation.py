"""The automation sensor: the runs that follow a shard's runs, decided by its ledger, from the events
recorded since the last ticks (a real instance, real runs of the tiny dataset)."""

import dagster as dg
import pytest

from fixed_res_sidecar.defs import automation
from fixed_res_sidecar.defs.automation import AutomationCursor, automation_sensor, automation_tick
from fixed_res_sidecar.defs.names import AUTOMATION_TAG, DATASET_TAG, RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.defs.run_resources import RETRY_ON_FAILURE_TAG
from fixed_res_sidecar_tests.defs.conftest import (
    TINY_SHARDS,
    dataset_entry,
    make_config,
    register,
    run_request,
    run_shard,
)

KEYS = DatasetKeys("tiny")
RESIZED = [KEYS.resized(r) for r in RESOLUTION_NAMES]
VERIFIERS = [KEYS.verify(r) for r in RESOLUTION_NAMES]


def asked(result: dg.SensorResult) -> set[tuple[str, str]]:
    """(asset, shard) of every run a tick requests (one shard each here)."""
    pairs = set()
    for request in result.run_requests or []:
        assert request.partition_key and request.tags[AUTOMATION_TAG] == "true" and request.tags[DATASET_TAG] == "tiny"
        pairs |= {(key.path[-1], request.partition_key) for key in request.asset_selection or []}
    return pairs


def test_the_sensor_runs_by_default_on_the_configured_interval(tiny_main, tmp_path):
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", automation={"interval_seconds": 300}))
    sensor = automation_sensor(config.datasets[0])
    assert sensor.name == "tiny__automation" and sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert sensor.minimum_interval_seconds == 300
    assert set(sensor.asset_selection.resolve(_graph(config))) == set(KEYS.shard_assets)


def _graph(config):
    from fixed_res_sidecar.defs.dataset_definitions import build_definitions

    return build_definitions(config).resolve_asset_graph()


def test_a_shard_built_without_its_verifiers_is_verified_and_cropped_once(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    first = automation_tick(dataset, instance, None)
    assert not first.run_requests and "nothing to follow up" in str(first.skip_reason)
    built, untouched = TINY_SHARDS
    assert run_shard(tiny_defs, instance, "tiny__build_shards", built, selection=RESIZED).success

    second = automation_tick(dataset, instance, first.cursor)
    assert asked(second) == {("verify_512", built), ("verify_1024", built), ("crop_bbox", built)}
    third = automation_tick(dataset, instance, second.cursor)  # the same events read again: not asked twice
    assert not third.run_requests
    (request,) = second.run_requests
    result = run_request(tiny_defs, instance, request)
    assert result.success
    assert {(e.asset_key.path[-1], e.partition) for e in result.get_asset_materialization_events()} == {
        ("verify_512", built), ("verify_1024", built), ("crop_bbox", built)
    }  # fmt: skip
    assert not automation_tick(dataset, instance, third.cursor).run_requests  # complete: nothing follows
    assert untouched not in instance.get_materialized_partitions(KEYS.crop_bbox)


def test_a_crop_follows_a_verification_in_a_later_run_and_is_asked_for_once(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    rel = TINY_SHARDS[0]
    cursor = automation_tick(dataset, instance, None).cursor
    assert run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[*RESIZED, KEYS.verify("512")]).success
    result = automation_tick(dataset, instance, cursor)
    assert asked(result) == {("verify_1024", rel), ("crop_bbox", rel)}  # 512 was verified by the run itself

    # Until that run writes something, the sensor does not ask again (were it lost, its retry would).
    (request,) = result.run_requests
    assert not automation_tick(dataset, instance, result.cursor).run_requests
    assert run_request(tiny_defs, instance, request).success
    assert instance.get_materialized_partitions(KEYS.crop_bbox) == {rel}


def test_an_output_built_with_crop_bbox_but_without_its_verifier_is_verified_next(tiny_config, tiny_defs, instance):
    """crop_bbox as a shard's latest event ends its follow-ups only when its run verified every output it built."""
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    rel = TINY_SHARDS[0]
    assert run_shard(tiny_defs, instance, "tiny__build_shards", rel).success  # built, verified, cropped
    cursor = automation_tick(dataset, instance, None).cursor
    partial = run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[KEYS.resized("512"), KEYS.crop_bbox])
    assert partial.success
    built = {e.asset_key for e in partial.get_asset_materialization_events()}
    assert built == {KEYS.resized("512"), KEYS.crop_bbox}
    assert asked(automation_tick(dataset, instance, cursor)) == {("verify_512", rel), ("crop_bbox", rel)}


def _set_status(instance: dg.DagsterInstance, run: dg.DagsterRun, event: dg.DagsterEventType) -> None:
    instance.run_storage.handle_run_event(run.run_id, dg.DagsterEvent(event.value, job_name=run.job_name))


@pytest.mark.parametrize(
    ("end", "retried", "followed"),
    [
        (dg.DagsterEventType.RUN_SUCCESS, "true", True),
        (dg.DagsterEventType.RUN_FAILURE, "true", False),  # its retry builds the shard again: not raced
        (dg.DagsterEventType.RUN_FAILURE, "false", True),  # failed on data, never retried: its shards are whole
        (dg.DagsterEventType.RUN_CANCELED, "true", False),  # the operator's call
    ],
)
def test_a_shard_waits_until_its_run_ended_and_a_failed_run_is_left_to_its_retry(
    tiny_config, tiny_defs, instance, end, retried, followed
):
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    rel = TINY_SHARDS[0]
    built = run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=RESIZED).dagster_run
    _set_status(instance, built, dg.DagsterEventType.RUN_START)  # as if it were still going: it may yet verify
    assert not instance.get_run_by_id(built.run_id).is_finished
    waiting = automation_tick(dataset, instance, None)
    assert not waiting.run_requests and "1 shard(s) wait for their runs to end" in str(waiting.skip_reason)
    assert {rel: run_id for rel, (_, run_id) in AutomationCursor.parse(waiting.cursor).waiting.items()} == {
        rel: built.run_id
    }

    instance.add_run_tags(built.run_id, {RETRY_ON_FAILURE_TAG: retried})  # a data failure sets it to "false"
    _set_status(instance, built, end)
    after = automation_tick(dataset, instance, waiting.cursor)
    if followed:
        assert asked(after) == {("verify_512", rel), ("verify_1024", rel), ("crop_bbox", rel)}
    else:
        assert not after.run_requests and "wait" not in str(after.skip_reason)
    assert AutomationCursor.parse(after.cursor).waiting == {}


def test_a_backlog_is_read_over_several_ticks_and_settled_events_are_not_read_again(
    tiny_config, tiny_defs, instance, monkeypatch
):
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    for rel in TINY_SHARDS:
        assert run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=RESIZED).success
    monkeypatch.setattr(automation, "EVENTS_PER_TICK", 1)  # a page of one record per asset and kind
    cursor, found, first_complete = None, set(), None
    for tick in range(1, 21):
        result = automation_tick(dataset, instance, cursor, settle_seconds=0)  # every event has committed
        found |= asked(result)
        cursor = result.cursor
        if first_complete is None and len(found) == 6:
            first_complete = tick
    assert found == {(f"verify_{r}", rel) for r in RESOLUTION_NAMES for rel in TINY_SHARDS} | {
        ("crop_bbox", rel) for rel in TINY_SHARDS
    }
    assert first_complete is not None and first_complete >= 2  # not all in the first tick
    state = AutomationCursor.parse(cursor)
    assert state.settled > 0 and state.handled == {} and state.waiting == {}


@pytest.mark.parametrize("text", [None, "", "garbage", "[1]", '{"settled": "x"}'])
def test_an_unreadable_cursor_reads_from_the_start(text):
    assert AutomationCursor.parse(text) == AutomationCursor()
