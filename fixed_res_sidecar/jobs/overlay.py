"""Overlay pictures for the crop-bbox verifier (SPEC 7).

Three panels side by side, all the same height: the original (shown upright, EXIF
orientation applied) with the boxes of `structured_description`, the 512 image with the
`structured_description_crop_512` boxes, and the 1024 image with the
`structured_description_crop_1024` boxes. Box number i has the same colour and label in
every panel, so a reviewer can see at a glance whether a box still sits on its object.
"""

import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw, ImageFont, ImageOps

from fixed_res_sidecar.core.bbox import CAPTION_FRAMES, DEFAULT_BBOX_KEYS, parse_box, raw_box_to_oriented

PANEL_HEIGHT = 384
TITLE_HEIGHT = 22  # title strip above each panel
PANEL_GAP = 8  # background strip between panels
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


@dataclass(frozen=True)
class BoxSlot:
    """One place in a caption where a box may be: its walk order, JSON path and value.

    `value` is whatever the caption holds there (a valid box, null, or anything
    malformed); the crop variants keep the caption's structure, so slot i of the
    original and slot i of a crop variant are the same object.
    """

    index: int
    path: str
    value: Any
    label: str


def iter_box_slots(caption: Any, bbox_keys: Sequence[str] = DEFAULT_BBOX_KEYS) -> Iterator[BoxSlot]:
    """Every box slot of a parsed caption, depth first, in key order (SPEC 6 walk).

    Same rules as core/bbox.py: under a bbox key, `[]` holds no box; a list holding at
    least one list is a list of boxes, one slot per item (crop variants keep a null
    where a box had no area left); any other value, null included, is one slot.
    """
    counter = iter(range(1 << 62))

    def walk(node: Any, path: str) -> Iterator[BoxSlot]:
        if isinstance(node, dict):
            own_label = next((node[k] for k in LABEL_KEYS if isinstance(node.get(k), str)), None)
            for key, value in node.items():
                child_path = f"{path}.{key}" if path else str(key)
                if key in bbox_keys:
                    # Name a box by its object's label, else by the key that holds it.
                    slot_label = own_label or (path.rsplit(".", 1)[-1] if path else str(key))
                    if value == []:
                        continue  # an empty list under a box key holds no box
                    if _is_box_list(value):
                        for i, item in enumerate(value):
                            yield BoxSlot(next(counter), f"{child_path}[{i}]", item, f"{slot_label}[{i}]")
                    else:
                        yield BoxSlot(next(counter), child_path, value, slot_label)
                else:
                    yield from walk(value, child_path)
        elif isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{path}[{i}]")

    yield from walk(caption, "")


def _is_box_list(value: Any) -> bool:
    # core/bbox.py's rule: a list holding at least one list is a list of boxes.
    return isinstance(value, list) and any(isinstance(item, list) for item in value)


def is_valid_box(value: Any) -> bool:
    """A crop-frame box: four integers in 0..1000, [ymin, xmin, ymax, xmax], min <= max."""
    if not isinstance(value, list) or len(value) != 4:
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return False
    return parse_box(value) is not None


@dataclass
class _Panel:
    title: str
    image: Image.Image  # already scaled to the panel height
    boxes: list[tuple[BoxSlot, tuple[float, float, float, float]]]


def overlay_picture(
    original: bytes | None,
    caption: str | None,
    img_512: bytes | None,
    crop_512: str | None,
    img_1024: bytes | None,
    crop_1024: str | None,
    *,
    panel_height: int = PANEL_HEIGHT,
    bbox_keys: Sequence[str] = DEFAULT_BBOX_KEYS,
    caption_frame: str = "oriented",
    labels: Sequence[str] = ("original", "512", "1024"),
) -> bytes:
    """A PNG: original | 512 | 1024, each with its own boxes; a missing image is a grey panel.

    The original is shown upright. Caption boxes are in that upright frame (SPEC 6),
    unless `caption_frame` is "raw": then they are moved through the EXIF orientation.
    """
    if caption_frame not in CAPTION_FRAMES:
        raise ValueError(f"caption_frame must be one of {CAPTION_FRAMES}, got {caption_frame!r}")
    panels = [
        _original_panel(original, caption, labels[0], panel_height, bbox_keys, caption_frame == "raw"),
        _resized_panel(img_512, crop_512, labels[1], panel_height, bbox_keys),
        _resized_panel(img_1024, crop_1024, labels[2], panel_height, bbox_keys),
    ]
    return _compose(panels, panel_height)


def overlay_width(panel_widths: Sequence[int]) -> int:
    """Width of the picture for the given panel widths (the layout used by `overlay_picture`)."""
    return sum(panel_widths) + PANEL_GAP * (len(panel_widths) - 1)


def panel_width(width: int, height: int, panel_height: int = PANEL_HEIGHT) -> int:
    """Width of a `width x height` image scaled to the panel height."""
    return max(1, round(width * panel_height / height))


