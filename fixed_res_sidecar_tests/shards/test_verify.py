"""The SPEC 7 verifier on real builds: passes when undamaged, names the shard for each damage."""

import io
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.core.geometry import geometry
from fixed_res_sidecar.core.pixels import PixelOptions
from fixed_res_sidecar.io import locations
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.crop_bbox import CROP_COLUMNS, META_COLUMN, build_crop_bbox_shard
from fixed_res_sidecar.shards.resize import ResizedOutput, build_resized_shard
from fixed_res_sidecar.shards.verify import (
    AUDIT_CONSISTENT,
    BOXES_VALID,
    CROP_BBOX_CHECKS,
    KEYS_MATCH,
    META_MATCHES_AUDIT,
    OVERLAYS_WRITTEN,
    RESIZED_CHECKS,
    SAMPLE_IMAGES,
    SHARD_COMPLETE,
    SIDECAR_COLUMNS,
    aspect_tolerance,
    dataset_summary,
    default_target_area,
    report_rel,
    resized_gate_problems,
    sample_rows,
    verify_crop_bbox_shard,
    verify_resized_shard,
    write_report,
)
from fixed_res_sidecar.sample_data import write_sample_dataset

REL = "nested/a/part-00001.parquet"  # the shard every damage test breaks


@dataclass
class Build:
    main: Location
    r512: Location
    r1024: Location
    sidecar: Location
    prefixes = {"512": "0_26mp_process", "1024": "1_05mp_process"}

    def resized(self, resolution: str) -> Location:
        return {"512": self.r512, "1024": self.r1024}[resolution]

    def verify(self, resolution: str, rel: str = REL, **options):
        return verify_resized_shard(
            self.main, rel, self.resized(resolution), key_column="image_key", audit_prefix=self.prefixes[resolution], **options
        )

    def verify_crop(self, rel: str = REL, **options):
        return verify_crop_bbox_shard(self.main, rel, self.r512, self.r1024, self.sidecar, key_column="image_key", **options)


@pytest.fixture
def build(sample_build, tmp_path) -> Build:
    """Fresh copies of main, both resized datasets, and a crop-bbox sidecar built from them."""
    main, (out_512, out_1024) = sample_build
    sidecar = Location.parse(tmp_path / "sidecar")
    for rel in main.list_shards():
        build_crop_bbox_shard(main, rel, out_512.location, out_1024.location, sidecar)
    return Build(main, out_512.location, out_1024.location, sidecar)


def rewrite(location: Location, rel: str, change) -> None:
    """Replace a built shard by `change(table)` (a damaged copy for a test), keeping its footer metadata."""
    path = Path(location.child(rel))
    table = pq.read_table(path)
    pq.write_table(change(table), path)


def replace_column(table: pa.Table, name: str, values: list) -> pa.Table:
    index = table.schema.get_field_index(name)
    return table.set_column(index, table.schema.field(index), pa.array(values, type=table.schema.field(index).type))


def column(location: Location, rel: str, name: str) -> list:
    return pq.read_table(location.child(rel), columns=[name]).column(name).to_pylist()


def first_row(location: Location, rel: str, name: str, value) -> int:
    return column(location, rel, name).index(value)


def assert_failed(report, name: str, location: Location, rel: str = REL, containing: str = "") -> str:
    check = report.check(name)
    assert not check.passed, check
    assert not report.passed
    assert location.child(rel) in check.message, check.message  # the message names the shard
    assert containing in check.message
    return check.message


# -- undamaged ---------------------------------------------------------------------


