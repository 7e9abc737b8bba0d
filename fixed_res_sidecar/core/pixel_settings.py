"""What decides an output's bytes besides its source (SPEC 4): the settings a dataset chooses
(`PixelOptions`, each number held to its bound in SETTING_BOUNDS, the format one of OUTPUT_FORMATS)
and the pipeline's fixed choices and library versions, all recorded in every output shard's footer.

The bounds and formats are defined here once: PixelOptions checks them, the datasets file
(defs/config.py) hands them to pydantic, and the command line (cli/common.py `bounded`) parses its
flags with them, so a value one of them accepts is never refused by another.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from importlib import metadata
from types import MappingProxyType
from typing import Any, cast

import PIL
from PIL import Image, features

RESAMPLE = Image.Resampling.LANCZOS
RESAMPLE_NAME = "lanczos"

# Image.resize(reducing_gap=3.0) first box-reduces by an integer factor, leaving a Lanczos
# step of at least 3x; Pillow documents >= 3.0 as indistinguishable from a direct resample.
REDUCING_GAP = 3.0

# JPEG shrink-on-load keeps at least this many decoded pixels per output pixel along each
# axis of the crop box. 1.0 means "at least the output's resolution"; measured PSNR against
# a direct full-resolution Lanczos stays well above 40 dB (see test_render.py).
DRAFT_MARGIN = 1.0

# A smaller output is resampled from an already made larger one (instead of from the decoded
# image) only when that holds its crop box at least this many times finer along each axis;
# 512 from 1024 is about 2x. Measured PSNR against a direct full-resolution resample > 50 dB.
INTERMEDIATE_MIN_RATIO = 1.75

# The output formats (`--output-format`, a dataset's `output_format`) and Pillow's name for each.
OUTPUT_FORMATS = {"webp": "WEBP", "jpeg": "JPEG", "png": "PNG"}
# zlib level for PNG output: level 6 (Pillow's default) takes 2.4x as long for files ~4% smaller.
PNG_COMPRESS_LEVEL = 1
# What JPEG output (no alpha channel) composites transparency onto when no background is set.
JPEG_BACKGROUND = (255, 255, 255)
# Largest side each encoder can write.
ENCODER_MAX_SIDE = {"webp": 16383, "jpeg": 65535, "png": 2**31 - 1}


@dataclass(frozen=True)
class Bound:
    """The values a numeric setting may take: an integer (a finite number when not `integer`) above
    `gt`, at least `ge` and at most `le`, each when given. pydantic's names, so the datasets file
    passes them on as they are (`field_constraints`)."""

    integer: bool = True
    gt: int | float | None = None
    ge: int | float | None = None
    le: int | float | None = None

    def admits(self, value: object) -> bool:
        if self.integer:
            if not is_integer(value):
                return False
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        number = cast("int | float", value)  # an integer (numbers.Integral) or a finite float, checked above
        return (
            (self.gt is None or number > self.gt)
            and (self.ge is None or number >= self.ge)
            and (self.le is None or number <= self.le)
        )

    @property
    def description(self) -> str:
        """The rule in words, for messages: "an integer in 0..100", "a positive integer", "a finite number >= 1"."""
        if self.integer:
            low = self.ge if self.ge is not None else None if self.gt is None else self.gt + 1
            if low is not None and self.le is not None:
                return f"an integer in {low}..{self.le}"
            if low == 1 and self.le is None:
                return "a positive integer"
            kind, limits = "an integer", [(">=", low), ("<=", self.le)]
        else:
            kind, limits = "a finite number", [(">", self.gt), (">=", self.ge), ("<=", self.le)]
        return " ".join([kind, *(f"{sign} {value:g}" for sign, value in limits if value is not None)])

    def field_constraints(self) -> dict[str, object]:
        """The bound as pydantic `Field` arguments."""
        constraints: dict[str, object] = {
            name: value for name, value in (("gt", self.gt), ("ge", self.ge), ("le", self.le)) if value is not None
        }
        if not self.integer:
            constraints["allow_inf_nan"] = False
        return constraints


# Every bound on a numeric PixelOptions field, once (see the module's docstring); checked in this order.
SETTING_BOUNDS: Mapping[str, Bound] = MappingProxyType(
    {
        "quality": Bound(ge=0, le=100),
        "webp_method": Bound(ge=0, le=6),  # the WebP encoder's effort (`method=`)
        "patch_size": Bound(gt=0, le=4096),  # 4096 already exceeds every target side
        "max_source_pixels": Bound(gt=0),
        "min_source_side": Bound(gt=0),
        "max_aspect_ratio": Bound(integer=False, ge=1),
    }
)
# Each of the three channels of `PixelOptions.background`.
BACKGROUND_CHANNEL = Bound(ge=0, le=255)


@dataclass(frozen=True)
class PixelOptions:
    """How images are rendered. Invalid settings raise ValueError on construction."""

    patch_size: int = 32
    square: bool = False
    output_format: str = "webp"  # one of OUTPUT_FORMATS
    quality: int = 95
    webp_method: int = 4  # 0..6, the WebP encoder's effort (`method=`)
    max_source_pixels: int = 200_000_000  # checked from the header, before decode -> "too_large"
    max_aspect_ratio: float = 10.0  # max(W/H, H/W) above this -> "aspect_ratio"
    min_source_side: int = 16  # min(W, H) below this -> "too_small"
    # None keeps real alpha (WebP, PNG); a colour composites onto it. JPEG cannot hold
    # alpha, so JPEG output composites onto white when no background is given.
    background: tuple[int, int, int] | None = None
    draft: bool = True  # JPEG shrink-on-load when the downscale allows

    def __post_init__(self) -> None:
        problems = []
        if self.output_format not in OUTPUT_FORMATS:
            problems.append(f"output_format must be one of {sorted(OUTPUT_FORMATS)}, got {self.output_format!r}")
        for name, bound in SETTING_BOUNDS.items():
            value = getattr(self, name)
            if not bound.admits(value):
                problems.append(f"{name} must be {bound.description}, got {value!r}")
        if self.background is not None and (
            not isinstance(self.background, (tuple, list))
            or len(self.background) != 3
            or not all(BACKGROUND_CHANNEL.admits(c) for c in self.background)
        ):
            problems.append(
                f"background must be None or three values, each {BACKGROUND_CHANNEL.description}, "
                f"got {self.background!r}"
            )
        if problems:
            raise ValueError("invalid PixelOptions: " + "; ".join(problems))
        if self.background is not None:
            object.__setattr__(self, "background", tuple(self.background))

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> PixelOptions:
        """The options named in `values` (command-line arguments, a dataset's settings); others default."""
        names = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in names})