def _original_panel(data, caption, label, panel_height, bbox_keys, raw_frame) -> _Panel:
    image, problem = _decode(data, draft_to=panel_height)
    if image is None:
        return _placeholder(f"{label}: {problem}", panel_height)
    full_size = image.info.get("full_size", image.size)  # before shrink-on-load
    orientation = _exif_orientation(image)
    try:
        upright = ImageOps.exif_transpose(image)
    except Exception:  # broken EXIF: show the stored pixels
        upright, orientation = image, 1
    width, height = full_size[::-1] if orientation in (5, 6, 7, 8) else full_size
    title = f"{label} {width}x{height}" + (f" (EXIF {orientation})" if orientation != 1 else "")
    move = (lambda box: raw_box_to_oriented(box, orientation)) if raw_frame else None
    boxes, caption_problem = _panel_boxes(caption, bbox_keys, move)
    title += f", {len(boxes)} boxes" if caption_problem is None else f", caption {caption_problem}"
    return _Panel(title, _scaled(upright, panel_height), boxes)


def _resized_panel(data, crop_caption, label, panel_height, bbox_keys) -> _Panel:
    image, problem = _decode(data)
    if image is None:
        return _placeholder(f"{label}: {problem}", panel_height)
    boxes, caption_problem = _panel_boxes(crop_caption, bbox_keys)
    title = f"{label} {image.width}x{image.height}"
    title += f", {len(boxes)} boxes" if caption_problem is None else f", crop caption {caption_problem}"
    return _Panel(title, _scaled(image, panel_height), boxes)


def _panel_boxes(caption: str | None, bbox_keys, move=None) -> tuple[list, str | None]:
    """(slot, box) for every drawable box of a caption, and what is wrong with the caption."""
    if caption is None:
        return [], "missing"
    try:
        parsed = json.loads(caption)
    except (TypeError, ValueError):
        return [], "invalid JSON"
    boxes = []
    for slot in iter_box_slots(parsed, bbox_keys):
        box = parse_box(slot.value)
        if box is not None:
            boxes.append((slot, move(box) if move else box))
    return boxes, None


def _decode(data: bytes | None, draft_to: int | None = None) -> tuple[Image.Image | None, str | None]:
    if not data:
        return None, "no image"
    try:
        image = Image.open(io.BytesIO(data))
        full_size = image.size
        if draft_to and image.format == "JPEG":
            # Shrink-on-load: both sides stay >= the panel height, enough in either orientation.
            image.draft("RGB", (draft_to, draft_to))
        image.load()
        image.info["full_size"] = full_size
        return image, None
    except Exception as exc:
        return None, f"does not decode ({type(exc).__name__})"


def _exif_orientation(image: Image.Image) -> int:
    try:
        value = int(image.getexif().get(0x0112, 1))
    except Exception:
        return 1
    return value if value in range(1, 9) else 1


def _scaled(image: Image.Image, panel_height: int) -> Image.Image:
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, PLACEHOLDER + (255,))
        image = Image.alpha_composite(flat, rgba)
    image = image.convert("RGB")
    size = (panel_width(image.width, image.height, panel_height), panel_height)
    return image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)


def _placeholder(title: str, panel_height: int) -> _Panel:
    return _Panel(title, Image.new("RGB", (panel_height, panel_height), PLACEHOLDER), [])


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _compose(panels: list[_Panel], panel_height: int) -> bytes:
    width = overlay_width([p.image.width for p in panels])
    canvas = Image.new("RGB", (width, TITLE_HEIGHT + panel_height), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    title_font, label_font = _font(14), _font(12)
    left = 0
    for panel in panels:
        canvas.paste(panel.image, (left, TITLE_HEIGHT))
        draw.text((left + 4, 3), panel.title, fill=(240, 240, 240), font=title_font)
        placed = [(slot, _offset(box_pixels(box, panel.image.size), left, TITLE_HEIGHT)) for slot, box in panel.boxes]
        # Every rectangle first, then every label, so no later box hides an earlier label.
        for slot, rect in placed:
            _draw_rectangle(draw, rect, _colour(slot))
        labels_at: dict[tuple[int, int], int] = {}
        for slot, rect in placed:
            # Captions often repeat a box (an object and a group holding it): stack their labels.
            stacked = labels_at.get(rect[:2], 0)
            labels_at[rect[:2]] = stacked + 1
            _draw_label(draw, rect, f"{slot.index} {slot.label}".strip(), _colour(slot), stacked, label_font)
        left += panel.image.width + PANEL_GAP
    out = io.BytesIO()
    canvas.save(out, "PNG", compress_level=1)  # review pictures: fast beats small
    return out.getvalue()


def _colour(slot: BoxSlot) -> tuple[int, int, int]:
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
