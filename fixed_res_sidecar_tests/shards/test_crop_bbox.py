"""The crop-bbox sidecar of real shards: built from the real resized shards (SPEC 2, 6)."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.core.audit import read_audit_records
from fixed_res_sidecar.core.bbox import CROP_COLUMNS, META_COLUMN
from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.io.parquet import ShardError
from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard
from fixed_res_sidecar.shards.overlay import write_overlays
from fixed_res_sidecar.shards.settings import SETTINGS_KEY
from fixed_res_sidecar.shards.verify import GateError, verify_crop_bbox_shard
from fixed_res_sidecar_tests.fixtures.datasets import sidecar_layout

COLUMNS = ["image_key", CROP_COLUMNS["512"], CROP_COLUMNS["1024"], META_COLUMN]
PREFIXES = {"512": "0_26mp_process", "1024": "1_05mp_process"}


@pytest.fixture
def build(sample_build, tmp_path):
    """(main, resized 512, resized 1024, output) over fresh copies of the sample build."""
    main, (out_512, out_1024) = sample_build
    return main, out_512.location, out_1024.location, Location.parse(tmp_path / "sidecar")


def boxes_in(node, keys=("bbox", "box_2d", "bbox_2d")):
    """Every box value found under a box key (a list of boxes counts each element)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys:
                if isinstance(value, list) and any(isinstance(v, list) for v in value):
                    found.extend(value)  # a list of boxes
                elif value not in (None, []):
                    found.append(value)
            else:
                found.extend(boxes_in(value, keys))
    elif isinstance(node, list):
        for value in node:
            found.extend(boxes_in(value, keys))
    return found


def rewrite(location: Location, rel: str, change) -> None:
    """Replace a shard by `change(table)`, written in place (a damaged copy for a test)."""
    path = Path(location.child(rel))
    table = pq.read_table(path)
    pq.write_table(change(table), path)


def test_sidecar_layout_keys_order_and_content(build):
    main, r512, r1024, output = build
    shards = main.list_shards()
    assert any("/" in rel for rel in shards)  # nested folders
    for rel in shards:
        result = build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
        assert (result.rel, result.status, result.rows) == (rel, "built", pq.read_metadata(main.child(rel)).num_rows)
    assert output.list_shards() == shards

    for rel in shards:
        source = pq.read_table(main.child(rel))
        sidecar = pq.read_table(output.child(rel))
        assert sidecar.column_names == COLUMNS
        assert sidecar.column("image_key").equals(source.column("image_key"))
        assert sidecar.schema.field("image_key").type == source.schema.field("image_key").type
        audits = {
            name: read_audit_records(pq.read_table(location.child(rel)), PREFIXES[name])
            for name, location in (("512", r512), ("1024", r1024))
        }
        for i, row in enumerate(sidecar.to_pylist()):
            caption = source.column("structured_description")[i].as_py()
            meta = json.loads(row[META_COLUMN])
            assert meta["caption_status"] == ("missing" if caption is None else "ok")
            for name in ("512", "1024"):
                record, part = audits[name][i], meta[name]
                # The meta repeats the resize audit; it never re-derives geometry.
                assert part["valid"] == record.valid and part["error"] == record.error
                assert (part["src_width"], part["src_height"]) == (record.src_width, record.src_height)
                assert (part["width"], part["height"]) == (record.width, record.height)
                assert meta["exif_orientation"] == record.exif_orientation
                crop = row[CROP_COLUMNS[name]]
                if not record.valid or caption is None:
                    assert crop is None and part["counts"] is None
                    continue
                assert part["crop_box"] == [record.crop_x0, record.crop_y0, record.crop_x1, record.crop_y1]
                original, cropped = json.loads(caption), json.loads(crop)
                assert original["summary"] == cropped["summary"]
                counts = part["counts"]
                assert counts["total"] == len(boxes_in(original))
                assert counts["total"] == counts["inside"] + counts["clipped"] + counts["outside"] + counts["malformed"]
                new_boxes = boxes_in(cropped)
                assert sum(b is None for b in new_boxes) == counts["outside"] + counts["malformed"]
                for box in new_boxes:
                    if box is not None:
                        assert all(isinstance(v, int) and 0 <= v <= 1000 for v in box)
                        assert box[0] < box[2] and box[1] < box[3]

        settings = json.loads(pq.read_schema(output.child(rel)).metadata[SETTINGS_KEY])
        assert settings["bbox_keys"] == ["bbox", "box_2d", "bbox_2d"]
        assert settings["caption_frame"] == "oriented"
        assert settings["audit_prefixes"] == PREFIXES
        assert settings["version"] >= 1