def is_integer(value: object) -> bool:
    # numbers.Integral also admits numpy integers (e.g. areas read from Parquet or YAML).
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def reference_options(options: PixelOptions) -> PixelOptions:
    """The same rendering as `options`, lossless (PNG): the pixels an output of `options` shows before
    its encoder's loss (what the verifier's fidelity check compares it with; it renders them with
    `process_image(..., encode=False)`, as the PNG would only give them back)."""
    background = options.background
    if background is None and options.output_format == "jpeg":
        background = JPEG_BACKGROUND
    return replace(options, output_format="png", background=background)


def pipeline_settings() -> dict[str, object]:
    """Fixed choices of this pipeline that decide output bytes besides PixelOptions (for build settings)."""
    return {
        "resample": RESAMPLE_NAME,
        "reducing_gap": REDUCING_GAP,
        "draft_margin": DRAFT_MARGIN,
        "intermediate_min_ratio": INTERMEDIATE_MIN_RATIO,
        "png_compress_level": PNG_COMPRESS_LEVEL,
    }


def library_versions() -> dict[str, str]:
    """Versions of the imaging libraries that shape the output pixels (for build settings)."""
    return dict(_library_versions())


@lru_cache(maxsize=1)
def _library_versions() -> tuple[tuple[str, str], ...]:
    versions = {
        "pillow": PIL.__version__,
        "pillow_distribution": _pillow_distribution(),
        "libwebp": features.version("webp"),
        "libjpeg": features.version("jpg"),
        "libjpeg_turbo": features.version_feature("libjpeg_turbo"),
        "littlecms2": features.version("littlecms2"),
        "zlib": features.version("zlib"),
    }
    return tuple((name, str(value) if value else "unavailable") for name, value in versions.items())


def _pillow_distribution() -> str:
    for name in ("pillow-simd", "Pillow"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"
