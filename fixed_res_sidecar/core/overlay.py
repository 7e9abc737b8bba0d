"""Overlay pictures of the crop-bbox sidecar (SPEC 7): pure, encoded bytes and captions in, PNG out;
and the fidelity check's comparison pictures (expected | stored | difference).

Three panels stacked, each PANEL_WIDTH wide (so labels stay readable where the picture is shown
at its natural size, e.g. in the Dagster UI): the original (shown upright, EXIF orientation
applied) with the boxes of `structured_description`, the 512 image with the
`structured_description_crop_512` boxes, and the 1024 image with the
`structured_description_crop_1024` boxes. Box number i has the same colour and label in
every panel, so a reviewer can see at a glance whether a box still sits on its object.

Images here are untrusted input, decoded as carefully as by the resize: only the formats
core/decoding.py accepts are opened, and an image whose header gives more than
`max_source_pixels` pixels is not decoded at all (its panel says so). Box slots come from
core/bbox.py's walker and EXIF orientation from core/orientation.py, so a picture shows
what the resize and the sidecar did, not a second opinion. A panel draws the boxes of the
first MAX_DRAWN_BOXES box slots only, and its title says so when the caption has more: a
caption of a million boxes gives a picture in seconds, not a picture nobody can read.
"""

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from fixed_res_sidecar.core.bbox import (
    CAPTION_FRAMES,
    DEFAULT_BBOX_KEYS,
    BoxSlot,
    CaptionStatus,
    caption_box_to_oriented,
    parse_box,
    parse_caption,
    walk_box_slots,
)
from fixed_res_sidecar.core.decoding import open_image, too_many_pixels
from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.core.fidelity import difference_image
from fixed_res_sidecar.core.orientation import (
    oriented_size,
    read_orientation,
    to_upright,
)
from fixed_res_sidecar.core.pixel_settings import PixelOptions

PANEL_WIDTH = 640
MAX_PANEL_HEIGHT = 960  # a very tall image is shown narrower instead
TITLE_HEIGHT = 28  # title strip above each panel
PANEL_GAP = 10  # background strip between panels
TITLE_FONT_SIZE, LABEL_FONT_SIZE = 18, 15
BOX_STROKE = 3
BACKGROUND = (32, 32, 32)
PLACEHOLDER = (96, 96, 96)
# Sasha Trubetskoy's distinct colours; box i gets BOX_COLOURS[i % len(BOX_COLOURS)].
BOX_COLOURS = (
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (210, 245, 60),
    (250, 190, 212),
    (0, 128, 128),
    (170, 110, 40),
)
LABEL_KEYS = ("label", "name", "category", "object", "text")
# Boxes drawn per panel: those of the first this many box slots (the same objects in every
# panel). A caption may hold a million boxes; the title then says how many slots it has.
MAX_DRAWN_BOXES = 100
DEFAULT_MAX_SOURCE_PIXELS = PixelOptions().max_source_pixels


@dataclass(frozen=True)
class LabelledSlot:
    """A box slot of a caption (core/bbox.py's walk) with the label drawn next to its box."""

    index: int  # walk order: the same object has the same index in the original and its crops
    path: str
    value: Any
    label: str


def iter_box_slots(
    caption: Any, bbox_keys: Sequence[str] = DEFAULT_BBOX_KEYS, *, crop_frame: bool = False
) -> list[LabelledSlot]:
    """Every box slot of a parsed caption, in walk order, with its label.

    The slots are core/bbox.py's (`walk_box_slots`); `crop_frame` for a crop variant. A box is
    named by its object's label (the first text among LABEL_KEYS of the object holding the
    box key), else by the last part of that object's path, else by the box key; the
    elements of a list of boxes add their position.
    """
    return [_labelled(slot) for slot in walk_box_slots(caption, bbox_keys, crop_frame=crop_frame)]


def _labelled(slot: BoxSlot) -> LabelledSlot:
    return LabelledSlot(slot.index, slot.path, slot.value, _label(slot))


