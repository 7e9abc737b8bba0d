"""What a Dagster instance already knows about a dataset's shards: materializations and check results.

Reading the event log, never the data: the crop gate across runs, the demo's bookkeeping and
the dataset audit ask here.

Storage outages: every call here that a run makes to the instance's storage is retried
(`storage_call`) while the database does not answer (a restart or failover takes seconds to a
minute), with backoff, for at most `STORAGE_RETRY_SECONDS` (plus one attempt), each wait logged;
then `EventLogUnavailable` fails the step. Not the key-value state (`load_state`, `save_state`):
a sensor tick that outlasted its timeout would still save it. Dagster's own event writes retry
only their connection, for about 11 s: a shard run waits for the storage (`wait_for_storage`)
before it records its shards. A run that failed anyway is retried as a new run, unless its data
failed (`retry_run_on_failure`).
"""

import base64
import json
import logging
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
from dagster._core.definitions.data_version import (
    CODE_VERSION_TAG,
    NULL_EVENT_POINTER,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)

from fixed_res_sidecar.defs.keys import RESOLUTIONS, DatasetKeys
from fixed_res_sidecar.defs.run_resources import RETRY_ON_FAILURE_TAG
from fixed_res_sidecar.shards.verify import RESIZED_CHECKS

log = logging.getLogger(__name__)

# How long a call to the instance's storage is retried while the database does not answer: longer
# than a database restart or a managed failover (tens of seconds), short enough that a dead
# database fails the run within minutes (its retry then redoes the shard).
STORAGE_RETRY_SECONDS = 120.0
FIRST_WAIT_SECONDS = 0.5  # then doubling, at most MAX_WAIT_SECONDS
MAX_WAIT_SECONDS = 10.0


class EventLogUnavailable(Exception):
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
    while the database is unavailable, for at most `budget` seconds (STORAGE_RETRY_SECONDS);
    then EventLogUnavailable. Other errors pass through at once."""
    budget = STORAGE_RETRY_SECONDS if budget is None else budget
    name = getattr(call, "__name__", "a call")
    started = time.monotonic()
    wait, attempt = FIRST_WAIT_SECONDS, 1
    while True:
        try:
            result = call(*args, **kwargs)
        except Exception as exc:
            if not _unavailable(exc):
                raise
            waited, reason = time.monotonic() - started, (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            if waited + wait > budget:
                raise EventLogUnavailable(
                    f"the Dagster instance's storage did not answer for {waited:.0f} s ({attempt} attempt(s) of "
                    f"{name}): {reason}"
                ) from exc
            log.warning(
                "storage unavailable (attempt %d of %s, %.1f s so far, budget %.0f s): %s; retrying in %.1f s",
                *(attempt, name, waited, budget, reason, wait),
            )
            time.sleep(wait)
            wait, attempt = min(wait * 2, MAX_WAIT_SECONDS), attempt + 1
            continue
        if attempt > 1:
            log.warning("storage answered again after %.1f s (%d attempts)", time.monotonic() - started, attempt)
        return result


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


def load_state(instance: dg.DagsterInstance, key: str) -> Any:
    """A JSON value kept in the instance's key-value store (compressed), or None."""
    text = instance.run_storage.get_cursor_values({key}).get(key)
    if not text:
        return None
    try:
        return json.loads(zlib.decompress(base64.b64decode(text)))
    except (ValueError, zlib.error):
        return None  # unreadable: the caller starts over


def save_state(instance: dg.DagsterInstance, key: str, value: Any) -> None:
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


def latest_metadata(instance: dg.DagsterInstance, key: dg.AssetKey, rel: str) -> dict[str, Any] | None:
    """The metadata values of the latest materialization of `key` for shard `rel`, or None."""
    record = latest_materialization(instance, key, rel)
    if record is None:
        return None
    return {name: value.value for name, value in record.asset_materialization.metadata.items()}


