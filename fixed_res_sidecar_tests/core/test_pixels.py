"""The per-image pixel pipeline (SPEC sections 3-5), on real images generated with Pillow."""

from __future__ import annotations

import importlib.metadata
import io
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import numpy as np
import PIL
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageCms, ImageOps, features

from fixed_res_sidecar.core.audit import ERROR_CODES, AuditRecord, audit_arrays
from fixed_res_sidecar.core.geometry import AREA_512, AREA_1024, geometry, near_target_area
from fixed_res_sidecar.core.memory import MemoryBudget
from fixed_res_sidecar.core.pixels import (
    EXCLUDED_INPUT_FORMATS,
    JPEG_SCAN_PADDING,
    MAX_COUNTED_FRAMES,
    ImageResult,
    PixelOptions,
    decode_memory_estimate,
    draft_factor,
    gif_frame_count,
    input_formats,
    jpeg_scan_end,
    library_versions,
    open_image,
    pipeline_settings,
    process_image,
    too_many_pixels,
)
from fixed_res_sidecar_tests.fixtures.images import (
    GREY,
    RED,
    adobe_rgb_like_profile,
    animated_gif,
    bad_inputs,
    broken_exif_jpeg,
    cmyk_jpeg,
    encode,
    gif_with_frames,
    grey_profile,
    header_bombs,
    jpeg_bytes,
    marker_image,
    palette_png_with_transparency,
    photo_like,
    png_bytes,
    png_with_exif_after_pixels,
    rgba_png,
    sixteen_bit_grey_png,
    swapped_red_green_profile,
    text_orientation_jpeg,
    truncated_with_end_marker,
)

BOTH_AREAS = (AREA_512, AREA_1024)
DEFAULT = PixelOptions()


def run(data, areas=(AREA_512,), **options) -> list[ImageResult]:
    return process_image(data, areas, PixelOptions(**options))


def decoded(result: ImageResult) -> Image.Image:
    assert result.record.valid, result.record
    image = Image.open(io.BytesIO(result.image))
    image.load()
    return image


def pixel(image: Image.Image, fx: float, fy: float):
    """The pixel at a fraction of the width and height."""
    return image.getpixel((min(int(fx * image.width), image.width - 1), min(int(fy * image.height), image.height - 1)))


def close(actual, expected, tolerance: int) -> bool:
    return all(abs(a - e) <= tolerance for a, e in zip(actual, expected))


def assert_valid_output(result: ImageResult, src_size, area, options: PixelOptions = DEFAULT) -> Image.Image:
    """The audit of a valid row agrees with SPEC 3 geometry and the encoded bytes."""
    record = result.record
    target = geometry(*src_size, area, options.patch_size, options.square)
    assert record.valid and record.error is None and result.image is not None
    assert (record.src_width, record.src_height) == src_size
    assert (record.width, record.height) == target.target_size
    assert record.width % options.patch_size == 0 and record.height % options.patch_size == 0
    assert (record.crop_x0, record.crop_y0, record.crop_x1, record.crop_y1) == target.crop_box.as_tuple()
    assert record.scale == pytest.approx(record.width / (record.crop_x1 - record.crop_x0))
    assert record.out_bytes == len(result.image)
    image = decoded(result)
    assert image.size == (record.width, record.height)
    assert image.format == {"webp": "WEBP", "jpeg": "JPEG", "png": "PNG"}[options.output_format]
    return image


def psnr(a: Image.Image, b: Image.Image) -> float:
    x = np.asarray(a.convert("RGB"), dtype=np.float64)
    y = np.asarray(b.convert("RGB"), dtype=np.float64)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


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


def test_pillow_bomb_guard_is_replaced_by_the_configured_limit():
    assert Image.MAX_IMAGE_PIXELS is None


def eps_bytes() -> bytes:
    return encode(Image.new("RGB", (32, 32), GREY), "EPS")


def test_eps_is_never_opened():
    data = eps_bytes()
    assert Image.open(io.BytesIO(data)).format == "EPS"  # Pillow alone would hand it to Ghostscript
    assert "EPS" in EXCLUDED_INPUT_FORMATS and "EPS" not in input_formats()
    assert {"JPEG", "PNG", "WEBP", "GIF", "TIFF"} <= set(input_formats())
    with pytest.raises(Image.UnidentifiedImageError):
        open_image(data)
    (result,) = run(data)
    assert (result.record.valid, result.record.error) == (False, "decode_error")


def test_open_image_reads_only_the_header():
    image = open_image(jpeg_bytes(marker_image(64, 48)))
    assert (image.format, image.size) == ("JPEG", (64, 48))
    assert image.tile  # nothing decoded yet (load() empties the tile list)


def test_too_many_pixels_is_the_header_limit():
    assert too_many_pixels(200, 100, 20_000) is None
    assert too_many_pixels(200, 100, 19_999) == "source has 20000 pixels (200x100), more than max_source_pixels=19999"


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


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_table_covers_every_header_error(bad_images):
    expected = {"missing_image", "decode_error", "too_large", "too_small", "aspect_ratio"}
    assert {case.error for case in bad_images.values()} == expected


