"""Every private Dagster name the package uses, behind one door, each with why no public API serves.

Dagster's private modules (`dagster._...`) change between releases without notice. Importing them
here only means a Dagster upgrade fails in one place, at import, and
`fixed_res_sidecar_tests/defs/test_dagster_private.py` exercises each name so that a changed
behaviour fails there too. Checked first against the public API of 1.13 (`DagsterInstance.
fetch_materializations` / `fetch_observations` with `AssetRecordsFilter`,
`get_latest_materialization_event`, `get_status_by_partition`, `dg.RunsFilter`, `dg.SubmitRunContext`):

- `CODE_VERSION_TAG`, `NULL_EVENT_POINTER`, `get_input_data_version_tag`, `get_input_event_pointer_tag`:
  the data provenance tags of a materialization. A batch step records its shards with explicit
  AssetMaterializations, which Dagster tags only for the step's own outputs; these are the tag
  names it writes there (the UI's Unsynced state reads them), with no public constant or builder.
- `AssetCheckEvaluationTargetMaterializationData`: links a check result to the materialization it
  evaluated; `dg.AssetCheckEvaluation` takes it as `target_materialization_data`, but the type is
  not exported.
- `PartitionKeyFilter`, `AssetCheckExecutionRecordStatus`: the latest *completed* result of a
  check for one partition. Only the event log storage's `get_asset_check_execution_history` filters
  by status and partition, with these types (`get_asset_check_partition_info` gives the latest
  execution, which a run in progress has only planned).
- `BulkActionsFilter`, `BulkActionStatus`: backfills in progress (the audit's "under way");
  `DagsterInstance.get_backfills` is public, its filter and status types are not.
- `ASSET_PARTITION_RANGE_START_TAG`, `ASSET_PARTITION_RANGE_END_TAG`: the tags of a run over a range
  of partitions; a sensor's RunRequest for a range sets them itself (RunRequest has no range argument).
- `PARENT_RUN_ID_TAG`, `RETRY_NUMBER_TAG`, `MAX_RETRIES_TAG`: the tags run retries write on a retry
  (its parent, its number) and read on a failed run (how often it may be retried); the run
  coordinator tells an automatic retry from a user's re-execution by them, and the load guard sets
  `dagster/max_retries` to 0 on a run whose code cannot load. Dagster documents the tag names
  (the run retries guide) but exports no constant.
- `LaunchRunContext`, `ResumeRunContext`: what a run launcher's `launch_run` / `resume_run` take;
  the Ray launcher (`ray_launcher.py`) passes dagster-ray's launcher a copy with the run's
  environment added. Run launchers are a documented extension point, their context types are not
  exported.
- `ExecuteRunArgs`, `ResumeRunArgs`: the serialized arguments of `dagster api execute_run` /
  `resume_run`; a run worker whose code cannot load finds its run id and instance in them
  (`load_guard.py`): nothing else of Dagster's has run in that process yet.
- `DagsterUserCodeProcessError`, `SerializableErrorInfo` (as `DataFailure`): a step that fails because
  its data failed (a failed check, a refused crop) shows one message and no stack trace. Dagster
  records a step's error from the exception it raises, with the traceback; a
  `DagsterUserCodeProcessError` ("an error in a user code process", which our shard workers are)
  carries an already serialized error instead, and Dagster records that one as it is, with the
  stack it has: none. `dg.Failure` has no way to leave its stack out.
- `InstanceRef`: what `DagsterInstance.get_ref()` returns, the picklable way to the instance that a
  run fence's commit check carries to the step's shard worker processes (`fencing.OwnerCheck`).
- `StepMaterializationData`, `AssetObservationData`, `RUNLESS_RUN_ID`, `RUNLESS_JOB_NAME`
  (`store_runless_events`): main's shards recorded many per storage write. The public
  `report_runless_asset_event` (and a SensorResult's `asset_events`, which the daemon applies with
  it) writes one event per call, several database round trips each (a new connection each on
  Postgres): 75 s per 1,000 shards. The event log's `store_event_batch` writes a batch in one
  insert, but takes the `EventLogEntry` that `report_runless_asset_event` builds from these.
- `AssetGraphSubset` (`backfill_request`): a sensor's RunRequest for a backfill
  (`RunRequest.for_asset_graph_subset`, which the sensor daemon turns into an asset backfill); the
  subset type it takes is not exported.
"""

