"""Target size and crop box for a fixed image area (SPEC section 3).

Pure functions: no images, no I/O. Everything else derives its geometry from here.
"""

import math
from dataclasses import dataclass

AREA_512 = 512 * 512  # 262,144 px, "0.26 MP"
AREA_1024 = 1024 * 1024  # 1,048,576 px, "1.05 MP"


@dataclass(frozen=True)
class CropBox:
    """A box in source pixels (floats), left/top inclusive, right/bottom exclusive."""

    x0: float
    y0: float
    x1: float
    y1: float

    @property
    def width(self) -> float:
        return self.x1 - self.x0

    @property
    def height(self) -> float:
        return self.y1 - self.y0

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.x0, self.y0, self.x1, self.y1)


@dataclass(frozen=True)
class Geometry:
    """Where a source image of `src_size` lands in a frame of `target_size`."""

    src_size: tuple[int, int]
    target_size: tuple[int, int]
    crop_box: CropBox

    @property
    def scale(self) -> float:
        return self.target_size[0] / self.crop_box.width


def _round_to_patch(ideal: float, patch_size: int) -> int:
    # floor(x + 0.5) is "round half up"; Python's round() is banker's rounding.
    return patch_size * max(1, math.floor(ideal / patch_size + 0.5))


def ideal_size(width: int, height: int, area: int) -> tuple[float, float]:
    return math.sqrt(area * width / height), math.sqrt(area * height / width)


def target_size(width: int, height: int, area: int, patch_size: int = 32, square: bool = False) -> tuple[int, int]:
    """Output (tw, th): multiples of `patch_size` whose area is near `area`, aspect kept."""
    _check_positive(width, height, area, patch_size)
    if square:
        side = _round_to_patch(math.sqrt(area), patch_size)
        return side, side
    ideal_w, ideal_h = ideal_size(width, height, area)
    return _round_to_patch(ideal_w, patch_size), _round_to_patch(ideal_h, patch_size)


def crop_box(width: int, height: int, target: tuple[int, int]) -> CropBox:
    """The centred box of the source with the target's aspect ratio, cropping one axis only."""
    tw, th = target
    ratio = tw / th
    if width / height > ratio:
        cw = height * ratio
        x0 = (width - cw) / 2
        return CropBox(x0, 0.0, x0 + cw, float(height))
    ch = width / ratio
    y0 = (height - ch) / 2
    return CropBox(0.0, y0, float(width), y0 + ch)


def geometry(width: int, height: int, area: int, patch_size: int = 32, square: bool = False) -> Geometry:
    target = target_size(width, height, area, patch_size, square)
    return Geometry((width, height), target, crop_box(width, height, target))


def area_tolerance(width: int, height: int, area: int, patch_size: int = 32) -> float:
    """Largest |tw*th/A - 1| that rounding each side to `patch_size` can cause."""
    ideal_w, ideal_h = ideal_size(width, height, area)
    return (1 + patch_size / (2 * ideal_w)) * (1 + patch_size / (2 * ideal_h)) - 1 + 1e-9


def near_target_area(out_w: int, out_h: int, src_w: int, src_h: int, area: int, patch_size: int = 32) -> bool:
    """SPEC section 3: the output area is within what rounding to the patch allows."""
    return abs(out_w * out_h / area - 1) <= area_tolerance(src_w, src_h, area, patch_size)


def _check_positive(*values: int) -> None:
    if any(v <= 0 for v in values):
        raise ValueError(f"sizes, area and patch size must be positive, got {values}")
