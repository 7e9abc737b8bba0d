"""What a Dagster instance already knows about a dataset's shards: materializations and check results.

Reading the event log, never the data: the crop gate across runs, the demo's bookkeeping and
the dataset audit ask here.
"""

from collections.abc import Iterable, Sequence
from typing import Any

import dagster as dg

from fixed_res_sidecar.defs.keys import RESOLUTIONS, DatasetKeys
from fixed_res_sidecar.shards.verify import RESIZED_CHECKS


def latest_materialization(instance: dg.DagsterInstance, key: dg.AssetKey, rel: str) -> dg.EventLogRecord | None:
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[rel]), limit=1)
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
    infos = instance.event_log_storage.get_asset_check_partition_info(list(check_keys), partition_keys=list(rels))
    return {(info.check_key.to_user_string(), info.partition_key): info.latest_execution_status.value for info in infos}


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
        for info in instance.event_log_storage.get_asset_check_partition_info(check_keys, partition_keys=[rel])
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