def test_undamaged_build_passes_every_check(build, tmp_path):
    for rel in build.main.list_shards():
        rows = pq.ParquetFile(build.main.child(rel)).metadata.num_rows
        for resolution in ("512", "1024"):
            report = build.verify(resolution, rel)
            assert [c.name for c in report.checks] == list(RESIZED_CHECKS)
            assert report.passed, [c.message for c in report.failed_checks]
            assert report.rows == rows and report.valid + report.invalid == rows
            assert report.invalid >= 1 and set(report.error_counts) <= set(ERROR_CODES)
            assert report.resolution == resolution and report.target_area == default_target_area(build.prefixes[resolution])
            example = report.examples[0]
            assert set(example) == {"row", "key", "error", "detail"} and example["error"] in ERROR_CODES
            assert report.check(SAMPLE_IMAGES).metadata["sampled"] == report.valid  # fewer rows than the sample size
        crop = build.verify_crop(rel, overlay_dir=Location.parse(tmp_path / "overlays"))
        assert [c.name for c in crop.checks] == [*CROP_BBOX_CHECKS, OVERLAYS_WRITTEN]
        assert crop.passed, [c.message for c in crop.failed_checks]
        assert crop.stats["caption_status"]["ok"] >= 1 and crop.stats["boxes"]["512"]["total"] > 0
        overlays = crop.stats["overlays"]
        assert len(overlays) == 4
        for path in overlays:
            assert Path(path).is_file() and Path(path).parent == tmp_path / "overlays" / rel.removesuffix(".parquet")
            assert Image.open(path).format == "PNG"


def test_report_json_and_write_report(build, tmp_path):
    report = build.verify("512")
    document = json.loads(report.to_json())
    assert document["passed"] is True and document["rel"] == REL
    assert [c["name"] for c in document["checks"]] == list(RESIZED_CHECKS)
    reports = Location.parse(tmp_path / "reports")
    written = write_report(reports, REL, report)
    assert written == report_rel(REL) == "nested/a/part-00001.verify.json"
    assert json.loads(Path(reports.child(written)).read_text()) == document


def test_sample_is_deterministic_per_shard_path():
    rows = list(range(1000))
    first = sample_rows(rows, 32, "a/part-1.parquet")
    assert first == sample_rows(rows, 32, "a/part-1.parquet") and len(first) == 32 and first == sorted(first)
    assert first != sample_rows(rows, 32, "a/part-2.parquet")
    assert sample_rows(rows[:5], 32, "x.parquet") == rows[:5]


def test_sample_images_respects_the_sample_size(build):
    report = build.verify("1024", sample=3)
    assert report.passed
    assert report.check(SAMPLE_IMAGES).metadata["sampled"] == 3


# -- SPEC 7 items 1 and 2: rows and keys ---------------------------------------------


def test_dropped_row_is_caught(build):
    rewrite(build.r512, REL, lambda t: t.take([i for i in range(t.num_rows) if i != 3]))
    report = build.verify("512")
    assert_failed(report, SHARD_COMPLETE, build.r512, containing="has 9 rows, the main shard has 10")
    assert_failed(report, KEYS_MATCH, build.r512, containing="row 3")
    assert report.check(KEYS_MATCH).metadata["first_mismatch_row"] == 3
    assert build.verify("1024").passed  # the other resolution is untouched


def test_two_swapped_keys_are_caught_with_the_first_mismatch(build):
    keys = column(build.r1024, REL, "image_key")
    keys[1], keys[2] = keys[2], keys[1]
    rewrite(build.r1024, REL, lambda t: replace_column(t, "image_key", keys))
    report = build.verify("1024")
    message = assert_failed(report, KEYS_MATCH, build.r1024, containing="row 1")
    assert repr(keys[1]) in message and repr(keys[2]) in message
    assert report.check(KEYS_MATCH).metadata == {
        "rows": 10, "main_rows": 10, "mismatching_rows": 2, "first_mismatch_row": 1, "key": keys[1], "main_key": keys[2]
    }
    assert report.check(SHARD_COMPLETE).passed


def test_missing_shard_is_a_failed_check_and_listed_missing(build):
    Path(build.r1024.child(REL)).unlink()
    report = build.verify("1024")
    assert_failed(report, SHARD_COMPLETE, build.r1024, containing="is missing")
    for name in RESIZED_CHECKS:
        assert not report.check(name).passed and build.r1024.child(REL) in report.check(name).message
    summary = dataset_summary(build.main, {"512": build.r512, "1024": build.r1024})
    assert summary["outputs"]["1024"]["missing"] == [REL]
    assert summary["outputs"]["512"]["missing"] == []
    assert summary["outputs"]["1024"]["shards"] == summary["main"]["shards"] - 1