def check_statuses(
    instance: dg.DagsterInstance, check_keys: Iterable[dg.AssetCheckKey], rels: Sequence[str]
) -> dict[tuple[str, str], str]:
    """(check key text, shard) -> latest execution status (SUCCEEDED, FAILED, PLANNED, ...)."""
    infos = storage_call(
        instance.event_log_storage.get_asset_check_partition_info, list(check_keys), partition_keys=list(rels)
    )
    return {(info.check_key.to_user_string(), info.partition_key): info.latest_execution_status.value for info in infos}


# Materialization metadata of a verifier and of crop_bbox: the fingerprint of the output they checked.
VERIFIED_FINGERPRINT = "verified_fingerprint"


@dataclass
class Recorded:
    """What the event log says of a shard's selected stages: every result passed on the latest build."""

    results: dict[dg.AssetCheckKey, tuple[bool, str, Any]]  # check -> (passed, description, target data)
    fingerprints: dict[str, str | None]  # output name -> fingerprint of the object the checks read
    materializations: dict[dg.AssetKey, dg.EventLogRecord]  # selected asset -> its latest materialization


def recorded_results(instance: dg.DagsterInstance, keys: DatasetKeys, rel: str, stages) -> Recorded | str:
    """The check results on record for the selected stages of shard `rel`, when they all passed and
    still describe the latest materializations (each after what it depends on); else why not."""
    from fixed_res_sidecar.defs.checks import target_data
    from fixed_res_sidecar.shards.verify import CROP_BBOX_CHECKS

    latest = {
        key: latest_materialization(instance, key, rel)
        for key in [*(keys.resized(r) for r in RESOLUTIONS), *(keys.verify(r) for r in RESOLUTIONS), keys.crop_bbox]
    }
    checked: dict[dg.AssetKey, tuple[str, ...]] = {}
    for resolution in {*stages.resize, *stages.verify}:
        if latest[keys.resized(resolution)] is None:
            return f"{keys.resized(resolution).to_user_string()} was never materialised"
    for resolution in stages.verify:
        resized, verified = latest[keys.resized(resolution)], latest[keys.verify(resolution)]
        if verified is None or built_at(verified) < built_at(resized):
            return f"{keys.resized(resolution).to_user_string()} is not verified since its latest materialization"
        checked[keys.verify(resolution)] = RESIZED_CHECKS
    if stages.crop:  # the sidecar is current only after verifications that are current themselves
        for resolution in RESOLUTIONS:
            links = (latest[keys.resized(resolution)], latest[keys.verify(resolution)], latest[keys.crop_bbox])
            if None in links or not built_at(links[0]) < built_at(links[1]) < built_at(links[2]):
                names = (keys.resized(resolution), keys.verify(resolution), keys.crop_bbox)
                chain = " < ".join(f"{key.to_user_string()} {_described(link)}" for key, link in zip(names, links))
                return f"not materialised in build order ({chain} expected)"
        checked[keys.crop_bbox] = CROP_BBOX_CHECKS
    results, fingerprints = {}, {}
    for asset, names in checked.items():
        target = latest[asset]
        recorded = target.asset_materialization.metadata.get(VERIFIED_FINGERPRINT)
        output = "crop_bbox" if asset == keys.crop_bbox else f"resized_{asset.path[-1].removeprefix('verify_')}"
        fingerprints[output] = recorded.value if recorded is not None else None
        for name in names:
            check_key = dg.AssetCheckKey(asset, name)
            evaluation = latest_evaluation(instance, check_key, rel)
            checked_id = getattr(evaluation and evaluation.target_materialization_data, "storage_id", None)
            if evaluation is None or not evaluation.passed or checked_id != target.storage_id:
                state = (
                    "never ran"
                    if evaluation is None
                    else "failed"
                    if not evaluation.passed
                    else f"passed on another materialization ({checked_id})"
                )
                return f"{check_key.to_user_string()} {state} (latest {target.storage_id}, run {target.run_id[:8]})"
            results[check_key] = (True, evaluation.description or "passed", target_data(target))
    if stages.crop:  # the sidecar was made from the resized shards its verifiers read: they must be unchanged too
        for resolution in RESOLUTIONS:
            recorded = latest[keys.verify(resolution)].asset_materialization.metadata.get(VERIFIED_FINGERPRINT)
            fingerprints[f"resized_{resolution}"] = recorded.value if recorded is not None else None
    selected = [
        *(keys.resized(r) for r in stages.resize),
        *(keys.verify(r) for r in stages.verify),
        *([keys.crop_bbox] if stages.crop else []),
    ]
    return Recorded(results, fingerprints, {key: latest[key] for key in selected})


