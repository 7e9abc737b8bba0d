"""Each private Dagster name the package uses (defs/dagster_private.py) still means what the package
relies on, on a real instance: a Dagster upgrade that changes one fails here, by name."""

import sys

import dagster as dg
import pytest

from fixed_res_sidecar.defs import dagster_private as private

PARTITIONS = dg.StaticPartitionsDefinition(["a", "b"])


@dg.asset(partitions_def=PARTITIONS, code_version="v1")
def upstream() -> None:
    return None


@dg.asset(partitions_def=PARTITIONS, deps=[upstream], code_version="v2")
def downstream(context: dg.AssetExecutionContext):
    yield dg.MaterializeResult()
    this_partition = dg.AssetRecordsFilter(asset_key=upstream.key, asset_partitions=[context.partition_key])
    records = context.instance.fetch_materializations(this_partition, limit=1).records
    if not records:
        return
    target = private.AssetCheckEvaluationTargetMaterializationData(
        storage_id=records[0].storage_id, run_id=records[0].run_id, timestamp=records[0].timestamp
    )
    yield dg.AssetCheckEvaluation(
        asset_key=upstream.key,
        check_name="looked_at",
        passed=context.partition_key == "a",
        partition=context.partition_key,
        target_materialization_data=target,
    )


def _latest(instance, key, partition=None):
    """The latest materialization record of `key` (of one partition if given), with its storage id."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None), limit=1
    ).records
    assert records, f"{key.to_user_string()} was never materialised"
    return records[0]


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


def _materialize(instance, assets, partition):
    result = dg.materialize(assets, instance=instance, partition_key=partition, selection=assets)
    assert result.success
    return result


def test_provenance_tags_are_the_ones_dagster_writes(instance):
    _materialize(instance, [upstream], "a")
    _materialize(instance, [upstream, downstream], "a")
    up = _latest(instance, upstream.key)
    tags = _latest(instance, downstream.key).asset_materialization.tags
    assert tags[private.CODE_VERSION_TAG] == "v2"
    assert tags[private.get_input_event_pointer_tag(upstream.key)] == str(up.storage_id)
    assert private.get_input_data_version_tag(upstream.key) in tags
    # An input never materialised is recorded with the null pointer the package writes for it.
    with dg.instance_for_test() as fresh:
        _materialize(fresh, [downstream], "b")
        alone = _latest(fresh, downstream.key).asset_materialization.tags
        assert alone[private.get_input_event_pointer_tag(upstream.key)] == private.NULL_EVENT_POINTER


def test_check_history_filters_by_partition_and_completed_status(instance):
    _materialize(instance, [upstream], "a")
    _materialize(instance, [upstream], "b")
    _materialize(instance, [upstream, downstream], "a")
    _materialize(instance, [upstream, downstream], "b")
    key = dg.AssetCheckKey(upstream.key, "looked_at")
    storage = instance.event_log_storage
    done = {private.AssetCheckExecutionRecordStatus.SUCCEEDED, private.AssetCheckExecutionRecordStatus.FAILED}
    results = {}
    for partition in ("a", "b"):
        records = storage.get_asset_check_execution_history(
            key, limit=1, status=done, partition_filter=private.PartitionKeyFilter(key=partition)
        )
        assert len(records) == 1
        evaluation = records[0].evaluation
        results[partition] = (records[0].status, evaluation.passed)
        target = evaluation.target_materialization_data
        assert isinstance(target, private.AssetCheckEvaluationTargetMaterializationData)
        # The result names the materialization it evaluated: the latest of upstream at that time.
        assert target.storage_id == _latest(instance, upstream.key, partition).storage_id
    assert results == {
        "a": (private.AssetCheckExecutionRecordStatus.SUCCEEDED, True),
        "b": (private.AssetCheckExecutionRecordStatus.FAILED, False),
    }


def test_backfill_filter_and_range_tags(instance):
    requested = private.BulkActionsFilter(statuses=[private.BulkActionStatus.REQUESTED])
    assert instance.get_backfills(filters=requested) == []
    # The run tags of a range run, which the sensors set themselves on a RunRequest.
    assert private.ASSET_PARTITION_RANGE_START_TAG == "dagster/asset_partition_range_start"
    assert private.ASSET_PARTITION_RANGE_END_TAG == "dagster/asset_partition_range_end"


@dg.asset
def fails_once() -> None:
    raise ValueError("a data failure")


@dg.asset
def succeeds() -> None:
    return None


def test_retry_tags_are_the_ones_run_retries_read_and_write(tmp_path):
    """MAX_RETRIES_TAG on a failed run decides whether it will be retried (the load guard sets it to 0)."""
    overrides = {"run_retries": {"enabled": True, "max_retries": 2}}
    with dg.instance_for_test(overrides=overrides, temp_dir=str(tmp_path)) as instance:
        will_retry = {}
        for value in ("0", "1"):
            result = dg.materialize([fails_once], instance=instance, tags={private.MAX_RETRIES_TAG: value},
                                    raise_on_error=False)  # fmt: skip
            will_retry[value] = instance.get_run_by_id(result.run_id).tags.get("dagster/will_retry")
        assert will_retry == {"0": "false", "1": "true"}
    # The names Dagster's run retries guide documents; the Ray cluster tests read them on real retries.
    assert (private.PARENT_RUN_ID_TAG, private.RETRY_NUMBER_TAG) == ("dagster/parent_run_id", "dagster/retry_number")


def _job_of_succeeds():
    return dg.Definitions(assets=[succeeds], jobs=[dg.define_asset_job("job_of_succeeds")]).resolve_job_def(
        "job_of_succeeds"
    )


def test_run_worker_arguments_and_the_instance_ref_round_trip(instance):
    """What `dagster api execute_run` is given (ExecuteRunArgs / ResumeRunArgs, serialized) carries the
    run id and an InstanceRef that opens the same instance (the load guard's and the fence's way in)."""
    import pickle

    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin  # test-only: building an origin

    ref = instance.get_ref()
    assert isinstance(ref, private.InstanceRef)
    assert pickle.loads(pickle.dumps(ref)) == ref
    origin = JobPythonOrigin("job", RepositoryPythonOrigin(sys.executable, ModuleCodePointer("m", "defs", None)))
    for kind in (private.ExecuteRunArgs, private.ResumeRunArgs):
        text = dg.serialize_value(kind(job_origin=origin, run_id="r-1", instance_ref=ref))
        args = dg.deserialize_value(text, (private.ExecuteRunArgs, private.ResumeRunArgs))
        assert type(args) is kind and args.run_id == "r-1"
        with dg.DagsterInstance.from_ref(args.instance_ref) as again:
            assert again.get_ref() == ref


def test_launch_and_resume_contexts_are_what_a_launcher_is_given(instance):
    """The contexts a run launcher's launch_run / resume_run take: the run and the workspace (the Ray
    launcher passes dagster-ray a copy with another run)."""
    run = instance.create_run_for_job(_job_of_succeeds())
    launch = private.LaunchRunContext(dagster_run=run, workspace=None)
    resume = private.ResumeRunContext(dagster_run=run, workspace=None, resume_attempt_number=1)
    assert launch.dagster_run.run_id == resume.dagster_run.run_id == run.run_id
    assert launch.workspace is None and resume.resume_attempt_number == 1


def _stored(instance, key, kind):
    fetch = instance.fetch_materializations if kind == "materialization" else instance.fetch_observations
    return list(reversed(fetch(dg.AssetRecordsFilter(asset_key=key), limit=100).records))


@pytest.mark.parametrize("batch", [1, 2, 1000])
def test_runless_events_stored_in_batches_are_what_report_runless_asset_event_stores(instance, monkeypatch, batch):
    """The same records, in the same order, as one `report_runless_asset_event` call per event: runless,
    per partition, with metadata and tags (the data version the UI and automation read); the partitions
    shown materialised; kinds mixed across batches."""
    monkeypatch.setattr(private, "EVENT_BATCH", batch)
    batched, single = dg.AssetKey(["batched"]), dg.AssetKey(["single"])

    def events(key):
        made = []
        for i, rel in enumerate(["a", "b", "c"]):
            tags = {"dagster/data_version": f"v{i}"}
            made.append(dg.AssetMaterialization(key, partition=rel, metadata={"rows": i}, tags=tags))
            if rel != "b":
                made.append(dg.AssetObservation(key, partition=rel, metadata={"rows": i}, tags=tags))
        return made

    assert private.store_runless_events(instance, events(batched)) == 5
    for event in events(single):
        instance.report_runless_asset_event(event)
    for kind in ("materialization", "observation"):
        got, want = _stored(instance, batched, kind), _stored(instance, single, kind)
        assert [(r.run_id, r.partition_key) for r in got] == [(r.run_id, r.partition_key) for r in want]
        for a, b in zip(got, want):
            event_a, event_b = (r.event_log_entry.dagster_event.event_specific_data for r in (a, b))
            assert a.event_log_entry.dagster_event_type == b.event_log_entry.dagster_event_type
            assert type(event_a) is type(event_b)
    assert instance.get_materialized_partitions(batched) == {"a", "b", "c"}
    latest = instance.get_latest_materialization_event(batched)
    assert latest.asset_materialization.tags["dagster/data_version"] == "v2"
    observations = _stored(instance, batched, "observation")
    assert [r.asset_observation.tags["dagster/data_version"] for r in observations] == ["v0", "v2"]


def test_a_backfill_request_is_what_the_sensor_daemon_turns_into_an_asset_backfill(instance):
    """The RunRequest goes to the backfill daemon, survives serialization (the code server sends it to the
    daemon), and the backfill the daemon makes of it targets those partitions of those assets."""
    from dagster._core.execution.backfill import PartitionBackfill
    from dagster._serdes import deserialize_value, serialize_value

    partitions = dg.DynamicPartitionsDefinition(name="shards")
    instance.add_dynamic_partitions("shards", ["a", "b", "c"])
    keys = [dg.AssetKey(["x"]), dg.AssetKey(["y"])]
    request = private.backfill_request(partitions, dict.fromkeys(keys, ("a", "c")), {"team": "data"})
    assert request.requires_backfill_daemon() and request.tags == {"team": "data"}
    request = deserialize_value(serialize_value(request), dg.RunRequest)
    backfill = PartitionBackfill.from_asset_graph_subset(
        backfill_id="b1",
        dynamic_partitions_store=instance,
        backfill_timestamp=0.0,
        asset_graph_subset=request.asset_graph_subset,
        tags=request.tags,
        title=None,
        description=None,
        run_config=None,
    )
    instance.add_backfill(backfill)
    stored = instance.get_backfill("b1").asset_backfill_data.target_subset
    assert {(p.asset_key, p.partition_key) for p in stored.iterate_asset_partitions()} == {
        (key, rel) for key in keys for rel in ("a", "c")
    }


def test_a_data_failure_fails_its_step_with_one_message_and_no_stack_trace(instance):
    @dg.asset
    def failing() -> None:
        raise private.DataFailure("2 of 8 shard(s) failed: a.parquet: verify_512 failed keys_match")

    result = dg.materialize([failing], instance=instance, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.event_specific_data.error
    assert error.message == "2 of 8 shard(s) failed: a.parquet: verify_512 failed keys_match"
    assert error.stack == [] and error.cls_name == "DataFailure" and error.cause is None
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.status is dg.DagsterRunStatus.FAILURE
