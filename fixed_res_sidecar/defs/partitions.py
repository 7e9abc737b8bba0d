"""One dynamic partitions definition per dataset: one partition per shard.

The partition key is the shard's path relative to the main prefix (`2026/12/part-00002.parquet`).
Dagster stores any string, but some cannot be used everywhere: `...` is the UI's range
separator, `,` splits the CLI's `--partitions` list, `[`/`]` frame the CLI's ranges, and
control characters do not display. Shards whose path holds one of these are refused with
a message that names them; they never become partitions.
"""

from collections.abc import Iterable, Iterator, Sequence

import dagster as dg

from fixed_res_sidecar.defs.dagster_private import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from fixed_res_sidecar.defs.names import DatasetKeys

# Adding keys in chunks keeps each storage write bounded (DAGSTER_NOTES: <= 10k at a time).
ADD_CHUNK = 10_000
MAX_KEY_LENGTH = 1024

_FORBIDDEN = {
    "...": "'...' (the UI's partition range separator)",
    ",": "',' (the CLI's partition list separator)",
    "[": "'[' (CLI partition range syntax)",
    "]": "']' (CLI partition range syntax)",
}


def shard_partitions(keys: DatasetKeys) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=keys.partitions)


def partition_key_problem(rel: str) -> str | None:
    """Why shard path `rel` cannot be a partition key, or None when it can."""
    if not rel:
        return "an empty shard path cannot be a partition key"
    if len(rel) > MAX_KEY_LENGTH:
        return (
            f"shard path {rel[:60]!r}... is {len(rel)} characters long; partition keys are limited to {MAX_KEY_LENGTH}"
        )
    found = [reason for text, reason in _FORBIDDEN.items() if text in rel]
    controls = sorted({repr(c) for c in rel if ord(c) < 32 or ord(c) == 127})
    if controls:
        found.append(f"control character(s) {', '.join(controls)}")
    if found:
        return (
            f"shard path {rel!r} cannot be a Dagster partition key: it contains {'; '.join(found)}. "
            "Rename the shard (or build it with `sidecar-ops`, which has no such limit)"
        )
    return None


def chunks(items: Sequence[str], size: int = ADD_CHUNK) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def add_requests(
    partitions: dg.DynamicPartitionsDefinition, new_keys: Iterable[str]
) -> list[dg.AddDynamicPartitionsRequest]:
    """Requests that add `new_keys`, at most ADD_CHUNK keys each."""
    return [partitions.build_add_request(chunk) for chunk in chunks(list(new_keys))]


def retire_requests(
    partitions: dg.DynamicPartitionsDefinition, removed_keys: Iterable[str]
) -> list[dg.DeleteDynamicPartitionsRequest]:
    """Requests that delete the partitions of shards removed from main, at most ADD_CHUNK keys each."""
    return [partitions.build_delete_request(chunk) for chunk in chunks(list(removed_keys))]


def consecutive_ranges(rels: Iterable[str], order: Sequence[str], size: int) -> list[list[str]]:
    """`rels` grouped into runs of consecutive partitions (in `order`, the order they were added), at most
    `size` each: what one run request covers."""
    position = {rel: i for i, rel in enumerate(order)}
    ranges: list[list[str]] = []
    for rel in sorted(rels, key=position.__getitem__):
        batch = ranges[-1] if ranges else None
        if batch and position[rel] == position[batch[-1]] + 1 and len(batch) < size:
            batch.append(rel)
        else:
            ranges.append([rel])
    return ranges


def range_tags(batch: Sequence[str]) -> dict[str, str]:
    """The tags of a run over `batch` (from `consecutive_ranges`): none for one partition (the request
    names it), else its first and last partition."""
    if len(batch) == 1:
        return {}
    return {ASSET_PARTITION_RANGE_START_TAG: batch[0], ASSET_PARTITION_RANGE_END_TAG: batch[-1]}
