"""Deterministic photo-like benchmark corpora, written once as main Parquet datasets and cached.

Two corpora:

* the comparison corpus (`ensure_corpus`): mostly JPEG, some PNG, some EXIF-rotated,
  long sides 300 to 6000 px with most pixels in 8-30 MP photos, split into a few shards
  so that the benchmark can interleave its pipelines shard by shard;
* the memory corpus (`ensure_memory_corpus`): one shard of about 2 GB of large JPEGs
  (a few distinct images repeated), in row groups of ~230 MB (see MEMORY_ROW_GROUP_ROWS).

Content ("textured" style, the default): a sky/ground gradient, flat-coloured shapes with
dark outlines (edges at many scales), a 1/f-like multi-scale texture on top and a little
sensor noise. After downscaling to 1 MP this still carries detail the way photographs do,
so WebP sizes and encode times are photo-like (about 300 KB at 1024 area, q95). The
"sample" style uses `fixed_res_sidecar.sample_data.make_photo` as is: smooth once
downscaled, so its WebP files are 3-10x smaller and cheaper to encode than photos'.

Every image is a pure function of (corpus seed, index); a corpus directory is only used
when its manifest (written last) matches the requested parameters.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageChops, ImageDraw

from fixed_res_sidecar.sample_data import make_photo

CORPUS_VERSION = 1  # bump when the generator changes: cached corpora are then rebuilt
MANIFEST = "manifest.json"
KEY_COLUMN = "image_key"
IMAGE_COLUMN = "image"
ROW_GROUP_ROWS = 16  # comparison corpus
HF_IMAGE_ROW_GROUP_ROWS = 100  # what Hugging Face `datasets` writes for image columns
# Memory corpus default: 32 rows of ~7 MB JPEGs = ~230 MB per row group, the bytes of a
# Hugging Face row group (100 rows) of typical 2-3 MB photos. pyarrow writes each such row
# group's image column as ONE data page, which any reader must hold whole (and briefly
# twice), so the row group's byte size, not its row count, sets the memory floor.
MEMORY_ROW_GROUP_ROWS = 32

# Displayed frame -> stored (raw) frame, inverse of the EXIF orientation's transpose.
RAW_FROM_DISPLAYED = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,
    8: Image.Transpose.ROTATE_270,
}
ASPECTS = ((4, 3), (3, 2), (16, 9), (1, 1), (5, 4), (2, 1))
ASPECT_WEIGHTS = (35, 30, 15, 10, 6, 4)
MAX_LONG_SIDE = 6000
PNG_MAX_PIXELS = 4_000_000


@dataclass(frozen=True)
class ImageSpec:
    index: int
    width: int  # displayed (upright) size
    height: int
    format: str  # "JPEG" or "PNG"
    orientation: int  # EXIF orientation; 1 = none
    quality: int  # JPEG quality
    seed: int

    @property
    def megapixels(self) -> float:
        return self.width * self.height / 1e6


# ----------------------------------------------------------------------------- specs


def corpus_specs(n_images: int, seed: int = 0, profile: str = "photo") -> list[ImageSpec]:
    """The image list of a corpus.

    profile "photo": 15% small (long side 300-1200), 25% medium (1-8 MP), 60% large
    (8-30 MP, long side capped at 6000), so about 90% of the pixels are in the large ones.
    profile "tiny": long sides 200-700 (for the smoke test).
    Every 12th image (index 5 mod 12) is a PNG of at most 4 MP; one in five JPEGs and one
    in two PNGs carries an EXIF rotation (6, 8 or 3).
    """
    specs = []
    for index in range(n_images):
        rng = random.Random(f"fixed-res-bench:{seed}:{index}")
        is_png = index % 12 == 5
        aspect_w, aspect_h = rng.choices(ASPECTS, ASPECT_WEIGHTS)[0]
        aspect = aspect_w / aspect_h
        if profile == "tiny":
            long_side = rng.randint(200, 700)
        elif profile == "photo":
            u = rng.random()
            if u < 0.15:
                long_side = rng.randint(300, 1200)
            else:
                megapixels = rng.uniform(1, 8) if u < 0.40 else rng.uniform(8, 30)
                if is_png:
                    megapixels = min(megapixels, PNG_MAX_PIXELS / 1e6)
                long_side = min(MAX_LONG_SIDE, round(math.sqrt(megapixels * 1e6 * aspect)))
        else:
            raise ValueError(f"unknown corpus profile {profile!r}")
        short_side = max(16, round(long_side / aspect))
        portrait = rng.random() < 0.35
        width, height = (short_side, long_side) if portrait else (long_side, short_side)
        if is_png:
            orientation = (1, 6)[(index // 12) % 2]
        else:
            orientation = {3: 6, 7: 8, 9: 3}.get(index % 10, 1)
        quality = rng.choice((85, 90, 90, 95))
        specs.append(
            ImageSpec(index, width, height, "PNG" if is_png else "JPEG", orientation, quality, rng.getrandbits(32))
        )
    return specs


# ----------------------------------------------------------------------------- images


def _noise(size: tuple[int, int], rng: np.random.Generator) -> Image.Image:
    width, height = size
    return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")


def _octave(size: tuple[int, int], divisor: int, rng: np.random.Generator) -> Image.Image:
    width, height = size
    small = (max(2, width // divisor), max(2, height // divisor))
    return _noise(small, rng).resize(size, Image.Resampling.BICUBIC)


def textured_photo(width: int, height: int, seed: int) -> Image.Image:
    """An upright RGB picture with photo-like detail at every scale (see the module docstring)."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    size = (width, height)
    sky = Image.linear_gradient("L").resize(size)
    top, bottom = (rng.randint(60, 140), rng.randint(120, 200), 240), (rng.randint(40, 90), 120, 50)
    image = Image.composite(Image.new("RGB", size, bottom), Image.new("RGB", size, top), sky)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(8, 30)):
        w = rng.randint(max(2, width // 40), max(3, width // 3))
        h = rng.randint(max(2, height // 40), max(3, height // 3))
        x0, y0 = rng.randint(0, width - w), rng.randint(0, height - h)
        colour = tuple(rng.randint(30, 230) for _ in range(3))
        shape = rng.choice(("ellipse", "rectangle"))
        getattr(draw, shape)((x0, y0, x0 + w - 1, y0 + h - 1), fill=colour, outline=(20, 20, 20), width=max(1, w // 80))
    # Luminance texture: octaves from 1/256 of the image down to 2 px, coarse ones strongest.
    lum = _octave(size, 256, nrng)
    for divisor, weight in ((48, 0.5), (8, 0.45), (2, 0.35)):
        lum = Image.blend(lum, _octave(size, divisor, nrng), weight)
    # Some colour variation: each channel is (lum + its own coarse octave) / 2.
    detail = Image.merge("RGB", [ImageChops.add(lum, _octave(size, 96, nrng), scale=2.0) for _ in range(3)])
    image = ImageChops.add(image, detail, scale=1.0, offset=-128)
    sensor = Image.merge("RGB", [_noise(size, nrng) for _ in range(3)])
    return Image.blend(image, sensor, 0.05)


def encode_spec(spec: ImageSpec, style: str = "textured") -> bytes:
    """The stored bytes of one corpus image (raw frame + EXIF orientation when rotated)."""
    if style == "sample":
        if spec.format == "JPEG":
            data, _ = make_photo(spec.width, spec.height, spec.seed, spec.orientation, quality=spec.quality)
            return data
        upright = Image.open(io.BytesIO(make_photo(spec.width, spec.height, spec.seed)[0])).convert("RGB")
    elif style == "textured":
        upright = textured_photo(spec.width, spec.height, spec.seed)
    else:
        raise ValueError(f"unknown corpus style {style!r}")
    raw = upright.transpose(RAW_FROM_DISPLAYED[spec.orientation]) if spec.orientation in RAW_FROM_DISPLAYED else upright
    exif = Image.Exif()
    if spec.orientation != 1:
        exif[0x0112] = spec.orientation
    out = io.BytesIO()
    if spec.format == "JPEG":
        raw.save(out, "JPEG", quality=spec.quality, exif=exif.tobytes())
    else:
        raw.save(out, "PNG", exif=exif.tobytes(), compress_level=6)
    return out.getvalue()


def _encode_job(job: tuple[ImageSpec, str]) -> bytes:
    return encode_spec(*job)


def _generate(jobs: list[tuple[ImageSpec, str]], workers: int) -> Iterator[bytes]:
    """Encoded images in order, made on `workers` processes."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield _encode_job(job)
        return
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(_encode_job, jobs, chunksize=1)


# ----------------------------------------------------------------------------- datasets


@dataclass
class Corpus:
    root: Path  # corpus directory
    main: Path  # the main dataset (shards under it)
    shards: list[str]
    specs: list[ImageSpec]
    source_bytes: int
    manifest: dict

    @property
    def images(self) -> int:
        return len(self.specs)


def _key(spec: ImageSpec) -> str:
    return f"img{spec.index:06d}"


def _shard_names(count: int) -> list[str]:
    return [f"part-{i:05d}.parquet" for i in range(count)]


def _schema() -> pa.Schema:
    return pa.schema([(KEY_COLUMN, pa.string()), (IMAGE_COLUMN, pa.binary())])


def _read_manifest(root: Path) -> dict | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def ensure_corpus(
    workdir: str | os.PathLike,
    n_images: int,
    shards: int,
    *,
    seed: int = 0,
    profile: str = "photo",
    style: str = "textured",
    workers: int | None = None,
    log=print,
) -> Corpus:
    """The comparison corpus under `workdir`, generated on first use and reused afterwards."""
    shards = max(1, min(shards, n_images))
    params = {
        "version": CORPUS_VERSION,
        "images": n_images,
        "shards": shards,
        "seed": seed,
        "profile": profile,
        "style": style,
    }
    tag = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(workdir) / f"corpus-{profile}-{style}-{n_images}x{shards}-{tag}"
    specs = corpus_specs(n_images, seed, profile)
    names = _shard_names(shards)
    manifest = _read_manifest(root)
    if manifest is None or manifest.get("params") != params:
        if root.exists():
            shutil.rmtree(root)
        (root / "main").mkdir(parents=True)
        log(f"corpus: generating {n_images} images into {root} (first run only) ...")
        bounds = [round(i * n_images / shards) for i in range(shards + 1)]
        encoded = _generate([(spec, style) for spec in specs], workers or os.cpu_count() or 1)
        total = 0
        for name, lo, hi in zip(names, bounds, bounds[1:]):
            keys, images = [], []
            for spec in specs[lo:hi]:
                data = next(encoded)
                keys.append(_key(spec))
                images.append(data)
                total += len(data)
            table = pa.table(
                {KEY_COLUMN: pa.array(keys), IMAGE_COLUMN: pa.array(images, pa.binary())}, schema=_schema()
            )
            pq.write_table(
                table,
                root / "main" / name,
                row_group_size=ROW_GROUP_ROWS,
                compression="none",
                use_dictionary=[KEY_COLUMN],
            )
        manifest = {"params": params, "source_bytes": total, "specs": [asdict(s) for s in specs]}
        (root / MANIFEST).write_text(json.dumps(manifest))
    return Corpus(root, root / "main", names, specs, manifest["source_bytes"], manifest)


def memory_specs(distinct: int, seed: int = 0) -> list[ImageSpec]:
    """A few large JPEGs (20-30 MP, long side <= 6000), some rotated."""
    specs = []
    for index in range(distinct):
        rng = random.Random(f"fixed-res-bench-memory:{seed}:{index}")
        aspect_w, aspect_h = ((4, 3), (3, 2), (5, 4))[index % 3]
        megapixels = rng.uniform(20, 30)
        long_side = min(MAX_LONG_SIDE, round(math.sqrt(megapixels * 1e6 * aspect_w / aspect_h)))
        short_side = round(long_side * aspect_h / aspect_w)
        width, height = (short_side, long_side) if index % 2 else (long_side, short_side)
        orientation = (1, 6, 1, 8)[index % 4]
        specs.append(ImageSpec(index, width, height, "JPEG", orientation, 90, rng.getrandbits(32)))
    return specs


def ensure_memory_corpus(
    workdir: str | os.PathLike,
    target_bytes: int = 2 * 10**9,
    *,
    distinct: int = 8,
    row_group_rows: int = MEMORY_ROW_GROUP_ROWS,
    seed: int = 0,
    specs: list[ImageSpec] | None = None,
    style: str = "textured",
    workers: int | None = None,
    log=print,
) -> Corpus:
    """One main shard holding about `target_bytes` of JPEGs: `distinct` images repeated.

    Written row group by row group, so generating it never holds the whole shard in memory.
    """
    specs = specs if specs is not None else memory_specs(distinct, seed)
    params = {
        "version": CORPUS_VERSION,
        "target_bytes": target_bytes,
        "specs": [asdict(s) for s in specs],
        "row_group_rows": row_group_rows,
        "style": style,
        "dictionary": False,  # repeated images must be stored in full, as distinct images would be
    }
    tag = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(workdir) / f"memory-{target_bytes // 10**6}MB-{tag}"
    name = "part-00000.parquet"
    manifest = _read_manifest(root)
    if manifest is None or manifest.get("params") != params:
        if root.exists():
            shutil.rmtree(root)
        (root / "main").mkdir(parents=True)
        log(
            f"memory corpus: generating {len(specs)} distinct large JPEGs, ~{target_bytes / 1e9:.2f} GB shard in {root} ..."
        )
        distinct_bytes = list(_generate([(spec, style) for spec in specs], workers or os.cpu_count() or 1))
        rows_specs: list[ImageSpec] = []
        total = 0
        with pq.ParquetWriter(root / "main" / name, _schema(), compression="none", use_dictionary=False) as writer:
            keys: list[str] = []
            images: list[bytes] = []
            while total < target_bytes:
                i = len(rows_specs)
                data = distinct_bytes[i % len(specs)]
                keys.append(f"row{i:06d}")
                images.append(data)
                rows_specs.append(specs[i % len(specs)])
                total += len(data)
                if len(keys) == row_group_rows or total >= target_bytes:
                    writer.write_table(
                        pa.table({KEY_COLUMN: keys, IMAGE_COLUMN: pa.array(images, pa.binary())}, schema=_schema())
                    )
                    keys, images = [], []
        manifest = {
            "params": params,
            "source_bytes": total,
            "rows": len(rows_specs),
            "distinct_bytes": [len(d) for d in distinct_bytes],
            "specs": [asdict(s) for s in rows_specs],
        }
        (root / MANIFEST).write_text(json.dumps(manifest))
    rows_specs = [ImageSpec(**s) for s in manifest["specs"]]
    return Corpus(root, root / "main", [name], rows_specs, manifest["source_bytes"], manifest)


def shard_images(main: Path, shard: str) -> Iterator[bytes]:
    """The encoded images of a main shard, read one row group at a time (so only one is in memory)."""
    source = pq.ParquetFile(main / shard)
    for index in range(source.metadata.num_row_groups):
        yield from source.read_row_group(index, columns=[IMAGE_COLUMN]).column(0).to_pylist()