@pytest.mark.parametrize("name", list(bad_inputs()))
def test_every_bad_input_is_an_invalid_row_not_an_exception(bad_images, name):
    data, error = bad_images[name]
    results = process_image(data, BOTH_AREAS, DEFAULT)
    assert len(results) == 2
    for result in results:
        assert result.image is None
        assert result.record.valid is False
        assert result.record.error == error
        assert result.record.error_detail
        assert result.record.out_bytes is None and result.record.width is None


@pytest.mark.parametrize("data, detail", [(None, "image bytes are null"), (b"", "image bytes are empty")])
def test_missing_image(data, detail):
    (result,) = run(data)
    assert result.record == AuditRecord(valid=False, error="missing_image", error_detail=detail)


@pytest.mark.parametrize("name", ["random_bytes", "text"])
def test_not_an_image(bad_images, name):
    (result,) = run(bad_images[name].data)
    assert result.record == AuditRecord(
        valid=False,
        error="decode_error",
        # No memory address in the text: rebuilding a shard gives identical bytes.
        error_detail="UnidentifiedImageError: cannot identify image file <_io.BytesIO object>",
    )


def test_truncated_jpeg_keeps_what_the_header_said(bad_images):
    (result,) = run(bad_images["truncated_jpeg"].data)
    record = result.record
    assert (record.valid, record.error) == (False, "decode_error")
    assert "truncated" in record.error_detail
    assert (record.src_width, record.src_height, record.src_format, record.src_mode) == (320, 240, "JPEG", "RGB")
    assert (record.exif_orientation, record.n_frames, record.width) == (1, 1, None)


def test_huge_png_header_is_refused_without_decoding(bad_images):
    data = bad_images["huge_png_header"].data
    assert len(data) < 200  # a tiny file claiming 40000x40000 pixels
    started = time.perf_counter()
    results = process_image(data, BOTH_AREAS, DEFAULT)
    # Decoding would need 6.4 GB and would then fail on the missing pixel data.
    assert time.perf_counter() - started < 0.5
    assert (
        results[0].record
        == results[1].record
        == AuditRecord(
            valid=False,
            error="too_large",
            error_detail="source has 1600000000 pixels (40000x40000), more than max_source_pixels=200000000",
            src_width=40000,
            src_height=40000,
            src_format="PNG",
            src_mode="RGB",
            exif_orientation=1,
            n_frames=1,
        )
    )


# What each header bomb claims: (width, height) as Pillow reads it from the header.
HEADER_CLAIMS = {
    "ppm_2_32": (2**32 - 1, 1),
    "ppm_2_31": (2**31, 16),
    "tiff_2_32": (2**32 - 1, 1),
    "psd_2_32": (2**32 - 1, 1),
    "dds_2_32": (2**32 - 1, 1),
    "fits_5e9": (5_000_000_000, 1),
}


@pytest.mark.parametrize("name", sorted(HEADER_CLAIMS))
def test_a_header_claiming_a_side_of_2_31_or_more_is_audited_whole_and_writable(name):
    data = header_bombs()[name]
    results = process_image(data, BOTH_AREAS, DEFAULT)
    for result in results:
        record = result.record
        assert (record.valid, record.error) == (False, "too_large")
        assert (record.src_width, record.src_height) == HEADER_CLAIMS[name]
        assert f"{record.src_width}x{record.src_height}" in record.error_detail
    # The audit columns hold what the header claimed (before: ArrowInvalid, the shard was lost).
    columns = audit_arrays("p", [r.record for r in results])
    assert columns["p_src_width"].to_pylist() == [HEADER_CLAIMS[name][0]] * 2


def test_an_apng_claiming_2_31_frames_records_the_capped_count():
    (result,) = run(header_bombs()["apng_2_31_frames"])
    assert result.record.valid
    assert result.record.n_frames == MAX_COUNTED_FRAMES
    assert result.record.error_detail == f"more than {MAX_COUNTED_FRAMES} frames; n_frames stops there"
    assert audit_arrays("p", [result.record])["p_n_frames"].to_pylist() == [MAX_COUNTED_FRAMES]


def _pillow_gif(frames: int) -> bytes:
    """A GIF as Pillow writes it: local palettes, a comment and a loop extension."""
    images = [Image.new("RGB", (40, 30), (i * 40 % 256, 255 - i * 20 % 256, i * 7 % 256)) for i in range(frames)]
    return encode(images[0], "GIF", save_all=True, append_images=images[1:], loop=0, comment=b"hello", duration=50)


@pytest.mark.parametrize(
    "data",
    [animated_gif(), _pillow_gif(1), _pillow_gif(9), gif_with_frames(7, frame_size=8), gif_with_frames(3)],
    ids=["three_colours", "pillow_1", "pillow_9", "seven_8px", "three_1px"],
)
def test_gif_frame_count_counts_what_pillow_counts(data):
    assert gif_frame_count(data, 10**6) == Image.open(io.BytesIO(data)).n_frames