def test_broken_parquet_file_is_a_failed_check(build):
    path = Path(build.r512.child(REL))
    path.write_bytes(path.read_bytes()[:1000])
    report = build.verify("512")
    assert_failed(report, SHARD_COMPLETE, build.r512, containing="not a readable Parquet file")


def test_missing_main_shard_fails_every_check_naming_it(build):
    Path(build.main.child(REL)).unlink()
    report = build.verify("512")
    assert all(not c.passed and build.main.child(REL) in c.message for c in report.checks)


# -- SPEC 7 item 3: sampled images ---------------------------------------------------


def test_image_whose_size_differs_from_its_audit_is_caught(build):
    prefix = build.prefixes["512"]
    row = first_row(build.r512, REL, f"{prefix}_valid", True)
    width, height = column(build.r512, REL, f"{prefix}_width")[row], column(build.r512, REL, f"{prefix}_height")[row]
    wrong = io.BytesIO()
    Image.new("RGB", (width + 32, height), (10, 20, 30)).save(wrong, "WEBP")
    images = column(build.r512, REL, "image")
    images[row] = wrong.getvalue()
    rewrite(build.r512, REL, lambda t: replace_column(t, "image", images))
    report = build.verify("512")
    message = assert_failed(report, SAMPLE_IMAGES, build.r512, containing=f"row {row}")
    assert f"decoded size {width + 32}x{height} differs from the audit's {width}x{height}" in message
    assert report.check(AUDIT_CONSISTENT).passed


def test_undecodable_sampled_image_is_caught(build):
    prefix = build.prefixes["1024"]
    row = first_row(build.r1024, REL, f"{prefix}_valid", True)
    images = column(build.r1024, REL, "image")
    images[row] = images[row][:200]
    rewrite(build.r1024, REL, lambda t: replace_column(t, "image", images))
    assert_failed(build.verify("1024"), SAMPLE_IMAGES, build.r1024, containing="does not decode")


def test_audit_geometry_off_spec_is_caught(build):
    # A crop box that is not SPEC 3's: the whole source, uncropped.
    prefix = build.prefixes["512"]
    row = first_row(build.r512, REL, f"{prefix}_valid", True)
    x0 = column(build.r512, REL, f"{prefix}_crop_x0")
    y0 = column(build.r512, REL, f"{prefix}_crop_y0")
    x1 = column(build.r512, REL, f"{prefix}_crop_x1")
    y1 = column(build.r512, REL, f"{prefix}_crop_y1")
    x0[row], y0[row] = 0.0, 0.0
    x1[row] = float(column(build.r512, REL, f"{prefix}_src_width")[row])
    y1[row] = float(column(build.r512, REL, f"{prefix}_src_height")[row])

    def change(table):
        for name, values in (("x0", x0), ("y0", y0), ("x1", x1), ("y1", y1)):
            table = replace_column(table, f"{prefix}_crop_{name}", values)
        return table

    rewrite(build.r512, REL, change)
    message = assert_failed(build.verify("512"), SAMPLE_IMAGES, build.r512, containing=f"row {row}")
    assert "crop box" in message


def test_aspect_tolerance_holds_one_pixel_and_rejects_a_skipped_crop():
    rng = random.Random(7)
    for _ in range(500):
        w, h = rng.randint(64, 6000), rng.randint(64, 6000)
        if max(w / h, h / w) > 8:
            continue
        g = geometry(w, h, 262144)
        tw, th = g.target_size
        box = g.crop_box
        for ew in (-1.0, 0.0, 1.0):
            for eh in (-1.0, 0.0, 1.0):
                cw, ch = box.width + ew, box.height + eh
                assert abs(tw / th - cw / ch) <= aspect_tolerance((tw, th), ch)
    # 4000x3000 at 512 area is 576x448: the uncropped source is far outside the bound.
    assert abs(576 / 448 - 4000 / 3000) > 10 * aspect_tolerance((576, 448), 3000)
    assert math.isclose(aspect_tolerance((576, 448), 3000), (1 + 576 / 448) / 3000, rel_tol=1e-6)


# -- SPEC 7 item 4: the audit ----------------------------------------------------------