def _label(slot: BoxSlot) -> str:
    holder, holder_path = slot.holder, slot.holder_path
    own = next((holder[k] for k in LABEL_KEYS if isinstance(holder.get(k), str)), None)
    label = own or (holder_path.rsplit(".", 1)[-1] if holder_path else str(slot.key))
    return label if slot.item is None else f"{label}[{slot.item}]"


@dataclass
class _Panel:
    title: str
    image: Image.Image  # already scaled to the panel height
    boxes: list[tuple[LabelledSlot, tuple[float, float, float, float]]]


@dataclass(frozen=True)
class OverlayRow:
    """What an overlay picture shows of one sidecar row: the original image and its caption, and each
    resolution's image and crop caption (encoded bytes and JSON text; None when missing)."""

    original: bytes | None = None
    caption: str | None = None
    img_512: bytes | None = None
    crop_512: str | None = None
    img_1024: bytes | None = None
    crop_1024: str | None = None


def overlay_picture(
    row: OverlayRow,
    *,
    panel_width: int = PANEL_WIDTH,
    bbox_keys: Sequence[str] = DEFAULT_BBOX_KEYS,
    caption_frame: str = "oriented",
    labels: Sequence[str] = ("original", "512", "1024"),
    max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS,
) -> bytes:
    """A PNG: original | 512 | 1024, each with its own boxes; a missing image is a grey panel.

    The original is shown upright. Caption boxes are in that upright frame (SPEC 6),
    unless `caption_frame` is "raw": then they are moved through the EXIF orientation.
    An image in a refused format, or with more than `max_source_pixels` pixels by its
    header, is not decoded: its panel is grey and its title says why.
    """
    if caption_frame not in CAPTION_FRAMES:
        raise ValueError(f"caption_frame must be one of {CAPTION_FRAMES}, got {caption_frame!r}")
    limit = max_source_pixels
    raw_frame = caption_frame == "raw"
    panels = [
        _original_panel(row.original, row.caption, labels[0], panel_width, bbox_keys, raw_frame, limit),
        _resized_panel(row.img_512, row.crop_512, labels[1], panel_width, bbox_keys, limit),
        _resized_panel(row.img_1024, row.crop_1024, labels[2], panel_width, bbox_keys, limit),
    ]
    return _compose(panels)


def comparison_picture(
    expected: Image.Image, stored: Image.Image, score_text: str, *, panel_width: int = PANEL_WIDTH
) -> bytes:
    """A PNG of a fidelity failure (core/fidelity.py): the expected output | the stored one | their
    difference (times 4: encoder noise stays dark, a wrong picture is bright), stacked like the
    overlay pictures so they read the same way in the Dagster UI."""
    panels = [
        _Panel(f"expected {expected.width}x{expected.height}", _scaled(expected, panel_width), []),
        _Panel(f"stored {stored.width}x{stored.height}, {score_text}", _scaled(stored, panel_width), []),
        _Panel("difference x4", _scaled(difference_image(expected, stored), panel_width), []),
    ]
    return _compose(panels)


