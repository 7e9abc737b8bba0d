"""shards/verify/sidecar.py: the crop-bbox sidecar's checks catch each kind of damage, naming the shard."""

import json
from pathlib import Path

from fixed_res_sidecar.core.bbox import CROP_COLUMNS, META_COLUMN
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard
from fixed_res_sidecar.shards.settings import SETTINGS_KEY
from fixed_res_sidecar.shards.verify import (
    BOXES_REDERIVED,
    BOXES_VALID,
    KEYS_MATCH,
    META_MATCHES_AUDIT,
    SHARD_COMPLETE,
    SIDECAR_COLUMNS,
    verify_crop_bbox_shard,
)
from fixed_res_sidecar_tests.fixtures.datasets import DAMAGED_REL as REL
from fixed_res_sidecar_tests.fixtures.datasets import (
    SidecarBuild,
    assert_failed,
    column,
    damage_column_chunk,
    replace_column,
    rewrite_shard,
)


def crop_row_with_box(build: SidecarBuild, resolution: str) -> int:
    crops = column(build.sidecar, REL, CROP_COLUMNS[resolution])
    return next(i for i, text in enumerate(crops) if text and '"bbox": [' in text)


def use_box_key(location: Location, rel: str, key: str) -> None:
    """Rename every "bbox" key of the captions of `location/rel` (a main shard) to `key`."""
    captions = column(location, rel, "structured_description")
    renamed = [None if text is None else text.replace('"bbox"', f'"{key}"') for text in captions]
    rewrite_shard(location, rel, lambda t: replace_column(t, "structured_description", renamed))


def test_crop_column_with_out_of_range_box_is_caught(sidecar_build):
    row = crop_row_with_box(sidecar_build, "512")
    crops = column(sidecar_build.sidecar, REL, CROP_COLUMNS["512"])
    caption = json.loads(crops[row])
    caption["objects"][0]["bbox"] = [0, 0, 1001, 500]
    crops[row] = json.dumps(caption)
    rewrite_shard(sidecar_build.sidecar, REL, lambda t: replace_column(t, CROP_COLUMNS["512"], crops))
    report = sidecar_build.verify_crop()
    message = assert_failed(report, BOXES_VALID, sidecar_build.sidecar, containing=f"row {row}")
    assert "objects[0].bbox = [0, 0, 1001, 500]" in message and CROP_COLUMNS["512"] in message
    assert report.check(META_MATCHES_AUDIT).passed


def test_many_bad_boxes_are_all_counted_and_a_few_described(sidecar_build):
    """The box walk stays bounded: 20,000 bad boxes (one of them a huge list) cost a count each,
    not a problem record and a full repr each."""
    from fixed_res_sidecar.shards.verify.report import MAX_PROBLEMS

    row = crop_row_with_box(sidecar_build, "512")
    crops = column(sidecar_build.sidecar, REL, CROP_COLUMNS["512"])
    bad = [list(range(100_000))] + [[0, 0, 1001, 500]] * 19_999
    crops[row] = json.dumps({"regions": {"bbox_2d": bad}})
    rewrite_shard(sidecar_build.sidecar, REL, lambda t: replace_column(t, CROP_COLUMNS["512"], crops))
    check = sidecar_build.verify_crop().check(BOXES_VALID)
    assert not check.passed and check.message.count("20000 bad box(es)") == 1
    assert check.metadata["problems"] == 20_000 and len(check.metadata["examples"]) == MAX_PROBLEMS
    assert check.metadata["boxes"]["512_invalid"] == 20_000
    assert "regions.bbox_2d[0] = [0, 1, 2, 3, 4, 5, ...] is not a valid box" in check.message
    assert len(check.message) < 1_000 and len(json.dumps(check.metadata)) < 10_000
    assert "regions.bbox_2d[1] = [0, 0, 1001, 500]" in json.dumps(check.metadata["examples"])


