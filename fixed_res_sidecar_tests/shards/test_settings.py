import os

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.settings import encode_settings, is_up_to_date, read_settings
from fixed_res_sidecar_tests.fixtures.datasets import damage_value


def _write(location: Location, rel: str, rows: int, settings: dict | None) -> None:
    schema = pa.schema([("k", pa.int64())])
    if settings is not None:
        schema = schema.with_metadata(encode_settings(settings))
    with location.write_atomic(rel) as tmp:
        pq.write_table(pa.table({"k": list(range(rows))}, schema=schema), tmp)


def test_settings_round_trip_through_the_footer(tmp_path):
    location = Location.parse(tmp_path)
    settings = {"target_area": 262144, "background": (1, 2, 3), "versions": {"pillow": "x"}}
    _write(location, "a.parquet", 3, settings)
    assert read_settings(location.parquet_file("a.parquet")) == {**settings, "background": [1, 2, 3]}


def test_is_up_to_date_needs_rows_and_settings_to_match(tmp_path):
    location = Location.parse(tmp_path)
    settings = {"quality": 95}
    _write(location, "ok.parquet", 3, settings)
    _write(location, "bare.parquet", 3, None)
    location.write_bytes("junk.parquet", b"not parquet")
    assert is_up_to_date(location, "ok.parquet", 3, settings)
    assert not is_up_to_date(location, "ok.parquet", 4, settings)
    assert not is_up_to_date(location, "ok.parquet", 3, {"quality": 90})
    assert not is_up_to_date(location, "bare.parquet", 3, settings)
    assert not is_up_to_date(location, "junk.parquet", 3, settings)
    assert not is_up_to_date(location, "missing.parquet", 3, settings)


def test_a_damaged_page_is_not_up_to_date(tmp_path):
    """Footer and settings intact, one page's bytes altered: the shard is rebuilt."""
    location = Location.parse(tmp_path)
    settings = {"quality": 95}
    values = [os.urandom(4000) for _ in range(8)]
    schema = pa.schema([("k", pa.int64()), ("image", pa.binary())]).with_metadata(encode_settings(settings))
    for rel in ("intact.parquet", "damaged.parquet"):
        with location.write_atomic(rel) as tmp:
            table = pa.table({"k": list(range(8)), "image": values}, schema=schema)
            pq.write_table(
                table,
                tmp,
                row_group_size=4,
                compression="NONE",
                use_dictionary=False,
                write_statistics=False,
                write_page_checksum=True,
            )
    damage_value(location.child("damaged.parquet"), values[6])
    assert is_up_to_date(location, "intact.parquet", 8, settings)
    assert not is_up_to_date(location, "damaged.parquet", 8, settings)
