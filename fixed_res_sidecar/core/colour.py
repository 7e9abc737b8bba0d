"""Colour: any decoded mode made an 8-bit one the pipeline works in, and resampled pixels made sRGB (SPEC 4).

`normalise_mode`: palette, 1-bit, 16-bit (scaled, never clipped) and odd modes become L, LA,
RGB, RGBA or CMYK, and a fully opaque alpha channel is dropped. `colour_conversion`: how an
embedded ICC profile is honoured (a cached lcms2 transform to sRGB, nothing for an sRGB profile,
or a note saying why it cannot be); `to_srgb` applies it to a resampled output.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

from PIL import Image, ImageChops, ImageCms, ImageMath

from .errors import describe_exception

SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I"})
ALPHA_MODES = {"RGBA": "RGB", "LA": "L"}  # mode with alpha -> the same without
PREMULTIPLIED = {"RGBA": "RGBa", "LA": "La"}
UNPREMULTIPLIED = {v: k for k, v in PREMULTIPLIED.items()}


class UnsupportedMode(ValueError):
    """A decoded image in a mode the pipeline cannot convert (the row is `unsupported`)."""


def normalise_mode(image: Image.Image) -> Image.Image:
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
        raise UnsupportedMode(f"image mode {mode} is not supported")

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


@dataclass(frozen=True)
class ColourConversion:
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
_transform_cache: OrderedDict[tuple[bytes, str], ColourConversion] = OrderedDict()
_transform_cache_lock = threading.Lock()


def colour_conversion(icc_profile: bytes | None, mode: str) -> ColourConversion:
    if not icc_profile:
        return ColourConversion()
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


def _build_conversion(icc_profile: bytes, mode: str) -> ColourConversion:
    """An sRGB transform for an embedded profile; a note instead when it cannot be honoured."""
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc_profile))
        colour_space = profile.profile.xcolor_space.strip()
    except Exception as exc:  # noqa: BLE001 - an untrusted profile: not honoured, and the row says so
        return ColourConversion(note=f"embedded ICC profile ignored, unreadable: {describe_exception(exc)}")
    expected = _PROFILE_COLOUR_SPACE[mode]
    if colour_space != expected:
        return ColourConversion(
            note=f"embedded ICC profile ignored: it describes {colour_space} but the image is {expected}"
        )
    in_mode, out_mode = _TRANSFORM_MODES[mode]
    try:
        transform = ImageCms.buildTransform(profile, _SRGB_PROFILE, in_mode, out_mode)
        if colour_space == "RGB" and _is_identity(profile):
            return ColourConversion()  # an sRGB profile (most photos): converting changes nothing
    except Exception as exc:  # noqa: BLE001 - as above
        return ColourConversion(note=f"embedded ICC profile ignored, no transform to sRGB: {describe_exception(exc)}")
    return ColourConversion(transform=transform)


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


def to_srgb(image: Image.Image, colour: ColourConversion) -> tuple[Image.Image, str | None]:
    """The image in sRGB (L, LA, RGB or RGBA) and a note when its profile was not applied."""
    if colour.transform is not None:
        try:
            if image.mode == "LA":
                rgb = ImageCms.applyTransform(image.getchannel("L"), colour.transform)
                rgb.putalpha(image.getchannel("A"))
                return rgb, None
            return ImageCms.applyTransform(image, colour.transform), None
        except Exception as exc:  # noqa: BLE001 - as in _build_conversion
            note = f"embedded ICC profile ignored, transform failed: {describe_exception(exc)}"
            return (image.convert("RGB") if image.mode == "CMYK" else image), note
    if image.mode == "CMYK":
        image = image.convert("RGB")  # no usable profile: Pillow's plain CMYK -> RGB
    return image, colour.note