def test_missing_crop_column_is_caught(sidecar_build):
    rewrite_shard(sidecar_build.sidecar, REL, lambda t: t.drop_columns([CROP_COLUMNS["1024"]]))
    report = sidecar_build.verify_crop()
    assert_failed(report, SIDECAR_COLUMNS, sidecar_build.sidecar, containing=CROP_COLUMNS["1024"])
    assert_failed(report, BOXES_VALID, sidecar_build.sidecar, containing="column missing")


def test_meta_disagreeing_with_the_audit_is_caught(sidecar_build):
    metas = column(sidecar_build.sidecar, REL, META_COLUMN)
    row = next(i for i, text in enumerate(metas) if json.loads(text)["1024"]["valid"])
    meta = json.loads(metas[row])
    meta["1024"]["width"] += 32
    metas[row] = json.dumps(meta)
    rewrite_shard(sidecar_build.sidecar, REL, lambda t: replace_column(t, META_COLUMN, metas))
    report = sidecar_build.verify_crop()
    assert_failed(report, META_MATCHES_AUDIT, sidecar_build.sidecar, containing=f"row {row}")
    assert "1024: meta width=" in report.check(META_MATCHES_AUDIT).message


def test_crop_keys_and_rows_and_missing_inputs(sidecar_build):
    keys = column(sidecar_build.sidecar, REL, "image_key")
    keys[0], keys[4] = keys[4], keys[0]
    rewrite_shard(sidecar_build.sidecar, REL, lambda t: replace_column(t, "image_key", keys))
    assert_failed(sidecar_build.verify_crop(), KEYS_MATCH, sidecar_build.sidecar, containing="row 0")

    Path(sidecar_build.r1024.child(REL)).unlink()
    report = sidecar_build.verify_crop()
    check = report.check(META_MATCHES_AUDIT)
    assert not check.passed and sidecar_build.r1024.child(REL) in check.message and "missing" in check.message

    Path(sidecar_build.sidecar.child(REL)).unlink()
    report = sidecar_build.verify_crop()
    assert_failed(report, SHARD_COMPLETE, sidecar_build.sidecar, containing="is missing")
    assert not any(c.passed for c in report.checks)


def test_crop_checks_use_the_box_keys_and_frame_the_sidecar_recorded(sidecar_build):
    use_box_key(sidecar_build.main, REL, "region")
    build_crop_bbox_shard(sidecar_build.layout(bbox_keys=("region",), caption_frame="raw"), REL)
    report = sidecar_build.verify_crop()
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.stats["bbox_keys"] == ["region"] and report.stats["caption_frame"] == "raw"
    assert report.check(BOXES_VALID).metadata["bbox_keys"] == ["region"]

    # A bad box under the recorded key is found; explicit keys override the recorded ones.
    crops = column(sidecar_build.sidecar, REL, CROP_COLUMNS["512"])
    row = next(i for i, text in enumerate(crops) if text and '"region": [' in text)
    caption = json.loads(crops[row])
    caption["objects"][0]["region"] = [0, 0, 1001, 500]
    crops[row] = json.dumps(caption)
    rewrite_shard(
        sidecar_build.sidecar, REL, lambda t: replace_column(t, CROP_COLUMNS["512"], crops)
    )  # keeps the footer settings
    message = assert_failed(sidecar_build.verify_crop(), BOXES_VALID, sidecar_build.sidecar, containing=f"row {row}")
    assert "objects[0].region = [0, 0, 1001, 500]" in message
    explicit = sidecar_build.verify_crop(bbox_keys=("box_2d",), caption_frame="oriented")
    assert explicit.check(BOXES_VALID).passed
    assert explicit.stats["bbox_keys"] == ["box_2d"] and explicit.stats["caption_frame"] == "oriented"


