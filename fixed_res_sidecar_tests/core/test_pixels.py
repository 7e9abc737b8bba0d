"""core/pixels.py: one image through the whole pipeline (SPEC sections 3-5), on real images generated
with Pillow: bad inputs, limits, geometry, threads, damaged files."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from fixed_res_sidecar.core.audit import ERROR_CODES, AuditRecord, audit_arrays
from fixed_res_sidecar.core.decoding import decode_memory_estimate, open_image
from fixed_res_sidecar.core.geometry import AREA_512, AREA_1024, near_target_area
from fixed_res_sidecar.core.memory import MemoryBudget
from fixed_res_sidecar.core.pixel_settings import PixelOptions, reference_options
from fixed_res_sidecar.core.pixels import process_image
from fixed_res_sidecar_tests.fixtures.images import (
    GREY,
    animated_gif,
    bad_inputs,
    cmyk_jpeg,
    encode,
    header_bombs,
    jpeg_bytes,
    marker_image,
    photo_like,
    png_bytes,
    rgba_png,
)
from fixed_res_sidecar_tests.fixtures.pixels import BOTH_AREAS, DEFAULT, assert_valid_output, close, decoded, pixel, run

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


# ----------------------------------------------------------------------------- limits


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


# ----------------------------------------------------------------------------- threads


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


def test_an_unencoded_render_keeps_exactly_the_pixels_a_lossless_encode_gives_back(good_images):
    """encode=False (the verifier's reference): each finished image is what the PNG of the same render
    decodes to, pixel for pixel and mode for mode, for every awkward kind of input; nothing is encoded."""
    lossless = reference_options(DEFAULT)
    for name, data in good_images.items():
        encoded = process_image(data, BOTH_AREAS, lossless)
        unencoded = process_image(data, BOTH_AREAS, lossless, encode=False)
        for stored, kept in zip(encoded, unencoded):
            assert kept.image is None and kept.record.out_bytes is None, name
            assert asdict(kept.record) == {**asdict(stored.record), "out_bytes": None}, name
            assert kept.finished is not None and stored.finished is None, name
            back = decoded(stored)
            assert (kept.finished.mode, kept.finished.size) == (back.mode, back.size), name
            assert kept.finished.tobytes() == back.tobytes(), name


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
