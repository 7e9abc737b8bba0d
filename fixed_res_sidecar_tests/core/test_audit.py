"""Audit records and their Parquet columns (SPEC 5): a shard write never fails over one row's values."""

import io
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fixed_res_sidecar.core.audit import (
    AUDIT_TYPES,
    AuditRecord,
    audit_arrays,
    audit_columns,
    audit_type_problems,
    read_audit_records,
)

PREFIX = "0_26mp_process"
INT64 = (-(2**63), 2**63 - 1)

# Whatever a header, a decoder or a bug could put in a record: sides of 2^31 and 2^32 - 1, a
# FITS axis of 5e9, counts past int64, negatives, floats too large for a double, lone surrogates.
extreme_ints = st.one_of(
    st.none(),
    st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**32 - 1, 5_000_000_000, *INT64, 2**63, 2**64, -(2**70), 10**30]),
    st.integers(),
)
extreme_floats = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([10**400, -(10**400), 2**70]),
)
extreme_text = st.one_of(
    st.none(), st.text(), st.sampled_from(["", "\ud83d", "caption \udc00 end", "é" * 10_000, "\x00"])
)
FIELD_VALUES = {
    "valid": st.one_of(st.booleans(), st.none()),
    "exif_orientation": extreme_ints,
    **{name: extreme_ints for name, dtype in AUDIT_TYPES.items() if pa.types.is_integer(dtype)},
    **{name: extreme_floats for name, dtype in AUDIT_TYPES.items() if pa.types.is_floating(dtype)},
    **{name: extreme_text for name, dtype in AUDIT_TYPES.items() if pa.types.is_string(dtype)},
}
records = st.builds(AuditRecord, **FIELD_VALUES)


def write_and_read(batch: list[AuditRecord]) -> list[AuditRecord]:
    """Through the real audit_arrays and a ParquetWriter with the resized shard's audit schema."""
    schema = pa.schema(audit_columns(PREFIX))
    buffer = io.BytesIO()
    with pq.ParquetWriter(buffer, schema) as writer:
        writer.write_table(pa.table(audit_arrays(PREFIX, batch), schema=schema))
    table = pq.read_table(io.BytesIO(buffer.getvalue()))
    assert audit_type_problems(table.schema, PREFIX) == {}
    return read_audit_records(table, PREFIX)


def expected_back(name: str, value):
    """What a column of SPEC 5's type holds for `value`: itself when it fits, else null (or escaped text)."""
    dtype = AUDIT_TYPES[name]
    if pa.types.is_boolean(dtype):
        return bool(value)
    if value is None:
        return None
    if pa.types.is_integer(dtype):
        bits = dtype.bit_width - 1
        return value if -(2**bits) <= value < 2**bits else None
    if pa.types.is_floating(dtype):
        try:
            return float(value)
        except OverflowError:
            return None
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


@settings(max_examples=200, deadline=None)
@given(st.lists(records, min_size=1, max_size=8))
@pytest.mark.heavy
def test_every_audit_column_at_its_extremes_is_written(batch):
    back = write_and_read(batch)
    assert len(back) == len(batch)
    for written, read in zip(batch, back):
        for name in AUDIT_TYPES:
            want, got = expected_back(name, getattr(written, name)), getattr(read, name)
            if isinstance(want, float) and math.isnan(want):
                assert math.isnan(got)
            else:
                assert got == want, (name, getattr(written, name), got)


def test_values_read_from_image_headers_are_kept_whole():
    """A TIFF/PPM side of 2^32 - 1, a FITS axis of 5e9 and an APNG frame count of 2^31 fit their columns."""
    record = AuditRecord(
        error="too_large", error_detail="claimed", src_width=2**32 - 1, src_height=5_000_000_000, n_frames=2**31
    )
    (back,) = write_and_read([record])
    assert (back.src_width, back.src_height, back.n_frames) == (2**32 - 1, 5_000_000_000, 2**31)
    for name in ("src_width", "src_height", "n_frames", "width", "height", "out_bytes"):
        assert AUDIT_TYPES[name] == pa.int64()
