"""Build settings: what an output shard was made with, stored in its Parquet footer.

`--skip-existing` compares these with the current ones (SPEC 2), so anything that
changes the bytes of an output belongs here.
"""

import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SETTINGS_KEY = b"fixed_res_sidecar.settings"


def encode_settings(settings: dict[str, Any]) -> dict[bytes, bytes]:
    """Parquet key-value metadata holding `settings`."""
    return {SETTINGS_KEY: json.dumps(settings, sort_keys=True).encode()}


def read_settings(parquet_file: pq.ParquetFile) -> dict[str, Any] | None:
    raw = (parquet_file.schema_arrow.metadata or {}).get(SETTINGS_KEY)
    return json.loads(raw) if raw else None


def is_up_to_date(location, rel: str, expected_rows: int, settings: dict[str, Any]) -> bool:
    """SPEC 2 skip rule: the shard exists, its footer row count and recorded settings match.

    A storage error while checking existence propagates (the shard fails and is retried);
    it must not make a finished shard look missing and trigger a rebuild.
    """
    if not location.exists(rel):
        return False
    try:
        existing = location.parquet_file(rel)
        recorded_rows, recorded = existing.metadata.num_rows, read_settings(existing)
    except (OSError, ValueError, pa.ArrowException):  # unreadable or not Parquet: rebuild it
        return False
    return recorded_rows == expected_rows and recorded == _normalised(settings)


def _normalised(settings: dict[str, Any]) -> dict[str, Any]:
    # Round-trip through JSON so tuples compare equal to the lists read back.
    return json.loads(json.dumps(settings, sort_keys=True))
