import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fixed_res_sidecar.core.geometry import (
    AREA_512,
    AREA_1024,
    area_tolerance,
    crop_box,
    geometry,
    near_target_area,
    target_size,
)

sizes = st.integers(min_value=1, max_value=20_000)
areas = st.sampled_from([AREA_512, AREA_1024])
patches = st.sampled_from([8, 14, 16, 32, 64])


def test_hand_computed_landscape_photo():
    # ideal 591.2 x 443.4 -> 18.47 and 13.86 patches -> 18 and 14 patches of 32.
    g = geometry(4000, 3000, AREA_512)
    assert g.target_size == (576, 448)
    # 576/448 = 1.2857 < 4/3, so the width is cropped: cw = 3000 * 576/448.
    assert g.crop_box.y0 == 0 and g.crop_box.y1 == 3000
    assert g.crop_box.width == pytest.approx(3000 * 576 / 448)
    assert g.crop_box.x0 == pytest.approx((4000 - 3000 * 576 / 448) / 2)
    assert g.scale == pytest.approx(448 / 3000)


def test_hand_computed_portrait_at_1024():
    # ideal 886.8 x 1182.4 -> 27.71 and 36.95 patches -> 28 x 37.
    assert target_size(3000, 4000, AREA_1024) == (896, 1184)
    box = crop_box(3000, 4000, (896, 1184))
    # 896/1184 = 0.7568 > 0.75, so the height is cropped.
    assert (box.x0, box.x1) == (0.0, 3000.0)
    assert box.height == pytest.approx(3000 * 1184 / 896)


def test_round_half_up_not_bankers():
    # ideal side exactly 16.5 patches: round half up gives 17, round() would give 16.
    width = height = 1
    side = 16.5 * 32
    assert target_size(width, height, int(side * side)) == (17 * 32, 17 * 32)


def test_square_option_and_upscale():
    g = geometry(300, 200, AREA_512, square=True)
    assert g.target_size == (512, 512)
    assert g.crop_box.as_tuple() == pytest.approx((50.0, 0.0, 250.0, 200.0))
    assert g.scale > 1


def test_tiny_images_get_at_least_one_patch():
    assert target_size(1, 10_000, AREA_512) == (32, 51_200)


@pytest.mark.parametrize("bad", [(0, 10, AREA_512, 32), (10, -1, AREA_512, 32), (10, 10, 0, 32), (10, 10, AREA_512, 0)])
def test_rejects_non_positive(bad):
    with pytest.raises(ValueError):
        target_size(*bad)


@given(sizes, sizes, areas, patches)
def test_properties(width, height, area, patch):
    g = geometry(width, height, area, patch)
    tw, th = g.target_size
    box = g.crop_box
    # Sides are multiples of the patch size.
    assert tw % patch == 0 and th % patch == 0 and tw >= patch and th >= patch
    # The crop box lies inside the image, and crops at most one axis, centred.
    assert -1e-9 <= box.x0 <= box.x1 <= width + 1e-9 and -1e-9 <= box.y0 <= box.y1 <= height + 1e-9
    assert box.width == pytest.approx(width, rel=1e-12) or box.height == pytest.approx(height, rel=1e-12)
    assert box.x0 == pytest.approx(width - box.x1, abs=1e-6) and box.y0 == pytest.approx(height - box.y1, abs=1e-6)
    # The crop box has exactly the target aspect ratio: one scale for both axes.
    assert tw / box.width == pytest.approx(th / box.height, rel=1e-9)
    # Area within what rounding each side allows (only meaningful when no side hit the 1-patch floor).
    ideal_w, ideal_h = math.sqrt(area * width / height), math.sqrt(area * height / width)
    if ideal_w >= patch and ideal_h >= patch:
        assert near_target_area(tw, th, width, height, area, patch)
        # Each side is within half a patch of its ideal, so the aspect error is bounded too.
        assert abs(tw - ideal_w) <= patch / 2 + 1e-9 and abs(th - ideal_h) <= patch / 2 + 1e-9


def test_near_target_area_rejects_a_wrong_size():
    assert near_target_area(576, 448, 4000, 3000, AREA_512)
    assert not near_target_area(640, 448, 4000, 3000, AREA_512)
    assert area_tolerance(4000, 3000, AREA_512) < 0.07
