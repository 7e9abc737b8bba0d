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
- `set_auto_materialize_paused`: the local instance's legacy "auto-materialize paused" flag (the
  demo clears it so that the UI does not say automation is off); the UI's switch, no public API.
"""

from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    NULL_EVENT_POINTER,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from dagster._daemon.asset_daemon import set_auto_materialize_paused

__all__ = [
    "ASSET_PARTITION_RANGE_END_TAG",
    "ASSET_PARTITION_RANGE_START_TAG",
    "CODE_VERSION_TAG",
    "NULL_EVENT_POINTER",
    "AssetCheckEvaluationTargetMaterializationData",
    "AssetCheckExecutionRecordStatus",
    "BulkActionStatus",
    "BulkActionsFilter",
    "PartitionKeyFilter",
    "get_input_data_version_tag",
    "get_input_event_pointer_tag",
    "set_auto_materialize_paused",
]