import time
from collections.abc import Iterable, Mapping, Sequence

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    NULL_EVENT_POINTER,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)
from dagster._core.errors import DagsterUserCodeProcessError
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.events import AssetObservationData, StepMaterializationData
from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus
from dagster._core.instance.ref import InstanceRef
from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID
from dagster._core.launcher import LaunchRunContext, ResumeRunContext
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    MAX_RETRIES_TAG,
    PARENT_RUN_ID_TAG,
    RETRY_NUMBER_TAG,
)
from dagster._grpc.types import ExecuteRunArgs, ResumeRunArgs
from dagster_shared.error import SerializableErrorInfo

DATA_FAILURE_CLASS = "DataFailure"


class DataFailure(DagsterUserCodeProcessError):
    """Fails a step with `message` alone: no stack trace, no class path (the data failed, not the code)."""

    def __init__(self, message: str):
        info = SerializableErrorInfo(message=message, stack=[], cls_name=DATA_FAILURE_CLASS)
        super().__init__(message, user_code_process_error_infos=[info])


EVENT_BATCH = 1000  # events per storage write: one insert of a few hundred kilobytes

__all__ = [
    "ASSET_PARTITION_RANGE_END_TAG",
    "ASSET_PARTITION_RANGE_START_TAG",
    "CODE_VERSION_TAG",
    "MAX_RETRIES_TAG",
    "NULL_EVENT_POINTER",
    "PARENT_RUN_ID_TAG",
    "RETRY_NUMBER_TAG",
    "AssetCheckEvaluationTargetMaterializationData",
    "AssetCheckExecutionRecordStatus",
    "BulkActionStatus",
    "BulkActionsFilter",
    "DataFailure",
    "ExecuteRunArgs",
    "InstanceRef",
    "LaunchRunContext",
    "PartitionKeyFilter",
    "ResumeRunArgs",
    "ResumeRunContext",
    "backfill_request",
    "get_input_data_version_tag",
    "get_input_event_pointer_tag",
    "store_runless_events",
]


def store_runless_events(
    instance: dg.DagsterInstance, events: Iterable[dg.AssetMaterialization | dg.AssetObservation]
) -> int:
    """Store runless asset events as `report_runless_asset_event` does, `EVENT_BATCH` per write: consecutive
    events of one kind go together (a batch holds one event type), the order is kept. Returns the count."""
    batch: list[dg.EventLogEntry] = []
    stored = 0

    def flush() -> None:
        nonlocal batch, stored
        if batch:
            instance.event_log_storage.store_event_batch(batch)
            stored += len(batch)
            batch = []

    for event in events:
        if isinstance(event, dg.AssetMaterialization):
            kind, data = dg.DagsterEventType.ASSET_MATERIALIZATION, StepMaterializationData(event)
        else:
            kind, data = dg.DagsterEventType.ASSET_OBSERVATION, AssetObservationData(event)
        if batch and (len(batch) >= EVENT_BATCH or batch[-1].dagster_event_type != kind):
            flush()
        batch.append(
            dg.EventLogEntry(
                user_message="",
                level="INFO",
                job_name=RUNLESS_JOB_NAME,
                run_id=RUNLESS_RUN_ID,
                error_info=None,
                timestamp=time.time(),
                dagster_event=dg.DagsterEvent(
                    event_type_value=kind.value, event_specific_data=data, job_name=RUNLESS_JOB_NAME
                ),
            )
        )
    flush()
    return stored


def backfill_request(
    partitions: dg.PartitionsDefinition,
    keys_by_asset: Mapping[dg.AssetKey, Sequence[str]],
    tags: Mapping[str, str],
) -> dg.RunRequest:
    """A sensor's request for one asset backfill of these partitions of these assets (the daemon creates
    the backfill; the backfill daemon its runs, following each asset's BackfillPolicy)."""
    subset = AssetGraphSubset(
        partitions_subsets_by_asset_key={
            key: partitions.subset_with_partition_keys(rels) for key, rels in keys_by_asset.items()
        }
    )
    return dg.RunRequest.for_asset_graph_subset(subset, tags=dict(tags))
