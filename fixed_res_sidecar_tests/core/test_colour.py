"""core/colour.py: every mode made 8-bit, transparency kept, embedded ICC profiles honoured (SPEC 4);
through the pipeline, on real images generated with Pillow."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageCms

from fixed_res_sidecar.core.geometry import AREA_512
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar_tests.fixtures.images import (
    RED,
    adobe_rgb_like_profile,
    cmyk_jpeg,
    encode,
    grey_profile,
    jpeg_bytes,
    palette_png_with_transparency,
    photo_like,
    png_bytes,
    rgba_png,
    sixteen_bit_grey_png,
    swapped_red_green_profile,
)
from fixed_res_sidecar_tests.fixtures.pixels import assert_valid_output, close, decoded, pixel, run

# ----------------------------------------------------------------------------- modes


def test_unsupported_mode_is_reported():
    data = encode(Image.new("F", (64, 64), 0.5), "TIFF")
    (result,) = run(data)
    assert (result.record.error, result.record.src_format, result.record.src_mode) == ("unsupported", "TIFF", "F")
    assert result.record.error_detail == "image mode F is not supported"
    assert (result.record.src_width, result.record.src_height) == (64, 64)


def test_cmyk_jpeg_colours_are_right():
    data = cmyk_jpeg(256, ((255, 0, 0, 0), (0, 255, 0, 0), (0, 0, 255, 0), (0, 0, 0, 255)))
    assert Image.open(io.BytesIO(data)).info.get("adobe") is not None  # the inverted Adobe kind
    (result,) = run(data)
    image = assert_valid_output(result, (256, 256), AREA_512).convert("RGB")
    assert result.record.src_mode == "CMYK"
    expected = {
        (0.25, 0.25): (0, 255, 255),
        (0.75, 0.25): (255, 0, 255),
        (0.25, 0.75): (255, 255, 0),
        (0.75, 0.75): (0, 0, 0),
    }
    for (fx, fy), colour in expected.items():
        assert close(pixel(image, fx, fy), colour, 12), ((fx, fy), pixel(image, fx, fy))


def test_sixteen_bit_grey_is_scaled_not_clipped():
    (result,) = run(sixteen_bit_grey_png(value=40000))
    assert result.record.src_mode == "I;16"
    image = assert_valid_output(result, (64, 48), AREA_512).convert("RGB")
    assert close(pixel(image, 0.5, 0.5), (156, 156, 156), 2)  # 40000 * 255 / 65535 = 155.6


def test_sixteen_bit_grey_keeps_its_range():
    values = np.linspace(0, 65535, 256, dtype=np.uint16).reshape(16, 16).repeat(8, 0).repeat(8, 1)
    data = png_bytes(Image.fromarray(values))
    (result,) = run(data, output_format="png")
    out = np.asarray(assert_valid_output(result, (128, 128), AREA_512, PixelOptions(output_format="png")))
    assert out.min() <= 2 and out.max() >= 253 and out.dtype == np.uint8


def test_sixteen_bit_grey_transparent_value_becomes_alpha():
    values = np.full((48, 64), 40000, dtype=np.uint16)
    values[:, :32] = 1000
    image = Image.fromarray(values)
    (result,) = run(png_bytes(image, transparency=1000), output_format="png")
    out = assert_valid_output(result, (64, 48), AREA_512, PixelOptions(output_format="png"))
    assert out.mode == "LA"
    assert pixel(out, 0.1, 0.5)[1] == 0
    assert pixel(out, 0.9, 0.5) == (156, 255)


def test_palette_png_transparency_is_kept():
    (result,) = run(palette_png_with_transparency())
    assert result.record.src_mode == "P"
    image = assert_valid_output(result, (96, 64), AREA_512)
    assert image.mode == "RGBA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (*RED, 255), 6)


def test_rgba_png_alpha_is_kept():
    (result,) = run(rgba_png(left_alpha=0, right_alpha=128))
    image = assert_valid_output(result, (96, 64), AREA_512)
    assert image.mode == "RGBA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (*RED, 128), 6)  # no colour bleeding from the transparent half


def test_fully_opaque_alpha_is_dropped():
    (result,) = run(rgba_png(left_alpha=255, right_alpha=255))
    assert result.record.src_mode == "RGBA"
    assert assert_valid_output(result, (96, 64), AREA_512).mode == "RGB"


def test_grey_with_alpha_keeps_alpha():
    grey = Image.new("LA", (96, 64), (200, 255))
    grey.paste((200, 0), (0, 0, 48, 64))
    (result,) = run(png_bytes(grey))
    image = assert_valid_output(result, (96, 64), AREA_512)
    assert image.mode == "RGBA" and result.record.src_mode == "LA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (200, 200, 200, 255), 4)


def test_grey_jpeg():
    (result,) = run(jpeg_bytes(Image.new("L", (320, 240), 90)))
    assert (result.record.src_mode, result.record.src_format) == ("L", "JPEG")
    image = assert_valid_output(result, (320, 240), AREA_512).convert("RGB")
    assert close(pixel(image, 0.5, 0.5), (90, 90, 90), 3)


@pytest.mark.parametrize("mode", ["1", "L", "P", "RGB", "I;16", "I;16B", "I"])
def test_odd_modes_become_eight_bit(mode):
    source = Image.linear_gradient("L").resize((128, 96))
    if mode.startswith("I"):
        values = np.asarray(source).astype(np.uint16) * 257
        byte_order = ">u2" if mode == "I;16B" else "<u2"
        source = Image.frombytes(
            "I;16B" if mode == "I;16B" else "I;16", source.size, values.astype(byte_order).tobytes()
        )
        source = source.convert("I") if mode == "I" else source
    else:
        source = source.convert(mode)
    assert source.mode == mode
    (result,) = run(encode(source, "TIFF"), output_format="png")
    image = assert_valid_output(result, (128, 96), AREA_512, PixelOptions(output_format="png"))
    assert image.mode in ("L", "RGB")
    assert np.asarray(image).max() >= 250  # the top of the gradient stays white


# ----------------------------------------------------------------------------- ICC profiles


def srgb_reference(colour, profile: bytes, mode="RGB"):
    source = Image.new(mode, (1, 1), colour)
    converted = ImageCms.profileToProfile(
        source, ImageCms.ImageCmsProfile(io.BytesIO(profile)), ImageCms.createProfile("sRGB"), outputMode="RGB"
    )
    return converted.getpixel((0, 0))


def test_swapped_primaries_profile_turns_stored_red_into_green():
    stored = Image.new("RGB", (128, 96), (255, 0, 0))
    (tagged,) = run(png_bytes(stored, icc_profile=swapped_red_green_profile()))
    (plain,) = run(png_bytes(stored))
    assert close(pixel(decoded(tagged), 0.5, 0.5), (0, 255, 0), 6)
    assert close(pixel(decoded(plain), 0.5, 0.5), (255, 0, 0), 6)
    assert tagged.record.error_detail is None


def test_srgb_profile_changes_nothing():
    photo = photo_like(160, 120, seed=14)
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    (tagged,) = run(jpeg_bytes(photo, icc_profile=srgb))
    (plain,) = run(jpeg_bytes(photo))
    assert tagged.image == plain.image and tagged.record.error_detail is None


def test_adobe_rgb_profile_is_converted_to_srgb():
    colour = (200, 80, 60)
    expected = srgb_reference(colour, adobe_rgb_like_profile())
    assert expected[0] - colour[0] > 20  # the same numbers are a more saturated red in Adobe RGB
    data = jpeg_bytes(Image.new("RGB", (128, 96), colour), quality=95, icc_profile=adobe_rgb_like_profile())
    (tagged,) = run(data, output_format="png")
    (plain,) = run(jpeg_bytes(Image.new("RGB", (128, 96), colour), quality=95), output_format="png")
    assert close(pixel(decoded(tagged), 0.5, 0.5), expected, 3)
    assert close(pixel(decoded(plain), 0.5, 0.5), colour, 3)


def test_rgba_with_profile_converts_colour_and_keeps_alpha():
    image = Image.new("RGBA", (64, 64), (255, 0, 0, 128))
    image.paste((255, 0, 0, 0), (0, 0, 32, 64))
    (result,) = run(png_bytes(image, icc_profile=swapped_red_green_profile()), output_format="png")
    out = decoded(result)
    assert out.mode == "RGBA"
    assert pixel(out, 0.1, 0.5)[3] == 0
    assert close(pixel(out, 0.9, 0.5), (0, 255, 0, 128), 6)


def test_grey_profile_is_converted_to_srgb():
    data = png_bytes(Image.new("L", (64, 64), 128), icc_profile=grey_profile(gamma=1.0))
    (result,) = run(data, output_format="png")
    # Linear 128/255 is sRGB 188.
    assert close(pixel(decoded(result).convert("RGB"), 0.5, 0.5), (188, 188, 188), 1)


def test_grey_alpha_with_grey_profile_keeps_alpha():
    grey = Image.new("LA", (64, 64), (128, 255))
    grey.paste((128, 0), (0, 0, 32, 64))
    (result,) = run(png_bytes(grey, icc_profile=grey_profile(gamma=1.0)), output_format="png")
    image = decoded(result)
    assert image.mode == "RGBA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (188, 188, 188, 255), 1)


@pytest.mark.parametrize(
    "profile, image, note",
    [
        (b"this is not an ICC profile", Image.new("RGB", (64, 64), (200, 80, 60)), "unreadable"),
        (adobe_rgb_like_profile(), Image.new("L", (64, 64), 120), "describes RGB but the image is GRAY"),
    ],
)
def test_unusable_profile_falls_back_and_says_so(profile, image, note):
    (result,) = run(png_bytes(image, icc_profile=profile), output_format="png")
    assert result.record.valid
    assert result.record.error_detail.startswith("embedded ICC profile ignored") and note in result.record.error_detail
    expected = image.convert("RGB").getpixel((0, 0))
    assert close(pixel(decoded(result).convert("RGB"), 0.5, 0.5), expected, 1)
