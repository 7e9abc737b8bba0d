"""Caption boxes moved into each resolution's crop frame, and `bbox_resize_meta` (SPEC section 6).

Pure functions: JSON text and audit records in, JSON text out. No storage, no images.

Rules, exactly:

* Caption parsing. A null caption, or one that is only whitespace, is `missing`. Anything
  that is not strict JSON text is `invalid_json`: this includes bytes that are not UTF-8,
  `NaN`/`Infinity`, numbers too large for a double and lone surrogate escapes such as
  `"\\ud83d"` (half an emoji, from a cut string), which Python's json module would otherwise
  accept or produce, and nesting deeper than MAX_CAPTION_DEPTH (500) levels: one bound, the
  same for the builder, the verifier and the overlays, well inside what the JSON parser
  manages from any caller.
  Either way both crop columns are null and the meta says why.
* What is a box. The JSON is walked depth first (`walk_box_slots` and `map_box_slots`, the
  one walk every reader of captions uses, with an explicit stack rather than recursion, so
  the depth of a caption costs no Python stack); only values under a key in `bbox_keys` are touched, and
  everything else is copied unchanged in key order. Under such a key: `[]` stays `[]` (no
  box); a list holding at least one list is a list of boxes, each element a box slot of its
  own; any other value is one box slot. A slot holding `null` stays `null` and is not
  counted. Nothing under a box key is copied unchanged, because a value left in the source
  frame would silently be wrong in the crop frame.
  A crop caption keeps the slots of its original, but a list of boxes that all had no area
  left becomes a list of nulls; walked as a crop caption (`crop_frame=True`), a non-empty
  list of nulls is therefore a list of boxes too.
* Malformed (-> null, counted `malformed`): not a list of exactly four numbers (bools are
  not numbers), a value outside 0..1000, or ymin > ymax or xmin > xmax. A dict or string
  under a box key is malformed too.
* Transform. Boxes are `[ymin, xmin, ymax, xmax]` on a 0..1000 grid over the oriented
  source `W x H`. With caption_frame "raw" they are first mapped through the EXIF
  orientation (all eight) into the oriented frame. Then Y = v/1000*H, X = v/1000*W,
  y' = (Y - y0)/ch*1000, x' = (X - x0)/cw*1000 with the resolution's crop box; each value is
  clipped to [0, 1000] and rounded half up (floor(v + 0.5)) to an integer.
* Outcome, decided on the clipped and rounded integers:
  - `outside` (-> null): no area left, i.e. ymin >= ymax or xmin >= xmax after clipping and
    rounding. That covers boxes wholly in the cropped-away margin, slivers narrower than
    half a grid unit, and zero-area input boxes. So every non-null crop box has
    ymin < ymax and xmin < xmax.
  - `inside`: area left and clipping changed nothing (every unclipped value within
    [0, 1000], with 1e-6 grid units of tolerance for floating-point noise).
  - `clipped`: area left but at least one value had to be clipped.
  `total` = inside + clipped + outside + malformed.

`bbox_resize_meta`, one JSON object per row:
    {"caption_status": "ok" | "missing" | "invalid_json", "exif_orientation": 1..8,
     "512": {"valid", "error", "src_width", "src_height", "width", "height",
             "crop_box": [x0, y0, x1, y1], "scale", "counts": {total, inside, clipped, outside, malformed}},
     "1024": {...}}
Sizes, crop box and scale are copied from that resolution's resize audit (null where the
audit has none). A crop column is null, and its `counts` null, when that resolution's row
is invalid (`valid` false, `error` the audit's code) or the caption is not `ok`.

Output text: crop captions are `json.dumps(value, ensure_ascii=False)` with the default
separators (", " and ": "), the way most captions are written in the first place, so the crop
caption reads like the original. Non-box values are equal as parsed JSON (numbers as
doubles), not byte-for-byte. `bbox_resize_meta` is machine data: compact separators.
"""

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, NamedTuple

