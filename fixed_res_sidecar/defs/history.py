"""What a Dagster instance knows about a dataset's shards, read into ledgers (`defs/ledger.py`).

Reading the event log, never the data. `read_ledgers` reads what one run needs of its shards;
`materialization_of` and `check_record_of` turn the instance's records into ledger entries (the
dataset audit applies them incrementally). The rules about shards live in the ledger, not here.

Storage outages: every call here that a run makes to the instance's storage is retried
(`storage_call`, through the one retry helper `io/retry.retry_call`) while the database does not
answer (a restart or failover takes seconds to a minute), with backoff, for at most
`STORAGE_RETRY.budget_seconds` (plus one attempt), each wait logged; then `EventLogUnavailable`
(a `StorageError`) fails the step. Not the key-value state (`load_json`, `save_json`): a sensor
tick that outlasted its timeout would still save it. Dagster's own event writes retry only their
connection, for about 11 s: a shard run waits for the storage (`wait_for_storage`) before it
records its shards. A run that failed anyway is retried as a new run, unless its data failed
(`retry_run_on_failure`).
"""

import base64
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import dagster as dg

from fixed_res_sidecar.core.resolutions import RESOLUTION_NAMES
from fixed_res_sidecar.defs import ledger
from fixed_res_sidecar.defs.dagster_private import (
    CODE_VERSION_TAG,
    NULL_EVENT_POINTER,
    AssetCheckExecutionRecordStatus,
    PartitionKeyFilter,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.run_resources import RETRY_ON_FAILURE_TAG
from fixed_res_sidecar.io.retry import RetryPolicy, StorageError, first_line, retry_call

log = logging.getLogger(__name__)

# How long a call to the instance's storage is retried while the database does not answer: longer
# than a database restart or a managed failover (tens of seconds), short enough that a dead
# database fails the run within minutes (its retry then redoes the shard). Waits 0.5 s, doubling, at most 10 s.
# SIDECAR_STORAGE_WAIT_SECONDS sets it for a deployment (defs/resources.py lists the run-time settings).
STORAGE_WAIT_ENV = "SIDECAR_STORAGE_WAIT_SECONDS"
STORAGE_RETRY = RetryPolicy(
    base_seconds=0.5, max_seconds=10.0, budget_seconds=float(os.environ.get(STORAGE_WAIT_ENV) or 120.0), jitter=False
)

# Materialization metadata. A verifier's and crop_bbox's: the fingerprint of the output they checked.
VERIFIED_FINGERPRINT = "verified_fingerprint"
# A restatement's: the run that built what it restates, and that build's place in the build order.
RESTATED_FROM_RUN = "restated_from_run"
RESTATED_FROM_ID = "restated_from_id"
# main's observation of a shard a complete listing no longer has (discovery).
REMOVED = "removed"
# A verifier's or crop_bbox's observation of a verification that failed (it is not materialised).
FAILED_VERIFICATION = "verification_failed"
# Assets whose failed verifications are observations (ledger names).
VERIFIED_ASSETS = (*(ledger.verifier(r) for r in RESOLUTION_NAMES), ledger.CROP_BBOX)


class EventLogUnavailable(StorageError):
    """The Dagster instance's storage kept failing for the whole retry budget: an infrastructure
    error, never a verdict on a shard."""


def _unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the database is not there (refused, dropped, restarting), not that a query is wrong."""
    import sqlalchemy.exc

    if isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        return True
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        return True
    try:  # dagster-postgres gives up on a connection after ~11 s (5 retries) with its own error
        from dagster_postgres.utils import DagsterPostgresException
    except ImportError:
        return False
    return isinstance(exc, DagsterPostgresException)


def storage_call(call: Callable, *args, budget: float | None = None, **kwargs):
    """`call(*args, **kwargs)` (a read or an idempotent write of the instance's storage), retried
    while the database is unavailable, for at most `budget` seconds (STORAGE_RETRY's); then
    EventLogUnavailable. Other errors pass through at once."""
    policy = STORAGE_RETRY if budget is None else RetryPolicy(**{**STORAGE_RETRY.__dict__, "budget_seconds": budget})
    name = getattr(call, "__name__", "a call")

    def fail(exc: BaseException, attempts: int, seconds: float) -> StorageError:
        return EventLogUnavailable(
            f"the Dagster instance's storage did not answer for {seconds:.0f} s ({attempts} attempt(s) of "
            f"{name}): {first_line(exc)}"
        )

    return retry_call(lambda: call(*args, **kwargs), policy, _unavailable, fail, name=name, log=log)


def wait_for_storage(instance: dg.DagsterInstance) -> None:
    """Return once the instance's event log answers (retried as `storage_call`): a run checks this
    before it records its shards, whose events Dagster writes retrying for about 11 s only."""
    storage_call(instance.event_log_storage.get_maximum_record_id)


def retry_run_on_failure(instance: dg.DagsterInstance, run_id: str, retry: bool) -> None:
    """Whether run `run_id` is retried if it fails in a step (deploy/dagster.yaml's run retries).

    Every run of a dataset starts with "true" (`run_resources.dataset_run_tags`): a step can fail
    before any code of ours runs (Dagster's own reads and writes during a storage outage), and a
    retry then records the shard (its outputs are kept and skipped as up to date). A run whose
    failure is the data's (a blocking check failed) sets "false": a retry would fail the same way.
    """
    storage_call(instance.add_run_tags, run_id, {RETRY_ON_FAILURE_TAG: str(retry).lower()})


def load_json(instance: dg.DagsterInstance, key: str) -> Any:
    """A JSON value kept in the instance's key-value store (compressed), or None."""
    text = instance.run_storage.get_cursor_values({key}).get(key)
    if not text:
        return None
    try:
        return json.loads(zlib.decompress(base64.b64decode(text)))
    except (ValueError, zlib.error):
        return None  # unreadable: the caller starts over


def save_json(instance: dg.DagsterInstance, key: str, value: Any) -> None:
    """Keep a JSON value in the instance's key-value store: one row, compressed (100,000 shards' state is
    a few megabytes of JSON, a few hundred kilobytes stored)."""
    raw = json.dumps(value, separators=(",", ":")).encode()
    instance.run_storage.set_cursor_values({key: base64.b64encode(zlib.compress(raw, 6)).decode("ascii")})


def built_from_main(
    instance: dg.DagsterInstance, keys: DatasetKeys, rel: str, main_fingerprint: str, code_version: str
) -> dict[str, str]:
    """Data provenance tags for an output built from main's shard `rel` at `main_fingerprint`.

    Dagster adds these to the outputs of an asset's own step; a batch step records its shards with
    explicit materializations, so it adds them itself. With them the UI marks the output Unsynced
    once the discovery sensor records another version of that shard (an observation after the
    pointer: main's latest record for the shard when this was built).
    """
    records = [
        storage_call(instance.get_latest_data_version_record, keys.main, is_source, rel) for is_source in (True, False)
    ]
    pointer = max((record.storage_id for record in records if record is not None), default=None)
    return {
        CODE_VERSION_TAG: code_version,
        get_input_data_version_tag(keys.main): main_fingerprint,
        get_input_event_pointer_tag(keys.main): NULL_EVENT_POINTER if pointer is None else str(pointer),
    }


def latest_materialization(instance: dg.DagsterInstance, key: dg.AssetKey, rel: str) -> dg.EventLogRecord | None:
    records = storage_call(
        instance.fetch_materializations, dg.AssetRecordsFilter(asset_key=key, asset_partitions=[rel]), limit=1
    )
    return records.records[0] if records.records else None


def check_statuses(
    instance: dg.DagsterInstance, check_keys: Iterable[dg.AssetCheckKey], rels: Sequence[str]
) -> dict[tuple[str, str], str]:
    """(check key text, shard) -> latest execution status (SUCCEEDED, FAILED, PLANNED)."""
    infos = storage_call(
        instance.event_log_storage.get_asset_check_partition_info, list(check_keys), partition_keys=list(rels)
    )
    return {(info.check_key.to_user_string(), info.partition_key): info.latest_execution_status.value for info in infos}


# -- ledgers -----------------------------------------------------------------------------------


def asset_keys(keys: DatasetKeys) -> dict[str, dg.AssetKey]:
    """Ledger asset name -> the dataset's asset key."""
    return {
        ledger.MAIN: keys.main,
        **{ledger.resized(r): keys.resized(r) for r in RESOLUTION_NAMES},
        **{ledger.verifier(r): keys.verify(r) for r in RESOLUTION_NAMES},
        ledger.CROP_BBOX: keys.crop_bbox,
    }


def check_keys(keys: DatasetKeys) -> dict[str, dg.AssetCheckKey]:
    """Ledger check name ("verify_512:keys_match") -> the dataset's check key."""
    assets = asset_keys(keys)
    return {
        f"{asset}:{name}": dg.AssetCheckKey(assets[asset], name)
        for asset, names in ledger.CHECKS.items()
        for name in names
    }


def materialization_of(record: dg.EventLogRecord) -> ledger.Materialization:
    """A ledger entry from a materialization record (main's: its data version is the source)."""
    materialization = record.asset_materialization
    assert materialization is not None
    metadata = {name: value.value for name, value in materialization.metadata.items()}
    tags = materialization.tags or {}
    key = materialization.asset_key
    source = tags.get("dagster/data_version") if key.path[-1] == ledger.MAIN else _input_version(tags, key)
    restates = metadata.get(RESTATED_FROM_ID)
    return ledger.Materialization(
        storage_id=record.storage_id,
        run_id=record.run_id,
        restates=int(restates) if isinstance(restates, int) else None,
        built_by=_text(metadata.get(RESTATED_FROM_RUN)),
        fingerprint=_text(metadata.get(VERIFIED_FINGERPRINT)),
        source=source,
    )


def _input_version(tags: Mapping[str, str], key: dg.AssetKey) -> str | None:
    main = dg.AssetKey([*key.path[:-1], ledger.MAIN])
    return tags.get(get_input_data_version_tag(main))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


_STATES = {"SUCCEEDED": ledger.CheckState.PASSED, "FAILED": ledger.CheckState.FAILED}


def check_record_of(info) -> ledger.CheckRecord:
    """A ledger entry from a check's partition info (its latest execution, planned ones included)."""
    return ledger.CheckRecord(
        _STATES.get(info.latest_execution_status.value, ledger.CheckState.PLANNED),
        info.latest_target_materialization_storage_id,
        info.latest_check_event_storage_id,
    )


def latest_result(instance: dg.DagsterInstance, check_key: dg.AssetCheckKey, rel: str) -> ledger.CheckRecord:
    """The latest completed result of a check for shard `rel`, with its description (a run in
    progress plans its checks first: their latest execution is then only planned)."""
    done = {AssetCheckExecutionRecordStatus.SUCCEEDED, AssetCheckExecutionRecordStatus.FAILED}
    records = storage_call(
        instance.event_log_storage.get_asset_check_execution_history,
        check_key,
        limit=1,
        status=done,
        partition_filter=PartitionKeyFilter(key=rel),
    )
    evaluation = records[0].evaluation if records else None
    if evaluation is None:
        return ledger.NEVER_RAN
    target = evaluation.target_materialization_data
    return ledger.CheckRecord(
        ledger.CheckState.PASSED if evaluation.passed else ledger.CheckState.FAILED,
        target.storage_id if target is not None else None,
        description=evaluation.description,
    )


def read_ledgers(instance: dg.DagsterInstance, keys: DatasetKeys, rels: Sequence[str]) -> dict[str, ledger.ShardLedger]:
    """The ledgers of shards `rels`: the latest materialization of each asset, main's latest removal,
    and each check's latest completed result (with its description) where its asset was materialised.

    Per shard one query per asset and one for main's observations; one query for the checks of all
    shards, and one more per check whose latest execution is only planned (a run in progress)."""
    assets, checks = asset_keys(keys), check_keys(keys)
    infos = storage_call(
        instance.event_log_storage.get_asset_check_partition_info, list(checks.values()), partition_keys=list(rels)
    )
    by_key = {(info.check_key, info.partition_key): info for info in infos}
    ledgers = {}
    for rel in rels:
        materializations = {}
        for name, key in assets.items():
            record = latest_materialization(instance, key, rel)
            if record is not None:
                materializations[name] = materialization_of(record)
        results = {}
        for name, check_key in checks.items():
            info = by_key.get((check_key, rel))
            if info is None or check_key.asset_key.path[-1] not in materializations:
                continue  # never ran, or nothing it could have passed on
            results[name] = latest_result(instance, check_key, rel)
        failures = {
            name: failure
            for name in VERIFIED_ASSETS
            if (failure := _latest_failed_verification(instance, assets[name], rel)) is not None
        }
        ledgers[rel] = ledger.ShardLedger(rel, materializations, results, _removed_at(instance, keys, rel), failures)
    return ledgers


def read_ledger(instance: dg.DagsterInstance, keys: DatasetKeys, rel: str) -> ledger.ShardLedger:
    return read_ledgers(instance, keys, [rel])[rel]


def _removed_at(instance: dg.DagsterInstance, keys: DatasetKeys, rel: str) -> int | None:
    observations = storage_call(
        instance.fetch_observations, dg.AssetRecordsFilter(asset_key=keys.main, asset_partitions=[rel]), limit=1
    )
    return next((record.storage_id for record in observations.records if is_removal(record)), None)


def _latest_failed_verification(
    instance: dg.DagsterInstance, key: dg.AssetKey, rel: str
) -> ledger.Materialization | None:
    """The latest observation of `key` for shard `rel` recording a failed verification, among its few
    latest observations (a refused crop_bbox is observed too)."""
    observations = storage_call(
        instance.fetch_observations, dg.AssetRecordsFilter(asset_key=key, asset_partitions=[rel]), limit=5
    )
    record = next((r for r in observations.records if is_failed_verification(r)), None)
    return ledger.Materialization(record.storage_id, record.run_id) if record is not None else None


def is_failed_verification(record: dg.EventLogRecord) -> bool:
    """Whether an observation records a verification that failed (defs/assets.py `failed_verification`)."""
    observation = record.asset_observation
    value = observation.metadata.get(FAILED_VERIFICATION) if observation is not None else None
    return bool(value is not None and value.value)


def is_removal(record: dg.EventLogRecord) -> bool:
    """Whether an observation of main says a complete listing no longer has the shard."""
    observation = record.asset_observation
    value = observation.metadata.get(REMOVED) if observation is not None else None
    return bool(value is not None and value.value)