def test_invalid_row_without_error_code_is_caught(build):
    prefix = build.prefixes["512"]
    row = first_row(build.r512, REL, f"{prefix}_valid", False)
    errors = column(build.r512, REL, f"{prefix}_error")
    errors[row] = None
    rewrite(build.r512, REL, lambda t: replace_column(t, f"{prefix}_error", errors))
    report = build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, build.r512, containing=f"row {row}")
    assert "invalid row has no error code" in report.check(AUDIT_CONSISTENT).message
    assert report.error_counts.get("(none)") == 1


def test_unknown_error_code_is_caught(build):
    prefix = build.prefixes["1024"]
    row = first_row(build.r1024, REL, f"{prefix}_valid", False)
    errors = column(build.r1024, REL, f"{prefix}_error")
    errors[row] = "gremlins"
    rewrite(build.r1024, REL, lambda t: replace_column(t, f"{prefix}_error", errors))
    assert_failed(build.verify("1024"), AUDIT_CONSISTENT, build.r1024, containing="unknown error code 'gremlins'")


def test_valid_row_without_image_is_caught(build):
    prefix = build.prefixes["1024"]
    row = first_row(build.r1024, REL, f"{prefix}_valid", True)
    images = column(build.r1024, REL, "image")
    images[row] = None
    rewrite(build.r1024, REL, lambda t: replace_column(t, "image", images))
    report = build.verify("1024")
    assert_failed(report, AUDIT_CONSISTENT, build.r1024, containing=f"row {row}")
    assert "valid row has no image" in report.check(AUDIT_CONSISTENT).message
    assert report.check(SAMPLE_IMAGES).passed  # a missing image is the audit's finding, not the sample's


def test_invalid_row_with_an_image_is_caught(build):
    prefix = build.prefixes["512"]
    invalid_row = first_row(build.r512, REL, f"{prefix}_valid", False)
    valid_row = first_row(build.r512, REL, f"{prefix}_valid", True)
    images = column(build.r512, REL, "image")
    images[invalid_row] = images[valid_row]
    rewrite(build.r512, REL, lambda t: replace_column(t, "image", images))
    assert_failed(build.verify("512"), AUDIT_CONSISTENT, build.r512, containing="invalid row has an image")


def test_missing_audit_column_fails_audit_and_sample_checks(build):
    prefix = build.prefixes["512"]
    rewrite(build.r512, REL, lambda t: t.drop_columns([f"{prefix}_error"]))
    report = build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, build.r512, containing=f"{prefix}_error")
    assert_failed(report, SAMPLE_IMAGES, build.r512, containing=f"{prefix}_error")
    assert report.check(KEYS_MATCH).passed


# -- crop-bbox sidecar -----------------------------------------------------------------


def crop_row_with_box(build: Build, resolution: str) -> int:
    crops = column(build.sidecar, REL, CROP_COLUMNS[resolution])
    return next(i for i, text in enumerate(crops) if text and '"bbox": [' in text)


def test_crop_column_with_out_of_range_box_is_caught(build):
    row = crop_row_with_box(build, "512")
    crops = column(build.sidecar, REL, CROP_COLUMNS["512"])
    caption = json.loads(crops[row])
    caption["objects"][0]["bbox"] = [0, 0, 1001, 500]
    crops[row] = json.dumps(caption)
    rewrite(build.sidecar, REL, lambda t: replace_column(t, CROP_COLUMNS["512"], crops))
    report = build.verify_crop()
    message = assert_failed(report, BOXES_VALID, build.sidecar, containing=f"row {row}")
    assert "objects[0].bbox = [0, 0, 1001, 500]" in message and CROP_COLUMNS["512"] in message
    assert report.check(META_MATCHES_AUDIT).passed


def test_missing_crop_column_is_caught(build):
    rewrite(build.sidecar, REL, lambda t: t.drop_columns([CROP_COLUMNS["1024"]]))
    report = build.verify_crop()
    assert_failed(report, SIDECAR_COLUMNS, build.sidecar, containing=CROP_COLUMNS["1024"])
    assert_failed(report, BOXES_VALID, build.sidecar, containing="column missing")


