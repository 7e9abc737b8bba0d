"""Overlay pictures: three panels, upright original, boxes where the captions put them."""

import io
import json
import struct
import time

import pytest
from PIL import EpsImagePlugin, Image

from fixed_res_sidecar.core.bbox import DEFAULT_BBOX_KEYS
from fixed_res_sidecar.core.overlay import (
    BOX_COLOURS,
    BOX_STROKE,
    MAX_DRAWN_BOXES,
    PANEL_GAP,
    PANEL_HEIGHT,
    TITLE_HEIGHT,
    box_pixels,
    iter_box_slots,
    overlay_picture,
    overlay_width,
    panel_boxes,
)
from fixed_res_sidecar.core.pixels import PixelOptions, process_image
from fixed_res_sidecar_tests.fixtures.images import png_header_only

GREY = (128, 128, 128)


def encoded(size, colour=GREY, fmt="PNG", exif_orientation=None, patch=None) -> bytes:
    """An image of `size`; `patch` = (box, colour) paints a rectangle (pixel coordinates)."""
    image = Image.new("RGB", size, colour)
    if patch:
        image.paste(patch[1], patch[0])
    out = io.BytesIO()
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        image.save(out, fmt, exif=exif.tobytes())
    else:
        image.save(out, fmt)
    return out.getvalue()


def caption(*boxes) -> str:
    return json.dumps({"objects": [{"label": f"thing {i}", "bbox": list(b)} for i, b in enumerate(boxes)]})