def test_null_image_row_has_null_crops_and_meta_says_why(build):
    main, r512, r1024, output = build
    rel = "part-00000.parquet"
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    sidecar = pq.read_table(output.child(rel)).to_pylist()
    row = sidecar[4]  # sample data: row 4 of the first shard has no image and no caption
    assert row[CROP_COLUMNS["512"]] is None and row[CROP_COLUMNS["1024"]] is None
    meta = json.loads(row[META_COLUMN])
    assert meta["caption_status"] == "missing"
    assert meta["512"]["valid"] is False and meta["512"]["error"] == "missing_image"
    assert meta["1024"]["valid"] is False and meta["1024"]["error"] == "missing_image"


def test_one_invalid_resolution_nulls_only_its_column(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]

    def mark_row_0_too_small(table: pa.Table) -> pa.Table:
        first = pa.array([True] + [False] * (table.num_rows - 1))
        for name, value in (("valid", False), ("error", "too_small"), ("width", None), ("crop_x0", None)):
            column = f"1_05mp_process_{name}"
            index = table.column_names.index(column)
            replaced = pc.if_else(first, pa.scalar(value, table.schema.field(column).type), table.column(column))
            table = table.set_column(index, table.schema.field(column), replaced)
        return table

    rewrite(r1024, rel, mark_row_0_too_small)
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    row = pq.read_table(output.child(rel)).to_pylist()[0]
    assert row[CROP_COLUMNS["512"]] is not None
    assert row[CROP_COLUMNS["1024"]] is None
    meta = json.loads(row[META_COLUMN])
    assert meta["caption_status"] == "ok"
    assert meta["1024"]["valid"] is False and meta["1024"]["error"] == "too_small"
    assert meta["1024"]["counts"] is None and meta["1024"]["crop_box"] is None
    assert meta["512"]["valid"] is True and meta["512"]["counts"]["total"] == 6


def test_refuses_a_missing_resized_shard(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[-1]
    os.remove(r1024.child(rel))
    with pytest.raises(ShardError, match=f"resized 1024 shard .*{rel}.* is missing"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    assert not output.exists(rel)


def test_refuses_mismatched_keys(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[1]

    def swap_rows_4_and_5(table: pa.Table) -> pa.Table:
        order = list(range(table.num_rows))
        order[4], order[5] = 5, 4
        return table.take(order)

    rewrite(r512, rel, swap_rows_4_and_5)
    with pytest.raises(ShardError, match=f"resized 512 shard .*{rel}: key at row 4"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    assert not output.exists(rel)
    assert not list(Path(output.path).rglob("*.tmp"))  # the aborted write left nothing behind


def test_refuses_a_wrong_audit_prefix(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    with pytest.raises(ShardError, match="resized 512 shard .* lacks column.*'0_26mp_v2_valid'"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output, audit_prefix_512="0_26mp_v2"), rel)


def test_refuses_a_row_count_mismatch(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    rewrite(r1024, rel, lambda table: table.slice(0, table.num_rows - 1))
    with pytest.raises(ShardError, match="resized 1024 shard .* has 9 rows, the main shard has 10"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)


def test_refuses_an_output_overlapping_an_input(build):
    main, r512, r1024, _output = build
    rel = main.list_shards()[0]
    with pytest.raises(LocationError, match="main dataset"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, Location.parse(Path(main.path, "sidecar"))), rel)
    with pytest.raises(LocationError, match="resized_512 output"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, r512), rel)


def test_skip_existing(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    assert build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel).status == "built"
    assert build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel, skip_existing=True).status == "skipped"
    # Other settings: rebuilt.
    changed = build_crop_bbox_shard(
        sidecar_layout(main, r512, r1024, output, caption_frame="raw"), rel, skip_existing=True
    )
    assert changed.status == "built"
    assert json.loads(pq.read_schema(output.child(rel)).metadata[SETTINGS_KEY])["caption_frame"] == "raw"
    again = build_crop_bbox_shard(
        sidecar_layout(main, r512, r1024, output, caption_frame="raw"), rel, skip_existing=True
    )
    assert again.status == "skipped"
    # A shard with the wrong row count (same settings): rebuilt.
    rewrite(output, rel, lambda table: table.slice(0, 3).replace_schema_metadata(table.schema.metadata))
    rebuilt = build_crop_bbox_shard(
        sidecar_layout(main, r512, r1024, output, caption_frame="raw"), rel, skip_existing=True
    )
    assert rebuilt.status == "built" and pq.read_metadata(output.child(rel)).num_rows == 10
    # Without skip_existing an up-to-date shard is rebuilt anyway.
    assert build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output, caption_frame="raw"), rel).status == "built"


