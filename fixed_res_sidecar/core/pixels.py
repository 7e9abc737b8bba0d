"""The per-image pixel pipeline (SPEC section 4): encoded bytes in, encoded bytes and audit out.

One call decodes a source image once and renders every requested target area from that
decode. Pure: no storage, no Dagster, no global state beyond a small cache of colour
transforms (a memory budget is passed in). Bad input never raises; it becomes an invalid `AuditRecord` with an error code.

How one image goes through (`process_image`):

1. Open lazily and read only the header: format, mode, size, frame count (capped at
   MAX_COUNTED_FRAMES), EXIF orientation. The source limits (pixel count, smallest side,
   aspect ratio, encoder side limit) are checked here, before any pixel is decoded. A
   single-scan JPEG is opened so that compressed data cut short is reported (`_decode_stream`).
2. Decode once, holding the estimated decode memory from the shard's budget when one is
   given (`decode_memory_estimate`). A JPEG is decoded with shrink-on-load (`draft`) when
   every output is small enough that the reduced decode still holds at least its resolution.
3. Normalise the mode: palette, 1-bit, 16-bit and odd modes become L, LA, RGB, RGBA or
   CMYK; a fully opaque alpha is dropped; real alpha is premultiplied once for resampling.
4. Per output, largest first: one Lanczos resample of the crop box in the raw (unrotated)
   frame, from the decoded image or, for a much smaller output, from a larger output
   already made; then, on the small output, colour conversion to sRGB, alpha handling and
   the EXIF transpose; then encode.

Working in the raw frame and rotating the output is cheaper than rotating the decoded
image, and Lanczos commutes with flips and 90 degree turns, so the pixels are the same up
to rounding. Every shortcut is checked against one direct Lanczos resample of the
full-resolution upright crop box in test_pixels.py (PSNR >= 40 dB, SPEC 3).
"""

from __future__ import annotations

import hashlib
import io
import math
import numbers
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from importlib import metadata

import PIL
from PIL import Image, ImageChops, ImageCms, ImageMath, features

from .audit import AuditRecord, ErrorCode
from .errors import describe_exception
from .geometry import Geometry, geometry
from .memory import MemoryBudget
from .orientation import (
    SWAPS_AXES,
    oriented_box_to_raw,
    oriented_size,
    read_orientation,
    to_upright,
)

# Pillow's own decompression-bomb guard is switched off on purpose: the configured
# `PixelOptions.max_source_pixels` is enforced from the header before decoding instead,
# and reported per row as `too_large` rather than as a warning or an exception.
Image.MAX_IMAGE_PIXELS = None

RESAMPLE = Image.Resampling.LANCZOS
RESAMPLE_NAME = "lanczos"

# Image.resize(reducing_gap=3.0) first box-reduces by an integer factor, leaving a Lanczos
# step of at least 3x; Pillow documents >= 3.0 as indistinguishable from a direct resample.
REDUCING_GAP = 3.0

# JPEG shrink-on-load keeps at least this many decoded pixels per output pixel along each
# axis of the crop box. 1.0 means "at least the output's resolution"; measured PSNR against
# a direct full-resolution Lanczos stays well above 40 dB (see test_pixels.py).
DRAFT_MARGIN = 1.0
DRAFT_FACTORS = (8, 4, 2)

# A smaller output is resampled from an already made larger one (instead of from the decoded
# image) only when that holds its crop box at least this many times finer along each axis;
# 512 from 1024 is about 2x. Measured PSNR against a direct full-resolution resample > 50 dB.
INTERMEDIATE_MIN_RATIO = 1.75

OUTPUT_FORMATS = {"webp": "WEBP", "jpeg": "JPEG", "png": "PNG"}
# zlib level for PNG output: level 6 (Pillow's default) takes 2.4x as long for files ~4% smaller.
PNG_COMPRESS_LEVEL = 1
# What JPEG output (no alpha channel) composites transparency onto when no background is set.
JPEG_BACKGROUND = (255, 255, 255)
# Largest side each encoder can write.
ENCODER_MAX_SIDE = {"webp": 16383, "jpeg": 65535, "png": 2**31 - 1}

# Frames are counted up to here (GIF and TIFF walk the file to count them); a larger count is
# recorded as this, with a note in error_detail.
MAX_COUNTED_FRAMES = 1000

# JPEG: what a single-scan sequential image's compressed data is decoded with instead of its
# end-of-image marker (see `_decode_stream`). 16 bytes of set bits cover the decoder's 57-bit
# read-ahead; a cut that loses more than about 3 blocks (34 bits each, read as bad codes)
# runs out of data and is reported as truncated.
JPEG_SCAN_PADDING = b"\xff\x00" * 16
_JPEG_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0..SOF15, not DHT/JPG/DAC
_SEQUENTIAL_HUFFMAN_FRAMES = frozenset({0xC0, 0xC1})  # baseline and extended sequential
# A marker that ends compressed data: 0xFF followed by anything but a stuffed 0, a restart
# marker or another 0xFF (fill).
_MARKER_IN_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")

