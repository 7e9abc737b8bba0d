"""EXIF orientation: the one reading of the tag, the upright transpose, and raw <-> oriented mapping."""

import io
import struct

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from fixed_res_sidecar.core.orientation import (
    ORIENTATION_TRANSPOSE,
    normalise_orientation,
    oriented_box_to_raw,
    oriented_point_to_raw,
    oriented_size,
    raw_box_to_oriented,
    raw_point_to_oriented,
    read_orientation,
    to_upright,
)
from fixed_res_sidecar_tests.fixtures.images import (
    broken_exif_jpeg,
    jpeg_bytes,
    marker_image,
    png_with_exif_after_pixels,
    text_orientation_jpeg,
)


def exif_jpeg(field_type: int, count: int, value: bytes) -> bytes:
    """A JPEG whose only EXIF tag is the orientation, stored with any TIFF type (big-endian)."""
    entry = struct.pack(">HHI", 0x0112, field_type, count) + value.ljust(4, b"\x00")
    tiff = b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 1) + entry + struct.pack(">I", 0)
    return jpeg_bytes(marker_image(64, 48), exif=b"Exif\x00\x00" + tiff)


def opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def stored(width: int = 6, height: int = 4) -> Image.Image:
    """A small image whose every pixel differs, so any wrong transpose shows."""
    return Image.frombytes("L", (width, height), bytes(range(width * height)))


# -- reading the tag -------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_read_orientation(orientation):
    assert read_orientation(opened(jpeg_bytes(marker_image(64, 48), orientation=orientation))) == orientation


def test_read_orientation_of_a_png_with_exif_after_the_pixels():
    image = opened(png_with_exif_after_pixels(marker_image(64, 48), 6))
    image.load()
    assert read_orientation(image) == 6


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns "Corrupt EXIF data"
@pytest.mark.parametrize(
    "data",
    [
        jpeg_bytes(marker_image(64, 48)),  # no EXIF
        jpeg_bytes(marker_image(64, 48), orientation=0),
        jpeg_bytes(marker_image(64, 48), orientation=9),
        jpeg_bytes(marker_image(64, 48), orientation=255),
        broken_exif_jpeg(marker_image(64, 48)),
        text_orientation_jpeg(marker_image(64, 48)),
        exif_jpeg(2, 2, b"6\x00"),  # ASCII "6": text, not a number (the overlay once read it as 6)
    ],
    ids=["absent", "0", "9", "255", "broken", "text ABC", "text 6"],
)
def test_unreadable_or_out_of_range_orientation_is_1(data):
    assert read_orientation(opened(data)) == 1


def test_a_long_orientation_counts():
    assert read_orientation(opened(exif_jpeg(4, 1, struct.pack(">I", 6)))) == 6


@pytest.mark.parametrize(
    "value, expected",
    [(6, 6), ((6,), 6), ([8], 8), (None, 1), (0, 1), (9, 1), ("6", 1), (6.0, 1), (True, 1), ((6, 6), 1)],
)
def test_normalise_orientation(value, expected):
    assert normalise_orientation(value) == expected


# -- turning pixels upright ---------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_to_upright_is_pillows_exif_transpose(orientation):
    data = jpeg_bytes(marker_image(60, 40), orientation=orientation)
    image = opened(data)
    image.load()
    expected = ImageOps.exif_transpose(image)
    upright = to_upright(image, read_orientation(image))
    assert upright.size == expected.size == oriented_size(image.size, orientation)
    assert upright.tobytes() == expected.tobytes()


def test_unknown_orientation_leaves_the_image_as_stored():
    image = stored()
    assert to_upright(image, 1) is image and to_upright(image, 0) is image
    assert oriented_size((6, 4), 1) == (6, 4) and oriented_size((6, 4), 6) == (4, 6)


# -- points and boxes ------------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_point_maps_follow_the_pixels(orientation):
    # The centre of each raw pixel lands on the centre of the same pixel value, upright.
    raw = stored()
    upright = to_upright(raw, orientation)
    for y in range(raw.height):
        for x in range(raw.width):
            ox, oy = raw_point_to_oriented(x + 0.5, y + 0.5, orientation, raw.size)
            assert upright.getpixel((int(ox), int(oy))) == raw.getpixel((x, y))
            assert oriented_point_to_raw(ox, oy, orientation, raw.size) == (x + 0.5, y + 0.5)


@settings(max_examples=200, deadline=None)
@given(
    raw_w=st.integers(1, 9),
    raw_h=st.integers(1, 9),
    orientation=st.integers(1, 8),
    corners=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
)
def test_boxes_map_to_the_same_pixels_in_both_frames(raw_w, raw_h, orientation, corners):
    raw = Image.frombytes("L", (raw_w, raw_h), bytes(range(raw_w * raw_h)))
    upright = to_upright(raw, orientation)
    w, h = upright.size
    xs = sorted(round(c * w) for c in corners[:2])
    ys = sorted(round(c * h) for c in corners[2:])
    assume(xs[0] < xs[1] and ys[0] < ys[1])
    box = (xs[0], ys[0], xs[1], ys[1])
    raw_box = oriented_box_to_raw(box, orientation, (raw_w, raw_h))
    assert to_upright(raw.crop(raw_box), orientation).tobytes() == upright.crop(box).tobytes()
    assert raw_box_to_oriented(raw_box, orientation, (raw_w, raw_h)) == box


def test_transposes_cover_every_orientation_but_upright():
    assert sorted(ORIENTATION_TRANSPOSE) == [2, 3, 4, 5, 6, 7, 8]
