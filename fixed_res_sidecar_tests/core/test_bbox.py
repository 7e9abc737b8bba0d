"""Caption boxes into crop frames (SPEC 6). Expected values are worked out by hand below."""

import io
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from fixed_res_sidecar.core.audit import AuditRecord
from fixed_res_sidecar.core.bbox import (
    MAX_CAPTION_DEPTH,
    BoxCounts,
    BoxOutcome,
    CaptionStatus,
    CropFrame,
    box_slots,
    caption_box_to_oriented,
    crop_captions_for_row,
    is_box_list,
    is_valid_crop_box,
    map_box_slots,
    parse_caption,
    transform_box,
    transform_caption,
)
from fixed_res_sidecar.core.geometry import AREA_512, AREA_1024, geometry

# A 1000 x 500 (W x H) source whose crop keeps the middle square: x 250..750, all rows.
# Then Y = v/2 px and y' = Y/500*1000 = v, while X = v px and x' = (v - 250)/500*1000 = 2v - 500.
FRAME = CropFrame(src_width=1000, src_height=500, x0=250.0, y0=0.0, x1=750.0, y1=500.0)


def counts(**values) -> BoxCounts:
    result = BoxCounts(**values)
    result.total = result.inside + result.clipped + result.outside + result.malformed
    return result


# -- single boxes ---------------------------------------------------------------------


def test_box_inside_the_crop():
    # y: 100, 400 stay; x: 2*300-500 = 100, 2*600-500 = 700
    assert transform_box([100, 300, 400, 600], FRAME) == ([100, 100, 400, 700], BoxOutcome.INSIDE)


def test_box_clipped_by_the_crop():
    # x: 2*100-500 = -300 -> clipped to 0, 2*400-500 = 300
    assert transform_box([200, 100, 300, 400], FRAME) == ([200, 0, 300, 300], BoxOutcome.CLIPPED)
    # x: 2*700-500 = 900, 2*900-500 = 1300 -> 1000
    assert transform_box([0, 700, 1000, 900], FRAME) == ([0, 900, 1000, 1000], BoxOutcome.CLIPPED)


def test_box_in_the_cropped_away_margin_is_null():
    # x: 2*0-500 = -500 and 2*200-500 = -100, both clip to 0: no width left
    assert transform_box([0, 0, 1000, 200], FRAME) == (None, BoxOutcome.OUTSIDE)
    # touching the crop edge from outside (x 250 -> 0) leaves no area either
    assert transform_box([0, 100, 1000, 250], FRAME) == (None, BoxOutcome.OUTSIDE)


def test_sliver_under_half_a_grid_unit_is_outside():
    # x: 2*250.1-500 = 0.2 -> rounds to 0, the same as the clipped xmin
    assert transform_box([100, 200, 200, 250.1], FRAME) == (None, BoxOutcome.OUTSIDE)


def test_zero_area_input_box_is_outside():
    assert transform_box([500, 400, 500, 600], FRAME) == (None, BoxOutcome.OUTSIDE)


def test_round_half_up_not_bankers():
    # y: 62.5 -> 63 (Python round() would give 62); x: 2*437.5-500 = 375
    assert transform_box([62.5, 437.5, 200, 500], FRAME) == ([63, 375, 200, 500], BoxOutcome.INSIDE)


@pytest.mark.parametrize(
    "box",
    [
        [1, 2, 3],  # three numbers
        [1, 2, 3, 4, 5],
        [0, 0, True, 10],  # bools are not numbers
        [0, "0", 10, 10],
        [0, 0, 1001, 10],  # outside 0..1000
        [-1, 0, 10, 10],
        [300, 0, 200, 10],  # ymin > ymax
        [0, 300, 10, 200],  # xmin > xmax
        "0 0 10 10",
        {"ymin": 0, "xmin": 0, "ymax": 10, "xmax": 10},
        7,
    ],
)
def test_malformed_boxes(box):
    assert transform_box(box, FRAME) == (None, BoxOutcome.MALFORMED)


# -- whole captions -------------------------------------------------------------------