def test_meta_disagreeing_with_the_audit_is_caught(build):
    metas = column(build.sidecar, REL, META_COLUMN)
    row = next(i for i, text in enumerate(metas) if json.loads(text)["1024"]["valid"])
    meta = json.loads(metas[row])
    meta["1024"]["width"] += 32
    metas[row] = json.dumps(meta)
    rewrite(build.sidecar, REL, lambda t: replace_column(t, META_COLUMN, metas))
    report = build.verify_crop()
    assert_failed(report, META_MATCHES_AUDIT, build.sidecar, containing=f"row {row}")
    assert "1024: meta width=" in report.check(META_MATCHES_AUDIT).message


def test_crop_keys_and_rows_and_missing_inputs(build):
    keys = column(build.sidecar, REL, "image_key")
    keys[0], keys[4] = keys[4], keys[0]
    rewrite(build.sidecar, REL, lambda t: replace_column(t, "image_key", keys))
    assert_failed(build.verify_crop(), KEYS_MATCH, build.sidecar, containing="row 0")

    Path(build.r1024.child(REL)).unlink()
    report = build.verify_crop()
    check = report.check(META_MATCHES_AUDIT)
    assert not check.passed and build.r1024.child(REL) in check.message and "missing" in check.message

    Path(build.sidecar.child(REL)).unlink()
    report = build.verify_crop()
    assert_failed(report, SHARD_COMPLETE, build.sidecar, containing="is missing")
    assert not any(c.passed for c in report.checks)


# -- dataset summary and S3 --------------------------------------------------------------


def test_dataset_summary_counts_shards_and_bytes(build):
    summary = dataset_summary(build.main, {"512": build.r512, "1024": build.r1024, "sidecar": build.sidecar})
    main_files = sorted(Path(build.main.path).rglob("*.parquet"))
    assert summary["main"] == {
        "location": build.main.uri,
        "shards": len(main_files),
        "total_bytes": sum(p.stat().st_size for p in main_files),
    }
    for name, location in (("512", build.r512), ("1024", build.r1024), ("sidecar", build.sidecar)):
        output = summary["outputs"][name]
        files = sorted(Path(location.path).rglob("*.parquet"))
        assert output["shards"] == 3 and output["total_bytes"] == sum(p.stat().st_size for p in files)
        assert output["missing"] == [] and output["extra"] == []


def test_s3_verify_and_summary(build, s3_bucket):
    client = locations.s3_client()
    roots = {}
    for name, location in (("main", build.main), ("512", build.r512), ("1024", build.r1024)):
        for path in sorted(Path(location.path).rglob("*.parquet")):
            key = f"data/{name}/{path.relative_to(location.path).as_posix()}"
            client.upload_file(str(path), s3_bucket, key)
        roots[name] = Location.parse(f"s3://{s3_bucket}/data/{name}")
    client.delete_object(Bucket=s3_bucket, Key=f"data/1024/{REL}")

    report = verify_resized_shard(roots["main"], REL, roots["512"], key_column="image_key", audit_prefix="0_26mp_process")
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.shard == f"s3://{s3_bucket}/data/512/{REL}"
    missing = verify_resized_shard(roots["main"], REL, roots["1024"], key_column="image_key", audit_prefix="1_05mp_process")
    assert_failed(missing, SHARD_COMPLETE, roots["1024"], containing="is missing")

    summary = dataset_summary(roots["main"], {"512": roots["512"], "1024": roots["1024"]})
    local = dataset_summary(build.main, {"512": build.r512, "1024": build.r1024})
    assert summary["main"]["shards"] == 3 and summary["main"]["total_bytes"] == local["main"]["total_bytes"]
    assert summary["outputs"]["512"]["total_bytes"] == local["outputs"]["512"]["total_bytes"]
    assert summary["outputs"]["1024"]["missing"] == [REL] and summary["outputs"]["1024"]["shards"] == 2