def test_raw_caption_frame_rotates_only_rotated_rows(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    raw_output = Location.parse(Path(output.path).parent / "sidecar-raw")
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, raw_output, caption_frame="raw"), rel)
    oriented = pq.read_table(output.child(rel)).to_pylist()
    raw = pq.read_table(raw_output.child(rel)).to_pylist()
    orientations = [json.loads(row[META_COLUMN])["exif_orientation"] for row in oriented]
    assert {1, 6} <= set(orientations)
    for orientation, a, b in zip(orientations, oriented, raw):
        if orientation == 1:
            assert a == b
        else:
            assert a[CROP_COLUMNS["512"]] != b[CROP_COLUMNS["512"]]


def test_caption_dataset(build, tmp_path):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    captions = Location.parse(tmp_path / "captions")
    source = pq.read_table(main.child(rel), columns=["image_key", "structured_description"])
    texts = [json.dumps({"bbox": [0, 0, 1000, 1000]})] * source.num_rows
    texts[1] = "{broken"
    Path(captions.child(rel)).parent.mkdir(parents=True)
    pq.write_table(source.set_column(1, "structured_description", pa.array(texts)), captions.child(rel))

    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output, caption_location=captions), rel)
    rows = pq.read_table(output.child(rel)).to_pylist()
    assert rows[0][CROP_COLUMNS["1024"]] is not None and json.loads(rows[0][CROP_COLUMNS["1024"]])["bbox"] is not None
    assert json.loads(rows[1][META_COLUMN])["caption_status"] == "invalid_json"
    assert rows[1][CROP_COLUMNS["512"]] is None
    settings = json.loads(pq.read_schema(output.child(rel)).metadata[SETTINGS_KEY])
    assert settings["caption_location"] == captions.uri

    # A caption dataset whose keys disagree is refused.
    pq.write_table(source.set_column(0, "image_key", pa.array(["x"] * source.num_rows)), captions.child(rel))
    with pytest.raises(ShardError, match="caption shard .* key at row 0"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output, caption_location=captions), rel)


def test_streams_across_unaligned_row_groups(build, monkeypatch):
    # Small read batches and output row groups: every step is sliced across the inputs'
    # different row-group boundaries, and the result must not change.
    from fixed_res_sidecar.shards import crop_bbox

    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    expected = pq.read_table(output.child(rel))
    monkeypatch.setattr(crop_bbox, "BATCH_ROWS", 3)
    monkeypatch.setattr(crop_bbox, "OUTPUT_ROW_GROUP_ROWS", 4)
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    assert pq.read_table(output.child(rel)).equals(expected)
    assert pq.read_metadata(output.child(rel)).num_row_groups > 1


