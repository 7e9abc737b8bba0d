"""Overlay pictures: three panels, upright original, boxes where the captions put them."""

import io
import json
import struct

import pytest
from PIL import EpsImagePlugin, Image

from fixed_res_sidecar.core.bbox import DEFAULT_BBOX_KEYS
from fixed_res_sidecar.core.overlay import (
    BOX_COLOURS,
    BOX_STROKE,
    MAX_DRAWN_BOXES,
    PANEL_WIDTH,
    PLACEHOLDER,
    TITLE_HEIGHT,
    OverlayRow,
    box_pixels,
    embeddable,
    iter_box_slots,
    overlay_picture,
    panel_boxes,
    panel_origins,
    panel_size,
    picture_size,
)
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.pixels import process_image
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


def left_edge_pixel(box, origin: tuple[int, int], size) -> tuple[int, int]:
    """A pixel inside the coloured stroke of the box's left edge, below its label, in the panel at `origin`."""
    x0, y0, _, y1 = box_pixels(box, size)
    return origin[0] + x0 + BOX_STROKE // 2, origin[1] + (y0 + y1) // 2 + 10


def test_three_stacked_panels_readable_width_and_box_drawn_in_its_colour_in_each():
    box = (250, 250, 750, 500)  # ymin, xmin, ymax, xmax on the 0..1000 grid
    png = overlay_picture(
        OverlayRow(
            encoded((768, 384)), caption(box), encoded((512, 256)), caption(box), encoded((1024, 512)), caption(box)
        )
    )
    picture = decode(png)
    size = (PANEL_WIDTH, PANEL_WIDTH // 2)  # all three are 2:1, shown PANEL_WIDTH wide
    assert panel_size(768, 384) == size and PANEL_WIDTH >= 600
    assert picture.size == picture_size([size] * 3)
    origins = panel_origins([size] * 3)
    assert [top for _, top in origins] == sorted({top for _, top in origins})  # stacked, top to bottom
    for origin in origins:
        assert picture.getpixel(left_edge_pixel(box, origin, size)) == BOX_COLOURS[0]
        # Inside the box, away from the stroke and label, the image shows through.
        x0, _y0, x1, y1 = box_pixels(box, size)
        assert picture.getpixel((origin[0] + (x0 + x1) // 2, origin[1] + y1 - 10)) == GREY
    # Between panels: the title strip of the next one.
    assert picture.getpixel((PANEL_WIDTH // 2, origins[1][1] - TITLE_HEIGHT // 2)) != GREY


def test_same_box_index_same_colour_across_panels_even_when_a_crop_box_is_gone():
    first, second = (100, 100, 300, 300), (500, 500, 900, 900)
    crop = json.dumps({"objects": [{"label": "thing 0", "bbox": None}, {"label": "thing 1", "bbox": list(second)}]})
    picture = decode(
        overlay_picture(
            OverlayRow(
                encoded((400, 400)), caption(first, second), encoded((400, 400)), crop, encoded((400, 400)), crop
            )
        )
    )
    size = (PANEL_WIDTH, PANEL_WIDTH)
    origins = panel_origins([size] * 3)
    assert picture.getpixel(left_edge_pixel(first, origins[0], size)) == BOX_COLOURS[0]
    for origin in origins:
        assert picture.getpixel(left_edge_pixel(second, origin, size)) == BOX_COLOURS[1]
    # Box 0 has no area left in the crops: nothing is drawn where it was.
    assert picture.getpixel(left_edge_pixel(first, origins[1], size)) == GREY


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
    picture = decode(overlay_picture(OverlayRow(out.getvalue(), caption(box))))
    size = panel_size(800, 400)  # upright; the stored 400x800 would be shown twice as tall
    placeholder = (PANEL_WIDTH, PANEL_WIDTH // 2)
    assert picture.size == picture_size([size, placeholder, placeholder])
    origin = panel_origins([size])[0]
    assert picture.getpixel(left_edge_pixel(box, origin, size)) == BOX_COLOURS[0]
    x0, _y0, x1, y1 = box_pixels(box, size)
    r, g, b = picture.getpixel(((x0 + x1) // 2, origin[1] + y1 - 12))
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
    picture = decode(overlay_picture(OverlayRow(out.getvalue(), caption(raw_box)), caption_frame="raw"))
    size = panel_size(800, 400)
    assert picture.getpixel(left_edge_pixel(displayed_box, panel_origins([size])[0], size)) == BOX_COLOURS[0]


def placeholder_panels(picture: Image.Image, sizes) -> list[bool]:
    """Per panel: whether it is the grey placeholder of an image that was not decoded."""
    return [
        picture.getpixel((x + w // 2, y + h // 2)) == PLACEHOLDER for (x, y), (w, h) in zip(panel_origins(sizes), sizes)
    ]


def test_missing_and_broken_images_become_placeholder_panels():
    picture = decode(overlay_picture(OverlayRow(None, None, b"not an image", "{not json", encoded((512, 512)))))
    sizes = [(PANEL_WIDTH, PANEL_WIDTH // 2)] * 2 + [(PANEL_WIDTH, PANEL_WIDTH)]
    assert picture.size == picture_size(sizes)
    assert placeholder_panels(picture, sizes) == [True, True, False]


@pytest.mark.parametrize("width", [300, 800])
def test_panel_width_is_configurable_and_tall_images_stay_bounded(width):
    picture = decode(
        overlay_picture(
            OverlayRow(encoded((300, 150)), None, encoded((100, 200)), None, encoded((400, 4000))), panel_width=width
        )
    )
    sizes = [panel_size(300, 150, width), panel_size(100, 200, width), panel_size(400, 4000, width)]
    assert sizes[0] == (width, width // 2) and sizes[1] == (min(width, 480), min(2 * width, 960))
    assert sizes[2][1] == 960  # a 1:10 image is shown narrower rather than 10 panels tall
    assert picture.size == picture_size(sizes)


def test_embeddable_pictures_are_webp_at_panel_width():
    picture = overlay_picture(OverlayRow(encoded((1600, 800))), panel_width=1200)
    small = Image.open(io.BytesIO(embeddable(picture)))
    assert small.format == "WEBP" and small.width == PANEL_WIDTH


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
        overlay_picture(OverlayRow(encoded((400, 400)), original, encoded((400, 400)), crop, encoded((400, 400)), crop))
    )
    size = (PANEL_WIDTH, PANEL_WIDTH)
    for origin in panel_origins([size] * 3):
        assert picture.getpixel(left_edge_pixel(cat, origin, size)) == BOX_COLOURS[2]


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
    picture = decode(overlay_picture(OverlayRow(data, caption(box)), caption_frame="raw"))
    size = panel_size(800, 400)  # as stored, not turned
    assert picture.size == picture_size([size, (PANEL_WIDTH, PANEL_WIDTH // 2), (PANEL_WIDTH, PANEL_WIDTH // 2)])
    assert picture.getpixel(left_edge_pixel(box, panel_origins([size])[0], size)) == BOX_COLOURS[0]  # not moved


def eps(size=(64, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, GREY).save(out, "EPS")
    return out.getvalue()


def test_refused_formats_are_never_decoded(monkeypatch):
    def no_ghostscript(self, *args, **kwargs):
        raise AssertionError("an EPS image was handed to Ghostscript")

    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "load", no_ghostscript)
    picture = decode(overlay_picture(OverlayRow(eps(), None, eps(), None, eps())))
    sizes = [(PANEL_WIDTH, PANEL_WIDTH // 2)] * 3
    assert placeholder_panels(picture, sizes) == [True, True, True]


def test_headers_over_the_pixel_limit_are_not_decoded():
    bomb = png_header_only(40000, 40000)  # a few bytes claiming 1.6 gigapixels: decoding would take GBs
    picture = decode(overlay_picture(OverlayRow(bomb, None, bomb, None, bomb)))
    sizes = [(PANEL_WIDTH, PANEL_WIDTH // 2)] * 3
    assert placeholder_panels(picture, sizes) == [True, True, True]

    # The limit is configurable: a 300x150 original is refused under 45,000 pixels.
    small = encoded((300, 150))
    shown = decode(overlay_picture(OverlayRow(small), max_source_pixels=45_000))
    assert placeholder_panels(shown, sizes) == [False, True, True]
    refused = decode(overlay_picture(OverlayRow(small), max_source_pixels=44_999))
    assert placeholder_panels(refused, sizes) == [True, True, True]


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
        picture = decode(overlay_picture(OverlayRow(encoded(size), caption(*boxes_in_caption))))
        stroke = picture.getpixel(left_edge_pixel(big, panel_origins([panel_size(*size)])[0], panel_size(*size)))
        drawn = stroke == BOX_COLOURS[last_drawn % len(BOX_COLOURS)]
        assert drawn is (last_drawn < MAX_DRAWN_BOXES)
