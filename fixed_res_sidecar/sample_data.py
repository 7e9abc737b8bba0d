"""A sample main dataset: photo-like JPEGs with boxed objects, captions and some bad rows.

Used by the demo (the README's first command), the tests and the benchmark. Images are
generated (no downloads): a sky/ground gradient, sensor-like noise, and coloured shapes
whose boxes go into the caption, so overlays show whether boxes still sit on objects.
"""

import io
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from fixed_res_sidecar.io.locations import Location

# EXIF orientation -> the transpose that turns the displayed image into the stored (raw) one.
RAW_FROM_DISPLAYED = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,
    8: Image.Transpose.ROTATE_270,
}
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220), "yellow": (240, 210, 40), "green": (40, 170, 70)}


@dataclass(frozen=True)
class SampleObject:
    label: str
    box: tuple[int, int, int, int]  # [ymin, xmin, ymax, xmax] normalised 0..1000, displayed frame


def make_photo(
    width: int, height: int, seed: int, orientation: int = 1, quality: int = 90, n_objects: int = 3
) -> tuple[bytes, list[SampleObject]]:
    """A JPEG that DISPLAYS as width x height (stored rotated when orientation is 3, 6 or 8)."""
    rng = random.Random(seed)
    sky = Image.linear_gradient("L").resize((width, height))
    top, bottom = (rng.randint(60, 140), rng.randint(120, 200), 240), (rng.randint(40, 90), 120, 50)
    image = Image.composite(Image.new("RGB", (width, height), bottom), Image.new("RGB", (width, height), top), sky)
    noise = Image.effect_noise((width, height), 24).convert("RGB")
    image = Image.blend(image, noise, 0.12)
    draw = ImageDraw.Draw(image)
    objects = []
    for _ in range(n_objects):
        name, colour = rng.choice(sorted(COLOURS.items()))
        w, h = rng.randint(width // 10, width // 3), rng.randint(height // 10, height // 3)
        x0, y0 = rng.randint(0, width - w), rng.randint(0, height - h)
        shape = rng.choice(["ellipse", "rectangle"])
        getattr(draw, shape)((x0, y0, x0 + w - 1, y0 + h - 1), fill=colour, outline=(20, 20, 20), width=max(1, w // 60))
        box = (
            round(y0 / height * 1000),
            round(x0 / width * 1000),
            round((y0 + h) / height * 1000),
            round((x0 + w) / width * 1000),
        )
        objects.append(SampleObject(f"{name} {shape}", box))
    exif = Image.Exif()
    if orientation in RAW_FROM_DISPLAYED:
        image = image.transpose(RAW_FROM_DISPLAYED[orientation])
        exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality, exif=exif.tobytes())
    return out.getvalue(), objects


def make_caption(objects: Sequence[SampleObject]) -> str:
    """A structured_description in the usual shape: nested objects, single boxes, box lists."""
    caption = {
        "summary": f"a synthetic scene with {len(objects)} objects",
        "objects": [{"label": o.label, "bbox": list(o.box), "attributes": {"score": 0.9}} for o in objects],
        "groups": {"all_shapes": {"box_2d": [list(o.box) for o in objects]}},
    }
    return json.dumps(caption)


BAD_ROWS = ("null", "random_bytes", "truncated", "tiny", "panorama")


def bad_image(kind: str, seed: int) -> bytes | None:
    rng = random.Random(seed)
    if kind == "null":
        return None
    if kind == "random_bytes":
        return bytes(rng.getrandbits(8) for _ in range(2048))
    if kind == "truncated":
        data, _ = make_photo(640, 480, seed)
        return data[: len(data) // 3]
    size = {"tiny": (1, 1), "panorama": (4000, 200)}[kind]
    out = io.BytesIO()
    Image.new("RGB", size, (90, 90, 90)).save(out, "JPEG")
    return out.getvalue()


def sample_shard_table(
    shard_index: int,
    rows: int,
    sizes: Sequence[tuple[int, int]] = ((640, 480), (480, 640), (800, 450), (1200, 900)),
    bad_rows: bool = True,
    struct_images: bool = False,
) -> pa.Table:
    """One main shard: `image_key`, `image`, `structured_description`."""
    keys, images, captions = [], [], []
    for row in range(rows):
        seed = shard_index * 100_003 + row
        key = f"shard{shard_index:03d}-img{row:05d}"
        # Every fifth row is bad, cycling through the kinds so a few shards hold all of them.
        bad_kind = BAD_ROWS[(2 * shard_index + row // 5) % len(BAD_ROWS)] if bad_rows and row % 5 == 4 else None
        if bad_kind:
            images.append(bad_image(bad_kind, seed))
            captions.append(None if bad_kind == "null" else make_caption([]))
        else:
            width, height = sizes[row % len(sizes)]
            orientation = (1, 1, 6, 1, 3, 8)[row % 6]
            data, objects = make_photo(width, height, seed, orientation=orientation)
            images.append(data)
            captions.append(make_caption(objects))
        keys.append(key)
    if struct_images:
        image_column = pa.array(
            [{"bytes": b, "path": f"{k}.jpg"} for b, k in zip(images, keys)],
            type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        )
    else:
        image_column = pa.array(images, type=pa.binary())
    return pa.table(
        {"image_key": pa.array(keys), "image": image_column, "structured_description": pa.array(captions, pa.string())}
    )


DEFAULT_SHARDS = ("part-00000.parquet", "part-00001.parquet", "2026/12/part-00002.parquet")


def write_sample_dataset(
    main: str | Location,
    shards: Sequence[str] = DEFAULT_SHARDS,
    rows_per_shard: int = 12,
    row_group_size: int = 8,
    **table_options,
) -> list[str]:
    """Write a sample main dataset; returns the shards' relative paths."""
    location = main if isinstance(main, Location) else Location.parse(main)
    for index, rel in enumerate(shards):
        table = sample_shard_table(index, rows_per_shard, **table_options)
        with location.write_atomic(rel) as tmp:
            pq.write_table(table, tmp, row_group_size=row_group_size)
    return list(shards)
