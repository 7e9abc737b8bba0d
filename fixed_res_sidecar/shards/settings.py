"""Build settings: what an output shard was made with, stored in its Parquet footer.

`--skip-existing` compares these with the current ones (SPEC 2), so anything that
changes the bytes of an output belongs here.
"""

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.core.bbox import CAPTION_FRAMES, DEFAULT_BBOX_KEYS
from fixed_res_sidecar.core.pixels import PixelOptions
from fixed_res_sidecar.io.parquet import ShardError, verify_page_checksums

SETTINGS_KEY = b"fixed_res_sidecar.settings"


def encode_settings(settings: dict[str, Any]) -> dict[bytes, bytes]:
    """Parquet key-value metadata holding `settings`."""
    return {SETTINGS_KEY: json.dumps(settings, sort_keys=True).encode()}


def read_settings(parquet_file: pq.ParquetFile) -> dict[str, Any] | None:
    raw = (parquet_file.schema_arrow.metadata or {}).get(SETTINGS_KEY)
    return json.loads(raw) if raw else None


def is_up_to_date(location, rel: str, expected_rows: int, settings: dict[str, Any]) -> bool:
    """SPEC 2 skip rule: the shard exists, its footer row count and recorded settings match, and
    every page of it reads and matches its checksum (a damaged shard is rebuilt).

    The checksum pass reads the whole shard (its bytes, no image is decoded), and only when the
    footer already matches. A storage error (StorageError) propagates: the shard fails and is
    retried; it must not make a finished shard look missing or damaged and trigger a rebuild.
    """
    if not location.exists(rel):
        return False
    try:
        existing = location.parquet_file(rel)
    except (OSError, ValueError, pa.ArrowException):  # unreadable or not Parquet: rebuild it
        return False
    with existing:
        try:
            recorded_rows, recorded = existing.metadata.num_rows, read_settings(existing)
        except ValueError:  # recorded settings that are not JSON
            return False
        if recorded_rows != expected_rows or recorded != _normalised(settings):
            return False
        try:
            verify_page_checksums(existing, location.child(rel))
        except ShardError:
            return False
    return True


def _normalised(settings: dict[str, Any]) -> dict[str, Any]:
    # Round-trip through JSON so tuples compare equal to the lists read back.
    return json.loads(json.dumps(settings, sort_keys=True))


@dataclass(frozen=True)
class SidecarReading:
    """How a crop sidecar shard says its captions are to be read, from its recorded settings
    (SPEC 6's defaults where it recorded none): what the verifier and the overlays use."""

    bbox_keys: tuple[str, ...] = DEFAULT_BBOX_KEYS
    caption_frame: str = CAPTION_FRAMES[0]
    # The smallest source limit its resized shards were built with: overlays decode nothing larger.
    max_source_pixels: int = PixelOptions().max_source_pixels

    @classmethod
    def of(cls, parquet_file: pq.ParquetFile) -> "SidecarReading":
        try:
            settings = read_settings(parquet_file)
        except Exception:  # noqa: BLE001 - a foreign or damaged footer: the defaults
            settings = None
        if not isinstance(settings, dict):
            return cls()
        keys = settings.get("bbox_keys")
        frame = settings.get("caption_frame")
        resized = settings.get("resized_settings")
        limits = [
            s.get("max_source_pixels")
            for s in (resized.values() if isinstance(resized, dict) else ())
            if isinstance(s, dict)
        ]
        limits = [v for v in limits if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        default = cls()
        return cls(
            tuple(keys)
            if isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys)
            else default.bbox_keys,
            frame if frame in CAPTION_FRAMES else default.caption_frame,
            min(limits) if limits else default.max_source_pixels,
        )
