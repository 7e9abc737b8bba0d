"""What an output shard was made with and from, stored in its Parquet footer.

Build settings: anything that changes the bytes of an output. Sources: the fingerprints of
the shards it was made from (its main shard; for a sidecar also both resized shards). An output
is up to date (SPEC 2's skip rule, `--skip-existing`) only when both equal the current ones.
"""

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fixed_res_sidecar.core.bbox import CAPTION_FRAMES, DEFAULT_BBOX_KEYS
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.io.parquet import ShardError, source_fingerprint, verify_page_checksums

SETTINGS_KEY = b"fixed_res_sidecar.settings"
SOURCES_KEY = b"fixed_res_sidecar.sources"

# Why an output is not up to date (`staleness`); the CLI counts them in its summary.
MISSING, UNREADABLE, ROWS, SETTINGS, SOURCES, DAMAGED = (
    "missing", "unreadable", "row count differs", "settings changed", "main changed", "damaged",
)  # fmt: skip
FAILED_VERIFICATION = "failed verification"  # up to date by its footer, but the verifier failed it (repair)


def encode_settings(settings: dict[str, Any], sources: dict[str, Any] | None = None) -> dict[bytes, bytes]:
    """Parquet key-value metadata holding `settings` and the fingerprints of the `sources`."""
    metadata = {SETTINGS_KEY: json.dumps(settings, sort_keys=True).encode()}
    if sources is not None:
        metadata[SOURCES_KEY] = json.dumps(sources, sort_keys=True).encode()
    return metadata


def read_settings(parquet_file: pq.ParquetFile) -> dict[str, Any] | None:
    raw = (parquet_file.schema_arrow.metadata or {}).get(SETTINGS_KEY)
    return json.loads(raw) if raw else None


def read_sources(parquet_file: pq.ParquetFile) -> dict[str, Any] | None:
    """The fingerprints of the shards an output was made from, as recorded; None when it recorded none."""
    raw = (parquet_file.schema_arrow.metadata or {}).get(SOURCES_KEY)
    try:
        sources = json.loads(raw) if raw else None
    except ValueError:
        return None
    return sources if isinstance(sources, dict) else None


def staleness(
    location, rel: str, expected_rows: int, settings: dict[str, Any], sources: dict[str, Any] | None = None
) -> str | None:
    """Why `location/rel` is not up to date (SPEC 2's skip rule), or None when it is: it exists, its
    footer row count, recorded settings and recorded sources (when given) match, and every page of
    it reads and matches its checksum (a damaged shard is rebuilt).

    The checksum pass reads the whole shard (its bytes, no image is decoded), and only when the
    footer already matches. A storage error (StorageError) propagates: the shard fails and is
    retried; it must not make a finished shard look missing or damaged and trigger a rebuild.
    """
    if not location.exists(rel):
        return MISSING
    try:
        existing = location.parquet_file(rel)
    except (OSError, ValueError, pa.ArrowException):  # unreadable or not Parquet: rebuild it
        return UNREADABLE
    with existing:
        try:
            recorded_rows, recorded = existing.metadata.num_rows, read_settings(existing)
        except ValueError:  # recorded settings that are not JSON
            return UNREADABLE
        if recorded_rows != expected_rows:
            return ROWS
        if recorded != _normalised(settings):
            return SETTINGS
        if sources is not None and read_sources(existing) != _normalised(sources):
            return SOURCES
        try:
            verify_page_checksums(existing, location.child(rel))
        except ShardError:
            return DAMAGED
    return None


def settings_difference(recorded: Any, expected: dict[str, Any]) -> str | None:
    """How an output's recorded build settings differ from those it is `expected` to have been built with, in
    words; None when they agree. Library versions are not compared: the same settings on another machine's
    libwebp make a good output (the fidelity check compares the pictures); skip-existing compares them."""
    if recorded is None:
        return "it records no build settings"
    if not isinstance(recorded, dict):
        return "its recorded build settings are not readable (not a JSON object)"
    wanted = _normalised({name: value for name, value in expected.items() if name != "versions"})
    differing = [
        f"{name} {json.dumps(recorded.get(name))} (expected {json.dumps(value)})"
        for name, value in wanted.items()
        if recorded.get(name) != value
    ]
    return "its footer records other build settings than expected: " + ", ".join(differing) if differing else None


def resized_sources(layout, rel: str, main_shard: pq.ParquetFile | None = None) -> dict[str, Any]:
    """The fingerprints of what a resized shard is made from: its main shard."""
    return {"main": source_fingerprint(layout.main, rel, main_shard)}


def sidecar_sources(layout, rel: str, main_shard: pq.ParquetFile | None = None) -> dict[str, Any]:
    """The fingerprints of what a sidecar shard is made from: its main shard, its caption shard (when
    captions are a dataset of their own) and both resized shards. A change to any makes it stale."""
    sources = {
        "main": source_fingerprint(layout.main, rel, main_shard),
        **{f"resized_{name}": output.location.fingerprint(rel) for name, output in layout.resized.items()},
    }
    if layout.captions is not None:
        sources["captions"] = source_fingerprint(layout.captions, rel)
    return sources


def stale_sources(recorded: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """What an output's recorded sources say about it, when they are not the current ones (for messages)."""
    if recorded is None:
        return "it records no source fingerprints (built by an older version)"
    changed = [name for name in current if recorded.get(name) != current[name]]
    if not changed:
        return None
    return "built from another version of " + ", ".join(
        f"{n} (recorded {recorded.get(n)}, now {current[n]})" for n in changed
    )


def is_up_to_date(location, rel: str, expected_rows: int, settings: dict[str, Any], sources=None) -> bool:
    return staleness(location, rel, expected_rows, settings, sources) is None


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