def decode(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    return image.convert("RGB")


def left_edge_pixel(box, panel_left: int, panel_size) -> tuple[int, int]:
    """A pixel inside the coloured stroke of the box's left edge, below its label."""
    x0, y0, _, y1 = box_pixels(box, panel_size)
    return panel_left + x0 + BOX_STROKE // 2, TITLE_HEIGHT + (y0 + y1) // 2 + 10


def test_three_panels_same_height_and_box_drawn_in_its_colour_in_each():
    box = (250, 250, 750, 500)  # ymin, xmin, ymax, xmax on the 0..1000 grid
    png = overlay_picture(
        encoded((768, 384)),
        caption(box),
        encoded((512, 256)),
        caption(box),
        encoded((1024, 512)),
        caption(box),
    )
    picture = decode(png)
    panel = (768, 384)  # all three are 2:1 and scaled to the panel height
    assert picture.size == (overlay_width([768, 768, 768]), TITLE_HEIGHT + PANEL_HEIGHT)
    assert picture.width == 3 * 768 + 2 * PANEL_GAP
    for panel_left in (0, 768 + PANEL_GAP, 2 * (768 + PANEL_GAP)):
        assert picture.getpixel(left_edge_pixel(box, panel_left, panel)) == BOX_COLOURS[0]
        # Inside the box, away from the stroke and label, the image shows through.
        x0, _y0, x1, y1 = box_pixels(box, panel)
        assert picture.getpixel((panel_left + (x0 + x1) // 2, TITLE_HEIGHT + y1 - 10)) == GREY
    # Between panels: the background strip.
    assert picture.getpixel((768 + PANEL_GAP // 2, TITLE_HEIGHT + 10)) != GREY


def test_same_box_index_same_colour_across_panels_even_when_a_crop_box_is_gone():
    first, second = (100, 100, 300, 300), (500, 500, 900, 900)
    crop = json.dumps({"objects": [{"label": "thing 0", "bbox": None}, {"label": "thing 1", "bbox": list(second)}]})
    picture = decode(
        overlay_picture(
            encoded((400, 400)), caption(first, second), encoded((400, 400)), crop, encoded((400, 400)), crop
        )
    )
    panel = (PANEL_HEIGHT, PANEL_HEIGHT)
    step = PANEL_HEIGHT + PANEL_GAP
    assert picture.getpixel(left_edge_pixel(first, 0, panel)) == BOX_COLOURS[0]
    for panel_left in (0, step, 2 * step):
        assert picture.getpixel(left_edge_pixel(second, panel_left, panel)) == BOX_COLOURS[1]
    # Box 0 has no area left in the crops: nothing is drawn where it was.
    assert picture.getpixel(left_edge_pixel(first, step, panel)) == GREY


def test_original_is_shown_upright_with_its_boxes_on_the_object():
    # Displayed frame 800x400 with a red patch at the top-left; stored rotated (EXIF 6 = rotate 90 CW to display).
    displayed = Image.new("RGB", (800, 400), GREY)
    displayed.paste((220, 30, 30), (80, 40, 240, 160))
    stored = displayed.transpose(Image.Transpose.ROTATE_90)  # what a camera writes for orientation 6
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(out, "PNG", exif=exif.tobytes())
    box = (100, 100, 400, 300)  # the red patch, in the displayed (oriented) frame
    picture = decode(overlay_picture(out.getvalue(), caption(box), None, None, None, None))
    panel = (768, 384)  # 800x400 upright at the panel height; stored 400x800 would be 192 wide
    assert picture.width == overlay_width([768, PANEL_HEIGHT, PANEL_HEIGHT])
    assert picture.getpixel(left_edge_pixel(box, 0, panel)) == BOX_COLOURS[0]
    x0, _y0, x1, y1 = box_pixels(box, panel)
    r, g, b = picture.getpixel(((x0 + x1) // 2, TITLE_HEIGHT + y1 - 12))
    assert r > 180 and g < 80 and b < 80  # the patch is inside the box


def test_raw_frame_captions_are_moved_through_the_exif_orientation():
    stored = Image.new("RGB", (400, 800), GREY)
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(out, "PNG", exif=exif.tobytes())
    raw_box = (100, 700, 400, 900)  # ymin, xmin, ymax, xmax on the stored pixels
    # Orientation 6: displayed x = 1000 - raw y (600..900), displayed y = raw x (700..900).
    displayed_box = (700, 600, 900, 900)
    picture = decode(overlay_picture(out.getvalue(), caption(raw_box), None, None, None, None, caption_frame="raw"))
    assert picture.getpixel(left_edge_pixel(displayed_box, 0, (768, 384))) == BOX_COLOURS[0]


def test_missing_and_broken_images_become_placeholder_panels():
    picture = decode(overlay_picture(None, None, b"not an image", "{not json", encoded((512, 512)), None))
    assert picture.size == (3 * PANEL_HEIGHT + 2 * PANEL_GAP, TITLE_HEIGHT + PANEL_HEIGHT)


@pytest.mark.parametrize("panel_height", [128, 256])
def test_panel_height_is_configurable(panel_height):
    picture = decode(
        overlay_picture(
            encoded((300, 150)), None, encoded((200, 100)), None, encoded((400, 200)), None, panel_height=panel_height
        )
    )
    assert picture.size == (3 * 2 * panel_height + 2 * PANEL_GAP, TITLE_HEIGHT + panel_height)


def test_box_slots_follow_the_caption_walk():
    parsed = {
        "objects": [{"label": "cat", "bbox": [1, 2, 3, 4]}, {"name": "dog", "box_2d": None}],
        "groups": {"pets": {"bbox_2d": [[5, 6, 7, 8], None, "junk"]}, "empty": {"bbox": []}},
        "note": {"bbox_like": [1, 2, 3, 4]},
    }
    slots = [(s.index, s.path, s.value, s.label) for s in iter_box_slots(parsed)]
    assert slots == [
        (0, "objects[0].bbox", [1, 2, 3, 4], "cat"),
        (1, "objects[1].box_2d", None, "dog"),
        (2, "groups.pets.bbox_2d[0]", [5, 6, 7, 8], "pets[0]"),
        (3, "groups.pets.bbox_2d[1]", None, "pets[1]"),
        (4, "groups.pets.bbox_2d[2]", "junk", "pets[2]"),
    ]


def test_crop_list_whose_boxes_all_fell_outside_keeps_the_colours_aligned():
    # The original's box_2d list had two boxes; both fell outside the crop, so the crop holds
    # [null, null]. The cat is slot 2 in every panel and drawn in colour 2 everywhere.
    cat = (250, 250, 750, 500)
    original = json.dumps({"group": {"box_2d": [[0, 0, 100, 100], [0, 900, 100, 1000]]}, "cat": {"bbox": list(cat)}})
    crop = json.dumps({"group": {"box_2d": [None, None]}, "cat": {"bbox": list(cat)}})
    assert [s.index for s in iter_box_slots(json.loads(crop), crop_frame=True)] == [0, 1, 2]
    picture = decode(
        overlay_picture(encoded((400, 400)), original, encoded((400, 400)), crop, encoded((400, 400)), crop)
    )
    panel = (PANEL_HEIGHT, PANEL_HEIGHT)
    for panel_left in (0, PANEL_HEIGHT + PANEL_GAP, 2 * (PANEL_HEIGHT + PANEL_GAP)):
        assert picture.getpixel(left_edge_pixel(cat, panel_left, panel)) == BOX_COLOURS[2]


def exif_text_orientation(image: Image.Image, text: bytes) -> bytes:
    """A PNG whose orientation tag holds ASCII text (e.g. b"6") instead of a number."""
    entry = struct.pack(">HHI", 0x0112, 2, len(text) + 1) + (text + b"\x00").ljust(4, b"\x00")
    exif = b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 1) + entry + struct.pack(">I", 0)
    out = io.BytesIO()
    image.save(out, "PNG", exif=exif)
    return out.getvalue()


def test_orientation_is_read_exactly_as_the_resize_reads_it():
    # The tag holds the text "6": the resize ignores it (orientation 1), so the overlay must
    # show the image as stored, 800x400, not turned to 400x800.
    data = exif_text_orientation(Image.new("RGB", (800, 400), GREY), b"6")
    (result,) = process_image(data, [262144], PixelOptions())
    assert result.record.exif_orientation == 1 and (result.record.src_width, result.record.src_height) == (800, 400)
    box = (100, 100, 400, 300)  # made on the raw pixels, which are also the displayed ones here
    picture = decode(overlay_picture(data, caption(box), None, None, None, None, caption_frame="raw"))
    assert picture.width == overlay_width([768, PANEL_HEIGHT, PANEL_HEIGHT])
    assert picture.getpixel(left_edge_pixel(box, 0, (768, 384))) == BOX_COLOURS[0]  # not moved through "6"


def eps(size=(64, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, GREY).save(out, "EPS")
    return out.getvalue()


def test_refused_formats_are_never_decoded(monkeypatch):
    def no_ghostscript(self, *args, **kwargs):
        raise AssertionError("an EPS image was handed to Ghostscript")

    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "load", no_ghostscript)
    picture = decode(overlay_picture(eps(), None, eps(), None, eps(), None))
    # Every panel is a grey square placeholder (a 64x32 image would be 768 wide).
    assert picture.size == (overlay_width([PANEL_HEIGHT] * 3), TITLE_HEIGHT + PANEL_HEIGHT)


def test_headers_over_the_pixel_limit_are_not_decoded():
    bomb = png_header_only(40000, 40000)  # a few bytes claiming 1.6 gigapixels
    started = time.perf_counter()
    picture = decode(overlay_picture(bomb, None, bomb, None, bomb, None))
    assert time.perf_counter() - started < 1.0
    assert picture.size == (overlay_width([PANEL_HEIGHT] * 3), TITLE_HEIGHT + PANEL_HEIGHT)

    # The limit is configurable: a 300x150 original is refused under 45,000 pixels.
    small = encoded((300, 150))
    assert decode(
        overlay_picture(small, None, None, None, None, None, max_source_pixels=45_000)
    ).width == overlay_width([768, PANEL_HEIGHT, PANEL_HEIGHT])
    assert decode(
        overlay_picture(small, None, None, None, None, None, max_source_pixels=44_999)
    ).width == overlay_width([PANEL_HEIGHT] * 3)


def test_a_panel_draws_the_boxes_of_the_first_slots_only_and_its_title_says_so():
    """A caption of a million boxes took over 300 s and 2.3 GB for one picture; now the first
    MAX_DRAWN_BOXES slots are drawn and the rest only counted."""
    corner, big = (0, 0, 20, 20), (300, 300, 900, 900)
    many = [corner] * MAX_DRAWN_BOXES + [big] * 50
    boxes, words = panel_boxes(caption(*many), DEFAULT_BBOX_KEYS)
    assert [slot.index for slot, _ in boxes] == list(range(MAX_DRAWN_BOXES))
    assert words == f"{MAX_DRAWN_BOXES} boxes drawn from the first {MAX_DRAWN_BOXES} of {len(many)} box slots"
    assert panel_boxes(caption(corner, big), DEFAULT_BBOX_KEYS)[1] == "2 boxes"
    assert panel_boxes("{oops", DEFAULT_BBOX_KEYS, crop_frame=True) == ([], "crop caption invalid JSON")

    size = (400, 400)
    for last_drawn in (MAX_DRAWN_BOXES - 1, MAX_DRAWN_BOXES):
        boxes_in_caption = [corner] * last_drawn + [big]
        picture = decode(overlay_picture(encoded(size), caption(*boxes_in_caption), None, None, None, None))
        stroke = picture.getpixel(left_edge_pixel(big, 0, (PANEL_HEIGHT, PANEL_HEIGHT)))
        drawn = stroke == BOX_COLOURS[last_drawn % len(BOX_COLOURS)]
        assert drawn is (last_drawn < MAX_DRAWN_BOXES)
