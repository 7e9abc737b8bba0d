"""Opening shards: a Parquet footer and columns, or one error that names the shard and what is wrong.

Every reader of shards (the builders, the verifier, the overlays) opens them here, so "this
shard cannot be used" is one exception with one kind of message wherever it happens.
"""

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.io.locations import Location

MESSAGE_CHARS = 300  # exception text quoted in a message: its first line, at most this long


class ShardError(RuntimeError):
    """A shard that cannot be used: missing, unreadable, lacking columns, or disagreeing with its
    main shard. The message names the shard."""


def open_shard(
    location: Location, rel: str, role: str, *, columns: Sequence[str] = (), rows: int | None = None
) -> pq.ParquetFile:
    """`location/rel`'s footer, checked to exist, parse, hold `columns` and, if given, `rows` rows.

    `role` names the shard in messages ("main", "resized 512", "sidecar", ...).
    """
    uri = location.child(rel)
    try:
        exists = location.exists(rel)
    except Exception as exc:
        raise ShardError(f"{role} shard {uri} could not be looked up: {describe(exc)}") from exc
    if not exists:
        raise ShardError(f"{role} shard {uri} is missing")
    try:
        parquet_file = location.parquet_file(rel)
        names = parquet_file.schema_arrow.names
    except Exception as exc:
        raise ShardError(f"{role} shard {uri} is not a readable Parquet file: {describe(exc)}") from exc
    missing = [c for c in columns if c not in names]
    if missing:
        raise ShardError(f"{role} shard {uri} lacks column(s) {missing}; it has {names}")
    if rows is not None and parquet_file.metadata.num_rows != rows:
        raise ShardError(f"{role} shard {uri} has {parquet_file.metadata.num_rows} rows, the main shard has {rows}")
    return parquet_file


def read_columns(parquet_file: pq.ParquetFile, columns: Sequence[str], uri: str) -> pa.Table:
    """The named columns that exist (the caller decides what a missing one means)."""
    present = [c for c in columns if c in parquet_file.schema_arrow.names]
    try:
        return parquet_file.read(columns=present, use_threads=False)
    except Exception as exc:
        raise ShardError(f"{uri}: columns {present} could not be read: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    """An exception as one short line for a message."""
    return describe_exception(exc, max_chars=MESSAGE_CHARS)