@pytest.mark.parametrize("frames", [MAX_COUNTED_FRAMES, MAX_COUNTED_FRAMES + 1, 1_000_000])
def test_frame_counting_stops_past_the_cap(frames):
    """A million 1-pixel frames took Pillow's n_frames about 2 s per row; the walk now stops at the cap."""
    data = gif_with_frames(frames)
    assert gif_frame_count(data, MAX_COUNTED_FRAMES + 1) == min(frames, MAX_COUNTED_FRAMES + 1)
    results = process_image(data, BOTH_AREAS, DEFAULT)
    for result in results:
        assert result.record.valid and result.record.src_format == "GIF"
        assert result.record.n_frames == MAX_COUNTED_FRAMES
        capped = frames > MAX_COUNTED_FRAMES
        assert result.record.error_detail == (
            f"more than {MAX_COUNTED_FRAMES} frames; n_frames stops there" if capped else None
        )


def test_tiff_frame_counting_stops_past_the_cap():
    frames = [Image.new("L", (16, 16), i % 256) for i in range(MAX_COUNTED_FRAMES + 5)]
    data = encode(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    (result,) = run(data)
    assert result.record.valid and result.record.n_frames == MAX_COUNTED_FRAMES
    assert "n_frames stops there" in result.record.error_detail
    (three,) = run(encode(frames[0], "TIFF", save_all=True, append_images=frames[1:3]))
    assert three.record.n_frames == 3 and three.record.error_detail is None


def _jpeg_variants() -> dict[str, bytes]:
    photo = photo_like(640, 480, seed=21)
    return {
        "baseline_420": jpeg_bytes(photo),
        "baseline_444": jpeg_bytes(photo, subsampling=0),
        "grey": jpeg_bytes(photo.convert("L")),
        "cmyk": jpeg_bytes(photo.convert("CMYK")),
        "optimized_huffman": jpeg_bytes(photo, optimize=True),
        "restart_markers": jpeg_bytes(photo, restart_marker_blocks=4),
        "exif_6": jpeg_bytes(photo, orientation=6),
    }


@pytest.mark.parametrize("name", list(_jpeg_variants()))
def test_a_jpeg_cut_short_with_an_end_marker_appended_is_a_decode_error(name):
    data = _jpeg_variants()[name]
    results = process_image(truncated_with_end_marker(data, 0.6), BOTH_AREAS, DEFAULT)
    for result in results:
        assert (result.record.valid, result.record.error) == (False, "decode_error")
        assert "truncated" in result.record.error_detail
    # The whole image still decodes, to exactly the pixels of a plain decode.
    assert all(r.record.valid for r in process_image(data, BOTH_AREAS, DEFAULT))
    end = jpeg_scan_end(data)
    assert end == len(data) - 2
    plain = Image.open(io.BytesIO(data)).tobytes()
    assert Image.open(io.BytesIO(data[:end] + JPEG_SCAN_PADDING)).tobytes() == plain


def test_a_complete_jpeg_without_its_end_marker_decodes():
    data = _jpeg_variants()["baseline_420"]
    assert all(r.record.valid for r in process_image(data[:-2], BOTH_AREAS, DEFAULT))


def test_a_progressive_jpeg_cut_short_with_an_end_marker_is_not_detected():
    """The README's stated limit: progressive (and multi-scan) JPEGs are not checked for truncation."""
    data = jpeg_bytes(photo_like(640, 480, seed=22), progressive=True)
    assert jpeg_scan_end(data) is None
    (result,) = run(truncated_with_end_marker(data, 0.6))
    assert result.record.valid


def test_an_image_over_the_whole_memory_budget_is_too_large_without_decoding():
    data = png_bytes(photo_like(320, 240, seed=23))
    needed = decode_memory_estimate(open_image(data))
    assert needed == 320 * 240 * 5  # RGB: 4 bytes per pixel decoded, 1 for resampling
    refused = process_image(data, BOTH_AREAS, DEFAULT, MemoryBudget(needed - 1))
    for result in refused:
        assert (result.record.valid, result.record.error) == (False, "too_large")
        assert "decode memory budget" in result.record.error_detail
        assert result.record.src_width == 320
    budget = MemoryBudget(needed)
    assert all(r.record.valid for r in process_image(data, BOTH_AREAS, DEFAULT, budget))
    assert budget.used == 0


@pytest.mark.parametrize(
    "mode, bytes_per_pixel",
    [("RGB", 5), ("RGBA", 10), ("LA", 10), ("L", 2), ("P", 6), ("I;16", 12), ("CMYK", 5)],
)
def test_decode_memory_estimate_per_mode(mode, bytes_per_pixel):
    image = Image.new(mode, (100, 50))
    data = encode(image, "JPEG" if mode == "CMYK" else "PNG")
    assert decode_memory_estimate(open_image(data)) == 100 * 50 * bytes_per_pixel


def test_decode_memory_estimate_follows_jpeg_shrink_on_load():
    image = open_image(jpeg_bytes(photo_like(400, 300, seed=24)))
    assert decode_memory_estimate(image, draft=2) == 200 * 150 * 5
    assert decode_memory_estimate(image, draft=8) == 50 * 38 * 5  # sides round up


def test_max_source_pixels_is_configurable():
    data = png_bytes(photo_like(200, 100, noise=0))
    (refused,) = run(data, max_source_pixels=19_999)
    (accepted,) = run(data, max_source_pixels=20_000)
    assert refused.record.error == "too_large" and accepted.record.valid


def test_one_pixel_image_is_too_small(bad_images):
    (result,) = run(bad_images["one_pixel"].data)
    assert result.record == AuditRecord(
        valid=False,
        error="too_small",
        error_detail="source is 1x1, its smaller side is below min_source_side=16",
        src_width=1,
        src_height=1,
        src_format="PNG",
        src_mode="RGB",
        exif_orientation=1,
        n_frames=1,
    )


def test_panorama_exceeds_the_aspect_ratio_limit(bad_images):
    (result,) = run(bad_images["panorama_20_to_1"].data)
    assert result.record == AuditRecord(
        valid=False,
        error="aspect_ratio",
        error_detail="source is 2000x100, aspect ratio 20 exceeds max_aspect_ratio=10",
        src_width=2000,
        src_height=100,
        src_format="JPEG",
        src_mode="RGB",
        exif_orientation=1,
        n_frames=1,
    )
    (allowed,) = run(bad_images["panorama_20_to_1"].data, max_aspect_ratio=25)
    assert_valid_output(allowed, (2000, 100), AREA_512)


def test_encoder_side_limit_is_per_output():
    data = png_bytes(Image.new("RGB", (6000, 20), GREY))  # 300:1
    small, large = run(data, BOTH_AREAS, max_aspect_ratio=1000)
    assert_valid_output(small, (6000, 20), AREA_512)
    assert (small.record.width, small.record.height) == (8864, 32)
    assert large.image is None
    assert (large.record.valid, large.record.error) == (False, "too_large")
    assert large.record.error_detail == "output 17728x64 exceeds the webp encoder limit of 16383 px per side"
    assert (large.record.width, large.record.height) == (17728, 64)  # what it would have been
    # JPEG can write 65535 px per side.
    _, large_jpeg = run(data, BOTH_AREAS, max_aspect_ratio=1000, output_format="jpeg")
    assert_valid_output(large_jpeg, (6000, 20), AREA_1024, PixelOptions(output_format="jpeg"))


def test_unsupported_mode_is_reported():
    data = encode(Image.new("F", (64, 64), 0.5), "TIFF")
    (result,) = run(data)
    assert (result.record.error, result.record.src_format, result.record.src_mode) == ("unsupported", "TIFF", "F")
    assert result.record.error_detail == "image mode F is not supported"
    assert (result.record.src_width, result.record.src_height) == (64, 64)


# ----------------------------------------------------------------------------- geometry


def test_both_outputs_from_one_call_follow_the_geometry():
    data = jpeg_bytes(photo_like(1200, 800, seed=3))
    small, large = process_image(data, BOTH_AREAS, DEFAULT)
    assert_valid_output(small, (1200, 800), AREA_512)
    assert_valid_output(large, (1200, 800), AREA_1024)
    assert (small.record.width, small.record.height) == (640, 416)
    assert (large.record.width, large.record.height) == (1248, 832)
    assert small.record.src_format == "JPEG" and small.record.n_frames == 1


@pytest.mark.parametrize("areas", [[0], [AREA_512, -1], [1.5]])
def test_bad_areas_are_refused(areas):
    with pytest.raises(ValueError, match="target areas"):
        process_image(jpeg_bytes(Image.new("RGB", (64, 64))), areas, DEFAULT)


def test_results_follow_the_order_of_the_areas():
    data = jpeg_bytes(photo_like(400, 300, seed=4))
    widths = [r.record.width for r in process_image(data, [AREA_1024, AREA_512, AREA_1024], DEFAULT)]
    assert widths == [1184, 576, 1184]
    assert process_image(data, [], DEFAULT) == []


def test_upscale_has_scale_above_one():
    data = jpeg_bytes(photo_like(300, 450, seed=5))
    (result,) = run(data, (AREA_1024,))
    assert_valid_output(result, (300, 450), AREA_1024)
    assert result.record.scale > 1
    assert (result.record.width, result.record.height) == (832, 1248)


def test_square_option_crops_the_centred_square():
    data = png_bytes(marker_image(600, 300))
    (result,) = run(data, square=True)
    image = assert_valid_output(result, (600, 300), AREA_512, PixelOptions(square=True))
    assert image.size == (512, 512)
    assert (result.record.crop_x0, result.record.crop_x1) == (150.0, 450.0)
    assert close(pixel(image, 0.05, 0.05), GREY, 8)  # the top-left marker was cropped away


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    width=st.integers(16, 420),
    height=st.integers(16, 420),
    area=st.sampled_from([64 * 64, 96 * 128, 160 * 160]),
    patch_size=st.sampled_from([16, 32]),
    square=st.booleans(),
)
def test_output_size_is_the_geometry_target_for_any_source_size(width, height, area, patch_size, square):
    assume(max(width / height, height / width) <= 10)
    data = png_bytes(Image.linear_gradient("L").resize((width, height)).convert("RGB"))
    options = PixelOptions(patch_size=patch_size, square=square, webp_method=0)
    (result,) = process_image(data, [area], options)
    image = assert_valid_output(result, (width, height), area, options)
    if not square:
        assert near_target_area(*image.size, width, height, area, patch_size)