def test_nested_objects_box_lists_and_non_box_keys():
    caption = {
        "summary": "été, 東京",
        "objects": [
            {"label": "cat", "bbox": [100, 300, 400, 600], "attributes": {"score": 0.25, "bbox_2d": [0, 0, 1000, 200]}},
            {"label": "dog", "box_2d": [200, 100, 300, 400]},
        ],
        "groups": {"all": {"bbox": [[100, 300, 400, 600], [0, 0, 1000, 200], None, [5, 5, 1]]}},
        "size": [100, 300, 400, 600],  # four numbers under a non-box key: left alone
        "empty": {"bbox": [], "box_2d": None},
    }
    new, box_counts = transform_caption(caption, FRAME)
    assert new == {
        "summary": "été, 東京",
        "objects": [
            {"label": "cat", "bbox": [100, 100, 400, 700], "attributes": {"score": 0.25, "bbox_2d": None}},
            {"label": "dog", "box_2d": [200, 0, 300, 300]},
        ],
        "groups": {"all": {"bbox": [[100, 100, 400, 700], None, None, None]}},
        "size": [100, 300, 400, 600],
        "empty": {"bbox": [], "box_2d": None},
    }
    assert list(new) == list(caption)  # key order kept
    assert list(new["objects"][0]) == ["label", "bbox", "attributes"]
    assert box_counts == counts(inside=2, clipped=1, outside=2, malformed=1)
    assert caption["objects"][0]["bbox"] == [100, 300, 400, 600]  # input untouched


def test_custom_bbox_keys():
    caption = {"region": [100, 300, 400, 600], "bbox": [100, 300, 400, 600]}
    new, box_counts = transform_caption(caption, FRAME, bbox_keys=("region",))
    assert new == {"region": [100, 100, 400, 700], "bbox": [100, 300, 400, 600]}
    assert box_counts == counts(inside=1)


def test_top_level_list_and_scalars():
    new, box_counts = transform_caption([{"bbox": [0, 700, 1000, 900]}, 3, "x", None], FRAME)
    assert new == [{"bbox": [0, 900, 1000, 1000]}, 3, "x", None]
    assert box_counts == counts(clipped=1)


# -- the walk: one rule for the transform, the verifier and the overlays ---------------


WALKED = {
    "objects": [{"label": "cat", "bbox": [1, 2, 3, 4]}, {"name": "dog", "box_2d": None}],
    "groups": {"pets": {"bbox_2d": [[5, 6, 7, 8], None, "junk"]}, "empty": {"bbox": []}},
    "note": {"bbox_like": [1, 2, 3, 4]},
    "odd": [[{"bbox": {"y": 1}}]],
}


def test_box_slots_in_walk_order_with_paths():
    slots = box_slots(WALKED)
    assert [(s.index, s.path, s.value, s.key, s.item) for s in slots] == [
        (0, "objects[0].bbox", [1, 2, 3, 4], "bbox", None),
        (1, "objects[1].box_2d", None, "box_2d", None),
        (2, "groups.pets.bbox_2d[0]", [5, 6, 7, 8], "bbox_2d", 0),
        (3, "groups.pets.bbox_2d[1]", None, "bbox_2d", 1),
        (4, "groups.pets.bbox_2d[2]", "junk", "bbox_2d", 2),
        (5, "odd[0][0].bbox", {"y": 1}, "bbox", None),
    ]
    assert [s.holder_path for s in slots] == [
        "objects[0]",
        "objects[1]",
        "groups.pets",
        "groups.pets",
        "groups.pets",
        "odd[0][0]",
    ]
    assert slots[0].holder is WALKED["objects"][0]
    assert [s.path for s in box_slots([{"bbox": [1, 2, 3, 4]}])] == ["[0].bbox"]


def test_map_box_slots_replaces_only_slots_and_copies_the_rest():
    mapped = map_box_slots(WALKED, ("bbox", "box_2d", "bbox_2d"), lambda value, holder, key, item, parts: (key, item))
    assert mapped == {
        "objects": [{"label": "cat", "bbox": ("bbox", None)}, {"name": "dog", "box_2d": ("box_2d", None)}],
        "groups": {"pets": {"bbox_2d": [("bbox_2d", 0), ("bbox_2d", 1), ("bbox_2d", 2)]}, "empty": {"bbox": []}},
        "note": {"bbox_like": [1, 2, 3, 4]},
        "odd": [[{"bbox": ("bbox", None)}]],
    }
    assert WALKED["objects"][0]["bbox"] == [1, 2, 3, 4]  # input untouched