def test_on_s3(build, s3_bucket):
    main, r512, r1024, local_output = build
    rel = "nested/a/part-00001.parquet"
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, local_output), rel)

    from fixed_res_sidecar.io.s3 import s3_client

    client = s3_client()
    for name, location in (("main", main), ("r512", r512), ("r1024", r1024)):
        client.upload_file(location.child(rel), s3_bucket, f"data/{name}/{rel}")
    s3 = {name: Location.parse(f"s3://{s3_bucket}/data/{name}") for name in ("main", "r512", "r1024", "sidecar")}
    result = build_crop_bbox_shard(sidecar_layout(s3["main"], s3["r512"], s3["r1024"], s3["sidecar"]), rel)
    assert result.status == "built"
    assert s3["sidecar"].list_shards() == [rel]
    remote = pq.read_table(s3["sidecar"].open_input(rel))
    assert remote.equals(pq.read_table(local_output.child(rel)))
    again = build_crop_bbox_shard(
        sidecar_layout(s3["main"], s3["r512"], s3["r1024"], s3["sidecar"]), rel, skip_existing=True
    )
    assert again.status == "skipped"


def test_main_shard_without_a_caption_column_has_every_caption_missing(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    rewrite(main, rel, lambda table: table.drop_columns(["structured_description"]))
    result = build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    assert result.status == "built" and result.caption_column_missing
    assert result.counts["captions"] == {"ok": 0, "missing": 10, "invalid_json": 0}
    assert "10 missing (the main shard has no caption column)" in result.status_text
    sidecar = pq.read_table(output.child(rel))
    assert sidecar.column_names == COLUMNS and sidecar.num_rows == 10
    audits = {
        name: read_audit_records(pq.read_table(location.child(rel)), PREFIXES[name])
        for name, location in (("512", r512), ("1024", r1024))
    }
    for i, row in enumerate(sidecar.to_pylist()):
        assert row[CROP_COLUMNS["512"]] is None and row[CROP_COLUMNS["1024"]] is None
        meta = json.loads(row[META_COLUMN])
        assert meta["caption_status"] == "missing"
        for name in ("512", "1024"):  # the resize side of the meta is still filled in
            assert meta[name]["valid"] == audits[name][i].valid and meta[name]["counts"] is None
            assert meta[name]["width"] == audits[name][i].width

    # The other shards, with captions, are unaffected.
    other = main.list_shards()[1]
    assert not build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), other).caption_column_missing


def test_a_caption_dataset_without_the_caption_column_is_still_an_error(build, tmp_path):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    captions = Location.parse(tmp_path / "captions")
    Path(captions.child(rel)).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pq.read_table(main.child(rel), columns=["image_key"]), captions.child(rel))
    with pytest.raises(ShardError, match="caption shard .* lacks column.*'structured_description'"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output, caption_location=captions), rel)
    assert not output.exists(rel)


def test_gate_runs_before_writing_and_not_for_skipped_shards(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    calls = []

    def refuse(shard):
        calls.append(shard)
        raise GateError(f"resized 512 shard of {shard} did not pass the verifier")

    with pytest.raises(GateError, match="did not pass the verifier"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel, gate=refuse)
    assert calls == [rel] and not output.exists(rel)
    assert build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel, gate=calls.append).status == "built"
    assert calls == [rel, rel]
    skipped = build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel, gate=refuse, skip_existing=True)
    assert skipped.status == "skipped" and calls == [rel, rel]


# -- one bad row never fails its shard ---------------------------------------------------------