from fixed_res_sidecar.core import orientation as exif
from fixed_res_sidecar.core.audit import AuditRecord
from fixed_res_sidecar.core.resolutions import RESOLUTIONS

# Bump when the output of this module changes for the same input: skip-existing compares it.
# 2: the sidecar shard is written with page checksums; 3: captions nested deeper than the walk's
# bound are invalid_json.
CROP_BBOX_VERSION = 3

DEFAULT_BBOX_KEYS = ("bbox", "box_2d", "bbox_2d")
# The sidecar's columns besides the key (SPEC 6): one crop caption per resolution, and the meta.
CROP_COLUMNS = {name: f"structured_description_crop_{name}" for name in RESOLUTIONS}
META_COLUMN = "bbox_resize_meta"
CAPTION_FRAMES = ("oriented", "raw")
GRID = 1000  # boxes are normalised to 0..GRID
EDGE_TOLERANCE = 1e-6  # grid units; a value this far past an edge still counts as inside

# Deeper captions are `invalid_json` everywhere (see parse_caption).
MAX_CAPTION_DEPTH = 500

CAPTION_SEPARATORS = (", ", ": ")
META_SEPARATORS = (",", ":")


class AuditInconsistent(ValueError):
    """A resize audit row the sidecar cannot use (valid, but without its crop geometry)."""


class CaptionStatus(str, Enum):
    OK = "ok"
    MISSING = "missing"
    INVALID_JSON = "invalid_json"


class BoxOutcome(str, Enum):
    INSIDE = "inside"
    CLIPPED = "clipped"
    OUTSIDE = "outside"
    MALFORMED = "malformed"


# BoxCounts' field per outcome (an Enum's `.value` is a property lookup: this runs for every box).
_COUNTED = {outcome: outcome.value for outcome in BoxOutcome}


@dataclass
class BoxCounts:
    total: int = 0
    inside: int = 0
    clipped: int = 0
    outside: int = 0
    malformed: int = 0

    def add(self, outcome: BoxOutcome) -> None:
        self.total += 1
        name = _COUNTED[outcome]
        setattr(self, name, getattr(self, name) + 1)

    def merge(self, other: "BoxCounts") -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class CropFrame:
    """One resolution's crop of the oriented source: source size and crop box in source pixels."""

    src_width: int
    src_height: int
    x0: float
    y0: float
    x1: float
    y1: float

    @classmethod
    def from_audit(cls, record: AuditRecord) -> "CropFrame | None":
        """The frame recorded by the resize stage, or None when the audit lacks any part of it."""
        width, height, x0, y0, x1, y1 = (
            record.src_width,
            record.src_height,
            record.crop_x0,
            record.crop_y0,
            record.crop_x1,
            record.crop_y1,
        )
        if width is None or height is None or x0 is None or y0 is None or x1 is None or y1 is None:
            return None
        frame = cls(width, height, x0, y0, x1, y1)
        if frame.x1 <= frame.x0 or frame.y1 <= frame.y0 or frame.src_width <= 0 or frame.src_height <= 0:
            return None
        return frame


# -- captions -------------------------------------------------------------------------


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _parse_finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} does not fit in a double")
    return value


def parse_caption(caption: str | bytes | None) -> tuple[CaptionStatus, Any]:
    """(status, parsed JSON value); the value is None unless the status is OK."""
    if isinstance(caption, bytes):
        try:
            caption = caption.decode("utf-8")
        except UnicodeDecodeError:
            return CaptionStatus.INVALID_JSON, None
    if caption is None or not caption.strip():
        return CaptionStatus.MISSING, None
    try:
        value = json.loads(caption, parse_constant=_reject_constant, parse_float=_parse_finite_float)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return CaptionStatus.INVALID_JSON, None
    if _SURROGATE_ESCAPE.search(caption) and not _is_unicode_text(value):
        return CaptionStatus.INVALID_JSON, None
    if caption.count("[") + caption.count("{") > MAX_CAPTION_DEPTH and _deeper_than(value, MAX_CAPTION_DEPTH):
        return CaptionStatus.INVALID_JSON, None
    return CaptionStatus.OK, value


