"""Caption boxes moved into each resolution's crop frame, and `bbox_resize_meta` (SPEC section 6).

Pure functions: JSON text and audit records in, JSON text out. No storage, no images.

Rules, exactly:

* Caption parsing. A null caption, or one that is only whitespace, is `missing`. Anything
  that is not strict JSON is `invalid_json`: this includes `NaN`/`Infinity` and numbers
  too large for a double, which Python's json module would otherwise accept or produce, and
  nesting too deep to walk (about a thousand levels).
  Either way both crop columns are null and the meta says why.
* What is a box. The JSON is walked recursively (`map_box_slots`, the one walker every
  reader of captions uses); only values under a key in `bbox_keys` are touched, and
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, NamedTuple

from fixed_res_sidecar.core import orientation as exif
from fixed_res_sidecar.core.audit import AuditRecord
from fixed_res_sidecar.core.resolutions import RESOLUTIONS

# Bump when the output of this module changes for the same input: skip-existing compares it.
CROP_BBOX_VERSION = 2  # 2: the sidecar shard is written with page checksums

DEFAULT_BBOX_KEYS = ("bbox", "box_2d", "bbox_2d")
# The sidecar's columns besides the key (SPEC 6): one crop caption per resolution, and the meta.
CROP_COLUMNS = {name: f"structured_description_crop_{name}" for name in RESOLUTIONS}
META_COLUMN = "bbox_resize_meta"
CAPTION_FRAMES = ("oriented", "raw")
GRID = 1000  # boxes are normalised to 0..GRID
EDGE_TOLERANCE = 1e-6  # grid units; a value this far past an edge still counts as inside

CAPTION_SEPARATORS = (", ", ": ")
META_SEPARATORS = (",", ":")


class CaptionStatus(str, Enum):
    OK = "ok"
    MISSING = "missing"
    INVALID_JSON = "invalid_json"


class BoxOutcome(str, Enum):
    INSIDE = "inside"
    CLIPPED = "clipped"
    OUTSIDE = "outside"
    MALFORMED = "malformed"


@dataclass
class BoxCounts:
    total: int = 0
    inside: int = 0
    clipped: int = 0
    outside: int = 0
    malformed: int = 0

    def add(self, outcome: BoxOutcome) -> None:
        self.total += 1
        setattr(self, outcome.value, getattr(self, outcome.value) + 1)

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

    def to_crop_y(self, v: float) -> float:
        """A 0..1000 source-grid y to the crop's 0..1000 grid (unclipped)."""
        return (v / GRID * self.src_height - self.y0) / (self.y1 - self.y0) * GRID

    def to_crop_x(self, v: float) -> float:
        return (v / GRID * self.src_width - self.x0) / (self.x1 - self.x0) * GRID

    @classmethod
    def from_audit(cls, record: AuditRecord) -> "CropFrame | None":
        """The frame recorded by the resize stage, or None when the audit lacks any part of it."""
        parts = (record.src_width, record.src_height, record.crop_x0, record.crop_y0, record.crop_x1, record.crop_y1)
        if any(p is None for p in parts):
            return None
        frame = cls(*parts)
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
    return CaptionStatus.OK, value


def dump_caption(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=CAPTION_SEPARATORS, allow_nan=False)


# -- one box --------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_box(value: Any) -> tuple[float, float, float, float] | None:
    """The box [ymin, xmin, ymax, xmax] if well-formed, else None (malformed)."""
    if not isinstance(value, list) or len(value) != 4 or not all(_is_number(v) for v in value):
        return None
    if not all(0 <= v <= GRID for v in value):
        return None
    ymin, xmin, ymax, xmax = value
    if ymin > ymax or xmin > xmax:
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
    if not isinstance(value, list) or len(value) != 4:
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return False
    return parse_box(value) is not None


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def transform_box(value: Any, frame: CropFrame, orientation: int = 1) -> tuple[list[int] | None, BoxOutcome]:
    """One caption box into the crop frame: (new box or None, what happened to it).

    `orientation` is the EXIF orientation to undo first; pass 1 for oriented-frame captions.
    """
    box = parse_box(value)
    if box is None:
        return None, BoxOutcome.MALFORMED
    ymin, xmin, ymax, xmax = box if orientation == exif.UPRIGHT else caption_box_to_oriented(box, orientation)
    unclipped = (frame.to_crop_y(ymin), frame.to_crop_x(xmin), frame.to_crop_y(ymax), frame.to_crop_x(xmax))
    result = [_round_half_up(min(max(v, 0.0), GRID)) for v in unclipped]
    if result[0] >= result[2] or result[1] >= result[3]:
        return None, BoxOutcome.OUTSIDE
    if all(-EDGE_TOLERANCE <= v <= GRID + EDGE_TOLERANCE for v in unclipped):
        return result, BoxOutcome.INSIDE
    return result, BoxOutcome.CLIPPED


