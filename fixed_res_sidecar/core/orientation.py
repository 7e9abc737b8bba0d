"""EXIF orientation: reading the tag, turning pixels upright, and moving points and boxes (SPEC 4, 6).

The one implementation used by the pixel pipeline (core/pixels.py, core/render.py), the caption boxes
(core/bbox.py) and the overlay pictures (core/overlay.py), so a picture can never show an
image or a box turned differently from the resize.

Frames: the *raw* frame is the pixels as stored; the *oriented* frame is the image as
displayed, after the transpose EXIF orientation asks for (what Pillow's
`ImageOps.exif_transpose` does). Orientations 5..8 swap the axes: a raw `W x H` image
is displayed `H x W`. Points and boxes are in continuous pixel coordinates of a frame of
the given size (a box's right and bottom edges are exclusive), so a normalised 0..1000
grid is simply a frame of size (1000, 1000).
"""

from __future__ import annotations

from PIL import Image

EXIF_ORIENTATION_TAG = 0x0112
ORIENTATIONS = range(1, 9)
UPRIGHT = 1

# Transpose that turns the raw frame upright, per EXIF orientation (as ImageOps.exif_transpose).
ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
SWAPS_AXES = frozenset({5, 6, 7, 8})

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1)


def normalise_orientation(value: object) -> int:
    """An EXIF orientation tag value as 1..8; 1 when absent, out of range or not an integer.

    A one-element tuple (how some writers store a SHORT) counts as its element. Text, floats
    and bools are not orientations.
    """
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value not in ORIENTATIONS:
        return UPRIGHT
    return value


def read_orientation(image: Image.Image) -> int:
    """The EXIF orientation of an opened image, 1..8; 1 when absent, out of range or unreadable.

    Broken EXIF never raises here: a row that decodes must not fail over its metadata. For a
    PNG whose eXIf chunk follows the pixel data, Pillow decodes the image to find it.
    """
    try:
        value = image.getexif().get(EXIF_ORIENTATION_TAG)
    except Exception:  # noqa: BLE001 - broken EXIF never fails a row that decodes
        return UPRIGHT
    return normalise_orientation(value)


def to_upright(image: Image.Image, orientation: int) -> Image.Image:
    """The image turned from the raw frame into the oriented (displayed) frame."""
    transpose = ORIENTATION_TRANSPOSE.get(orientation)
    return image.transpose(transpose) if transpose is not None else image


def oriented_size(raw_size: tuple[int, int], orientation: int) -> tuple[int, int]:
    """The displayed size of an image stored as `raw_size`."""
    width, height = raw_size
    return (height, width) if orientation in SWAPS_AXES else (width, height)


def raw_point_to_oriented(x: float, y: float, orientation: int, raw_size: tuple[float, float]) -> tuple[float, float]:
    """A point of the raw frame (`raw_size` = W, H) in the oriented frame."""
    w, h = raw_size
    if orientation == 2:  # mirrored left-right
        return w - x, y
    if orientation == 3:  # rotated 180
        return w - x, h - y
    if orientation == 4:  # mirrored top-bottom
        return x, h - y
    if orientation == 5:  # mirrored over the main diagonal
        return y, x
    if orientation == 6:  # stored turned 90 counter-clockwise; displayed by turning 90 clockwise
        return h - y, x
    if orientation == 7:  # mirrored over the anti-diagonal
        return h - y, w - x
    if orientation == 8:  # stored turned 90 clockwise; displayed by turning 90 counter-clockwise
        return y, w - x
    return x, y  # 1, and anything unreadable, is upright


def oriented_point_to_raw(x: float, y: float, orientation: int, raw_size: tuple[float, float]) -> tuple[float, float]:
    """A point of the oriented frame in the raw frame (`raw_size` = W, H); inverse of `raw_point_to_oriented`."""
    w, h = raw_size
    if orientation == 2:
        return w - x, y
    if orientation == 3:
        return w - x, h - y
    if orientation == 4:
        return x, h - y
    if orientation == 5:
        return y, x
    if orientation == 6:
        return y, h - x
    if orientation == 7:
        return w - y, h - x
    if orientation == 8:
        return w - y, x
    return x, y


def raw_box_to_oriented(box: Box, orientation: int, raw_size: tuple[float, float]) -> Box:
    """A box (x0, y0, x1, y1) of the raw frame in the oriented frame."""
    xa, ya = raw_point_to_oriented(box[0], box[1], orientation, raw_size)
    xb, yb = raw_point_to_oriented(box[2], box[3], orientation, raw_size)
    return min(xa, xb), min(ya, yb), max(xa, xb), max(ya, yb)


def oriented_box_to_raw(box: Box, orientation: int, raw_size: tuple[float, float]) -> Box:
    """A box (x0, y0, x1, y1) of the oriented frame in the raw frame.

    Cropping the raw image with the returned box and then turning it upright gives the
    upright image cropped with `box`.
    """
    xa, ya = oriented_point_to_raw(box[0], box[1], orientation, raw_size)
    xb, yb = oriented_point_to_raw(box[2], box[3], orientation, raw_size)
    return min(xa, xb), min(ya, yb), max(xa, xb), max(ya, yb)