def test_struct_image_layout_and_square_builds(tmp_path):
    """Hugging Face {bytes, path} images; a dataset built square is checked as square."""
    main = Location.parse(tmp_path / "main")
    write_sample_dataset(main, shards=("s.parquet",), rows_per_shard=5, struct_images=True)
    output = Location.parse(tmp_path / "square512")
    build_resized_shard(main, "s.parquet", [ResizedOutput(output, 262144, "0_26mp_process")], options=PixelOptions(square=True))

    def verify(square: bool):
        return verify_resized_shard(main, "s.parquet", output, audit_prefix="0_26mp_process", square=square)

    report = verify(square=True)
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.check(SAMPLE_IMAGES).metadata["sampled"] == report.valid > 0
    # Checked as a non-square dataset, the square outputs are not SPEC 3's aspect-keeping sizes.
    assert_failed(verify(square=False), SAMPLE_IMAGES, output, rel="s.parquet")

    prefix = "0_26mp_process"
    row = first_row(output, "s.parquet", f"{prefix}_valid", True)
    images = column(output, "s.parquet", "image")
    images[row] = {**images[row], "bytes": None}
    rewrite(output, "s.parquet", lambda t: replace_column(t, "image", images))
    assert_failed(verify(square=True), AUDIT_CONSISTENT, output, rel="s.parquet", containing="valid row has no image")


def test_missing_key_column_fails_keys_match_without_raising(build):
    rewrite(build.r512, REL, lambda t: t.drop_columns(["image_key"]))
    report = build.verify("512")
    assert_failed(report, KEYS_MATCH, build.r512, containing="key column 'image_key' is missing")
    assert report.check(SHARD_COMPLETE).passed and report.check(AUDIT_CONSISTENT).passed


def test_empty_image_bytes_count_as_no_image(build):
    prefix = build.prefixes["512"]
    row = first_row(build.r512, REL, f"{prefix}_valid", True)
    images = column(build.r512, REL, "image")
    images[row] = b""
    rewrite(build.r512, REL, lambda t: replace_column(t, "image", images))
    report = build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, build.r512, containing="valid row has no image")
    assert row not in report.check(SAMPLE_IMAGES).metadata["sampled_rows"]


def test_image_column_of_the_wrong_type_fails_without_raising(build):
    rewrite(build.r512, REL, lambda t: t.set_column(1, "image", pa.array(range(t.num_rows), pa.int64())))
    report = build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, build.r512, containing="has type int64, not encoded bytes")
    assert_failed(report, SAMPLE_IMAGES, build.r512, containing="has type int64")
    assert report.check(KEYS_MATCH).passed


def test_only_the_sampled_images_leave_arrow(build, monkeypatch):
    # Presence is computed in Arrow; Python sees the bytes of the sampled rows only.
    from fixed_res_sidecar.shards import verify

    copied = []
    real = verify.image_bytes_array

    class Counting:
        def __init__(self, array):
            self.array = array

        def take(self, indices):
            copied.extend(indices)
            return self.array.take(indices)

    monkeypatch.setattr(verify, "image_bytes_array", lambda cells: Counting(real(cells)))
    report = build.verify("1024", sample=2)
    assert report.passed and len(copied) == 2 == report.check(SAMPLE_IMAGES).metadata["sampled"]


# -- crop-bbox: settings, walk, overlays --------------------------------------------------


def use_box_key(location: Location, rel: str, key: str) -> None:
    """Rename every "bbox" key of the captions of `location/rel` (a main shard) to `key`."""
    captions = column(location, rel, "structured_description")
    renamed = [None if text is None else text.replace('"bbox"', f'"{key}"') for text in captions]
    rewrite(location, rel, lambda t: replace_column(t, "structured_description", renamed))


