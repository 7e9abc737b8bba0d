"""Image cells of a Parquet image column: plain binary, or the Hugging Face `{bytes, path}` struct."""

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

BYTES_FIELD = "bytes"


def image_bytes(cell: Any) -> bytes | None:
    """The encoded bytes of one image cell (as read with `as_py()`); None when there are none.

    A struct cell gives its `bytes` field. Empty bytes are returned as they are: callers decide
    whether an empty image is missing (the verifier) or a row error (the resize).
    """
    if isinstance(cell, dict):
        return cell.get(BYTES_FIELD)
    return cell


def is_image_type(dtype: pa.DataType) -> bool:
    """Whether an Arrow type can hold images: binary, or a struct with a `bytes` field."""
    return _is_binary(dtype) or (pa.types.is_struct(dtype) and dtype.get_field_index(BYTES_FIELD) >= 0)


def output_image_type(dtype: pa.DataType) -> pa.DataType:
    """The type of an output's image column for a main image column of type `dtype` (SPEC 5).

    The same type, except that fixed-size binary becomes binary: encoded outputs differ in
    size. A struct keeps its fields, its `bytes` field changed the same way.
    """
    if pa.types.is_fixed_size_binary(dtype):
        return pa.binary()
    if pa.types.is_struct(dtype):
        index = dtype.get_field_index(BYTES_FIELD)
        if index >= 0:
            fields = [dtype.field(i) for i in range(dtype.num_fields)]
            fields[index] = fields[index].with_type(output_image_type(fields[index].type))
            return pa.struct(fields)
    return dtype


def image_bytes_array(array: pa.Array) -> pa.Array:
    """The binary array of an image column chunk: itself, or the struct's `bytes` child with the
    struct's own nulls applied (a null struct has no bytes)."""
    if pa.types.is_struct(array.type):
        if isinstance(array, pa.ChunkedArray):
            return pa.chunked_array([image_bytes_array(chunk) for chunk in array.chunks], _bytes_type(array.type))
        # pyarrow.compute makes its kernel functions at import time, so a checker sees no struct_field
        return pc.struct_field(array, [array.type.get_field_index(BYTES_FIELD)])  # pyright: ignore[reportAttributeAccessIssue]
    return array


def has_image(array: pa.Array) -> pa.Array:
    """Per row, whether an image column holds non-empty bytes; never null. Copies no image."""
    data = image_bytes_array(array)
    # greater and binary_length: pyarrow.compute kernels, made at import time (as struct_field above)
    return pc.fill_null(pc.greater(pc.binary_length(data), 0), False)  # pyright: ignore[reportAttributeAccessIssue]


def _bytes_type(struct_type: pa.DataType) -> pa.DataType:
    return struct_type.field(struct_type.get_field_index(BYTES_FIELD)).type


def _is_binary(dtype: pa.DataType) -> bool:
    return pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_fixed_size_binary(dtype)
