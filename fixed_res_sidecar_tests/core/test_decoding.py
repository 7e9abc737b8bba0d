"""core/decoding.py: untrusted bytes opened, what the header tells (frames, decode memory), truncated
JPEGs and shrink-on-load; on real images generated with Pillow, through the pipeline where it matters."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from fixed_res_sidecar.core.audit import audit_arrays
from fixed_res_sidecar.core.decoding import (
    EXCLUDED_INPUT_FORMATS,
    JPEG_SCAN_PADDING,
    MAX_COUNTED_FRAMES,
    decode_memory_estimate,
    draft_factor,
    gif_frame_count,
    input_formats,
    jpeg_scan_end,
    open_image,
    too_many_pixels,
)
from fixed_res_sidecar.core.geometry import AREA_512
from fixed_res_sidecar.core.pixels import process_image
from fixed_res_sidecar_tests.fixtures.images import (
    GREY,
    RED,
    animated_gif,
    encode,
    gif_with_frames,
    header_bombs,
    jpeg_bytes,
    marker_image,
    photo_like,
    truncated_with_end_marker,
)
from fixed_res_sidecar_tests.fixtures.pixels import BOTH_AREAS, DEFAULT, assert_valid_output, close, pixel, run

# ----------------------------------------------------------------------------- opening


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


def test_webp_input():
    (result,) = run(encode(Image.new("RGB", (320, 240), (20, 140, 220)), "WEBP", quality=95))
    assert (result.record.src_format, result.record.src_mode) == ("WEBP", "RGB")
    image = assert_valid_output(result, (320, 240), AREA_512)
    assert close(pixel(image, 0.5, 0.5), (20, 140, 220), 6)


def test_animated_gif_uses_the_first_frame():
    (result,) = run(animated_gif(colours=(RED, (0, 255, 0), (0, 0, 255))))
    assert (result.record.n_frames, result.record.src_format) == (3, "GIF")
    image = assert_valid_output(result, (64, 48), AREA_512)
    assert close(pixel(image.convert("RGB"), 0.5, 0.5), RED, 8)


# ----------------------------------------------------------------------------- frame counts


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


# ----------------------------------------------------------------------------- truncated JPEG


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


# ----------------------------------------------------------------------------- decode memory


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


# ----------------------------------------------------------------------------- shrink-on-load


def test_draft_keeps_at_least_the_largest_output_resolution():
    assert draft_factor(1184 / 4000) == 2  # 12 MP -> 1024 area: decode at 2000x1500
    assert draft_factor(576 / 4000) == 4  # 12 MP -> 512 area only: decode at 1000x750
    assert draft_factor(0.05) == 8
    assert draft_factor(0.6) == 1
    assert draft_factor(1.5) == 1  # upscale