def test_transform_keeps_the_slots_of_the_walk():
    # Slot i of a crop caption is slot i of its original, whatever happened to the box.
    caption = {
        "objects": [{"bbox": [0, 0, 100, 100]}, {"bbox": None}],
        "all": {"box_2d": [[0, 0, 1, 1], [900, 0, 1000, 100]]},
    }
    new, _ = transform_caption(caption, FRAME)
    original = [s.path for s in box_slots(caption)]
    assert [s.path for s in box_slots(new, crop_frame=True)] == original


def test_a_list_of_boxes_all_outside_the_crop_is_still_a_list_of_boxes_in_the_crop_frame():
    # Both boxes lie in the cropped-away left margin (x < 250 of 1000): they become null.
    caption = {"group": {"box_2d": [[0, 0, 100, 100], [500, 0, 600, 200]]}, "cat": {"bbox": [100, 300, 400, 600]}}
    new, box_counts = transform_caption(caption, FRAME)
    assert new == {"group": {"box_2d": [None, None]}, "cat": {"bbox": [100, 100, 400, 700]}}
    assert box_counts == counts(inside=1, outside=2)
    slots = box_slots(new, crop_frame=True)
    assert [(s.index, s.path, s.value) for s in slots] == [
        (0, "group.box_2d[0]", None),
        (1, "group.box_2d[1]", None),
        (2, "cat.bbox", [100, 100, 400, 700]),
    ]
    assert [s.index for s in box_slots(caption) if s.path == "cat.bbox"] == [2]  # same index as in the original


@pytest.mark.parametrize(
    "value, in_original, in_crop",
    [
        ([[1, 2, 3, 4]], True, True),
        ([None, [1, 2, 3, 4]], True, True),
        ([None, None], False, True),  # in an original: one malformed box
        ([1, 2, 3, 4], False, False),
        ([], False, False),
        (None, False, False),
        ("x", False, False),
    ],
)
def test_is_box_list(value, in_original, in_crop):
    assert is_box_list(value) is in_original
    assert is_box_list(value, crop_frame=True) is in_crop


def test_an_all_null_list_in_an_original_caption_is_one_malformed_box():
    new, box_counts = transform_caption({"bbox": [None, None, None, None]}, FRAME)
    assert new == {"bbox": None} and box_counts == counts(malformed=1)


@pytest.mark.parametrize(
    "value, valid",
    [
        ([0, 0, 1000, 1000], True),
        ([10, 20, 10, 30], True),
        ([0, 0, 1001, 500], False),
        ([-1, 0, 10, 10], False),
        ([20, 0, 10, 10], False),
        ([0, 30, 10, 10], False),
        ([0.5, 0, 10, 10], False),  # crop boxes are integers
        ([True, 0, 10, 10], False),
        ([0, 0, 10], False),
        ("0,0,10,10", False),
        (None, False),
    ],
)
def test_crop_box_validity(value, valid):
    assert is_valid_crop_box(value) is valid


# -- caption parsing ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, status",
    [
        (None, CaptionStatus.MISSING),
        ("", CaptionStatus.MISSING),
        ("  \n", CaptionStatus.MISSING),
        ("{not json", CaptionStatus.INVALID_JSON),
        ('{"a": NaN}', CaptionStatus.INVALID_JSON),
        ('{"a": 1e999}', CaptionStatus.INVALID_JSON),
        (b"\xff\xfe", CaptionStatus.INVALID_JSON),
        ('{"a": 1}', CaptionStatus.OK),
        (b'{"a": 1}', CaptionStatus.OK),
        ("null", CaptionStatus.OK),
    ],
)
def test_parse_caption(text, status):
    assert parse_caption(text)[0] is status


# -- one row --------------------------------------------------------------------------


def audit(valid=True, error=None, orientation=1, src=(1000, 500), crop=(250.0, 0.0, 750.0, 500.0), size=(512, 512)):
    return AuditRecord(
        valid=valid,
        error=error,
        src_width=src[0] if src else None,
        src_height=src[1] if src else None,
        exif_orientation=orientation,
        width=size[0] if valid else None,
        height=size[1] if valid else None,
        crop_x0=crop[0] if valid else None,
        crop_y0=crop[1] if valid else None,
        crop_x1=crop[2] if valid else None,
        crop_y1=crop[3] if valid else None,
        scale=(size[0] / (crop[2] - crop[0])) if valid else None,
    )