# Metadata of a restated materialization: the storage id of the one it restates (its place in the
# build order; a restatement says "unchanged since", so it keeps that place).
RESTATED_FROM_ID = "restated_from_id"


def built_at(record: dg.EventLogRecord) -> int:
    """Where a materialization stands in the build order: its storage id, or for a restatement that
    of the materialization it restates. A verifier restated by another run after crop_bbox was built
    (e.g. by the automation sensor) still comes before that crop_bbox."""
    value = record.asset_materialization.metadata.get(RESTATED_FROM_ID)
    return int(value.value) if value is not None else record.storage_id


def _described(record: dg.EventLogRecord | None) -> str:
    return "(never)" if record is None else f"({built_at(record)}, run {record.run_id[:8]})"


def latest_evaluation(instance: dg.DagsterInstance, check_key: dg.AssetCheckKey, rel: str):
    """The latest completed result of a check for shard `rel` (a run in progress plans checks first)."""
    from dagster._core.event_api import PartitionKeyFilter
    from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus as Status

    records = storage_call(
        instance.event_log_storage.get_asset_check_execution_history,
        check_key,
        limit=1,
        status={Status.SUCCEEDED, Status.FAILED},
        partition_filter=PartitionKeyFilter(key=rel),
    )
    return records[0].evaluation if records else None


def unverified_resized_problems(instance: dg.DagsterInstance, keys: DatasetKeys, rel: str) -> list[str]:
    """Why shard `rel` must not get its crop_bbox yet, from the recorded history; empty when both
    verifiers passed on the current resized shards.

    Per resolution: the verifier materialised this shard after the latest materialization of the
    resized shard it verifies (a resized shard rebuilt since is unverified), and each of its
    checks last passed on that verifier materialization (not on an older one).
    """
    check_keys = [dg.AssetCheckKey(keys.verify(r), name) for r in RESOLUTIONS for name in RESIZED_CHECKS]
    infos = {
        info.check_key: info
        for info in storage_call(
            instance.event_log_storage.get_asset_check_partition_info, check_keys, partition_keys=[rel]
        )
    }
    problems = []
    for resolution in RESOLUTIONS:
        resized_key, verify_key = keys.resized(resolution), keys.verify(resolution)
        resized = latest_materialization(instance, resized_key, rel)
        verified = latest_materialization(instance, verify_key, rel)
        if resized is None:
            problems.append(f"{resized_key.to_user_string()} was never materialised for this shard")
        if verified is None:
            problems.append(f"{verify_key.to_user_string()} was never materialised for this shard")
        elif resized is not None and resized.storage_id > verified.storage_id:
            problems.append(
                f"{resized_key.to_user_string()} was materialised again (run {resized.run_id[:8]}) after "
                f"{verify_key.to_user_string()} last verified it (run {verified.run_id[:8]}): the passed checks "
                "describe an older build"
            )
        for name in RESIZED_CHECKS:
            key = dg.AssetCheckKey(verify_key, name)
            info = infos.get(key)
            status = info.latest_execution_status.value.lower() if info is not None else "never run"
            if status != "succeeded":
                problems.append(f"{key.to_user_string()} {status}")
            elif verified is not None and not _evaluates(info, verified.storage_id):
                problems.append(
                    f"{key.to_user_string()} passed on an older materialization of {verify_key.to_user_string()}, "
                    "not on its latest"
                )
    return problems


def _evaluates(info, materialization_storage_id: int) -> bool:
    """Whether the check's latest evaluation belongs to that materialization (or a later one)."""
    target = info.latest_target_materialization_storage_id
    if target is not None:
        return target >= materialization_storage_id
    return info.latest_check_event_storage_id > materialization_storage_id
