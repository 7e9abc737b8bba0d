"""core/fidelity.py: the score of a stored output against the picture its source gives."""

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from fixed_res_sidecar.core.fidelity import (
    FIDELITY_MIN_SCORE,
    IDENTICAL_PSNR,
    OTHER_PATH_BELOW,
    PSNR_CAP,
    Expected,
    Rendering,
    Renders,
    decoded,
    difference_image,
    expected_output,
    fidelity,
    psnr,
    score_output,
)
from fixed_res_sidecar.core.geometry import AREA_512, AREA_1024
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.pixels import process_image
from fixed_res_sidecar.sample_data import make_photo
from fixed_res_sidecar_tests.fixtures.images import jpeg_bytes, photo_like, png_bytes


def webp(image: Image.Image, quality: int = 95) -> Image.Image:
    out = io.BytesIO()
    image.save(out, "WEBP", quality=quality)
    return decoded(out.getvalue())


@pytest.fixture(scope="module")
def photo() -> bytes:
    return jpeg_bytes(photo_like(900, 600, seed=3), orientation=6)


def test_the_build_scores_zero_and_the_same_picture_re_encoded_stays_close(photo):
    built = process_image(photo, [AREA_1024, AREA_512], PixelOptions())
    for position, area in enumerate((AREA_1024, AREA_512)):
        expected, problem = expected_output(photo, Rendering(area, PixelOptions(), built_with=(AREA_1024, AREA_512)))
        assert problem is None and expected.image.size == (built[position].record.width, built[position].record.height)
        result = fidelity(expected, decoded(built[position].image))
        assert result.passed and result.score == 0.0  # the same path, the same encoder: the same bytes
        assert 30 < expected.fresh_psnr < PSNR_CAP  # a lossy WebP of a noisy photo
        # Another encoder effort is a legitimate difference.
        other = fidelity(expected, webp(expected.image, quality=94))
        assert other.passed and abs(other.score) < 1


def test_renders_of_a_source_are_reused_for_the_other_area(photo):
    """The fused render made for one area serves the other: the second needs neither the source nor a
    render, and gives the same expected image as rendering afresh."""
    renders = Renders()
    expected_output(photo, Rendering(AREA_512, PixelOptions(), built_with=(AREA_1024,)), renders=renders)
    assert len(renders.images) == 1
    reused, problem = expected_output(
        None, Rendering(AREA_1024, PixelOptions(), built_with=(AREA_512,)), renders=renders
    )
    fresh, _ = expected_output(photo, Rendering(AREA_1024, PixelOptions(), built_with=(AREA_512,)))
    assert problem is None and len(renders.images) == 1
    assert reused.image.tobytes() == fresh.image.tobytes() and reused.fresh_psnr == fresh.fresh_psnr
    # Asked again, the expected output itself is kept: the same object, no second encode.
    again, _ = expected_output(None, Rendering(AREA_1024, PixelOptions(), built_with=(AREA_512,)), renders=renders)
    assert again is reused and len(renders.expected) == 2
    # Other settings are another render.
    expected_output(photo, Rendering(AREA_1024, PixelOptions(square=True), built_with=(AREA_512,)), renders=renders)
    assert len(renders.images) == 2


def test_wrong_pictures_score_far_below_the_threshold(photo):
    expected, _ = expected_output(photo, Rendering(AREA_512, PixelOptions()))
    good = expected.image
    wrong = {
        "rotated": good.transpose(Image.Transpose.ROTATE_180),
        "channels": Image.merge("RGB", good.convert("RGB").split()[::-1]),
        "black": Image.new("RGB", good.size),
        "re-compressed": webp(good, quality=5),
    }
    for name, image in wrong.items():
        result = fidelity(expected, webp(image) if name != "re-compressed" else image)
        assert not result.passed and result.score < FIDELITY_MIN_SCORE, name
        assert f"score {result.score:.2f} dB is below" in result.problem


def test_another_size_scores_minus_the_cap():
    expected = Expected(Image.new("RGB", (64, 32), (10, 20, 30)), 40.0)
    result = fidelity(expected, Image.new("RGB", (32, 64), (10, 20, 30)))
    assert (result.score, result.psnr, result.passed) == (-PSNR_CAP, 0.0, False)
    assert "stored image is 32x64, the expected one 64x32" in result.problem


@pytest.mark.parametrize("modes", [("RGB", "RGB"), ("L", "RGB"), ("RGB", "L"), ("RGB", "P"), ("RGB", "CMYK")])
def test_opaque_psnr_is_the_textbook_formula_over_8_bit_rgb(modes):
    """The opaque path sums squared errors in integers: the same PSNR as 10 log10(255^2 / MSE) over every
    RGB value, computed here in floats, for images of any opaque mode."""
    rng = np.random.default_rng(5)
    first = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).convert(modes[0])
    second = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).convert(modes[1])
    a, b = (np.asarray(image.convert("RGB"), dtype=np.float64) for image in (first, second))
    assert psnr(first, second) == pytest.approx(10 * np.log10(255**2 / np.mean((a - b) ** 2)), abs=1e-9)


def test_the_largest_opaque_error_does_not_overflow():
    black, white = Image.new("RGB", (128, 128)), Image.new("RGB", (128, 128), (255, 255, 255))
    assert psnr(black, white) == 0.0  # 49,152 errors of 255 squared: past 32 bits


def test_what_transparent_pixels_hold_does_not_count_but_alpha_does():
    image = Image.new("RGBA", (32, 32), (200, 10, 10, 255))
    image.paste((0, 0, 255, 0), (0, 0, 16, 32))  # left half fully transparent, blue underneath
    recoloured = image.copy()
    recoloured.paste((0, 255, 0, 0), (0, 0, 16, 32))  # another colour under alpha 0: the same picture
    assert psnr(image, recoloured) == IDENTICAL_PSNR
    opaque = image.copy()
    opaque.putalpha(255)
    assert psnr(image, opaque) < 10