# ----------------------------------------------------------------------------- orientation


# Where the top-left corner of the stored pixels is once the image is upright.
MARKER_CORNER = {1: "TL", 2: "TR", 3: "BR", 4: "BL", 5: "TL", 6: "TR", 7: "BR", 8: "BL"}
CORNERS = {"TL": (0.06, 0.06), "TR": (0.94, 0.06), "BL": (0.06, 0.94), "BR": (0.94, 0.94)}


def assert_marker_in(image: Image.Image, corner: str) -> None:
    for name, (fx, fy) in CORNERS.items():
        colour = pixel(image.convert("RGB"), fx, fy)
        assert close(colour, RED if name == corner else GREY, 40), (name, colour, corner)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation):
    data = jpeg_bytes(marker_image(640, 480), orientation=orientation)
    (result,) = run(data)
    upright = (480, 640) if orientation >= 5 else (640, 480)
    image = assert_valid_output(result, upright, AREA_512)
    assert result.record.exif_orientation == orientation
    assert_marker_in(image, MARKER_CORNER[orientation])
    # Same answer as Pillow's own exif_transpose followed by a plain resize.
    reference = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).resize(image.size)
    assert psnr(image, reference) > 25


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_orientation_of_both_outputs_from_one_decode(orientation):
    data = jpeg_bytes(marker_image(1600, 1200), orientation=orientation)
    upright = (1200, 1600) if orientation >= 5 else (1600, 1200)
    for result, area in zip(process_image(data, BOTH_AREAS, DEFAULT), BOTH_AREAS):
        assert_marker_in(assert_valid_output(result, upright, area), MARKER_CORNER[orientation])


