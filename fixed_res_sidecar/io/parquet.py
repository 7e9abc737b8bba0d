"""Opening and reading shards: one error that names the shard and what is wrong with it.

Every reader of shards (the builders, the verifier, the overlays) opens them here, so "this
shard cannot be used" is one exception (`ShardError`) with one kind of message wherever it
happens. Storage that kept failing is not the shard's fault: `StorageError` (io/retry.py)
passes through every function here unchanged.

Shards are opened with page checksum verification (`Location.parquet_file`), so a page damaged
after it was written fails the read that meets it, and the error names the column and row group.
"""

import hashlib
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.retry import StorageError

MESSAGE_CHARS = 300  # exception text quoted in a message: its first line, at most this long
CHECKSUM_FAILURE = "CRC checksum verification failed"  # pyarrow's text for a page that fails its checksum


class ShardError(RuntimeError):
    """A shard that cannot be used: missing, unreadable, damaged, lacking columns, or disagreeing
    with its main shard. The message names the shard."""


def open_shard(
    location: Location, rel: str, role: str, *, columns: Sequence[str] = (), rows: int | None = None
) -> pq.ParquetFile:
    """`location/rel`'s footer, checked to exist, parse, hold `columns` and, if given, `rows` rows.

    `role` names the shard in messages ("main", "resized 512", "sidecar", ...).
    """
    uri = location.child(rel)
    try:
        exists = location.exists(rel)
    except StorageError:
        raise
    except Exception as exc:
        raise ShardError(f"{role} shard {uri} could not be looked up: {describe(exc)}") from exc
    if not exists:
        raise ShardError(f"{role} shard {uri} is missing")
    try:
        parquet_file = location.parquet_file(rel)
        names = parquet_file.schema_arrow.names
    except StorageError:
        raise
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
    except StorageError:
        raise
    except Exception as exc:
        raise unreadable(parquet_file, present, uri, exc) from exc


def iter_batches(
    parquet_file: pq.ParquetFile, columns: Sequence[str], uri: str, batch_size: int
) -> Iterator[pa.RecordBatch]:
    """`columns` streamed in batches of `batch_size` rows (a shard's images never all in memory)."""
    batches = parquet_file.iter_batches(batch_size=batch_size, columns=list(columns), use_threads=False)
    try:
        yield from batches
    except StorageError:
        raise
    except Exception as exc:
        raise unreadable(parquet_file, columns, uri, exc) from exc


def verify_page_checksums(parquet_file: pq.ParquetFile, uri: str) -> None:
    """Read every page of every column, raising ShardError at the first damaged one.

    A full read of the shard's bytes (images are not decoded): one row group in memory at a
    time, dropped at once. Pages written without a checksum cannot be checked and pass.
    """
    for group in range(parquet_file.num_row_groups):
        try:
            parquet_file.read_row_group(group, use_threads=False)
        except StorageError:
            raise
        except Exception as exc:
            raise unreadable(parquet_file, parquet_file.schema_arrow.names, uri, exc, [group]) from exc


def unreadable(
    parquet_file: pq.ParquetFile,
    columns: Sequence[str],
    uri: str,
    exc: Exception,
    row_groups: Sequence[int] | None = None,
) -> ShardError:
    """The error for a failed read of `columns`, naming the first column chunk (column, row group)
    that fails on its own, found by reading them one by one (only after a failure)."""
    damaged = " (a page does not match its checksum: the file was damaged after it was written)"
    groups = range(parquet_file.num_row_groups) if row_groups is None else row_groups
    for group in groups:
        for column in columns:
            try:
                parquet_file.read_row_group(group, columns=[column], use_threads=False)
            except StorageError:
                raise
            except Exception as chunk_exc:  # noqa: BLE001 - any failure of this chunk is what we are looking for
                why = damaged if CHECKSUM_FAILURE in str(chunk_exc) else ""
                return ShardError(
                    f"{uri}: column {column!r} in row group {group} could not be read{why}: {describe(chunk_exc)}"
                )
    why = damaged if CHECKSUM_FAILURE in str(exc) else ""
    return ShardError(f"{uri}: columns {list(columns)} could not be read{why}: {describe(exc)}")


def describe(exc: BaseException) -> str:
    """An exception as one short line for a message."""
    return describe_exception(exc, max_chars=MESSAGE_CHARS)


def source_fingerprint(location: Location, rel: str, parquet_file: pq.ParquetFile | None = None) -> str:
    """A main shard's identity, cheap at any scale: its object stamp (size and ETag on S3; size, modification
    and change times and inode locally: `Location.fingerprint`), its footer's row count and a hash of its
    footer. No image is read.

    Outputs record it in their footers (`shards/settings.py`): an output built from another
    fingerprint of its main shard is stale.
    """
    stamp = location.fingerprint(rel)
    if stamp is None:
        raise ShardError(f"main shard {location.child(rel)} is missing")
    metadata = (parquet_file or open_shard(location, rel, "main")).metadata
    # The footer's own bytes, as pickling serialises them: never decoded (statistics of keys that
    # are not UTF-8 would fail `to_dict()`), and not read a second time.
    footer = metadata.__reduce__()[1][0]
    return f"{stamp}:{metadata.num_rows}:{hashlib.sha256(footer).hexdigest()[:16]}"


_BYTES_OF_TEXT = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(), pa.string_view(): pa.binary_view()}


def text_as_bytes(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A text column's values as the bytes stored (no copy); other types as they are.

    Parquet writers do not all check that text is UTF-8, and turning a text column into Python
    strings fails on its first bad value: read as bytes, each value is decoded alone, and a bad
    one is that row's problem (e.g. a caption that is `invalid_json`), not the shard's.
    """
    binary = _BYTES_OF_TEXT.get(values.type)
    if binary is None:
        return values
    if isinstance(values, pa.ChunkedArray):
        return pa.chunked_array([chunk.view(binary) for chunk in values.chunks], binary)
    return values.view(binary)
