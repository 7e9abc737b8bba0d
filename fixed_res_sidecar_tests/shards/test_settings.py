import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.settings import encode_settings, is_up_to_date, read_settings


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