CAPTION = '{"label": "cat", "bbox": [100, 300, 400, 600], "more": [{"box_2d": [0, 0, 1000, 200]}]}'


def test_row_with_both_resolutions_valid():
    # The 1024 crop here is the whole source: x' = v, y' = v.
    full = audit(crop=(0.0, 0.0, 1000.0, 500.0), size=(1440, 736))
    row = crop_captions_for_row(CAPTION, {"512": audit(), "1024": full})
    assert row.crops["512"] == '{"label": "cat", "bbox": [100, 100, 400, 700], "more": [{"box_2d": null}]}'
    assert (
        row.crops["1024"] == '{"label": "cat", "bbox": [100, 300, 400, 600], "more": [{"box_2d": [0, 0, 1000, 200]}]}'
    )
    meta = json.loads(row.meta_json())
    assert list(meta) == ["caption_status", "exif_orientation", "512", "1024"]
    assert meta["caption_status"] == "ok"
    assert meta["exif_orientation"] == 1
    assert meta["512"] == {
        "valid": True,
        "error": None,
        "src_width": 1000,
        "src_height": 500,
        "width": 512,
        "height": 512,
        "crop_box": [250.0, 0.0, 750.0, 500.0],
        "scale": 1.024,
        "counts": {"total": 2, "inside": 1, "clipped": 0, "outside": 1, "malformed": 0},
    }
    assert meta["1024"]["counts"] == {"total": 2, "inside": 2, "clipped": 0, "outside": 0, "malformed": 0}
    assert meta["1024"]["crop_box"] == [0.0, 0.0, 1000.0, 500.0]
    assert "," in row.meta_json() and ", " not in row.meta_json()  # compact meta


def test_invalid_resolution_row_has_null_crop_and_meta_says_why():
    invalid = AuditRecord(valid=False, error="aspect_ratio", src_width=4000, src_height=200)
    row = crop_captions_for_row(CAPTION, {"512": audit(), "1024": invalid})
    assert row.crops["512"] is not None
    assert row.crops["1024"] is None
    meta = json.loads(row.meta_json())
    assert meta["1024"] == {
        "valid": False,
        "error": "aspect_ratio",
        "src_width": 4000,
        "src_height": 200,
        "width": None,
        "height": None,
        "crop_box": None,
        "scale": None,
        "counts": None,
    }


@pytest.mark.parametrize("caption, status", [(None, "missing"), ('{"bbox": [1, 2', "invalid_json")])
def test_missing_or_invalid_caption_nulls_both_crops(caption, status):
    row = crop_captions_for_row(caption, {"512": audit(), "1024": audit()})
    assert row.crops == {"512": None, "1024": None}
    meta = json.loads(row.meta_json())
    assert meta["caption_status"] == status
    assert meta["512"]["valid"] is True and meta["512"]["counts"] is None
    assert meta["512"]["width"] == 512  # the geometry is still recorded


def test_deeply_nested_captions():
    deep = '{"a": ' * 200 + '{"bbox": [100, 300, 400, 600]}' + "}" * 200
    row = crop_captions_for_row(deep, {"512": audit()})
    assert row.caption_status == "ok" and '{"bbox": [100, 100, 400, 700]}' in row.crops["512"]
    too_deep = "[" * 100_000 + "]" * 100_000
    row = crop_captions_for_row(too_deep, {"512": audit()})
    assert row.caption_status == "invalid_json" and row.crops["512"] is None


def nested_caption(levels: int) -> str:
    """A caption of `levels` nested objects, the innermost holding one box (levels + 1 containers deep)."""
    return '{"a": ' * (levels - 1) + '{"bbox": [100, 300, 400, 600]}' + "}" * (levels - 1)


def at_stack_depth(frames: int, call):
    """`call()` made `frames` Python frames deeper than here (as from a deep caller: Dagster, a CLI thread)."""
    return call() if frames == 0 else at_stack_depth(frames - 1, call)


