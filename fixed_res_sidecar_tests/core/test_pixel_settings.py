"""core/pixel_settings.py: the settings that decide an output's bytes, the libraries behind them, and the
bounds every setting is held to."""

from __future__ import annotations

import importlib.metadata

import PIL
import pytest
from PIL import features

from fixed_res_sidecar.core.pixel_settings import PixelOptions, library_versions, pipeline_settings
from fixed_res_sidecar_tests.fixtures.pixels import DEFAULT

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
