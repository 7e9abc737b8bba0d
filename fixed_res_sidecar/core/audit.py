"""The per-row audit record of a resized image and its Parquet columns (SPEC section 5).

Integer columns whose values come from an image file (its sizes and frame count, and the output
size derived from them) are int64: a header may claim any size, and a claimed 2^32 - 1 px side
is audited as it is (the row is then `too_large`). Writing audits never fails over one row's
values (`audit_arrays`): a value its column cannot hold (an integer beyond int64, text that is
not valid Unicode) is stored as null or as escaped text instead.
"""

import numbers
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

import pyarrow as pa


class ErrorCode(str, Enum):
    MISSING_IMAGE = "missing_image"
    DECODE_ERROR = "decode_error"
    TOO_LARGE = "too_large"
    TOO_SMALL = "too_small"
    ASPECT_RATIO = "aspect_ratio"
    ENCODE_ERROR = "encode_error"
    UNSUPPORTED = "unsupported"


ERROR_CODES = tuple(code.value for code in ErrorCode)


@dataclass
class AuditRecord:
    """One row's audit: what came in, what went out, or why nothing did."""

    valid: bool = False
    error: str | None = None
    error_detail: str | None = None
    src_width: int | None = None
    src_height: int | None = None
    src_format: str | None = None
    src_mode: str | None = None
    exif_orientation: int = 1
    n_frames: int | None = None
    width: int | None = None
    height: int | None = None
    crop_x0: float | None = None
    crop_y0: float | None = None
    crop_x1: float | None = None
    crop_y1: float | None = None
    scale: float | None = None
    out_bytes: int | None = None


AUDIT_TYPES: dict[str, pa.DataType] = {
    "valid": pa.bool_(),
    "error": pa.string(),
    "error_detail": pa.string(),
    "src_width": pa.int64(),
    "src_height": pa.int64(),
    "src_format": pa.string(),
    "src_mode": pa.string(),
    "exif_orientation": pa.int8(),
    "n_frames": pa.int64(),
    "width": pa.int64(),
    "height": pa.int64(),
    "crop_x0": pa.float64(),
    "crop_y0": pa.float64(),
    "crop_x1": pa.float64(),
    "crop_y1": pa.float64(),
    "scale": pa.float64(),
    "out_bytes": pa.int64(),
}
AUDIT_FIELDS = tuple(f.name for f in fields(AuditRecord))
assert tuple(AUDIT_TYPES) == AUDIT_FIELDS, "AuditRecord and AUDIT_TYPES must list the same fields in order"


def audit_column(audit_prefix: str, field: str) -> str:
    return f"{audit_prefix}_{field}"


def audit_columns(audit_prefix: str) -> list[pa.Field]:
    """The audit columns of a resized shard, in order. `valid` is never null."""
    return [
        pa.field(audit_column(audit_prefix, name), dtype, nullable=(name != "valid"))
        for name, dtype in AUDIT_TYPES.items()
    ]


def audit_arrays(audit_prefix: str, records: list[AuditRecord]) -> dict[str, pa.Array]:
    """Column name -> array for a batch of records. Never fails over the values: see `storable`."""
    return {
        field.name: pa.array([storable(getattr(r, name), field.type) for r in records], type=field.type)
        for name, field in zip(AUDIT_TYPES, audit_columns(audit_prefix))
    }


def storable(value: Any, dtype: pa.DataType) -> Any:
    """`value` as an audit column of type `dtype` can hold it.

    `valid` (bool) is never null. An integer outside the column's range, a number too large
    for a double, or a value of the wrong kind becomes null (unknown); the row's error_detail
    says what the file claimed. Text that is not valid Unicode (lone surrogates) is kept with
    those characters escaped (`\\ud83d`).
    """
    if pa.types.is_boolean(dtype):
        return bool(value)
    if value is None:
        return None
    if pa.types.is_integer(dtype):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            return None
        bits = dtype.bit_width - 1
        return int(value) if -(2**bits) <= value < 2**bits else None
    if pa.types.is_floating(dtype):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            return None
        try:
            return float(value)
        except OverflowError:
            return None
    text = value if isinstance(value, str) else str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class AuditColumnsError(ValueError):
    """A table lacks audit columns, or holds them with the wrong types."""


def audit_values(table: pa.Table, audit_prefix: str) -> dict[str, list]:
    """field -> the values of its audit column, for every field of SPEC 5 (how every reader reads audits).

    Raises AuditColumnsError naming the missing columns.
    """
    missing = [
        audit_column(audit_prefix, f) for f in AUDIT_TYPES if audit_column(audit_prefix, f) not in table.column_names
    ]
    if missing:
        raise AuditColumnsError(f"audit columns missing: {missing}")
    return {f: table.column(audit_column(audit_prefix, f)).to_pylist() for f in AUDIT_TYPES}


def audit_type_problems(schema: pa.Schema, audit_prefix: str) -> dict[str, str]:
    """Audit column -> its type, for every audit column of `schema` whose type is not SPEC 5's."""
    return {
        name: str(schema.field(name).type)
        for f, dtype in AUDIT_TYPES.items()
        if (name := audit_column(audit_prefix, f)) in schema.names and schema.field(name).type != dtype
    }


def read_audit_records(table: pa.Table, audit_prefix: str) -> list[AuditRecord]:
    """Audit records back from a resized shard's columns (the crop sidecar reads them so)."""
    values = audit_values(table, audit_prefix)
    return [AuditRecord(**{f: values[f][i] for f in AUDIT_TYPES}) for i in range(table.num_rows)]
