"""Key values, read without decoding them, and as text for messages and reports.

Keys are copied from the main shard as they are, never decoded: a binary key column may hold
any bytes, and a text column written by a lax writer may hold bytes that are not UTF-8. Where
keys are compared (the verifier, the crop sidecar) they are read as bytes; where a person reads
them (messages, JSON reports, overlay file names) they are shown as UTF-8 text, with bytes that
do not decode as `\\xNN` escapes.
"""

from typing import Any

import pyarrow as pa


def raw_key_values(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """The values of a key column as Python objects; text columns give bytes, never decoded."""
    if pa.types.is_string(column.type):
        column = column.cast(pa.binary())
    elif pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    return column.to_pylist()


def key_text(value: Any) -> Any:
    """A key as messages and reports show it (JSON-ready): bytes as UTF-8 text with undecodable
    bytes escaped as `\\xNN`; any other value as it is."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return value


def key_texts(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """`key_text` of every value of a key column."""
    return [key_text(value) for value in raw_key_values(column)]