# A \uD800-\uDFFF escape: the only way JSON text gives a string a lone surrogate (a pair is fine).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _is_unicode_text(value: Any) -> bool:
    """Whether every string of a parsed caption is valid Unicode (no lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests containers more than `limit` levels deep (a scalar is 0).

    Level by level, without recursion."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [c for node in level for c in (node.values() if type(node) is dict else node) if type(c) in _CONTAINERS]
    return False


_CONTAINERS = (dict, list)


def dump_caption(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=CAPTION_SEPARATORS, allow_nan=False)


# -- one box --------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_JSON_NUMBERS = (int, float)  # the types JSON numbers parse to; anything else takes `_is_number`


def parse_box(value: Any) -> tuple[float, float, float, float] | None:
    """The box [ymin, xmin, ymax, xmax] if well-formed, else None (malformed)."""
    if not isinstance(value, list) or len(value) != 4:
        return None
    ymin, xmin, ymax, xmax = value
    # Exact types first (what JSON gives; this runs for every box), then the rule itself.
    numbers = _JSON_NUMBERS
    json_numbers = type(ymin) in numbers and type(xmin) in numbers and type(ymax) in numbers and type(xmax) in numbers
    if not json_numbers and not all(_is_number(v) for v in value):
        return None
    if not (0 <= ymin <= ymax <= GRID and 0 <= xmin <= xmax <= GRID):
        return None
    return ymin, xmin, ymax, xmax


def caption_box_to_oriented(
    box: tuple[float, float, float, float], orientation: int
) -> tuple[float, float, float, float]:
    """A well-formed caption box ([ymin, xmin, ymax, xmax] on the 0..1000 grid) drawn on the raw
    pixels, in the displayed frame.

    The mapping is core/orientation.py's pixel-box mapping (x0, y0, x1, y1) applied on the
    0..1000 grid; an orientation outside 1..8 leaves the box as it is.
    """
    ymin, xmin, ymax, xmax = box
    x0, y0, x1, y1 = exif.raw_box_to_oriented((xmin, ymin, xmax, ymax), orientation, (GRID, GRID))
    return y0, x0, y1, x1


def is_valid_crop_box(value: Any) -> bool:
    """A box of a crop caption: four integers in 0..1000, [ymin, xmin, ymax, xmax], min <= max."""
    # Exact types (JSON gives int, never a subclass; bool is not a number here): the verifier
    # runs this on every box of a shard.
    if type(value) is not list or len(value) != 4:
        return False
    ymin, xmin, ymax, xmax = value
    if not (type(ymin) is int and type(xmin) is int and type(ymax) is int and type(xmax) is int):
        return False
    return 0 <= ymin <= ymax <= GRID and 0 <= xmin <= xmax <= GRID


def transform_box(value: Any, frame: CropFrame, orientation: int = 1) -> tuple[list[int] | None, BoxOutcome]:
    """One caption box into the crop frame: (new box or None, what happened to it).

    `orientation` is the EXIF orientation to undo first; pass 1 for oriented-frame captions.
    """
    box = parse_box(value)
    if box is None:
        return None, BoxOutcome.MALFORMED
    ymin, xmin, ymax, xmax = box if orientation == exif.UPRIGHT else caption_box_to_oriented(box, orientation)
    # The module docstring's transform: a 0..1000 source-grid value to the crop's 0..1000 grid, clipped,
    # then rounded half up. Written out per value, without calls: this runs for every box of every caption.
    height, width, y0, x0 = frame.src_height, frame.src_width, frame.y0, frame.x0
    crop_height, crop_width = frame.y1 - y0, frame.x1 - x0
    top = (ymin / GRID * height - y0) / crop_height * GRID
    left = (xmin / GRID * width - x0) / crop_width * GRID
    bottom = (ymax / GRID * height - y0) / crop_height * GRID
    right = (xmax / GRID * width - x0) / crop_width * GRID
    floor = math.floor
    result = [
        0 if top <= 0.0 else GRID if top >= GRID else floor(top + 0.5),
        0 if left <= 0.0 else GRID if left >= GRID else floor(left + 0.5),
        0 if bottom <= 0.0 else GRID if bottom >= GRID else floor(bottom + 0.5),
        0 if right <= 0.0 else GRID if right >= GRID else floor(right + 0.5),
    ]
    if result[0] >= result[2] or result[1] >= result[3]:
        return None, BoxOutcome.OUTSIDE
    low, high = -EDGE_TOLERANCE, GRID + EDGE_TOLERANCE
    if low <= top <= high and low <= left <= high and low <= bottom <= high and low <= right <= high:
        return result, BoxOutcome.INSIDE
    return result, BoxOutcome.CLIPPED


# -- walking a caption's boxes --------------------------------------------------------


class BoxSlot(NamedTuple):
    """One place in a caption where a box may be (SPEC 6 walk).

    `value` is whatever the caption holds there: a box, null, or anything malformed. A crop
    caption keeps its original's slots, so slot i of an original and slot i of its crop
    variant are the same object.
    """

    # walk order over the caption, from 0; a field named like tuple.index on purpose (its readers say slot.index)
    index: int  # pyright: ignore[reportIncompatibleMethodOverride]
    value: Any
    holder: dict  # the JSON object holding the box key
    key: str  # the box key
    item: int | None  # position in a list of boxes; None for a single box
    holder_parts: Any  # the holder's JSON path, as linked (parent, key-or-index) pairs; None at the root

    @property
    def holder_path(self) -> str:
        """JSON path of the holder, e.g. `objects[0]` or `groups.pets` ("" at the root)."""
        parts = []
        node = self.holder_parts
        while node is not None:
            node, part = node
            parts.append(part)
        return _format_path(reversed(parts))

    @property
    def path(self) -> str:
        """JSON path of the slot, e.g. `objects[0].bbox` or `groups.pets.bbox_2d[1]`."""
        holder = self.holder_path
        path = f"{holder}.{self.key}" if holder else str(self.key)
        return path if self.item is None else f"{path}[{self.item}]"


def _format_path(parts: Iterable[str | int]) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text


def is_box_list(value: Any, crop_frame: bool = False) -> bool:
    """Whether a value under a box key is a list of boxes (rather than one box).

    A list holding at least one list is; in a crop caption a non-empty list of nulls is too
    (the boxes of such a list that have no area left in the crop are null).
    """
    if not isinstance(value, list) or not value:
        return False
    for item in value:  # a plain loop: this runs for every box of every caption
        if isinstance(item, list):
            return True
    return crop_frame and value[0] is None and all(item is None for item in value)


def walk_box_slots(
    caption: Any, bbox_keys: Iterable[str] = DEFAULT_BBOX_KEYS, *, crop_frame: bool = False
) -> Iterator[BoxSlot]:
    """Every box slot of a parsed caption, in walk order, as it is reached (see `map_box_slots`).

    Lazy: a reader that needs only the first slots (an overlay picture) stops early.
    """
    for index, (value, holder, key, item, parts, _, _) in enumerate(
        _walk(caption, frozenset(bbox_keys), crop_frame, None)
    ):
        yield BoxSlot(index, value, holder, key, item, parts)


def box_slots(caption: Any, bbox_keys: Iterable[str] = DEFAULT_BBOX_KEYS, *, crop_frame: bool = False) -> list[BoxSlot]:
    """Every box slot of a parsed caption, in walk order (see `map_box_slots`)."""
    return list(walk_box_slots(caption, bbox_keys, crop_frame=crop_frame))


def map_box_slots(
    caption: Any,
    bbox_keys: Iterable[str],
    replace: Callable[[Any, dict, str, int | None, Any], Any],
    *,
    crop_frame: bool = False,
) -> Any:
    """A copy of a parsed caption with the value of every box slot replaced by `replace(...)`.

    The SPEC 6 walk, the one every reader of captions uses: depth first, in key order; under
    a key in `bbox_keys`, `[]` holds no slot, a list of boxes (`is_box_list`) one slot per
    element, and any other value (null included) is one slot. Everything else is copied
    unchanged. `crop_frame` says the caption is a crop variant (see `is_box_list`). The input
    is not modified. Any depth is walked (an explicit stack, no recursion); parse_caption
    bounds the depth of what reaches here.

    `replace(value, holder, key, item, holder_parts)` is called once per slot, in walk order,
    with the fields of `BoxSlot` (no object is made: the transform runs on every row);
    `walk_box_slots` gives them as BoxSlots.
    """
    if not isinstance(caption, (dict, list)):
        return caption
    root: dict | list = {} if isinstance(caption, dict) else []
    for value, holder, key, item, parts, target, place in _walk(caption, frozenset(bbox_keys), crop_frame, root):
        target[place] = replace(value, holder, key, item, parts)
    return root


def _walk(
    caption: Any, keys: frozenset[str], crop_frame: bool, root: dict | list | None
) -> Iterator[tuple[Any, dict, str, int | None, Any, Any, Any]]:
    """The walk behind `map_box_slots` and `walk_box_slots`.

    Yields (value, holder, key, item, holder_parts, target, place) per slot. With `root` (an
    empty container of the caption's kind), it builds the copy as it goes, and `target[place]`
    is where the slot's replacement belongs (holding None until the caller sets it).
    """
    if not isinstance(caption, (dict, list)):
        return
    # One entry per open container: the container, its remaining items, its copy, its JSON path.
    # The copy is Any: a container of the node's own kind (dict or list), or None without `root`.
    stack: list[tuple[dict | list, Iterator[tuple[Any, Any]], Any, Any]] = [(caption, _items(caption), root, None)]
    while stack:
        node, items, copy, parts = stack[-1]
        if isinstance(node, dict):
            for key, child in items:
                if key in keys:
                    if isinstance(child, list) and not child:
                        if copy is not None:
                            copy[key] = []
                    elif is_box_list(child, crop_frame):
                        slots = None if copy is None else [None] * len(child)
                        if copy is not None:
                            copy[key] = slots
                        for i, element in enumerate(child):
                            yield element, node, key, i, parts, slots, i
                    else:
                        if copy is not None:
                            copy[key] = None
                        yield child, node, key, None, parts, copy, key
                elif isinstance(child, (dict, list)):
                    child_copy = None if copy is None else {} if isinstance(child, dict) else []
                    if copy is not None:
                        copy[key] = child_copy
                    stack.append((child, _items(child), child_copy, (parts, key)))
                    break  # down first; this object's remaining items follow
                elif copy is not None:
                    copy[key] = child
            else:
                stack.pop()
        else:
            for i, child in items:
                if isinstance(child, (dict, list)):
                    child_copy = None if copy is None else {} if isinstance(child, dict) else []
                    if copy is not None:
                        copy.append(child_copy)
                    stack.append((child, _items(child), child_copy, (parts, i)))
                    break  # down first; this list's remaining items follow
                elif copy is not None:
                    copy.append(child)
            else:
                stack.pop()


def _items(node: dict | list) -> Iterator[tuple[Any, Any]]:
    return iter(node.items()) if isinstance(node, dict) else enumerate(node)


# -- a whole caption ------------------------------------------------------------------


def transform_caption(
    value: Any,
    frame: CropFrame,
    bbox_keys: Iterable[str] = DEFAULT_BBOX_KEYS,
    orientation: int = 1,
) -> tuple[Any, BoxCounts]:
    """A parsed caption with every box moved into `frame`; the input is not modified.

    A null slot stays null and is not counted; every other slot is a box or malformed.
    """
    counts = BoxCounts()

    def move(value: Any, holder: dict, key: str, item: int | None, parts: Any) -> list[int] | None:
        if value is None:
            return None
        new_box, outcome = transform_box(value, frame, orientation)
        counts.add(outcome)
        return new_box

    return map_box_slots(value, bbox_keys, move), counts


# -- one row: both crop captions and the meta -----------------------------------------


@dataclass
class RowResult:
    """What the sidecar holds for one row: a crop caption per resolution (or None), and the meta."""

    crops: dict[str, str | None]
    meta: dict[str, Any]
    counts: dict[str, BoxCounts | None]

    @property
    def caption_status(self) -> str:
        return self.meta["caption_status"]

    def meta_json(self) -> str:
        return json.dumps(self.meta, ensure_ascii=False, separators=META_SEPARATORS, allow_nan=False)


def _exif_orientation(audits: Mapping[str, AuditRecord]) -> int:
    """The orientation the resize stage found (all resolutions come from one decode)."""
    for record in audits.values():
        if record.valid and record.exif_orientation in exif.ORIENTATIONS:
            return record.exif_orientation
    for record in audits.values():
        if record.exif_orientation in exif.ORIENTATIONS:
            return record.exif_orientation
    return exif.UPRIGHT


def _resolution_meta(record: AuditRecord, counts: BoxCounts | None) -> dict[str, Any]:
    crop = (record.crop_x0, record.crop_y0, record.crop_x1, record.crop_y1)
    return {
        "valid": bool(record.valid),
        "error": record.error,
        "src_width": record.src_width,
        "src_height": record.src_height,
        "width": record.width,
        "height": record.height,
        "crop_box": None if any(v is None for v in crop) else list(crop),
        "scale": record.scale,
        "counts": None if counts is None else counts.as_dict(),
    }


def crop_captions_for_row(
    caption: str | bytes | None,
    audits: Mapping[str, AuditRecord],
    bbox_keys: Iterable[str] = DEFAULT_BBOX_KEYS,
    caption_frame: str = "oriented",
) -> RowResult:
    """The crop captions and `bbox_resize_meta` of one row.

    `audits` maps a resolution name ("512", "1024") to that row's resize audit. A crop caption
    is None when its resolution's row is invalid or the caption is missing or invalid JSON;
    its counts are then None too. Raises AuditInconsistent when an audit cannot be used.
    """
    if caption_frame not in CAPTION_FRAMES:
        raise ValueError(f"caption_frame must be one of {CAPTION_FRAMES}, got {caption_frame!r}")
    bbox_keys = tuple(bbox_keys)
    status, value = parse_caption(caption)
    orientation = _exif_orientation(audits)
    undo_orientation = orientation if caption_frame == "raw" else 1

    frames: dict[str, CropFrame | None] = {}
    for name, record in audits.items():
        frames[name] = CropFrame.from_audit(record) if record.valid else None
        if record.valid and frames[name] is None:
            raise AuditInconsistent(f"resolution {name}: the audit marks the row valid but lacks its crop geometry")

    transformed: dict[str, tuple[str, BoxCounts]] = {}
    if status is CaptionStatus.OK:
        for name, frame in frames.items():
            if frame is not None:
                new_value, counts = transform_caption(value, frame, bbox_keys, undo_orientation)
                transformed[name] = (dump_caption(new_value), counts)

    meta: dict[str, Any] = {"caption_status": status.value, "exif_orientation": orientation}
    crops: dict[str, str | None] = {}
    all_counts: dict[str, BoxCounts | None] = {}
    for name, record in audits.items():
        crops[name], all_counts[name] = transformed.get(name, (None, None))
        meta[name] = _resolution_meta(record, all_counts[name])
    return RowResult(crops, meta, all_counts)
