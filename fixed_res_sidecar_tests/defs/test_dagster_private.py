"""Each private Dagster name the package uses (defs/dagster_private.py) still means what the package
relies on, on a real instance: a Dagster upgrade that changes one fails here, by name."""

import sys

import dagster as dg
import pytest
from dagster._daemon.asset_daemon import get_auto_materialize_paused

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


def test_the_auto_materialize_paused_flag(instance):
    private.set_auto_materialize_paused(instance, True)
    assert get_auto_materialize_paused(instance)
    private.set_auto_materialize_paused(instance, False)
    assert not get_auto_materialize_paused(instance)


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