def test_orientation_stored_after_png_pixels_is_still_applied():
    data = png_with_exif_after_pixels(marker_image(640, 480), 6)
    small, large = process_image(data, BOTH_AREAS, DEFAULT)
    for result, area in ((small, AREA_512), (large, AREA_1024)):
        assert result.record.exif_orientation == 6
        assert_marker_in(assert_valid_output(result, (480, 640), area), "TR")


@pytest.mark.parametrize("value", [0, 9, 255])
def test_out_of_range_orientation_counts_as_1(value):
    data = jpeg_bytes(marker_image(640, 480), orientation=value)
    (result,) = run(data)
    assert result.record.exif_orientation == 1
    assert_marker_in(assert_valid_output(result, (640, 480), AREA_512), "TL")


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns "Corrupt EXIF data"
@pytest.mark.parametrize("make", [broken_exif_jpeg, text_orientation_jpeg])
def test_broken_exif_never_fails_a_row_that_decodes(make):
    (result,) = run(make(marker_image(640, 480)))
    assert result.record.exif_orientation == 1 and result.record.error_detail is None
    assert_marker_in(assert_valid_output(result, (640, 480), AREA_512), "TL")


# ----------------------------------------------------------------------------- colour


def test_cmyk_jpeg_colours_are_right():
    data = cmyk_jpeg(256, ((255, 0, 0, 0), (0, 255, 0, 0), (0, 0, 255, 0), (0, 0, 0, 255)))
    assert Image.open(io.BytesIO(data)).info.get("adobe") is not None  # the inverted Adobe kind
    (result,) = run(data)
    image = assert_valid_output(result, (256, 256), AREA_512).convert("RGB")
    assert result.record.src_mode == "CMYK"
    expected = {
        (0.25, 0.25): (0, 255, 255),
        (0.75, 0.25): (255, 0, 255),
        (0.25, 0.75): (255, 255, 0),
        (0.75, 0.75): (0, 0, 0),
    }
    for (fx, fy), colour in expected.items():
        assert close(pixel(image, fx, fy), colour, 12), ((fx, fy), pixel(image, fx, fy))


def test_sixteen_bit_grey_is_scaled_not_clipped():
    (result,) = run(sixteen_bit_grey_png(value=40000))
    assert result.record.src_mode == "I;16"
    image = assert_valid_output(result, (64, 48), AREA_512).convert("RGB")
    assert close(pixel(image, 0.5, 0.5), (156, 156, 156), 2)  # 40000 * 255 / 65535 = 155.6


def test_sixteen_bit_grey_keeps_its_range():
    values = np.linspace(0, 65535, 256, dtype=np.uint16).reshape(16, 16).repeat(8, 0).repeat(8, 1)
    data = png_bytes(Image.fromarray(values))
    (result,) = run(data, output_format="png")
    out = np.asarray(assert_valid_output(result, (128, 128), AREA_512, PixelOptions(output_format="png")))
    assert out.min() <= 2 and out.max() >= 253 and out.dtype == np.uint8