# -- walking a caption's boxes --------------------------------------------------------


class BoxSlot(NamedTuple):
    """One place in a caption where a box may be (SPEC 6 walk).

    `value` is whatever the caption holds there: a box, null, or anything malformed. A crop
    caption keeps its original's slots, so slot i of an original and slot i of its crop
    variant are the same object.
    """

    index: int  # walk order over the caption, from 0
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
    if any(isinstance(item, list) for item in value):
        return True
    return crop_frame and all(item is None for item in value)


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
    is not modified. Raises RecursionError for captions nested too deep to walk.

    `replace(value, holder, key, item, holder_parts)` is called once per slot, in walk order,
    with the fields of `BoxSlot` (no object is made: the transform runs on every row);
    `box_slots` collects them as BoxSlots.
    """
    keys = frozenset(bbox_keys)

    def at_box_key(holder: dict, key: str, value: Any, parts: Any) -> Any:
        if isinstance(value, list) and not value:
            return value
        if is_box_list(value, crop_frame):
            result = []
            for i, item in enumerate(value):
                result.append(replace(item, holder, key, i, parts))
            return result
        return replace(value, holder, key, None, parts)

    def walk(node: Any, parts: Any) -> Any:
        # Plain loops, not comprehensions: one Python frame per JSON level, so deep captions fit.
        # Scalars are copied without a call (most of a caption's values).
        if isinstance(node, dict):
            result = {}
            for key, child in node.items():
                if key in keys:
                    result[key] = at_box_key(node, key, child, parts)
                elif isinstance(child, (dict, list)):
                    result[key] = walk(child, (parts, key))
                else:
                    result[key] = child
            return result
        result = []
        for i, child in enumerate(node):
            result.append(walk(child, (parts, i)) if isinstance(child, (dict, list)) else child)
        return result

    return walk(caption, None) if isinstance(caption, (dict, list)) else caption


def box_slots(caption: Any, bbox_keys: Iterable[str] = DEFAULT_BBOX_KEYS, *, crop_frame: bool = False) -> list[BoxSlot]:
    """Every box slot of a parsed caption, in walk order (see `map_box_slots`)."""
    slots: list[BoxSlot] = []

    def collect(value: Any, holder: dict, key: str, item: int | None, parts: Any) -> Any:
        slots.append(BoxSlot(len(slots), value, holder, key, item, parts))
        return value

    map_box_slots(caption, bbox_keys, collect, crop_frame=crop_frame)
    return slots


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
    its counts are then None too.
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
            raise ValueError(f"resolution {name}: the audit marks the row valid but lacks its crop geometry")

    transformed: dict[str, tuple[str, BoxCounts]] = {}
    if status is CaptionStatus.OK:
        try:
            for name, frame in frames.items():
                if frame is not None:
                    new_value, counts = transform_caption(value, frame, bbox_keys, undo_orientation)
                    transformed[name] = (dump_caption(new_value), counts)
        except RecursionError:
            # Nested too deep to walk; json.loads rejects a little deeper still. Either way the
            # caption is unusable, and it is reported like any other unreadable caption.
            status, transformed = CaptionStatus.INVALID_JSON, {}

    meta: dict[str, Any] = {"caption_status": status.value, "exif_orientation": orientation}
    crops: dict[str, str | None] = {}
    all_counts: dict[str, BoxCounts | None] = {}
    for name, record in audits.items():
        crops[name], all_counts[name] = transformed.get(name, (None, None))
        meta[name] = _resolution_meta(record, all_counts[name])
    return RowResult(crops, meta, all_counts)