def test_crop_checks_use_the_box_keys_and_frame_the_sidecar_recorded(build):
    use_box_key(build.main, REL, "region")
    build_crop_bbox_shard(build.main, REL, build.r512, build.r1024, build.sidecar, bbox_keys=("region",), caption_frame="raw")
    report = build.verify_crop()
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.stats["bbox_keys"] == ["region"] and report.stats["caption_frame"] == "raw"
    assert report.check(BOXES_VALID).metadata["bbox_keys"] == ["region"]

    # A bad box under the recorded key is found; explicit keys override the recorded ones.
    crops = column(build.sidecar, REL, CROP_COLUMNS["512"])
    row = next(i for i, text in enumerate(crops) if text and '"region": [' in text)
    caption = json.loads(crops[row])
    caption["objects"][0]["region"] = [0, 0, 1001, 500]
    crops[row] = json.dumps(caption)
    rewrite(build.sidecar, REL, lambda t: replace_column(t, CROP_COLUMNS["512"], crops))  # keeps the footer settings
    message = assert_failed(build.verify_crop(), BOXES_VALID, build.sidecar, containing=f"row {row}")
    assert "objects[0].region = [0, 0, 1001, 500]" in message
    explicit = build.verify_crop(bbox_keys=("box_2d",), caption_frame="oriented")
    assert explicit.check(BOXES_VALID).passed
    assert explicit.stats["bbox_keys"] == ["box_2d"] and explicit.stats["caption_frame"] == "oriented"


def test_sidecar_without_recorded_settings_uses_the_defaults(build):
    rewrite(build.sidecar, REL, lambda t: t.replace_schema_metadata(None))  # no footer settings
    report = build.verify_crop()
    assert report.passed and report.stats["bbox_keys"] == ["bbox", "box_2d", "bbox_2d"]
    assert report.stats["caption_frame"] == "oriented"


def test_a_box_list_wholly_outside_the_crop_is_not_a_bad_box(build, tmp_path):
    # A landscape row: its crop cuts a margin off the left, where both boxes of a list lie.
    prefix = build.prefixes["512"]
    x0 = column(build.r512, REL, f"{prefix}_crop_x0")
    widths = column(build.r512, REL, f"{prefix}_src_width")
    row = next(i for i, (x, w) in enumerate(zip(x0, widths)) if x is not None and x / w > 0.01)
    captions = column(build.main, REL, "structured_description")
    captions[row] = json.dumps({"group": {"box_2d": [[0, 0, 100, 2], [500, 0, 600, 3]]}, "cat": {"bbox": [400, 400, 600, 600]}})
    rewrite(build.main, REL, lambda t: replace_column(t, "structured_description", captions))
    build_crop_bbox_shard(build.main, REL, build.r512, build.r1024, build.sidecar)
    crop = json.loads(column(build.sidecar, REL, CROP_COLUMNS["512"])[row])
    assert crop["group"]["box_2d"] == [None, None]
    report = build.verify_crop(overlay_dir=Location.parse(tmp_path / "overlays"))
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.check(BOXES_VALID).metadata["boxes"]["512_null"] >= 2


def test_overlays_are_not_drawn_for_rows_whose_resize_was_invalid(build, tmp_path):
    # Without captions no row has crop boxes: overlays fall back to rows valid at both resolutions.
    rewrite(build.main, REL, lambda t: t.drop_columns(["structured_description"]))
    build_crop_bbox_shard(build.main, REL, build.r512, build.r1024, build.sidecar)
    report = build.verify_crop(overlay_dir=Location.parse(tmp_path / "overlays"), overlay_sample=100)
    assert report.passed, [c.message for c in report.failed_checks]
    drawn = sorted(int(Path(path).name.split("-")[0]) for path in report.stats["overlays"])
    valid = [
        i
        for i, (a, b) in enumerate(zip(column(build.r512, REL, "0_26mp_process_valid"), column(build.r1024, REL, "1_05mp_process_valid")))
        if a and b
    ]
    assert drawn == valid and len(valid) < 10


def test_resized_gate_problems_name_the_shard_and_failed_checks(build):
    resized = {"512": (build.r512, build.prefixes["512"]), "1024": (build.r1024, build.prefixes["1024"])}
    assert resized_gate_problems(build.main, REL, resized, sample=2) == []
    prefix = build.prefixes["1024"]
    row = first_row(build.r1024, REL, f"{prefix}_valid", True)
    images = column(build.r1024, REL, "image")
    images[row] = None
    rewrite(build.r1024, REL, lambda t: replace_column(t, "image", images))
    (problem,) = resized_gate_problems(build.main, REL, resized, sample=2)
    assert problem.startswith(f"resized 1024 shard {build.r1024.child(REL)} did not pass the verifier: audit_consistent (")
    assert "valid row has no image" in problem