def test_sixteen_bit_grey_transparent_value_becomes_alpha():
    values = np.full((48, 64), 40000, dtype=np.uint16)
    values[:, :32] = 1000
    image = Image.fromarray(values)
    (result,) = run(png_bytes(image, transparency=1000), output_format="png")
    out = assert_valid_output(result, (64, 48), AREA_512, PixelOptions(output_format="png"))
    assert out.mode == "LA"
    assert pixel(out, 0.1, 0.5)[1] == 0
    assert pixel(out, 0.9, 0.5) == (156, 255)


def test_palette_png_transparency_is_kept():
    (result,) = run(palette_png_with_transparency())
    assert result.record.src_mode == "P"
    image = assert_valid_output(result, (96, 64), AREA_512)
    assert image.mode == "RGBA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (*RED, 255), 6)


def test_rgba_png_alpha_is_kept():
    (result,) = run(rgba_png(left_alpha=0, right_alpha=128))
    image = assert_valid_output(result, (96, 64), AREA_512)
    assert image.mode == "RGBA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (*RED, 128), 6)  # no colour bleeding from the transparent half


def test_rgba_png_composited_on_background_when_asked():
    (result,) = run(rgba_png(left_alpha=0, right_alpha=128), background=(0, 0, 255))
    image = assert_valid_output(result, (96, 64), AREA_512, PixelOptions(background=(0, 0, 255)))
    assert image.mode == "RGB"
    assert close(pixel(image, 0.1, 0.5), (0, 0, 255), 6)
    assert close(pixel(image, 0.9, 0.5), (128, 0, 127), 8)


def test_jpeg_output_composites_alpha_on_white():
    (result,) = run(rgba_png(left_alpha=0, right_alpha=128), output_format="jpeg")
    image = assert_valid_output(result, (96, 64), AREA_512, PixelOptions(output_format="jpeg"))
    assert image.mode == "RGB"
    assert close(pixel(image, 0.1, 0.5), (255, 255, 255), 8)
    assert close(pixel(image, 0.9, 0.5), (255, 127, 127), 10)


def test_fully_opaque_alpha_is_dropped():
    (result,) = run(rgba_png(left_alpha=255, right_alpha=255))
    assert result.record.src_mode == "RGBA"
    assert assert_valid_output(result, (96, 64), AREA_512).mode == "RGB"


def test_grey_with_alpha_keeps_alpha():
    grey = Image.new("LA", (96, 64), (200, 255))
    grey.paste((200, 0), (0, 0, 48, 64))
    (result,) = run(png_bytes(grey))
    image = assert_valid_output(result, (96, 64), AREA_512)
    assert image.mode == "RGBA" and result.record.src_mode == "LA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (200, 200, 200, 255), 4)


def test_animated_gif_uses_the_first_frame():
    (result,) = run(animated_gif(colours=(RED, (0, 255, 0), (0, 0, 255))))
    assert (result.record.n_frames, result.record.src_format) == (3, "GIF")
    image = assert_valid_output(result, (64, 48), AREA_512)
    assert close(pixel(image.convert("RGB"), 0.5, 0.5), RED, 8)


def test_grey_jpeg():
    (result,) = run(jpeg_bytes(Image.new("L", (320, 240), 90)))
    assert (result.record.src_mode, result.record.src_format) == ("L", "JPEG")
    image = assert_valid_output(result, (320, 240), AREA_512).convert("RGB")
    assert close(pixel(image, 0.5, 0.5), (90, 90, 90), 3)


def test_webp_input():
    (result,) = run(encode(Image.new("RGB", (320, 240), (20, 140, 220)), "WEBP", quality=95))
    assert (result.record.src_format, result.record.src_mode) == ("WEBP", "RGB")
    image = assert_valid_output(result, (320, 240), AREA_512)
    assert close(pixel(image, 0.5, 0.5), (20, 140, 220), 6)


@pytest.mark.parametrize("mode", ["1", "L", "P", "RGB", "I;16", "I;16B", "I"])
def test_odd_modes_become_eight_bit(mode):
    source = Image.linear_gradient("L").resize((128, 96))
    if mode.startswith("I"):
        values = np.asarray(source).astype(np.uint16) * 257
        byte_order = ">u2" if mode == "I;16B" else "<u2"
        source = Image.frombytes(
            "I;16B" if mode == "I;16B" else "I;16", source.size, values.astype(byte_order).tobytes()
        )
        source = source.convert("I") if mode == "I" else source
    else:
        source = source.convert(mode)
    assert source.mode == mode
    (result,) = run(encode(source, "TIFF"), output_format="png")
    image = assert_valid_output(result, (128, 96), AREA_512, PixelOptions(output_format="png"))
    assert image.mode in ("L", "RGB")
    assert np.asarray(image).max() >= 250  # the top of the gradient stays white