def test_sidecar_without_recorded_settings_uses_the_defaults(sidecar_build):
    def without_settings(table):
        return table.replace_schema_metadata({k: v for k, v in table.schema.metadata.items() if k != SETTINGS_KEY})

    rewrite_shard(sidecar_build.sidecar, REL, without_settings)  # no footer settings (its sources kept)
    report = sidecar_build.verify_crop()
    assert report.passed and report.stats["bbox_keys"] == ["bbox", "box_2d", "bbox_2d"]
    assert report.stats["caption_frame"] == "oriented"


def test_a_box_list_wholly_outside_the_crop_is_not_a_bad_box(sidecar_build, tmp_path):
    from fixed_res_sidecar.shards.overlay import write_overlays

    # A landscape row: its crop cuts a margin off the left, where both boxes of a list lie.
    prefix = sidecar_build.prefixes["512"]
    x0 = column(sidecar_build.r512, REL, f"{prefix}_crop_x0")
    widths = column(sidecar_build.r512, REL, f"{prefix}_src_width")
    row = next(i for i, (x, w) in enumerate(zip(x0, widths)) if x is not None and x / w > 0.01)
    captions = column(sidecar_build.main, REL, "structured_description")
    captions[row] = json.dumps(
        {"group": {"box_2d": [[0, 0, 100, 2], [500, 0, 600, 3]]}, "cat": {"bbox": [400, 400, 600, 600]}}
    )
    rewrite_shard(sidecar_build.main, REL, lambda t: replace_column(t, "structured_description", captions))
    build_crop_bbox_shard(sidecar_build.layout(), REL)
    crop = json.loads(column(sidecar_build.sidecar, REL, CROP_COLUMNS["512"])[row])
    assert crop["group"]["box_2d"] == [None, None]
    report = sidecar_build.verify_crop()
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.check(BOXES_VALID).metadata["boxes"]["512_null"] >= 2
    assert write_overlays(sidecar_build.layout(), REL, Location.parse(tmp_path / "overlays"), 10)  # drawn too


def test_a_damaged_sidecar_page_fails_shard_complete(sidecar_build):
    damage_column_chunk(sidecar_build.sidecar.child(REL), META_COLUMN)
    report = sidecar_build.verify_crop()
    message = assert_failed(report, SHARD_COMPLETE, sidecar_build.sidecar, containing=f"column {META_COLUMN!r}")
    assert "does not match its checksum" in message


def test_a_valid_box_moved_off_its_object_is_caught_by_the_re_derivation(sidecar_build):
    """A crop box nudged by 40/1000 is still a valid box and its meta still agrees with the audits:
    only re-deriving the crop captions from the caption and the audits shows it is wrong."""
    row = crop_row_with_box(sidecar_build, "1024")
    crops = column(sidecar_build.sidecar, REL, CROP_COLUMNS["1024"])
    caption = json.loads(crops[row])
    ymin, xmin, ymax, xmax = caption["objects"][0]["bbox"]
    shift = 40 if xmax <= 960 else -40
    caption["objects"][0]["bbox"] = [ymin, xmin + shift, ymax, xmax + shift]
    crops[row] = json.dumps(caption)
    rewrite_shard(sidecar_build.sidecar, REL, lambda t: replace_column(t, CROP_COLUMNS["1024"], crops))
    report = sidecar_build.verify_crop()
    message = assert_failed(report, BOXES_REDERIVED, sidecar_build.sidecar, containing=f"row {row}")
    assert CROP_COLUMNS["1024"] in message and CROP_COLUMNS["512"] not in message
    assert [c.name for c in report.failed_checks] == [BOXES_REDERIVED]
    # The undamaged sidecar agrees exactly, on every row.
    build_crop_bbox_shard(sidecar_build.layout(), REL)
    for rel in sidecar_build.main.list_shards():
        check = verify_crop_bbox_shard(sidecar_build.layout(), rel, sample=None).check(BOXES_REDERIVED)
        assert check.passed and check.metadata["rederived_rows"] == 10, check.message
    assert verify_crop_bbox_shard(sidecar_build.layout(), REL, sample=3).check(BOXES_REDERIVED).metadata == {
        "rederived_rows": 3
    }