@pytest.mark.parametrize(
    "levels, status",
    [(MAX_CAPTION_DEPTH - 1, CaptionStatus.OK), (MAX_CAPTION_DEPTH, CaptionStatus.INVALID_JSON), (980, None)],
)
def test_caption_depth_is_judged_alike_from_any_caller(levels, status):
    """One bound for the builder, the verifier and the overlays: the parser's own limit depends on
    how deep its caller already is (980 levels parsed in the builder, failed in the overlays)."""
    text = nested_caption(levels)
    shallow = parse_caption(text)[0]
    deep = at_stack_depth(400, lambda: parse_caption(text)[0])
    assert shallow is deep is (status or CaptionStatus.INVALID_JSON)
    row = at_stack_depth(400, lambda: crop_captions_for_row(text, {"512": audit()}))
    assert row.caption_status == shallow.value
    if shallow is CaptionStatus.OK:
        assert '{"bbox": [100, 100, 400, 700]}' in row.crops["512"]
        (slot,) = at_stack_depth(400, lambda: box_slots(parse_caption(text)[1]))
        assert slot.value == [100, 300, 400, 600] and slot.path == ".".join(["a"] * (levels - 1) + ["bbox"])


def test_the_walk_takes_no_python_stack_per_level():
    deep: dict = {"bbox": [1, 2, 3, 4]}
    for _ in range(20_000):  # far past Python's recursion limit
        deep = {"a": [deep]}
    (slot,) = box_slots(deep)
    assert slot.value == [1, 2, 3, 4] and slot.index == 0
    mapped = map_box_slots(deep, ["bbox"], lambda value, *_: "moved")
    for _ in range(20_000):
        mapped = mapped["a"][0]
    assert mapped == {"bbox": "moved"}


@pytest.mark.parametrize(
    "text",
    ['{"label": "\\ud83d", "bbox": [1, 2, 3, 4]}', '["\\udc00"]', b'{"label": "\\uD83D"}', '{"\\ud800": 1}'],
)
def test_a_lone_surrogate_is_invalid_json(text):
    """Valid JSON syntax, but not Unicode text: half an emoji from a cut string cannot be written as UTF-8."""
    assert parse_caption(text)[0] is CaptionStatus.INVALID_JSON
    row = crop_captions_for_row(text, {"512": audit(), "1024": audit()})
    assert row.caption_status == "invalid_json" and row.crops == {"512": None, "1024": None}
    row.meta_json().encode("utf-8")


def test_surrogate_pairs_and_escaped_backslashes_are_fine():
    assert parse_caption('{"label": "\\ud83d\\ude00"}') == (CaptionStatus.OK, {"label": "\U0001f600"})
    assert parse_caption('{"label": "\\\\ud83d"}') == (CaptionStatus.OK, {"label": "\\ud83d"})


def test_valid_audit_without_geometry_is_an_error():
    broken = AuditRecord(valid=True, src_width=10, src_height=10)
    with pytest.raises(ValueError, match="lacks its crop geometry"):
        crop_captions_for_row(CAPTION, {"512": broken})


def test_unknown_caption_frame_is_refused():
    with pytest.raises(ValueError, match="caption_frame"):
        crop_captions_for_row(CAPTION, {"512": audit()}, caption_frame="upright")


# -- raw-frame captions and EXIF orientation ------------------------------------------

# The oriented (displayed) image is 1000 x 500, so the stored one of orientations 6 and 8 is
# 500 wide and 1000 tall. The raw box [300, 200, 500, 400] covers raw rows 300..500 and
# columns 200..400 of that grid.
RAW_CAPTION = '{"bbox": [300, 200, 500, 400]}'


def test_orientation_6_raw_caption():
    # Orientation 6 is displayed by rotating the stored pixels 90 degrees clockwise:
    # a raw point (y, x) lands at (y', x') = (x, 1000 - y).
    # Corners (300, 200) -> (200, 700) and (500, 400) -> (400, 500): oriented [200, 500, 400, 700].
    # Then the crop: y' = v, x' = 2v - 500 -> [200, 500, 400, 900].
    row = crop_captions_for_row(RAW_CAPTION, {"512": audit(orientation=6)}, caption_frame="raw")
    assert row.crops["512"] == '{"bbox": [200, 500, 400, 900]}'
    assert json.loads(row.meta_json())["exif_orientation"] == 6


def test_orientation_8_raw_caption():
    # Orientation 8 is displayed by rotating 90 degrees counter-clockwise:
    # a raw point (y, x) lands at (y', x') = (1000 - x, y).
    # Corners (300, 200) -> (800, 300) and (500, 400) -> (600, 500): oriented [600, 300, 800, 500].
    # Then the crop: x' = 2v - 500 -> [600, 100, 800, 500].
    row = crop_captions_for_row(RAW_CAPTION, {"512": audit(orientation=8)}, caption_frame="raw")
    assert row.crops["512"] == '{"bbox": [600, 100, 800, 500]}'