def srgb_reference(colour, profile: bytes, mode="RGB"):
    source = Image.new(mode, (1, 1), colour)
    converted = ImageCms.profileToProfile(
        source, ImageCms.ImageCmsProfile(io.BytesIO(profile)), ImageCms.createProfile("sRGB"), outputMode="RGB"
    )
    return converted.getpixel((0, 0))


def test_swapped_primaries_profile_turns_stored_red_into_green():
    stored = Image.new("RGB", (128, 96), (255, 0, 0))
    (tagged,) = run(png_bytes(stored, icc_profile=swapped_red_green_profile()))
    (plain,) = run(png_bytes(stored))
    assert close(pixel(decoded(tagged), 0.5, 0.5), (0, 255, 0), 6)
    assert close(pixel(decoded(plain), 0.5, 0.5), (255, 0, 0), 6)
    assert tagged.record.error_detail is None


def test_srgb_profile_changes_nothing():
    photo = photo_like(160, 120, seed=14)
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    (tagged,) = run(jpeg_bytes(photo, icc_profile=srgb))
    (plain,) = run(jpeg_bytes(photo))
    assert tagged.image == plain.image and tagged.record.error_detail is None


def test_adobe_rgb_profile_is_converted_to_srgb():
    colour = (200, 80, 60)
    expected = srgb_reference(colour, adobe_rgb_like_profile())
    assert expected[0] - colour[0] > 20  # the same numbers are a more saturated red in Adobe RGB
    data = jpeg_bytes(Image.new("RGB", (128, 96), colour), quality=95, icc_profile=adobe_rgb_like_profile())
    (tagged,) = run(data, output_format="png")
    (plain,) = run(jpeg_bytes(Image.new("RGB", (128, 96), colour), quality=95), output_format="png")
    assert close(pixel(decoded(tagged), 0.5, 0.5), expected, 3)
    assert close(pixel(decoded(plain), 0.5, 0.5), colour, 3)


def test_rgba_with_profile_converts_colour_and_keeps_alpha():
    image = Image.new("RGBA", (64, 64), (255, 0, 0, 128))
    image.paste((255, 0, 0, 0), (0, 0, 32, 64))
    (result,) = run(png_bytes(image, icc_profile=swapped_red_green_profile()), output_format="png")
    out = decoded(result)
    assert out.mode == "RGBA"
    assert pixel(out, 0.1, 0.5)[3] == 0
    assert close(pixel(out, 0.9, 0.5), (0, 255, 0, 128), 6)


def test_grey_profile_is_converted_to_srgb():
    data = png_bytes(Image.new("L", (64, 64), 128), icc_profile=grey_profile(gamma=1.0))
    (result,) = run(data, output_format="png")
    # Linear 128/255 is sRGB 188.
    assert close(pixel(decoded(result).convert("RGB"), 0.5, 0.5), (188, 188, 188), 1)


def test_grey_alpha_with_grey_profile_keeps_alpha():
    grey = Image.new("LA", (64, 64), (128, 255))
    grey.paste((128, 0), (0, 0, 32, 64))
    (result,) = run(png_bytes(grey, icc_profile=grey_profile(gamma=1.0)), output_format="png")
    image = decoded(result)
    assert image.mode == "RGBA"
    assert pixel(image, 0.1, 0.5)[3] == 0
    assert close(pixel(image, 0.9, 0.5), (188, 188, 188, 255), 1)


@pytest.mark.parametrize(
    "profile, image, note",
    [
        (b"this is not an ICC profile", Image.new("RGB", (64, 64), (200, 80, 60)), "unreadable"),
        (adobe_rgb_like_profile(), Image.new("L", (64, 64), 120), "describes RGB but the image is GRAY"),
    ],
)
def test_unusable_profile_falls_back_and_says_so(profile, image, note):
    (result,) = run(png_bytes(image, icc_profile=profile), output_format="png")
    assert result.record.valid
    assert result.record.error_detail.startswith("embedded ICC profile ignored") and note in result.record.error_detail
    expected = image.convert("RGB").getpixel((0, 0))
    assert close(pixel(decoded(result).convert("RGB"), 0.5, 0.5), expected, 1)


# ----------------------------------------------------------------------------- encoder settings


def test_quality_and_method_reach_the_encoder():
    data = jpeg_bytes(photo_like(320, 240, seed=6))
    by_setting = {
        (quality, method): run(data, quality=quality, webp_method=method)[0].image
        for quality, method in [(95, 4), (50, 4), (95, 0), (95, 6)]
    }
    assert len(set(by_setting.values())) == 4
    assert len(by_setting[(50, 4)]) < len(by_setting[(95, 4)])


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_other_output_formats(fmt):
    (result,) = run(jpeg_bytes(photo_like(320, 240, seed=6)), output_format=fmt)
    assert_valid_output(result, (320, 240), AREA_512, PixelOptions(output_format=fmt))


def test_output_carries_no_exif_orientation():
    (result,) = run(jpeg_bytes(marker_image(640, 480), orientation=6))
    assert decoded(result).getexif().get(0x0112) is None  # pixels are upright already


# ----------------------------------------------------------------------------- speed and fidelity


