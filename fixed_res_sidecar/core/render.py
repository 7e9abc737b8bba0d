"""Rendering one output from a decoded source: resample, finish, encode (SPEC 3, 4).

`resample`: one Lanczos resample of the crop box to the output size, in the raw (unrotated)
frame, from the decoded image or, for a much smaller output, from a larger output already made.
`finish`: on the small output, colour conversion to sRGB, alpha kept or composited, and the EXIF
transpose. `encode_output`: the encoder and settings the options name.

Working in the raw frame and rotating the output is cheaper than rotating the decoded
image, and Lanczos commutes with flips and 90 degree turns, so the pixels are the same up
to rounding. Every shortcut is checked against one direct Lanczos resample of the
full-resolution upright crop box in test_render.py (PSNR >= 40 dB, SPEC 3).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from .colour import ALPHA_MODES, UNPREMULTIPLIED, ColourConversion, to_srgb
from .geometry import Geometry
from .orientation import SWAPS_AXES, oriented_box_to_raw, to_upright
from .pixel_settings import (
    INTERMEDIATE_MIN_RATIO,
    JPEG_BACKGROUND,
    PNG_COMPRESS_LEVEL,
    REDUCING_GAP,
    RESAMPLE,
    PixelOptions,
)

# Outputs already made from one decode, for the smaller ones after them: (raw-frame crop box, pixels).
Intermediates = list[tuple[tuple[float, float, float, float], Image.Image]]


@dataclass
class Decoded:
    """The decoded source, ready for resampling, and what each output needs to finish it."""

    pixels: Image.Image  # raw frame; L, La, RGB, RGBa (alpha premultiplied) or CMYK
    raw_size: tuple[int, int]
    draft_scale: int  # decoded pixel coordinate = raw pixel coordinate / draft_scale
    orientation: int
    colour: ColourConversion


def resample(decoded: Decoded, target: Geometry, intermediates: Intermediates) -> Image.Image:
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


def finish(image: Image.Image, decoded: Decoded, options: PixelOptions) -> tuple[Image.Image, str | None]:
    """sRGB, alpha kept or composited, upright."""
    if image.mode in UNPREMULTIPLIED:
        image = image.convert(UNPREMULTIPLIED[image.mode])
    image, note = to_srgb(image, decoded.colour)
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