# Formats that draft (shrink-on-load) applies to.
DRAFT_FORMATS = frozenset({"JPEG", "MPO"})
# Every format Pillow can open, except EPS: opening EPS hands untrusted bytes to Ghostscript.
# Whatever else decodes untrusted images (the overlay pictures) opens them with `open_image` too.
EXCLUDED_INPUT_FORMATS = frozenset({"EPS"})

SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I"})
ALPHA_MODES = {"RGBA": "RGB", "LA": "L"}  # mode with alpha -> the same without
PREMULTIPLIED = {"RGBA": "RGBa", "LA": "La"}
UNPREMULTIPLIED = {v: k for k, v in PREMULTIPLIED.items()}


@dataclass(frozen=True)
class PixelOptions:
    """How images are rendered. Invalid settings raise ValueError on construction."""

    patch_size: int = 32
    square: bool = False
    output_format: str = "webp"  # "webp" | "jpeg" | "png"
    quality: int = 95
    webp_method: int = 4  # 0..6, the WebP encoder's effort (`method=`)
    max_source_pixels: int = 200_000_000  # checked from the header, before decode -> "too_large"
    max_aspect_ratio: float = 10.0  # max(W/H, H/W) above this -> "aspect_ratio"
    min_source_side: int = 16  # min(W, H) below this -> "too_small"
    # None keeps real alpha (WebP, PNG); a colour composites onto it. JPEG cannot hold
    # alpha, so JPEG output composites onto white when no background is given.
    background: tuple[int, int, int] | None = None
    draft: bool = True  # JPEG shrink-on-load when the downscale allows

    def __post_init__(self) -> None:
        problems = []
        if self.output_format not in OUTPUT_FORMATS:
            problems.append(f"output_format must be one of {sorted(OUTPUT_FORMATS)}, got {self.output_format!r}")
        if not _is_int(self.quality) or not 0 <= self.quality <= 100:
            problems.append(f"quality must be an integer in 0..100, got {self.quality!r}")
        if not _is_int(self.webp_method) or not 0 <= self.webp_method <= 6:
            problems.append(f"webp_method must be an integer in 0..6, got {self.webp_method!r}")
        if not _is_int(self.patch_size) or self.patch_size <= 0:
            problems.append(f"patch_size must be a positive integer, got {self.patch_size!r}")
        if not _is_int(self.max_source_pixels) or self.max_source_pixels <= 0:
            problems.append(f"max_source_pixels must be a positive integer, got {self.max_source_pixels!r}")
        if not _is_int(self.min_source_side) or self.min_source_side <= 0:
            problems.append(f"min_source_side must be a positive integer, got {self.min_source_side!r}")
        if (
            isinstance(self.max_aspect_ratio, bool)
            or not isinstance(self.max_aspect_ratio, (int, float))
            or not math.isfinite(self.max_aspect_ratio)
            or self.max_aspect_ratio < 1
        ):
            problems.append(f"max_aspect_ratio must be a finite number >= 1, got {self.max_aspect_ratio!r}")
        if self.background is not None and (
            not isinstance(self.background, (tuple, list))
            or len(self.background) != 3
            or not all(_is_int(c) and 0 <= c <= 255 for c in self.background)
        ):
            problems.append(f"background must be None or three integers in 0..255, got {self.background!r}")
        if problems:
            raise ValueError("invalid PixelOptions: " + "; ".join(problems))
        if self.background is not None:
            object.__setattr__(self, "background", tuple(self.background))

    @classmethod
    def from_values(cls, values: Mapping[str, object]) -> PixelOptions:
        """The options named in `values` (command-line arguments, a dataset's settings); others default."""
        names = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in names})


def reference_options(options: PixelOptions) -> PixelOptions:
    """The same rendering as `options`, encoded losslessly (PNG): the pixels an output of `options`
    shows before its encoder's loss (what the verifier's fidelity check compares it with)."""
    background = options.background
    if background is None and options.output_format == "jpeg":
        background = JPEG_BACKGROUND
    return replace(options, output_format="png", background=background)


@dataclass
class ImageResult:
    record: AuditRecord  # every field filled as SPEC 5 says
    image: bytes | None  # encoded output, None when record.valid is False