def test_draft_keeps_at_least_the_largest_output_resolution():
    assert draft_factor(1184 / 4000) == 2  # 12 MP -> 1024 area: decode at 2000x1500
    assert draft_factor(576 / 4000) == 4  # 12 MP -> 512 area only: decode at 1000x750
    assert draft_factor(0.05) == 8
    assert draft_factor(0.6) == 1
    assert draft_factor(1.5) == 1  # upscale


def fidelity_cases(request) -> list[tuple[str, bytes, tuple[int, ...]]]:
    """(name, data, areas): each exercises one fast path against the direct resample."""
    photo_12mp = request.getfixturevalue("photo_jpeg_12mp")
    return [
        # JPEG draft 1/2 for the 1024 output, the 512 output resampled from the 1024 one.
        ("4000x3000 jpeg", photo_12mp, BOTH_AREAS),
        # JPEG draft 1/4 when only the 512 output is wanted.
        ("4000x3000 jpeg 512 only", photo_12mp, (AREA_512,)),
        # Draft in the raw frame, crop box mapped through orientation 6, output rotated.
        ("3000x4000 jpeg exif 6", request.getfixturevalue("photo_jpeg_12mp_exif_6"), BOTH_AREAS),
        # Odd sizes: the last DCT block is partial; orientation 7 mirrors both axes.
        ("1333x1999 jpeg exif 7", jpeg_bytes(photo_like(1999, 1333, seed=12), orientation=7), (AREA_512,)),
        ("1200x800 jpeg", jpeg_bytes(photo_like(1200, 800, seed=3)), BOTH_AREAS),
        ("300x450 jpeg upscale", jpeg_bytes(photo_like(300, 450, seed=4)), BOTH_AREAS),
        # No draft for TIFF: Image.resize(reducing_gap=3) box-reduces 2x first.
        ("4000x3000 tiff 512 only", encode(photo_like(4000, 3000, seed=13), "TIFF"), (AREA_512,)),
    ]


def test_fast_path_stays_within_40_db_of_one_direct_lanczos(request, record_property):
    """Shrink-on-load, reducing_gap, the raw-frame resample and the 512-from-1024 intermediate,
    each against one direct Lanczos resample of the full-resolution, upright crop box (SPEC 3)."""
    options = PixelOptions(output_format="png")  # lossless, so only resampling differs
    report = {}
    for name, data, areas in fidelity_cases(request):
        full = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        for result, area in zip(process_image(data, areas, options), areas):
            target = geometry(*full.size, area)
            reference = full.resize(target.target_size, Image.Resampling.LANCZOS, box=target.crop_box.as_tuple())
            value = psnr(assert_valid_output(result, full.size, area, options), reference)
            report[f"{name}, area {area}"] = round(value, 2)
            assert value >= 40, (name, area, value)
    record_property("psnr_db", report)
    print("\nPSNR dB vs one direct Lanczos resample:", *(f"  {k}: {v}" for k, v in report.items()), sep="\n")


def test_threads_give_the_same_bytes_as_one_thread(good_images):
    inputs = list(good_images.values()) * 2
    sequential = [process_image(data, [AREA_512], DEFAULT) for data in inputs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda data: process_image(data, [AREA_512], DEFAULT), inputs))
    assert [[r.image for r in rs] for rs in threaded] == [[r.image for r in rs] for rs in sequential]
    assert [[asdict(r.record) for r in rs] for rs in threaded] == [[asdict(r.record) for r in rs] for rs in sequential]


def test_every_good_input_is_valid(good_images):
    for name, data in good_images.items():
        for result in process_image(data, [AREA_512], DEFAULT):
            assert result.record.valid, (name, result.record)


# ----------------------------------------------------------------------------- fuzzing


def _fuzz_bases() -> list[bytes]:
    photo = photo_like(96, 64, seed=11)
    return [
        jpeg_bytes(photo),
        jpeg_bytes(photo, orientation=6),
        png_bytes(photo),
        rgba_png(),
        animated_gif(),
        encode(photo, "WEBP"),
        cmyk_jpeg(64),
    ]


FUZZ_BASES = _fuzz_bases()


@pytest.mark.filterwarnings("ignore")  # corrupt data makes Pillow warn; warnings are not failures
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(range(len(FUZZ_BASES))),
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=6),
    keep=st.floats(0.05, 1.0),
)
def test_damaged_images_never_raise(base, edits, keep):
    data = bytearray(FUZZ_BASES[base])
    for where, value in edits:
        data[int(where * len(data))] = value
    data = bytes(data[: max(1, int(len(data) * keep))])
    options = PixelOptions(max_source_pixels=4_000_000, webp_method=0)  # bound what a damaged header may claim
    results = process_image(data, [64 * 64, 128 * 128], options)
    assert len(results) == 2
    for result in results:
        record = result.record
        if record.valid:
            assert record.error is None and result.image is not None and record.out_bytes == len(result.image)
            assert decoded(result).size == (record.width, record.height)
        else:
            assert record.error in ERROR_CODES and record.error_detail and result.image is None
        assert 1 <= record.exif_orientation <= 8