def test_captions_that_are_not_utf8_text_are_invalid_json_for_their_row_only(build):
    """Raw bytes in a binary caption column, and a lone surrogate escape (half an emoji): before,
    the whole shard failed with a message about the resized audits."""
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    bad = {1: b'{"label": "caf\xe9", "bbox": [1, 2, 3, 4]}', 2: b'{"label": "\\ud83d", "bbox": [1, 2, 3, 4]}'}

    def binary_captions(table):
        captions = [None if c is None else c.encode() for c in table.column("structured_description").to_pylist()]
        for row, value in bad.items():
            captions[row] = value
        index = table.schema.get_field_index("structured_description")
        return table.set_column(index, "structured_description", pa.array(captions, pa.binary()))

    rewrite(main, rel, binary_captions)
    result = build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    assert result.built and result.rows == 10
    metas = [json.loads(m) for m in pq.read_table(output.child(rel)).column(META_COLUMN).to_pylist()]
    statuses = [m["caption_status"] for m in metas]
    assert statuses[1] == statuses[2] == "invalid_json"
    assert statuses.count("ok") == 10 - 2 - statuses.count("missing")  # every other row as before
    crops = pq.read_table(output.child(rel)).column(CROP_COLUMNS["512"]).to_pylist()
    assert crops[1] is None and crops[2] is None and crops[0] is not None

    # The same lone surrogate in a string column.
    def string_captions(table):
        captions = [
            None if c is None else c.decode("utf-8", "replace")
            for c in table.column("structured_description").to_pylist()
        ]
        captions[1] = '{"label": "\\ud83d"}'
        captions[2] = json.dumps({"ok": True})
        index = table.schema.get_field_index("structured_description")
        return table.set_column(index, "structured_description", pa.array(captions, pa.string()))

    rewrite(main, rel, string_captions)
    build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
    metas = [json.loads(m) for m in pq.read_table(output.child(rel)).column(META_COLUMN).to_pylist()]
    assert [m["caption_status"] for m in metas[1:3]] == ["invalid_json", "ok"]


def test_bytes_that_are_not_utf8_in_a_string_caption_column_are_invalid_json_for_their_row_only(build, tmp_path):
    """Reported: a `string` caption column holding bytes that are not UTF-8 (Parquet writers do not
    all check) failed the whole sidecar shard with a UnicodeDecodeError."""
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    bad = b'{"label": "caf\xe9", "bbox": [1, 2, 3, 4]}'  # Latin-1, not UTF-8

    def string_captions(table):
        captions = [None if c is None else c.encode() for c in table.column("structured_description").to_pylist()]
        captions[1] = bad
        index = table.schema.get_field_index("structured_description")
        return table.set_column(index, "structured_description", pa.array(captions, pa.binary()).view(pa.string()))

    rewrite(main, rel, string_captions)
    assert pq.read_schema(main.child(rel)).field("structured_description").type == pa.string()
    layout = sidecar_layout(main, r512, r1024, output, reports=Location.parse(tmp_path / "reports"))
    result = build_crop_bbox_shard(layout, rel)
    assert result.built and result.counts["captions"]["invalid_json"] == 1
    sidecar = pq.read_table(output.child(rel))
    statuses = [json.loads(m)["caption_status"] for m in sidecar.column(META_COLUMN).to_pylist()]
    assert statuses[1] == "invalid_json" and statuses.count("ok") == 10 - 1 - statuses.count("missing")
    assert sidecar.column(CROP_COLUMNS["512"])[1].as_py() is None
    report = verify_crop_bbox_shard(layout, rel)
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.stats["caption_status"]["invalid_json"] == 1
    # The overlay pictures read the captions too (every row a candidate: a sample larger than the shard).
    assert write_overlays(layout, rel, layout.report_location("overlays"), sample=10)


def test_an_inconsistent_audit_is_reported_against_the_resized_shards(build):
    main, r512, r1024, output = build
    rel = main.list_shards()[0]
    rewrite(
        r512,
        rel,
        lambda t: t.set_column(
            t.schema.get_field_index("0_26mp_process_crop_x0"),
            "0_26mp_process_crop_x0",
            pa.nulls(t.num_rows, pa.float64()),
        ),
    )
    with pytest.raises(ShardError, match=rf"resized shards .*{rel}.*lacks its crop geometry"):
        build_crop_bbox_shard(sidecar_layout(main, r512, r1024, output), rel)