class _RowError(Exception):
    """A per-row failure with its audit error code (and the output geometry when known)."""

    def __init__(self, code: ErrorCode, detail: str, target: Geometry | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.target = target


def process_image(
    data: bytes | None, areas: Sequence[int], options: PixelOptions, budget: MemoryBudget | None = None
) -> list[ImageResult]:
    """One decode feeds every target area; returns one result per area, same order.

    Never raises for bad input: every failure is an invalid result carrying an error code,
    a detail text and whatever is known about the source. Raises ValueError for areas that
    are not positive integers (bad configuration).

    With a `budget` (shared by the threads of one shard), the image holds its estimated decode
    memory (`decode_memory_estimate`, from the header) from decoding until its outputs are
    made, waiting while other images hold too much; an image whose estimate exceeds the whole
    budget is `too_large` without being decoded.
    """
    areas = list(areas)
    bad_areas = [area for area in areas if not _is_int(area) or area <= 0]
    if bad_areas:  # configuration, not data: refuse loudly rather than fail every row
        raise ValueError(f"target areas must be positive integers, got {bad_areas}")
    known = AuditRecord()  # filled in as the source reveals itself; copied into each result
    try:
        source = _open(data, known, options)
        plans = [_plan(area, known, options) for area in areas]
        if not any(isinstance(plan, Geometry) for plan in plans):
            return [_invalid(known, plan) for plan in plans]
        draft = _planned_draft(source, plans, options)
        try:
            with _reserved(budget, decode_memory_estimate(source.image, draft)):
                decoded = _decode(source, known, draft)
                if source.orientation_read_late:
                    plans = [_plan(area, known, options) for area in areas]
                return _render_all(decoded, plans, known, options)
        except _RowError as err:
            # Checks run in pipeline order: an output already refused keeps its own reason.
            return [_invalid(known, plan if isinstance(plan, _RowError) else err) for plan in plans]
    except _RowError as err:
        return [_invalid(known, err) for _ in areas]
    except Exception as exc:  # last line of defence: a bad row must never stop a shard
        err = _RowError(ErrorCode.DECODE_ERROR, describe_exception(exc))
        return [_invalid(known, err) for _ in areas]


def decode_memory_estimate(image: Image.Image, draft: int = 1) -> int:
    """Bytes that decoding an opened (not yet loaded) image and making its outputs may hold at
    the peak, from its header: the decoded pixels (at 1/`draft` of each side for JPEG
    shrink-on-load) times the peak bytes per pixel of its mode (`_peak_bytes_per_pixel`)."""
    width, height = (-(-side // draft) for side in image.size)
    return width * height * _peak_bytes_per_pixel(image.mode, image.has_transparency_data)


def _peak_bytes_per_pixel(mode: str, transparent: bool) -> int:
    """The decoded pixel (Pillow keeps 3 or 4 bands in 4 bytes), what `_normalise_mode` and
    premultiplying convert it to while it is still held, and one byte for the resampling passes.

    Measured growth of the process's peak RSS per decoded pixel stays below this: RGB 4.3
    (estimate 5), RGBA 8.5 (10), P 5.3 (6), I;16 10.0 (12), L 0.7 (2).
    """
    decoded = 1 if mode in ("1", "L", "P") else 2 if mode in SIXTEEN_BIT_MODES and mode != "I" else 4
    if mode in SIXTEEN_BIT_MODES:
        working = 4 + 4 + 1 + (4 if transparent else 0)  # mode I, scaled, L, and an alpha band
    elif mode in ("P", "PA", "1", "L", "RGB") and transparent:
        working = 4 + 1 + 4  # RGBA or LA, its alpha band, premultiplied
    elif mode in UNPREMULTIPLIED:
        working = 4 + 1 + 4
    elif mode in ALPHA_MODES:
        working = 1 + 4  # its alpha band, then without alpha or premultiplied
    elif mode in ("P", "RGBX", "YCbCr"):
        working = 4  # RGB
    elif mode == "1":
        working = 1  # L
    else:
        working = 0
    return decoded + working + 1


@contextmanager
def _reserved(budget: MemoryBudget | None, nbytes: int) -> Iterator[None]:
    if budget is None:
        yield
        return
    if nbytes > budget.total:
        mib = 2**20
        raise _RowError(
            ErrorCode.TOO_LARGE,
            f"decoding needs about {nbytes / mib:,.0f} MiB, more than the shard's decode memory budget of "
            f"{budget.total / mib:,.0f} MiB (set by the task's memory)",
        )
    with budget.reserve(nbytes):
        yield


def pipeline_settings() -> dict[str, object]:
    """Fixed choices of this pipeline that decide output bytes besides PixelOptions (for build settings)."""
    return {
        "resample": RESAMPLE_NAME,
        "reducing_gap": REDUCING_GAP,
        "draft_margin": DRAFT_MARGIN,
        "intermediate_min_ratio": INTERMEDIATE_MIN_RATIO,
        "png_compress_level": PNG_COMPRESS_LEVEL,
    }


def library_versions() -> dict[str, str]:
    """Versions of the imaging libraries that shape the output pixels (for build settings)."""
    return dict(_library_versions())


@lru_cache(maxsize=1)
def _library_versions() -> tuple[tuple[str, str], ...]:
    versions = {
        "pillow": PIL.__version__,
        "pillow_distribution": _pillow_distribution(),
        "libwebp": features.version("webp"),
        "libjpeg": features.version("jpg"),
        "libjpeg_turbo": features.version_feature("libjpeg_turbo"),
        "littlecms2": features.version("littlecms2"),
        "zlib": features.version("zlib"),
    }
    return tuple((name, str(value) if value else "unavailable") for name, value in versions.items())


def _pillow_distribution() -> str:
    for name in ("pillow-simd", "Pillow"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


# ----------------------------------------------------------------------------- header


@dataclass
class _Source:
    image: Image.Image
    raw_size: tuple[int, int]  # as stored, before EXIF orientation
    orientation: int | None  # None until read
    orientation_read_late: bool = False  # read only after decoding (PNG keeps EXIF after the pixels)


def _open(data: bytes | None, known: AuditRecord, options: PixelOptions) -> _Source:
    if data is None or len(data) == 0:
        raise _RowError(ErrorCode.MISSING_IMAGE, "image bytes are null" if data is None else "image bytes are empty")
    try:
        image = open_image(_decode_stream(data))
    except Image.DecompressionBombError as exc:
        raise _RowError(ErrorCode.TOO_LARGE, describe_exception(exc)) from None
    except Exception as exc:
        raise _RowError(ErrorCode.DECODE_ERROR, describe_exception(exc)) from None

    raw_w, raw_h = image.size
    known.src_format = image.format
    known.src_mode = image.mode
    known.n_frames, frames_note = _frame_count(image, data)
    known.error_detail = frames_note  # a note on a valid row; an error replaces it
    source = _Source(image, (raw_w, raw_h), None)
    if _exif_readable_before_decode(image):
        _set_orientation(source, known, read_orientation(image))
    else:
        known.src_width, known.src_height = raw_w, raw_h  # until the orientation is known

    if raw_w <= 0 or raw_h <= 0:
        raise _RowError(ErrorCode.DECODE_ERROR, f"image header gives an empty size {raw_w}x{raw_h}")
    # All three limits are invariant under EXIF rotation, so the raw size is enough.
    too_many = too_many_pixels(raw_w, raw_h, options.max_source_pixels)
    if too_many:
        raise _RowError(ErrorCode.TOO_LARGE, too_many)
    if min(raw_w, raw_h) < options.min_source_side:
        raise _RowError(
            ErrorCode.TOO_SMALL,
            f"source is {raw_w}x{raw_h}, its smaller side is below min_source_side={options.min_source_side}",
        )
    aspect = max(raw_w / raw_h, raw_h / raw_w)
    if aspect > options.max_aspect_ratio:
        limit = options.max_aspect_ratio
        raise _RowError(
            ErrorCode.ASPECT_RATIO,
            f"source is {raw_w}x{raw_h}, aspect ratio {aspect:.4g} exceeds max_aspect_ratio={limit:g}",
        )
    return source


def open_image(data: bytes) -> Image.Image:
    """Open encoded bytes lazily (the header only) in an allowed input format; raises as Image.open does.

    Nothing is decoded yet: check `too_many_pixels` on `image.size` before `load()`.
    """
    return Image.open(io.BytesIO(data), formats=input_formats())


def _decode_stream(data: bytes) -> bytes:
    """The bytes to decode: `data`, except that a single-scan sequential JPEG ends its compressed
    data with JPEG_SCAN_PADDING instead of its end-of-image marker.

    libjpeg treats a marker met inside the compressed data as the end of the data and fills
    the blocks still missing with grey, with only a warning that Pillow drops: a JPEG cut
    short with an end-of-image marker appended would decode "fine". Without the marker the
    decoder has to ask for more data, and Pillow reports the image as truncated. The padding
    (set bits, as a stuffed 0xFF 0x00) is what the decoder reads ahead past the last block of a
    complete image; it completes at most the last few blocks of a cut one.
    """
    end = jpeg_scan_end(data)
    return data if end is None else data[:end] + JPEG_SCAN_PADDING


def jpeg_scan_end(data: bytes) -> int | None:
    """Where the compressed data of a single-scan sequential Huffman JPEG ends (its end-of-image
    marker, or the end of the file when there is none); None for anything else.

    Progressive, multi-scan, arithmetic-coded and lossless JPEGs read every scan before
    returning a row, so they cannot be checked this way; nor can a JPEG whose scan is followed
    by a marker other than the end of image.
    """
    if not data.startswith(b"\xff\xd8"):
        return None
    pos, end, frame = 2, len(data), None
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        if marker in (0xD8, 0xD9):  # a new image or its end before any scan
            return None
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker in _JPEG_FRAME_MARKERS:
            frame = marker
        if marker == 0xDA:  # start of scan: its header, then the compressed data
            if frame not in _SEQUENTIAL_HUFFMAN_FRAMES:
                return None
            found = _MARKER_IN_SCAN.search(data, pos + 2 + length)
            if found is None:
                return end
            return found.start() if data[found.start() + 1] == 0xD9 else None
        pos += 2 + length
    return None


def too_many_pixels(width: int, height: int, max_source_pixels: int) -> str | None:
    """Why a `width x height` source is refused before decoding (decompression bombs), or None."""
    pixels = width * height
    if pixels > max_source_pixels:
        return f"source has {pixels} pixels ({width}x{height}), more than max_source_pixels={max_source_pixels}"
    return None


def _set_orientation(source: _Source, known: AuditRecord, orientation: int) -> None:
    source.orientation = orientation
    known.exif_orientation = orientation
    known.src_width, known.src_height = oriented_size(source.raw_size, orientation)


def _frame_count(image: Image.Image, data: bytes) -> tuple[int | None, str | None]:
    """(frames, a note when the count stopped at MAX_COUNTED_FRAMES); (None, None) when unknown.

    GIF and TIFF find their frames by walking the file, so a crafted file of a million tiny
    frames would take seconds to count: the walk stops past MAX_COUNTED_FRAMES. Other formats
    state their count in the header; a larger claim is capped the same way.
    """
    try:
        if not getattr(image, "is_animated", False):
            return 1, None
        if image.format == "GIF":
            frames = gif_frame_count(data, MAX_COUNTED_FRAMES + 1)
        elif image.format == "TIFF":
            frames = _seek_frame_count(image, MAX_COUNTED_FRAMES + 1)
        else:
            frames = int(image.n_frames)
    except Exception:  # a broken animation: its first frame may still decode
        return None, None
    if frames > MAX_COUNTED_FRAMES:
        return MAX_COUNTED_FRAMES, f"more than {MAX_COUNTED_FRAMES} frames; n_frames stops there"
    return max(frames, 1), None


def gif_frame_count(data: bytes, limit: int) -> int:
    """The image descriptors of a GIF, counted until its trailer, the end of the data or `limit`.

    What Pillow counts as frames, without Pillow's per-frame setup: block headers are read
    and image data is skipped sub-block by sub-block.
    """
    flags = data[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # header, screen, global colour table
    frames, end = 0, len(data)
    while pos < end and frames < limit:
        block = data[pos]
        if block == 0x3B:  # trailer
            break
        if block == 0x21:  # extension: label, then sub-blocks
            pos = _skip_sub_blocks(data, pos + 2)
        elif block == 0x2C:  # image descriptor, local colour table, LZW code size, sub-blocks
            frames += 1
            if pos + 10 > end:
                break
            flags = data[pos + 9]
            pos = _skip_sub_blocks(data, pos + 11 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0))
        else:  # stray byte between blocks: skipped, as Pillow does
            pos += 1
    return frames


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    """The position after the sub-blocks starting at `pos` (each a length byte and data; 0 ends them)."""
    end = len(data)
    while pos < end:
        size = data[pos]
        pos += 1 + size
        if size == 0:
            break
    return pos


def _seek_frame_count(image: Image.Image, limit: int) -> int:
    """Frames counted by seeking one frame at a time (a TIFF reads each frame's directory and decodes
    nothing), up to `limit`. One at a time: TIFF's seek past the last frame miscounts."""
    frames = 1
    try:
        while frames < limit:
            image.seek(frames)
            frames += 1
    except EOFError:
        pass
    finally:
        image.seek(0)
    return frames


def _exif_readable_before_decode(image: Image.Image) -> bool:
    # PngImageFile.getexif() decodes the whole image when no eXIf chunk came before the
    # pixel data; every other format has its EXIF parsed with the header.
    return image.format != "PNG" or "exif" in image.info


def _plan(area: int, known: AuditRecord, options: PixelOptions) -> Geometry | _RowError:
    """The geometry of one output, or why it cannot be made. Needs no pixels."""
    target = geometry(known.src_width, known.src_height, area, options.patch_size, options.square)
    limit = ENCODER_MAX_SIDE[options.output_format]
    tw, th = target.target_size
    if max(tw, th) > limit:
        return _RowError(
            ErrorCode.TOO_LARGE,
            f"output {tw}x{th} exceeds the {options.output_format} encoder limit of {limit} px per side",
            target,
        )
    return target


# ----------------------------------------------------------------------------- decode


@dataclass
class _Decoded:
    """The decoded source, ready for resampling, and what each output needs to finish it."""

    pixels: Image.Image  # raw frame; L, La, RGB, RGBa (alpha premultiplied) or CMYK
    raw_size: tuple[int, int]
    draft_scale: int  # decoded pixel coordinate = raw pixel coordinate / draft_scale
    orientation: int
    colour: _ColourConversion


def _planned_draft(source: _Source, plans: list, options: PixelOptions) -> int:
    """The JPEG shrink-on-load factor to ask for (1: none), from the largest output's scale."""
    if not (options.draft and source.image.format in DRAFT_FORMATS and source.orientation is not None):
        return 1
    return draft_factor(max(plan.scale for plan in plans if isinstance(plan, Geometry)))


def _decode(source: _Source, known: AuditRecord, draft: int) -> _Decoded:
    image = source.image
    draft_scale = _apply_draft(image, draft) if draft > 1 else 1
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise _RowError(ErrorCode.TOO_LARGE, describe_exception(exc)) from None
    except Exception as exc:
        raise _RowError(ErrorCode.DECODE_ERROR, describe_exception(exc)) from None

    if source.orientation is None:
        _set_orientation(source, known, read_orientation(image))
        source.orientation_read_late = True

    try:
        pixels = _normalise_mode(image)
        colour = _colour_conversion(image.info.get("icc_profile") or None, pixels.mode)
    except _RowError:
        raise
    except Exception as exc:
        raise _RowError(ErrorCode.UNSUPPORTED, describe_exception(exc)) from None
    if pixels.mode in PREMULTIPLIED:
        # Resample with premultiplied alpha so transparent pixels do not bleed their colour.
        # Done once here rather than by Image.resize once per output.
        pixels = pixels.convert(PREMULTIPLIED[pixels.mode])
    return _Decoded(pixels, source.raw_size, draft_scale, source.orientation, colour)


def draft_factor(largest_scale: float) -> int:
    """The JPEG DCT reduction (1, 2, 4 or 8) that still holds `largest_scale` output pixels per source pixel.

    `largest_scale` is the largest output/crop-box ratio among the outputs made from one decode.
    """
    allowed = 1 / (largest_scale * DRAFT_MARGIN)
    return next((factor for factor in DRAFT_FACTORS if factor <= allowed), 1)


def _apply_draft(image: Image.Image, factor: int) -> int:
    """Ask the JPEG decoder for shrink-on-load by `factor`; returns the reduction it applied."""
    raw_w, raw_h = image.size
    # JpegImageFile.draft takes the largest power of two <= min(raw // requested) per axis,
    # so requesting raw // factor selects exactly `factor`. It reports what it chose.
    chosen = image.draft(image.mode, (raw_w // factor, raw_h // factor))
    if chosen is None:
        return 1
    _, box = chosen
    return round(raw_w / box[2])


def _normalise_mode(image: Image.Image) -> Image.Image:
    """An 8-bit L, LA, RGB, RGBA or CMYK image; alpha only when some pixel is not opaque."""
    mode = image.mode
    if mode in SIXTEEN_BIT_MODES:
        image = _sixteen_bit_to_grey(image)
    elif mode in ("P", "PA", "1", "L", "RGB") and image.has_transparency_data:
        image = image.convert("LA" if mode in ("1", "L") else "RGBA")
    elif mode in ("P", "RGBX", "YCbCr"):
        image = image.convert("RGB")
    elif mode == "1":
        image = image.convert("L")
    elif mode in UNPREMULTIPLIED:
        image = image.convert(UNPREMULTIPLIED[mode])
    elif mode not in ("L", "LA", "RGB", "RGBA", "CMYK"):
        raise _RowError(ErrorCode.UNSUPPORTED, f"image mode {mode} is not supported")

    if image.mode in ALPHA_MODES:
        lowest_alpha, _ = image.getchannel("A").getextrema()
        if lowest_alpha == 255:  # fully opaque: the alpha channel carries nothing
            image = image.convert(ALPHA_MODES[image.mode])
    return image


def _sixteen_bit_to_grey(image: Image.Image) -> Image.Image:
    """Scale 16-bit grey to 8 bit (0..65535 -> 0..255, rounded); never clip at 255."""
    wide = image if image.mode == "I" else image.convert("I")
    # On mode I, point() applies v * scale + offset and truncates; the 0.5 rounds. The final
    # convert("L") clips only what lies outside 16 bits (mode I may hold 32-bit values).
    grey = wide.point(lambda v: v * (255 / 65535) + 0.5).convert("L")
    key = image.info.get("transparency")
    if isinstance(key, int) and not isinstance(key, bool):  # PNG tRNS: one transparent grey value
        alpha = ImageMath.lambda_eval(lambda args: args["convert"]((args["a"] != key) * 255, "L"), a=wide)
        return Image.merge("LA", (grey, alpha))
    return grey


# ----------------------------------------------------------------------------- colour


@dataclass(frozen=True)
class _ColourConversion:
    """How the resampled pixels become sRGB."""

    transform: ImageCms.ImageCmsTransform | None = None  # None: already sRGB or no profile
    note: str | None = None  # why an embedded profile could not be honoured (goes to error_detail)


_SRGB_PROFILE = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
_PROFILE_COLOUR_SPACE = {"RGB": "RGB", "RGBA": "RGB", "L": "GRAY", "LA": "GRAY", "CMYK": "CMYK"}
# The transform's input and output modes for each working mode; LA converts its L band.
_TRANSFORM_MODES = {
    "RGB": ("RGB", "RGB"),
    "RGBA": ("RGBA", "RGBA"),
    "L": ("L", "RGB"),
    "LA": ("L", "RGB"),
    "CMYK": ("CMYK", "RGB"),
}
# Shared by all threads: lcms2 keeps no per-call state in a transform (each cmsDoTransform
# copies the transform's one-pixel cache to the stack), so one transform serves them all.
_TRANSFORM_CACHE_SIZE = 64
_transform_cache: OrderedDict[tuple[bytes, str], _ColourConversion] = OrderedDict()
_transform_cache_lock = threading.Lock()


def _colour_conversion(icc_profile: bytes | None, mode: str) -> _ColourConversion:
    if not icc_profile:
        return _ColourConversion()
    key = (hashlib.sha1(icc_profile, usedforsecurity=False).digest(), mode)
    # Building under the lock is fine: profiles repeat across a dataset, builds are rare.
    with _transform_cache_lock:
        conversion = _transform_cache.get(key)
        if conversion is None:
            conversion = _build_conversion(icc_profile, mode)
            _transform_cache[key] = conversion
            if len(_transform_cache) > _TRANSFORM_CACHE_SIZE:
                _transform_cache.popitem(last=False)
        else:
            _transform_cache.move_to_end(key)
    return conversion


def _build_conversion(icc_profile: bytes, mode: str) -> _ColourConversion:
    """An sRGB transform for an embedded profile; a note instead when it cannot be honoured."""
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc_profile))
        colour_space = profile.profile.xcolor_space.strip()
    except Exception as exc:
        return _ColourConversion(note=f"embedded ICC profile ignored, unreadable: {describe_exception(exc)}")
    expected = _PROFILE_COLOUR_SPACE[mode]
    if colour_space != expected:
        return _ColourConversion(
            note=f"embedded ICC profile ignored: it describes {colour_space} but the image is {expected}"
        )
    in_mode, out_mode = _TRANSFORM_MODES[mode]
    try:
        transform = ImageCms.buildTransform(profile, _SRGB_PROFILE, in_mode, out_mode)
        if colour_space == "RGB" and _is_identity(profile):
            return _ColourConversion()  # an sRGB profile (most photos): converting changes nothing
    except Exception as exc:
        return _ColourConversion(note=f"embedded ICC profile ignored, no transform to sRGB: {describe_exception(exc)}")
    return _ColourConversion(transform=transform)


def _is_identity(profile: ImageCms.ImageCmsProfile) -> bool:
    """Whether converting from `profile` to sRGB moves no colour by more than one level.

    Measured on a 16x16x16 colour cube rather than guessed from the profile's name.
    """
    transform = ImageCms.buildTransform(profile, _SRGB_PROFILE, "RGB", "RGB")
    probe = _colour_cube()
    difference = ImageChops.difference(probe, ImageCms.applyTransform(probe, transform))
    return max(high for _, high in difference.getextrema()) <= 1


@lru_cache(maxsize=1)
def _colour_cube() -> Image.Image:
    levels = range(0, 256, 17)  # 16 levels, 0 and 255 included
    cube = bytes(channel for r in levels for g in levels for b in levels for channel in (r, g, b))
    return Image.frombytes("RGB", (64, 64), cube)


def _to_srgb(image: Image.Image, colour: _ColourConversion) -> tuple[Image.Image, str | None]:
    """The image in sRGB (L, LA, RGB or RGBA) and a note when its profile was not applied."""
    if colour.transform is not None:
        try:
            if image.mode == "LA":
                rgb = ImageCms.applyTransform(image.getchannel("L"), colour.transform)
                rgb.putalpha(image.getchannel("A"))
                return rgb, None
            return ImageCms.applyTransform(image, colour.transform), None
        except Exception as exc:
            note = f"embedded ICC profile ignored, transform failed: {describe_exception(exc)}"
            return (image.convert("RGB") if image.mode == "CMYK" else image), note
    if image.mode == "CMYK":
        image = image.convert("RGB")  # no usable profile: Pillow's plain CMYK -> RGB
    return image, colour.note


# ----------------------------------------------------------------------------- render


def _render_all(decoded: _Decoded, plans: list, known: AuditRecord, options: PixelOptions) -> list[ImageResult]:
    """One result per plan, same order; the largest outputs are made first so they can feed smaller ones."""
    results: list[ImageResult | None] = [None] * len(plans)
    intermediates: list[tuple[tuple[float, float, float, float], Image.Image]] = []
    by_scale = sorted(
        (i for i, plan in enumerate(plans) if isinstance(plan, Geometry)), key=lambda i: plans[i].scale, reverse=True
    )
    for i in by_scale:
        results[i] = _render(decoded, plans[i], known, options, intermediates)
    return [result if result is not None else _invalid(known, plan) for result, plan in zip(results, plans)]


def _render(
    decoded: _Decoded,
    target: Geometry,
    known: AuditRecord,
    options: PixelOptions,
    intermediates: list[tuple[tuple[float, float, float, float], Image.Image]],
) -> ImageResult:
    try:
        resampled = _resample(decoded, target, intermediates)
        finished, note = _finish(resampled, decoded, options)
    except Exception as exc:
        return _invalid(known, _RowError(ErrorCode.UNSUPPORTED, describe_exception(exc), target))
    try:
        encoded = encode_output(finished, options)
    except Exception as exc:
        return _invalid(known, _RowError(ErrorCode.ENCODE_ERROR, describe_exception(exc), target))
    record = _with_geometry(replace(known), target)
    record.valid = True
    record.error = None
    record.error_detail = "; ".join(n for n in (record.error_detail, note) if n) or None
    record.out_bytes = len(encoded)
    return ImageResult(record, encoded)


def _resample(
    decoded: _Decoded,
    target: Geometry,
    intermediates: list[tuple[tuple[float, float, float, float], Image.Image]],
) -> Image.Image:
    """One Lanczos resample of the crop box to the output size, in the raw (unrotated) frame.

    From an earlier, larger output when that holds the whole crop box at least
    INTERMEDIATE_MIN_RATIO times finer (cheaper, and within PSNR 40 dB of the direct
    resample); otherwise from the decoded image. Outputs that are a downscale of the
    decoded image are remembered in `intermediates` for the smaller outputs after them.
    """
    tw, th = target.target_size
    size = (th, tw) if decoded.orientation in SWAPS_AXES else (tw, th)
    raw_box = oriented_box_to_raw(target.crop_box.as_tuple(), decoded.orientation, decoded.raw_size)
    for source_box, image in intermediates:
        box = _box_inside(raw_box, source_box, image.size)
        if box is not None and min((box[2] - box[0]) / size[0], (box[3] - box[1]) / size[1]) >= INTERMEDIATE_MIN_RATIO:
            return image.resize(size, RESAMPLE, box=box)

    scale = decoded.draft_scale
    width, height = decoded.pixels.size
    # Clamp: float rounding in the geometry may put an edge a hair outside the image.
    box = (
        min(max(raw_box[0] / scale, 0.0), width),
        min(max(raw_box[1] / scale, 0.0), height),
        min(max(raw_box[2] / scale, 0.0), width),
        min(max(raw_box[3] / scale, 0.0), height),
    )
    resampled = decoded.pixels.resize(size, RESAMPLE, box=box, reducing_gap=REDUCING_GAP)
    if size[0] < box[2] - box[0] and size[1] < box[3] - box[1]:
        intermediates.append((raw_box, resampled))
    return resampled


def _box_inside(
    box: tuple[float, float, float, float], outer: tuple[float, float, float, float], outer_size: tuple[int, int]
) -> tuple[float, float, float, float] | None:
    """`box` in the pixel coordinates of an image of `outer` resampled to `outer_size`; None when not inside."""
    kx = outer_size[0] / (outer[2] - outer[0])
    ky = outer_size[1] / (outer[3] - outer[1])
    x0, x1 = (box[0] - outer[0]) * kx, (box[2] - outer[0]) * kx
    y0, y1 = (box[1] - outer[1]) * ky, (box[3] - outer[1]) * ky
    tolerance = 1e-6
    if x0 < -tolerance or y0 < -tolerance or x1 > outer_size[0] + tolerance or y1 > outer_size[1] + tolerance:
        return None
    return max(x0, 0.0), max(y0, 0.0), min(x1, outer_size[0]), min(y1, outer_size[1])


def _finish(image: Image.Image, decoded: _Decoded, options: PixelOptions) -> tuple[Image.Image, str | None]:
    """sRGB, alpha kept or composited, upright."""
    if image.mode in UNPREMULTIPLIED:
        image = image.convert(UNPREMULTIPLIED[image.mode])
    image, note = _to_srgb(image, decoded.colour)
    if image.mode in ALPHA_MODES:
        background = options.background
        if background is None and options.output_format == "jpeg":
            background = JPEG_BACKGROUND
        if background is not None:
            rgba = image if image.mode == "RGBA" else image.convert("RGBA")
            canvas = Image.new("RGB", rgba.size, background)
            canvas.paste(rgba, mask=rgba.getchannel("A"))
            image = canvas
    return to_upright(image, decoded.orientation), note


def encode_output(image: Image.Image, options: PixelOptions) -> bytes:
    """A finished (sRGB, upright) image encoded as `options` say: what an output row holds."""
    buffer = io.BytesIO()
    if options.output_format == "webp":
        image.save(buffer, "WEBP", quality=options.quality, method=options.webp_method)
    elif options.output_format == "jpeg":
        image.save(buffer, "JPEG", quality=options.quality)
    else:
        image.save(buffer, "PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


# ----------------------------------------------------------------------------- helpers


def _invalid(known: AuditRecord, err: _RowError) -> ImageResult:
    record = replace(known, valid=False, error=err.code.value, error_detail=err.detail, out_bytes=None)
    if err.target is not None:
        record = _with_geometry(record, err.target)
    return ImageResult(record, None)


def _with_geometry(record: AuditRecord, target: Geometry) -> AuditRecord:
    record.width, record.height = target.target_size
    box = target.crop_box
    record.crop_x0, record.crop_y0, record.crop_x1, record.crop_y1 = box.x0, box.y0, box.x1, box.y1
    record.scale = target.scale
    return record


def _is_int(value: object) -> bool:
    # numbers.Integral also admits numpy integers (e.g. areas read from Parquet or YAML).
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@lru_cache(maxsize=1)
def input_formats() -> tuple[str, ...]:
    """The formats untrusted image bytes may be opened as: every one Pillow knows except EXCLUDED_INPUT_FORMATS."""
    Image.init()
    return tuple(name for name in Image.OPEN if name not in EXCLUDED_INPUT_FORMATS)