def panel_size(width: int, height: int, panel_width: int = PANEL_WIDTH) -> tuple[int, int]:
    """The size a `width x height` image is shown at: `panel_width` wide, at most MAX_PANEL_HEIGHT tall."""
    scale = min(panel_width / width, MAX_PANEL_HEIGHT / height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def panel_origins(sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Top-left corner of each panel's image in the picture, for panels of `sizes` (stacked)."""
    origins, top = [], 0
    for _, height in sizes:
        origins.append((0, top + TITLE_HEIGHT))
        top += TITLE_HEIGHT + height + PANEL_GAP
    return origins


def picture_size(sizes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Size of the whole picture for panels of `sizes`."""
    return max(w for w, _ in sizes), sum(TITLE_HEIGHT + h for _, h in sizes) + PANEL_GAP * (len(sizes) - 1)


def _original_panel(data, caption, label, panel_width, bbox_keys, raw_frame, max_source_pixels) -> _Panel:
    image, problem = _decode(data, max_source_pixels, draft_to=panel_width)
    if image is None:
        return _placeholder(f"{label}: {problem}", panel_width)
    full_size = image.info.get("full_size", image.size)  # before shrink-on-load
    orientation = read_orientation(image)  # as the resize read it
    upright = to_upright(image, orientation)
    width, height = oriented_size(full_size, orientation)
    title = f"{label} {width}x{height}" + (f" (EXIF {orientation})" if orientation != 1 else "")
    move = (lambda box: caption_box_to_oriented(box, orientation)) if raw_frame else None
    boxes, caption_text = panel_boxes(caption, bbox_keys, move)
    return _Panel(f"{title}, {caption_text}", _scaled(upright, panel_width), boxes)


def _resized_panel(data, crop_caption, label, panel_width, bbox_keys, max_source_pixels) -> _Panel:
    image, problem = _decode(data, max_source_pixels)
    if image is None:
        return _placeholder(f"{label}: {problem}", panel_width)
    boxes, caption_text = panel_boxes(crop_caption, bbox_keys, crop_frame=True)
    title = f"{label} {image.width}x{image.height}, {caption_text}"
    return _Panel(title, _scaled(image, panel_width), boxes)


def panel_boxes(caption: str | None, bbox_keys, move=None, crop_frame: bool = False) -> tuple[list, str]:
    """(slot, box) for the drawable boxes among the first MAX_DRAWN_BOXES slots of a caption, and
    the title's words on them: how many boxes, how many slots when they are capped, or what is
    wrong with the caption."""
    status, parsed = parse_caption(caption)
    if status is not CaptionStatus.OK:
        what = "missing" if status is CaptionStatus.MISSING else "invalid JSON"
        return [], f"{'crop caption' if crop_frame else 'caption'} {what}"
    boxes = []
    slots = 0
    for slot in walk_box_slots(parsed, bbox_keys, crop_frame=crop_frame):
        slots += 1  # every slot is counted; only the first MAX_DRAWN_BOXES are looked at
        if slot.index < MAX_DRAWN_BOXES:
            box = parse_box(slot.value)
            if box is not None:
                boxes.append((_labelled(slot), move(box) if move else box))
    if slots > MAX_DRAWN_BOXES:
        return boxes, f"{len(boxes)} boxes drawn from the first {MAX_DRAWN_BOXES} of {slots} box slots"
    return boxes, f"{len(boxes)} boxes"


def _decode(
    data: bytes | None, max_source_pixels: int, draft_to: int | None = None
) -> tuple[Image.Image | None, str | None]:
    """The decoded image, or None and why not; refused formats and oversized headers are never decoded."""
    if not data:
        return None, "no image"
    try:
        image = open_image(data)  # header only, allowed formats only
        full_size = image.size
        if too_many_pixels(*full_size, max_source_pixels):
            return None, f"not decoded, {full_size[0]}x{full_size[1]} exceeds max_source_pixels={max_source_pixels}"
        if draft_to and image.format == "JPEG":
            # Shrink-on-load: both sides stay >= the panel width, enough in either orientation.
            image.draft("RGB", (draft_to, draft_to))
        image.load()
        image.info["full_size"] = full_size
        return image, None
    except Exception as exc:
        return None, f"does not decode ({describe_exception(exc, max_chars=80)})"


def _scaled(image: Image.Image, panel_width: int) -> Image.Image:
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, (*PLACEHOLDER, 255))
        image = Image.alpha_composite(flat, rgba)
    image = image.convert("RGB")
    size = panel_size(image.width, image.height, panel_width)
    return image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)


def _placeholder(title: str, panel_width: int) -> _Panel:
    return _Panel(title, Image.new("RGB", (panel_width, panel_width // 2), PLACEHOLDER), [])


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _compose(panels: list[_Panel]) -> bytes:
    sizes = [p.image.size for p in panels]
    canvas = Image.new("RGB", picture_size(sizes), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    title_font, label_font = _font(TITLE_FONT_SIZE), _font(LABEL_FONT_SIZE)
    for panel, (left, top) in zip(panels, panel_origins(sizes)):
        canvas.paste(panel.image, (left, top))
        draw.text((left + 4, top - TITLE_HEIGHT + 4), panel.title, fill=(240, 240, 240), font=title_font)
        placed = [(slot, _offset(box_pixels(box, panel.image.size), left, top)) for slot, box in panel.boxes]
        # Every rectangle first, then every label, so no later box hides an earlier label.
        for slot, rect in placed:
            _draw_rectangle(draw, rect, _colour(slot))
        labels_at: dict[tuple[int, int], int] = {}
        for slot, rect in placed:
            # Captions often repeat a box (an object and a group holding it): stack their labels.
            stacked = labels_at.get(rect[:2], 0)
            labels_at[rect[:2]] = stacked + 1
            _draw_label(draw, rect, f"{slot.index} {slot.label}".strip(), _colour(slot), stacked, label_font)
    out = io.BytesIO()
    canvas.save(out, "PNG", compress_level=1)  # review pictures: fast beats small
    return out.getvalue()


def _colour(slot: LabelledSlot) -> tuple[int, int, int]:
    return BOX_COLOURS[slot.index % len(BOX_COLOURS)]


def _offset(rect: tuple[int, int, int, int], left: int, top: int) -> tuple[int, int, int, int]:
    x0, y0, x1, y1 = rect
    return x0 + left, y0 + top, x1 + left, y1 + top


def box_pixels(box: tuple[float, float, float, float], panel_size: tuple[int, int]) -> tuple[int, int, int, int]:
    """A normalised yxyx box as panel pixels (x0, y0, x1, y1), right/bottom inclusive."""
    ymin, xmin, ymax, xmax = box
    width, height = panel_size
    x0, x1 = round(xmin / 1000 * width), round(xmax / 1000 * width) - 1
    y0, y1 = round(ymin / 1000 * height), round(ymax / 1000 * height) - 1
    return x0, y0, max(x0, x1), max(y0, y1)


def _draw_rectangle(draw: ImageDraw.ImageDraw, rect: tuple[int, int, int, int], colour) -> None:
    x0, y0, x1, y1 = rect
    # A thin dark rim outside the coloured stroke keeps the box visible on any background.
    draw.rectangle((x0 - 1, y0 - 1, x1 + 1, y1 + 1), outline=(0, 0, 0), width=1)
    draw.rectangle(rect, outline=colour, width=BOX_STROKE)


def _draw_label(draw: ImageDraw.ImageDraw, rect, text: str, colour, stacked: int, font) -> None:
    text_box = draw.textbbox((0, 0), text, font=font)
    text_w, text_h = text_box[2] - text_box[0] + 4, text_box[3] - text_box[1] + 4
    # Inside the box's top-left corner, below the stroke, so the left edge stays visible.
    tx, ty = rect[0] + BOX_STROKE, rect[1] + BOX_STROKE + stacked * (text_h + 1)
    draw.rectangle((tx, ty, tx + text_w - 1, ty + text_h - 1), fill=colour)
    luminance = 0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2]
    ink = (0, 0, 0) if luminance > 140 else (255, 255, 255)
    draw.text((tx + 2 - text_box[0], ty + 2 - text_box[1]), text, fill=ink, font=font)


def embeddable(picture: bytes, width: int = PANEL_WIDTH) -> bytes:
    """A WebP of an overlay picture, at most `width` wide, small enough to embed in a web page.

    Opened with the same guard as every untrusted image: allowed formats only, and no decode
    past the pixel limit.
    """
    image = open_image(picture)
    problem = too_many_pixels(*image.size, DEFAULT_MAX_SOURCE_PIXELS)
    if problem:
        raise ValueError(problem)
    with image:
        image = image.convert("RGB")
        if image.width > width:
            height = max(1, round(image.height * width / image.width))
            image = image.resize((width, height), Image.Resampling.LANCZOS)
        out = io.BytesIO()
        # Quality 80 keeps a 640 px picture near 60-120 KB of event log with labels still sharp.
        image.save(out, "WEBP", quality=80, method=4)
    return out.getvalue()
