"""core/render.py: outputs turned upright, transparency composited, encoded as asked, and every resampling
shortcut within 40 dB of one direct Lanczos resample (SPEC 3, 4); through the pipeline."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageOps

from fixed_res_sidecar.core.geometry import AREA_512, AREA_1024, geometry
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.pixels import process_image
from fixed_res_sidecar_tests.fixtures.images import (
    GREY,
    RED,
    broken_exif_jpeg,
    encode,
    jpeg_bytes,
    marker_image,
    photo_like,
    png_with_exif_after_pixels,
    rgba_png,
    text_orientation_jpeg,
)
from fixed_res_sidecar_tests.fixtures.pixels import (
    BOTH_AREAS,
    DEFAULT,
    assert_valid_output,
    close,
    decoded,
    pixel,
    psnr,
    run,
)

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


# ----------------------------------------------------------------------------- compositing


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
