"""Overlay pictures of sampled rows of a crop sidecar shard: which rows, and where the PNGs go.

Not a verifier check: the pictures are for people. Each shows the original with its caption
boxes, the 512 image with `structured_description_crop_512` and the 1024 image with
`structured_description_crop_1024` (core/overlay.py draws them). They go to
`<overlay dir>/<rel without .parquet>/<row>-<key>.png`.
"""

from typing import Any

from fixed_res_sidecar.core.audit import audit_column
from fixed_res_sidecar.core.bbox import CROP_COLUMNS
from fixed_res_sidecar.core.image_cell import image_bytes
from fixed_res_sidecar.core.overlay import OverlayRow, overlay_picture
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.parquet import open_shard, read_columns
from fixed_res_sidecar.shards.layout import DatasetLayout
from fixed_res_sidecar.shards.settings import SidecarReading
from fixed_res_sidecar.shards.verify.report import (
    column_or_nulls,
    keys_or_nulls,
    read_rows,
    safe_name,
    sample_rows,
    shard_stem,
)


def write_overlays(layout: DatasetLayout, rel: str, overlay_dir: Location, sample: int) -> list[str]:
    """Draw up to `sample` overlay pictures of shard `rel` under `overlay_dir`; returns their URIs.

    Rows are sampled as for the verifier's images (the same rows every run). Box keys and the
    caption frame are the layout's, else what the sidecar recorded; no image with more pixels
    than the resized shards' source limit is decoded. Raises ShardError (naming the shard)
    when an input cannot be read, LocationError when the pictures would land in a read-only
    location.
    """
    sidecar_uri = layout.sidecar.child(rel)
    with open_shard(layout.sidecar, rel, "sidecar", columns=[layout.key_column, *CROP_COLUMNS.values()]) as sidecar:
        table = read_columns(sidecar, [layout.key_column, *CROP_COLUMNS.values()], sidecar_uri)
        recorded = SidecarReading.of(sidecar)
    keys = keys_or_nulls(table, layout.key_column)
    crops = {resolution: column_or_nulls(table, column) for resolution, column in CROP_COLUMNS.items()}
    rows = sample_rows(_candidates(layout, rel, table.num_rows, crops), sample, rel)

    def cells(location: Location, column: str, role: str) -> dict[int, Any]:
        with open_shard(location, rel, role) as parquet_file:
            if column not in parquet_file.schema_arrow.names:
                return {}
            return {row: values[column] for row, values in read_rows(parquet_file, rows, [column]).items()}

    originals = cells(layout.main, layout.image_column, "main")
    captions = cells(layout.caption_source, layout.caption_column, "caption")
    resized = {name: cells(o.location, layout.image_column, f"resized {name}") for name, o in layout.resized.items()}
    options = {
        "bbox_keys": layout.bbox_keys or recorded.bbox_keys,
        "caption_frame": layout.caption_frame or recorded.caption_frame,
        "max_source_pixels": recorded.max_source_pixels,
    }
    stem = shard_stem(rel)
    written = []
    for row in rows:
        shown = OverlayRow(
            image_bytes(originals.get(row)) or None,
            captions.get(row),
            image_bytes(resized["512"].get(row)) or None,
            crops["512"][row],
            image_bytes(resized["1024"].get(row)) or None,
            crops["1024"][row],
        )
        png = overlay_picture(shown, **options)
        target = f"{stem}/{row:06d}-{safe_name(keys[row])}.png"
        overlay_dir.write_bytes(target, png, protect=layout.read_only)
        written.append(overlay_dir.child(target))
    return written


def _candidates(layout: DatasetLayout, rel: str, rows: int, crops: dict[str, list]) -> list[int]:
    """Rows worth an overlay picture, from the first of these that has any.

    Rows with captions in both crop frames say the most; then rows valid at both resolutions,
    then at either. Rows whose resize was invalid (the source may be a bomb or garbage) are
    drawn only when no row has a resized image; even then nothing refused is decoded.
    """
    both = [r for r in range(rows) if crops["512"][r] is not None and crops["1024"][r] is not None]
    if both:
        return both
    valid = []
    for name, output in layout.resized.items():
        column = audit_column(output.audit_prefix, "valid")
        with open_shard(output.location, rel, f"resized {name}", columns=[column], rows=rows) as parquet_file:
            valid.append(read_columns(parquet_file, [column], output.location.child(rel)).column(column).to_pylist())
    for tier in (all, any):
        candidates = [r for r in range(rows) if tier(flags[r] is True for flags in valid)]
        if candidates:
            return candidates
    return list(range(rows))