def test_oriented_caption_ignores_exif_orientation():
    # Same numbers as an oriented-frame box: y' = v, x' = 2v - 500 -> 2*200-500 = -100 -> 0.
    row = crop_captions_for_row(RAW_CAPTION, {"512": audit(orientation=6)}, caption_frame="oriented")
    assert row.crops["512"] == '{"bbox": [300, 0, 500, 300]}'


@pytest.mark.parametrize("orientation", range(1, 9))
def test_raw_to_oriented_matches_pillow_exif_transpose(orientation):
    # Paint the box on a stored image, let Pillow display it, and find where it ended up.
    raw_w, raw_h = (40, 80)
    top, left, bottom, right = 10, 6, 30, 22  # raw pixels, right/bottom exclusive
    image = Image.new("L", (raw_w, raw_h), 0)
    image.paste(255, (left, top, right, bottom))
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = io.BytesIO()
    image.save(data, "PNG", exif=exif.tobytes())
    displayed = ImageOps.exif_transpose(Image.open(io.BytesIO(data.getvalue())))
    dx0, dy0, dx1, dy1 = displayed.getbbox()
    disp_w, disp_h = displayed.size

    raw_box = (top / raw_h * 1000, left / raw_w * 1000, bottom / raw_h * 1000, right / raw_w * 1000)
    ymin, xmin, ymax, xmax = caption_box_to_oriented(raw_box, orientation)
    got = (xmin / 1000 * disp_w, ymin / 1000 * disp_h, xmax / 1000 * disp_w, ymax / 1000 * disp_h)
    assert got == pytest.approx((dx0, dy0, dx1, dy1), abs=1e-9)


# -- property: boxes inside the crop come back to where they were ---------------------


@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(16, 6000),
    height=st.integers(16, 6000),
    area=st.sampled_from([AREA_512, AREA_1024]),
    corners=st.tuples(*[st.floats(0, 1, allow_nan=False)] * 4),
)
def test_inside_boxes_map_back_within_rounding(width, height, area, corners):
    geo = geometry(width, height, area)
    crop = geo.crop_box
    frame = CropFrame(width, height, *crop.as_tuple())
    # A box in source 0..1000 units that lies inside the crop box.
    top, bottom = sorted(corners[:2])
    left, right = sorted(corners[2:])
    y_lo, y_hi = crop.y0 / height * 1000, crop.y1 / height * 1000
    x_lo, x_hi = crop.x0 / width * 1000, crop.x1 / width * 1000
    box = [
        y_lo + top * (y_hi - y_lo),
        x_lo + left * (x_hi - x_lo),
        y_lo + bottom * (y_hi - y_lo),
        x_lo + right * (x_hi - x_lo),
    ]
    box = [min(max(v, 0.0), 1000.0) for v in box]

    new_box, outcome = transform_box(box, frame)

    source_px = (box[0] / 1000 * height, box[1] / 1000 * width, box[2] / 1000 * height, box[3] / 1000 * width)
    # Half a crop-grid unit, in source pixels, per axis (plus float noise).
    tol_y = 0.5 / 1000 * crop.height + 1e-6
    tol_x = 0.5 / 1000 * crop.width + 1e-6
    if new_box is None:
        # Only a box thinner than a grid unit may vanish, and only by rounding.
        assert outcome is BoxOutcome.OUTSIDE
        assert source_px[2] - source_px[0] <= 2 * tol_y or source_px[3] - source_px[1] <= 2 * tol_x
        return
    assert outcome is BoxOutcome.INSIDE
    assert all(isinstance(v, int) and 0 <= v <= 1000 for v in new_box)
    assert new_box[0] < new_box[2] and new_box[1] < new_box[3]
    back = (
        crop.y0 + new_box[0] / 1000 * crop.height,
        crop.x0 + new_box[1] / 1000 * crop.width,
        crop.y0 + new_box[2] / 1000 * crop.height,
        crop.x0 + new_box[3] / 1000 * crop.width,
    )
    for got, want, tol in zip(back, source_px, (tol_y, tol_x, tol_y, tol_x)):
        assert math.isclose(got, want, abs_tol=tol), (got, want, tol)
