"""core/pixel_settings.py: the settings that decide an output's bytes, the libraries behind them, and the
bounds every setting is held to."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import typing

import PIL
import pytest
from PIL import features

from fixed_res_sidecar.core.pixel_settings import (
    BACKGROUND_CHANNEL,
    SETTING_BOUNDS,
    Bound,
    PixelOptions,
    library_versions,
    pipeline_settings,
)
from fixed_res_sidecar_tests.fixtures.pixels import DEFAULT, bound_edges

# ----------------------------------------------------------------------------- environment


def test_only_pillow_simd_is_installed():
    assert importlib.metadata.distribution("pillow-simd").version == PIL.__version__
    for plain_pillow in ("Pillow", "pillow"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(plain_pillow)
    assert features.check("webp") is True


def test_pipeline_settings_name_the_fixed_choices():
    settings_ = pipeline_settings()
    assert settings_["resample"] == "lanczos"
    assert {"reducing_gap", "draft_margin", "intermediate_min_ratio", "png_compress_level"} <= set(settings_)


def test_library_versions_name_the_libraries_that_shape_pixels():
    versions = library_versions()
    assert versions["pillow"] == PIL.__version__
    assert versions["pillow_distribution"] == f"pillow-simd {PIL.__version__}"
    assert versions["libwebp"] == features.version("webp")
    assert {"libjpeg", "libjpeg_turbo", "littlecms2", "zlib"} <= set(versions)
    assert all(isinstance(v, str) and v for v in versions.values())
    versions["pillow"] = "changed"  # callers get a copy
    assert library_versions()["pillow"] == PIL.__version__


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"quality": 101}, "quality"),
        ({"quality": -1}, "quality"),
        ({"quality": 9.5}, "quality"),
        ({"webp_method": 7}, "webp_method"),
        ({"output_format": "gif"}, "output_format"),
        ({"patch_size": 0}, "patch_size"),
        ({"max_source_pixels": 0}, "max_source_pixels"),
        ({"min_source_side": -3}, "min_source_side"),
        ({"max_aspect_ratio": 0.5}, "max_aspect_ratio"),
        ({"max_aspect_ratio": float("nan")}, "max_aspect_ratio"),
        ({"background": (255, 255)}, "background"),
        ({"background": (0, 0, 256)}, "background"),
    ],
)
def test_bad_options_are_refused_before_work_starts(bad, field):
    with pytest.raises(ValueError, match=field):
        PixelOptions(**bad)


def test_default_options_match_the_spec():
    assert DEFAULT.output_format == "webp" and DEFAULT.quality == 95 and DEFAULT.patch_size == 32
    assert DEFAULT.background is None and DEFAULT.square is False


# ----------------------------------------------------------------------------- bounds


def test_every_numeric_setting_has_its_one_bound():
    hints = typing.get_type_hints(PixelOptions)
    numeric = {f.name for f in dataclasses.fields(PixelOptions) if hints[f.name] in (int, float)}
    assert numeric == set(SETTING_BOUNDS)


@pytest.mark.parametrize("name", list(SETTING_BOUNDS))
def test_options_refuse_exactly_what_the_bound_refuses(name):
    inside, outside = bound_edges(SETTING_BOUNDS[name])
    for value in inside:
        assert getattr(PixelOptions(**{name: value}), name) == value
    for value in outside:
        with pytest.raises(ValueError, match=f"{name} must be {SETTING_BOUNDS[name].description}"):
            PixelOptions(**{name: value})


def test_bounds_say_their_rule():
    rules = {name: bound.description for name, bound in SETTING_BOUNDS.items()}
    assert rules == {
        "quality": "an integer in 0..100",
        "webp_method": "an integer in 0..6",
        "patch_size": "an integer in 1..4096",
        "max_source_pixels": "a positive integer",
        "min_source_side": "a positive integer",
        "max_aspect_ratio": "a finite number >= 1",
    }
    assert (
        Bound(ge=5).description == "an integer >= 5" and Bound(integer=False, gt=0).description == "a finite number > 0"
    )
    assert SETTING_BOUNDS["patch_size"].field_constraints() == {"gt": 0, "le": 4096}
    assert SETTING_BOUNDS["max_aspect_ratio"].field_constraints() == {"ge": 1, "allow_inf_nan": False}


def test_background_channels_are_held_to_their_bound():
    inside, outside = bound_edges(BACKGROUND_CHANNEL)
    for value in inside:
        assert PixelOptions(background=(value, value, value)).background == (value, value, value)
    for value in outside:
        with pytest.raises(ValueError, match="background"):
            PixelOptions(background=(0, value, 0))