def test_transparent_surroundings_do_not_dilute_the_error():
    """The same picture and the same damage score the same PSNR opaque and pasted on a transparent canvas
    16 times its area (averaged over every pixel, the canvas added 12 dB)."""
    picture = photo_like(64, 64, seed=5)
    damaged = webp(picture, quality=20)
    assert 15 < psnr(picture, damaged) < 40

    def on_canvas(image: Image.Image) -> Image.Image:
        canvas = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
        canvas.paste(image.convert("RGBA"), (96, 96))
        return canvas

    assert psnr(on_canvas(picture), on_canvas(damaged)) == pytest.approx(psnr(picture, damaged), abs=1e-6)
    # Where nothing shows in either image, nothing counts; an alpha that appears there does.
    appeared = on_canvas(picture)
    appeared.paste((9, 9, 9, 255), (0, 0, 4, 4))
    assert psnr(on_canvas(picture), appeared) < psnr(on_canvas(picture), on_canvas(picture)) == IDENTICAL_PSNR


def cut_out_png(width: int, height: int, visible: float) -> bytes:
    """A photo cut-out: an ellipse of `visible` of the picture's area with a soft edge, fully transparent around it."""
    import math

    photo = Image.open(io.BytesIO(make_photo(width, height, 4)[0])).convert("RGB")
    alpha = Image.new("L", (width, height), 0)
    scale = math.sqrt(visible * 4 / math.pi)  # the ellipse's axes, as fractions of the sides
    box = (width * (1 - scale) / 2, height * (1 - scale) / 2, width * (1 + scale) / 2, height * (1 + scale) / 2)
    ImageDraw.Draw(alpha).ellipse(box, fill=255)
    photo.putalpha(alpha.filter(ImageFilter.GaussianBlur(4)))
    return png_bytes(photo)


def test_damage_to_a_cut_out_on_a_transparent_background_fails():
    """Reported: on an RGBA cut-out, WebP q30, q60 and a blur of radius 1.5 all scored 0.00 (the transparent
    pixels lifted the damaged PSNR above the cap)."""
    source = cut_out_png(1000, 800, visible=0.2)
    rendering = Rendering(AREA_1024, PixelOptions(), built_with=(AREA_1024, AREA_512))
    built = process_image(source, [AREA_1024, AREA_512], PixelOptions())[0]
    stored = decoded(built.image)
    assert stored.mode == "RGBA" and 0.15 < np.asarray(stored)[..., 3].mean() / 255 < 0.25
    good, _ = score_output(source, stored, rendering)
    assert good.passed and good.score == 0.0
    damages = {
        "webp q30": webp(stored, quality=30),
        "webp q60": webp(stored, quality=60),
        "blur r1.5": webp(stored.filter(ImageFilter.GaussianBlur(1.5))),
    }
    for name, damaged in damages.items():
        result, _ = score_output(source, damaged, rendering)
        assert not result.passed and result.score < FIDELITY_MIN_SCORE, (name, result)


def test_perfect_outputs_of_flat_pictures_pass_whatever_the_encoders_do_above_the_cap():
    flat = Expected(Image.new("RGB", (64, 64), (120, 130, 140)), IDENTICAL_PSNR)
    nearly = Image.new("RGB", (64, 64), (120, 130, 141))  # 58.9 dB: invisible, far below "identical"
    result = fidelity(flat, nearly)
    assert result.passed and result.score == 0.0


def test_a_source_that_gives_no_image_says_why():
    expected, problem = expected_output(b"not an image", Rendering(AREA_512, PixelOptions()))
    assert expected is None and "decode_error" in problem


def test_expected_output_composites_alpha_as_jpeg_output_does():
    source = png_bytes(Image.new("RGBA", (256, 256), (255, 0, 0, 0)))
    expected, _ = expected_output(source, Rendering(AREA_512, PixelOptions(output_format="jpeg")))
    assert expected.image.mode == "RGB" and expected.image.getpixel((5, 5)) == (255, 255, 255)
    kept, _ = expected_output(source, Rendering(AREA_512, PixelOptions()))
    assert kept.image.mode == "RGBA"


def test_difference_image_is_dark_where_equal_and_bright_where_not():
    left = Image.new("RGB", (20, 10), (100, 100, 100))
    right = left.copy()
    right.paste((160, 100, 100), (10, 0, 20, 10))
    difference = difference_image(left, right)
    assert difference.getpixel((2, 2)) == (0, 0, 0) and difference.getpixel((15, 2)) == (240, 0, 0)
    assert difference_image(left, Image.new("RGB", (5, 5))).size == left.size


def test_a_one_resolution_build_is_scored_against_its_own_rendering_path():
    """A smooth 1200x900 JPEG built at 512 alone is shrunk on load more than in the fused build: against
    the fused render it scores below OTHER_PATH_BELOW; score_output renders it the other way too and keeps
    the better."""
    source = make_photo(1200, 900, 1)[0]
    (alone,) = process_image(source, [AREA_512], PixelOptions())
    stored = decoded(alone.image)
    fused, _ = expected_output(source, Rendering(AREA_512, PixelOptions(), built_with=(AREA_1024,)))
    assert fidelity(fused, stored).score < OTHER_PATH_BELOW
    result, expected = score_output(
        source, stored, Rendering(AREA_512, PixelOptions(), built_with=(AREA_1024, AREA_512))
    )
    assert result.score == 0.0 and expected.image.size == stored.size
