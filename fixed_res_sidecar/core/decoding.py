"""Untrusted image bytes opened, and what their header tells before any pixel is decoded.

Opening (`open_image`): lazily, the header only, in an allowed format (never EPS, which Pillow
hands to Ghostscript); whatever else decodes untrusted images (the overlay pictures, the
verifier) opens them here too. From the header: the pixel limit against decompression bombs
(`too_many_pixels`), the frame count (capped at MAX_COUNTED_FRAMES: GIF and TIFF walk the file to
count), whether EXIF can be read before decoding, and the decode memory estimate
(`decode_memory_estimate`). Before decoding: the truncated-JPEG check (`decode_stream`,
`jpeg_scan_end`) and the JPEG shrink-on-load factor (`draft_factor`, `apply_draft`).
"""

from __future__ import annotations

import io
import re
from functools import lru_cache

from PIL import Image

from .colour import ALPHA_MODES, SIXTEEN_BIT_MODES, UNPREMULTIPLIED
from .pixel_settings import DRAFT_MARGIN

# Pillow's own decompression-bomb guard is switched off on purpose: the configured
# `PixelOptions.max_source_pixels` is enforced from the header before decoding instead,
# and reported per row as `too_large` rather than as a warning or an exception.
Image.MAX_IMAGE_PIXELS = None

# Every format Pillow can open, except EPS: opening EPS hands untrusted bytes to Ghostscript.
# Whatever else decodes untrusted images (the overlay pictures) opens them with `open_image` too.
EXCLUDED_INPUT_FORMATS = frozenset({"EPS"})
# Formats that draft (shrink-on-load) applies to, and the reductions it may ask for.
DRAFT_FORMATS = frozenset({"JPEG", "MPO"})
DRAFT_FACTORS = (8, 4, 2)

# Frames are counted up to here (GIF and TIFF walk the file to count them); a larger count is
# recorded as this, with a note in error_detail.
MAX_COUNTED_FRAMES = 1000

# JPEG: what a single-scan sequential image's compressed data is decoded with instead of its
# end-of-image marker (see `decode_stream`). 16 bytes of set bits cover the decoder's 57-bit
# read-ahead; a cut that loses more than about 3 blocks (34 bits each, read as bad codes)
# runs out of data and is reported as truncated.
JPEG_SCAN_PADDING = b"\xff\x00" * 16
_JPEG_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0..SOF15, not DHT/JPG/DAC
_SEQUENTIAL_HUFFMAN_FRAMES = frozenset({0xC0, 0xC1})  # baseline and extended sequential
# A marker that ends compressed data: 0xFF followed by anything but a stuffed 0, a restart
# marker or another 0xFF (fill).
_MARKER_IN_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def open_image(data: bytes) -> Image.Image:
    """Open encoded bytes lazily (the header only) in an allowed input format; raises as Image.open does.

    Nothing is decoded yet: check `too_many_pixels` on `image.size` before `load()`.
    """
    return Image.open(io.BytesIO(data), formats=input_formats())


@lru_cache(maxsize=1)
def input_formats() -> tuple[str, ...]:
    """The formats untrusted image bytes may be opened as: every one Pillow knows except EXCLUDED_INPUT_FORMATS."""
    Image.init()
    return tuple(name for name in Image.OPEN if name not in EXCLUDED_INPUT_FORMATS)


def too_many_pixels(width: int, height: int, max_source_pixels: int) -> str | None:
    """Why a `width x height` source is refused before decoding (decompression bombs), or None."""
    pixels = width * height
    if pixels > max_source_pixels:
        return f"source has {pixels} pixels ({width}x{height}), more than max_source_pixels={max_source_pixels}"
    return None


def decode_stream(data: bytes) -> bytes:
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


def frame_count(image: Image.Image, data: bytes) -> tuple[int | None, str | None]:
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
    except Exception:  # noqa: BLE001 - a broken animation: its first frame may still decode
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


def exif_readable_before_decode(image: Image.Image) -> bool:
    # PngImageFile.getexif() decodes the whole image when no eXIf chunk came before the
    # pixel data; every other format has its EXIF parsed with the header.
    return image.format != "PNG" or "exif" in image.info


def decode_memory_estimate(image: Image.Image, draft: int = 1) -> int:
    """Bytes that decoding an opened (not yet loaded) image and making its outputs may hold at
    the peak, from its header: the decoded pixels (at 1/`draft` of each side for JPEG
    shrink-on-load) times the peak bytes per pixel of its mode (`_peak_bytes_per_pixel`)."""
    width, height = (-(-side // draft) for side in image.size)
    return width * height * _peak_bytes_per_pixel(image.mode, image.has_transparency_data)


def _peak_bytes_per_pixel(mode: str, transparent: bool) -> int:
    """The decoded pixel (Pillow keeps 3 or 4 bands in 4 bytes), what `colour.normalise_mode` and
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


def draft_factor(largest_scale: float) -> int:
    """The JPEG DCT reduction (1, 2, 4 or 8) that still holds `largest_scale` output pixels per source pixel.

    `largest_scale` is the largest output/crop-box ratio among the outputs made from one decode.
    """
    allowed = 1 / (largest_scale * DRAFT_MARGIN)
    return next((factor for factor in DRAFT_FACTORS if factor <= allowed), 1)


def apply_draft(image: Image.Image, factor: int) -> int:
    """Ask the JPEG decoder for shrink-on-load by `factor`; returns the reduction it applied."""
    raw_w, raw_h = image.size
    # JpegImageFile.draft takes the largest power of two <= min(raw // requested) per axis,
    # so requesting raw // factor selects exactly `factor`. It reports what it chose.
    chosen = image.draft(image.mode, (raw_w // factor, raw_h // factor))
    if chosen is None:
        return 1
    _, box = chosen
    return round(raw_w / box[2])
