"""shards/verify/resized.py: SPEC 7 items 1-4 catch each kind of damage, naming the shard; the gate."""

import io
import json
import math
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.core.geometry import geometry
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.core.resolutions import area_for_audit_prefix
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar.io.s3 import S3_MAX_ATTEMPTS, s3_client
from fixed_res_sidecar.sample_data import make_photo, write_sample_dataset
from fixed_res_sidecar.shards.layout import DatasetLayout, ResizedOutput
from fixed_res_sidecar.shards.listing import dataset_summary
from fixed_res_sidecar.shards.resize import ResizeTargets, build_resized_shard
from fixed_res_sidecar.shards.settings import SETTINGS_KEY
from fixed_res_sidecar.shards.verify import (
    AUDIT_CONSISTENT,
    CROP_BBOX_CHECKS,
    FIDELITY,
    KEYS_MATCH,
    RESIZED_CHECKS,
    SAMPLE_IMAGES,
    SHARD_COMPLETE,
    VerifyOptions,
    require_verified,
    resized_verification_problems,
    verify_crop_bbox_shard,
    verify_resized_shard,
)
from fixed_res_sidecar.shards.verify.coverage import COVERAGE_STAT
from fixed_res_sidecar.shards.verify.report import sample_rows
from fixed_res_sidecar.shards.verify.resized import aspect_tolerance
from fixed_res_sidecar_tests.fixtures.datasets import DAMAGED_REL as REL
from fixed_res_sidecar_tests.fixtures.datasets import (
    assert_failed,
    column,
    damage_value,
    first_row,
    replace_column,
    rewrite_shard,
    sidecar_layout,
)
from fixed_res_sidecar_tests.fixtures.faulty_s3 import (
    any_of,
    copy_files,
    every_object_get,
    first_get_of_each_key,
    small_ranges_first_attempt,
)


@pytest.mark.heavy
def test_undamaged_build_passes_every_check(sidecar_build):
    for rel in sidecar_build.main.list_shards():
        rows = pq.ParquetFile(sidecar_build.main.child(rel)).metadata.num_rows
        for resolution in ("512", "1024"):
            report = sidecar_build.verify(resolution, rel)
            assert [c.name for c in report.checks] == list(RESIZED_CHECKS)
            assert report.passed, [c.message for c in report.failed_checks]
            assert report.rows == rows and report.valid + report.invalid == rows
            assert report.invalid >= 1 and set(report.error_counts) <= set(ERROR_CODES)
            assert report.resolution == resolution and report.target_area == area_for_audit_prefix(
                sidecar_build.prefixes[resolution]
            )
            example = report.examples[0]
            assert set(example) == {"row", "key", "error", "detail"} and example["error"] in ERROR_CODES
            assert report.check(SAMPLE_IMAGES).metadata["sampled"] == report.valid  # fewer rows than the sample size
        crop = sidecar_build.verify_crop(rel)
        assert [c.name for c in crop.checks] == list(CROP_BBOX_CHECKS)
        assert crop.passed, [c.message for c in crop.failed_checks]
        assert crop.stats["caption_status"]["ok"] >= 1 and crop.stats["boxes"]["512"]["total"] > 0


def reencoded(fmt: str, quality: int, background: tuple | None = None):
    """bytes -> the same picture encoded again in `fmt` at `quality` (on `background`, alpha dropped)."""

    def encode(data: bytes) -> bytes:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            picture = image.copy()
        if background is not None or fmt == "JPEG":
            flat = Image.new("RGB", picture.size, background or (255, 255, 255))
            flat.paste(picture, mask=picture.getchannel("A") if picture.mode == "RGBA" else None)
            picture = flat
        out = io.BytesIO()
        picture.save(out, fmt, quality=quality)
        return out.getvalue()

    return encode


def forge_shard(location: Location, rel: str, change_image=None, rows=None, **recorded) -> None:
    """Rewrite resized shard `rel` as a wrong release or a careless copy would: the images of `rows` (default:
    every valid one) through `change_image`, the footer's build settings changed by `recorded`; the sources it
    records kept, every page checksum valid."""
    path = location.child(rel)
    parquet_file = pq.ParquetFile(path)
    metadata = dict(parquet_file.schema_arrow.metadata)
    settings = json.loads(metadata[SETTINGS_KEY])
    settings.update(recorded)
    metadata[SETTINGS_KEY] = json.dumps(settings, sort_keys=True).encode()
    table = parquet_file.read()
    if change_image is not None:
        images = table.column("image").to_pylist()
        for row, data in enumerate(images):
            if data and (rows is None or row in rows):
                images[row] = change_image(data)
        table = replace_column(table, "image", images)
    pq.write_table(table.replace_schema_metadata(metadata), path, write_page_checksum=True, row_group_size=4)


@pytest.mark.parametrize(
    ("change_image", "recorded", "failing", "words"),
    [
        (reencoded("WEBP", 10), {"quality": 10}, {SHARD_COMPLETE, FIDELITY}, "quality 10 (expected 95)"),
        (None, {"quality": 10}, {SHARD_COMPLETE}, "quality 10 (expected 95)"),
        (
            reencoded("JPEG", 95),
            {"output_format": "jpeg"},
            {SHARD_COMPLETE, SAMPLE_IMAGES},
            'output_format "jpeg" (expected "webp")',
        ),
        (None, {"webp_method": 6, "patch_size": 16}, {SHARD_COMPLETE}, "patch_size 16 (expected 32)"),
    ],
    ids=["reencoded_q10_footer_q10", "footer_q10", "jpeg_rows_footer_jpeg", "footer_method_and_patch"],
)
def test_a_footer_that_lies_fails_against_the_expected_settings(sidecar_build, change_image, recorded, failing, words):
    """Reported: the verifier rendered the expected images with the settings the shard's footer records, so
    outputs re-encoded at quality 10 passed once the footer said quality 10, and JPEG rows once it said jpeg."""
    forge_shard(sidecar_build.r512, REL, change_image, **recorded)
    report = sidecar_build.verify("512", sample=None)
    assert {c.name for c in report.failed_checks} == failing, [c.message for c in report.failed_checks]
    message = assert_failed(report, SHARD_COMPLETE, sidecar_build.r512, containing="was not built as expected")
    assert words in message and report.check(SHARD_COMPLETE).metadata["other_settings"] in message
    if FIDELITY in failing:  # compared with what quality 95 makes
        assert report.check(FIDELITY).metadata["failing_rows"] == report.valid
    if SAMPLE_IMAGES in failing:
        assert "stored as JPEG, the expected output format is WEBP" in report.check(SAMPLE_IMAGES).message
    # Verified as built with what the footer says, the forged shard passes only when its pictures match it.
    lied = sidecar_build.verify("512", sample=None, pixels=PixelOptions.from_values(recorded))
    assert lied.check(SHARD_COMPLETE).passed
    assert sidecar_build.verify("1024").passed  # the other resolution is untouched


def test_alpha_dropped_fails_although_the_footer_says_composited_on_white(tmp_path):
    """Reported: alpha dropped (-43 dB) passed once the footer said background white."""
    main = Location.parse(tmp_path / "main")
    cut_outs = []
    for seed in range(3):
        picture = Image.open(io.BytesIO(make_photo(640, 480, seed)[0])).convert("RGBA")
        picture.putalpha(Image.radial_gradient("L").resize((640, 480)).point(lambda v: 255 if v < 128 else 0))
        out = io.BytesIO()
        picture.save(out, "PNG")
        cut_outs.append(out.getvalue())
    Path(main.path).mkdir(parents=True)
    pq.write_table(pa.table({"image_key": ["a", "b", "c"], "image": cut_outs}), main.child("s.parquet"))
    output = ResizedOutput(Location.parse(tmp_path / "512"), 262144, "0_26mp_process")
    layout = DatasetLayout(main, {"512": output})
    build_resized_shard(layout, "s.parquet")
    options = VerifyOptions(sample=None, fidelity_sample=None)
    assert verify_resized_shard(layout, "s.parquet", "512", options).passed
    forge_shard(
        output.location, "s.parquet", reencoded("WEBP", 95, background=(255, 255, 255)), background=[255, 255, 255]
    )
    report = verify_resized_shard(layout, "s.parquet", "512", options)
    assert {c.name for c in report.failed_checks} == {SHARD_COMPLETE, FIDELITY}
    assert "background [255, 255, 255] (expected null)" in report.check(SHARD_COMPLETE).message
    assert report.check(FIDELITY).metadata["failing_rows"] == 3 and report.check(FIDELITY).metadata["min_score"] < -20


def test_a_row_stored_in_another_format_fails_naming_it(sidecar_build):
    """Reported: one row of a WebP shard re-encoded as JPEG q95 (footer untouched) passed with every row
    sampled and compared (score -0.19)."""
    row = first_row(sidecar_build.r512, REL, "0_26mp_process_valid", True)
    forge_shard(sidecar_build.r512, REL, reencoded("JPEG", 95), rows={row})
    report = sidecar_build.verify("512", sample=None, fidelity_sample=None)
    assert report.failed_checks == [report.check(SAMPLE_IMAGES)]
    key = column(sidecar_build.r512, REL, "image_key")[row]
    message = assert_failed(report, SAMPLE_IMAGES, sidecar_build.r512, containing=f"row {row} ({key!r})")
    assert "1 of 8 sampled images failed" in message and "stored as JPEG, the expected output format is WEBP" in message


def test_sample_images_respects_the_sample_size(sidecar_build):
    report = sidecar_build.verify("1024", sample=3)
    assert report.passed
    assert report.check(SAMPLE_IMAGES).metadata["sampled"] == 3


def test_dropped_row_is_caught(sidecar_build):
    rewrite_shard(sidecar_build.r512, REL, lambda t: t.take([i for i in range(t.num_rows) if i != 3]))
    report = sidecar_build.verify("512")
    assert_failed(report, SHARD_COMPLETE, sidecar_build.r512, containing="has 9 rows, the main shard has 10")
    assert_failed(report, KEYS_MATCH, sidecar_build.r512, containing="row 3")
    assert report.check(KEYS_MATCH).metadata["first_mismatch_row"] == 3
    assert sidecar_build.verify("1024").passed  # the other resolution is untouched


def test_two_swapped_keys_are_caught_with_the_first_mismatch(sidecar_build):
    keys = column(sidecar_build.r1024, REL, "image_key")
    keys[1], keys[2] = keys[2], keys[1]
    rewrite_shard(sidecar_build.r1024, REL, lambda t: replace_column(t, "image_key", keys))
    report = sidecar_build.verify("1024")
    message = assert_failed(report, KEYS_MATCH, sidecar_build.r1024, containing="row 1")
    assert repr(keys[1]) in message and repr(keys[2]) in message
    assert report.check(KEYS_MATCH).metadata == {
        "rows": 10,
        "main_rows": 10,
        "mismatching_rows": 2,
        "first_mismatch_row": 1,
        "key": keys[1],
        "main_key": keys[2],
    }
    assert report.check(SHARD_COMPLETE).passed


def test_missing_shard_is_a_failed_check_and_listed_missing(sidecar_build):
    Path(sidecar_build.r1024.child(REL)).unlink()
    report = sidecar_build.verify("1024")
    assert_failed(report, SHARD_COMPLETE, sidecar_build.r1024, containing="is missing")
    for name in RESIZED_CHECKS:
        assert not report.check(name).passed and sidecar_build.r1024.child(REL) in report.check(name).message
    summary = dataset_summary(sidecar_build.main, {"512": sidecar_build.r512, "1024": sidecar_build.r1024})
    assert summary["outputs"]["1024"]["missing"] == [REL]
    assert summary["outputs"]["512"]["missing"] == []
    assert summary["outputs"]["1024"]["shards"] == summary["main"]["shards"] - 1


def test_broken_parquet_file_is_a_failed_check(sidecar_build):
    path = Path(sidecar_build.r512.child(REL))
    path.write_bytes(path.read_bytes()[:1000])
    report = sidecar_build.verify("512")
    assert_failed(report, SHARD_COMPLETE, sidecar_build.r512, containing="not a readable Parquet file")


def test_missing_main_shard_fails_every_check_naming_it(sidecar_build):
    Path(sidecar_build.main.child(REL)).unlink()
    report = sidecar_build.verify("512")
    assert all(not c.passed and sidecar_build.main.child(REL) in c.message for c in report.checks)


def test_image_whose_size_differs_from_its_audit_is_caught(sidecar_build):
    prefix = sidecar_build.prefixes["512"]
    row = first_row(sidecar_build.r512, REL, f"{prefix}_valid", True)
    width, height = (
        column(sidecar_build.r512, REL, f"{prefix}_width")[row],
        column(sidecar_build.r512, REL, f"{prefix}_height")[row],
    )
    wrong = io.BytesIO()
    Image.new("RGB", (width + 32, height), (10, 20, 30)).save(wrong, "WEBP")
    images = column(sidecar_build.r512, REL, "image")
    images[row] = wrong.getvalue()
    rewrite_shard(sidecar_build.r512, REL, lambda t: replace_column(t, "image", images))
    report = sidecar_build.verify("512")
    message = assert_failed(report, SAMPLE_IMAGES, sidecar_build.r512, containing=f"row {row}")
    assert f"decoded size {width + 32}x{height} differs from the audit's {width}x{height}" in message
    assert report.check(AUDIT_CONSISTENT).passed


def test_undecodable_sampled_image_is_caught(sidecar_build):
    prefix = sidecar_build.prefixes["1024"]
    row = first_row(sidecar_build.r1024, REL, f"{prefix}_valid", True)
    images = column(sidecar_build.r1024, REL, "image")
    images[row] = images[row][:200]
    rewrite_shard(sidecar_build.r1024, REL, lambda t: replace_column(t, "image", images))
    assert_failed(sidecar_build.verify("1024"), SAMPLE_IMAGES, sidecar_build.r1024, containing="does not decode")


def test_audit_geometry_off_spec_is_caught(sidecar_build):
    # A crop box that is not SPEC 3's: the whole source, uncropped.
    prefix = sidecar_build.prefixes["512"]
    row = first_row(sidecar_build.r512, REL, f"{prefix}_valid", True)
    x0 = column(sidecar_build.r512, REL, f"{prefix}_crop_x0")
    y0 = column(sidecar_build.r512, REL, f"{prefix}_crop_y0")
    x1 = column(sidecar_build.r512, REL, f"{prefix}_crop_x1")
    y1 = column(sidecar_build.r512, REL, f"{prefix}_crop_y1")
    x0[row], y0[row] = 0.0, 0.0
    x1[row] = float(column(sidecar_build.r512, REL, f"{prefix}_src_width")[row])
    y1[row] = float(column(sidecar_build.r512, REL, f"{prefix}_src_height")[row])

    def change(table):
        for name, values in (("x0", x0), ("y0", y0), ("x1", x1), ("y1", y1)):
            table = replace_column(table, f"{prefix}_crop_{name}", values)
        return table

    rewrite_shard(sidecar_build.r512, REL, change)
    message = assert_failed(sidecar_build.verify("512"), SAMPLE_IMAGES, sidecar_build.r512, containing=f"row {row}")
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


def test_invalid_row_without_error_code_is_caught(sidecar_build):
    prefix = sidecar_build.prefixes["512"]
    row = first_row(sidecar_build.r512, REL, f"{prefix}_valid", False)
    errors = column(sidecar_build.r512, REL, f"{prefix}_error")
    errors[row] = None
    rewrite_shard(sidecar_build.r512, REL, lambda t: replace_column(t, f"{prefix}_error", errors))
    report = sidecar_build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, sidecar_build.r512, containing=f"row {row}")
    assert "invalid row has no error code" in report.check(AUDIT_CONSISTENT).message
    assert report.error_counts.get("(none)") == 1


def test_unknown_error_code_is_caught(sidecar_build):
    prefix = sidecar_build.prefixes["1024"]
    row = first_row(sidecar_build.r1024, REL, f"{prefix}_valid", False)
    errors = column(sidecar_build.r1024, REL, f"{prefix}_error")
    errors[row] = "gremlins"
    rewrite_shard(sidecar_build.r1024, REL, lambda t: replace_column(t, f"{prefix}_error", errors))
    assert_failed(
        sidecar_build.verify("1024"), AUDIT_CONSISTENT, sidecar_build.r1024, containing="unknown error code 'gremlins'"
    )


def test_valid_row_without_image_is_caught(sidecar_build):
    prefix = sidecar_build.prefixes["1024"]
    row = first_row(sidecar_build.r1024, REL, f"{prefix}_valid", True)
    images = column(sidecar_build.r1024, REL, "image")
    images[row] = None
    rewrite_shard(sidecar_build.r1024, REL, lambda t: replace_column(t, "image", images))
    report = sidecar_build.verify("1024")
    assert_failed(report, AUDIT_CONSISTENT, sidecar_build.r1024, containing=f"row {row}")
    assert "valid row has no image" in report.check(AUDIT_CONSISTENT).message
    assert report.check(SAMPLE_IMAGES).passed  # a missing image is the audit's finding, not the sample's


def test_invalid_row_with_an_image_is_caught(sidecar_build):
    prefix = sidecar_build.prefixes["512"]
    invalid_row = first_row(sidecar_build.r512, REL, f"{prefix}_valid", False)
    valid_row = first_row(sidecar_build.r512, REL, f"{prefix}_valid", True)
    images = column(sidecar_build.r512, REL, "image")
    images[invalid_row] = images[valid_row]
    rewrite_shard(sidecar_build.r512, REL, lambda t: replace_column(t, "image", images))
    assert_failed(
        sidecar_build.verify("512"), AUDIT_CONSISTENT, sidecar_build.r512, containing="invalid row has an image"
    )


def test_missing_audit_column_fails_audit_and_sample_checks(sidecar_build):
    prefix = sidecar_build.prefixes["512"]
    rewrite_shard(sidecar_build.r512, REL, lambda t: t.drop_columns([f"{prefix}_error"]))
    report = sidecar_build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, sidecar_build.r512, containing=f"{prefix}_error")
    assert_failed(report, SAMPLE_IMAGES, sidecar_build.r512, containing=f"{prefix}_error")
    assert report.check(KEYS_MATCH).passed


def test_s3_verify_and_summary(sidecar_build, s3_bucket):
    client = s3_client()
    roots = {}
    for name, location in (("main", sidecar_build.main), ("512", sidecar_build.r512), ("1024", sidecar_build.r1024)):
        for path in sorted(Path(location.path).rglob("*.parquet")):
            key = f"data/{name}/{path.relative_to(location.path).as_posix()}"
            client.upload_file(str(path), s3_bucket, key)
        roots[name] = Location.parse(f"s3://{s3_bucket}/data/{name}")
    client.delete_object(Bucket=s3_bucket, Key=f"data/1024/{REL}")

    layout = sidecar_layout(roots["main"], roots["512"], roots["1024"], None)
    # Copied, main's shards are other objects (their stamps are ETags now): outputs built from the
    # local copies are stale until rebuilt from the S3 ones.
    stale = verify_resized_shard(layout, REL, "512")
    assert_failed(stale, SHARD_COMPLETE, roots["512"], containing="is stale: built from another version of main")
    build_resized_shard(layout, REL, targets=ResizeTargets(resolutions=["512"], skip_existing=True))
    report = verify_resized_shard(layout, REL, "512")
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.shard == f"s3://{s3_bucket}/data/512/{REL}"
    missing = verify_resized_shard(layout, REL, "1024")
    assert_failed(missing, SHARD_COMPLETE, roots["1024"], containing="is missing")

    summary = dataset_summary(roots["main"], {"512": roots["512"], "1024": roots["1024"]})
    local = dataset_summary(sidecar_build.main, {"512": sidecar_build.r512, "1024": sidecar_build.r1024})
    assert summary["main"]["shards"] == 3 and summary["main"]["total_bytes"] == local["main"]["total_bytes"]
    assert summary["outputs"]["1024"]["missing"] == [REL] and summary["outputs"]["1024"]["shards"] == 2


def test_struct_image_layout_and_square_builds(tmp_path):
    """Hugging Face {bytes, path} images; a dataset built square is checked as square."""
    main = Location.parse(tmp_path / "main")
    write_sample_dataset(main, shards=("s.parquet",), rows_per_shard=5, struct_images=True)
    output = Location.parse(tmp_path / "square512")
    layout = DatasetLayout(main, {"512": ResizedOutput(output, 262144, "0_26mp_process")})
    build_resized_shard(layout, "s.parquet", options=PixelOptions(square=True))

    def verify(square: bool):
        return verify_resized_shard(layout, "s.parquet", "512", VerifyOptions(pixels=PixelOptions(square=square)))

    report = verify(square=True)
    assert report.passed, [c.message for c in report.failed_checks]
    assert report.check(SAMPLE_IMAGES).metadata["sampled"] == report.valid > 0
    # Checked as a non-square dataset, the square outputs are not SPEC 3's aspect-keeping sizes.
    assert_failed(verify(square=False), SAMPLE_IMAGES, output, rel="s.parquet")

    prefix = "0_26mp_process"
    row = first_row(output, "s.parquet", f"{prefix}_valid", True)
    images = column(output, "s.parquet", "image")
    images[row] = {**images[row], "bytes": None}
    rewrite_shard(output, "s.parquet", lambda t: replace_column(t, "image", images))
    assert_failed(verify(square=True), AUDIT_CONSISTENT, output, rel="s.parquet", containing="valid row has no image")


def test_missing_key_column_fails_keys_match_without_raising(sidecar_build):
    rewrite_shard(sidecar_build.r512, REL, lambda t: t.drop_columns(["image_key"]))
    report = sidecar_build.verify("512")
    assert_failed(report, KEYS_MATCH, sidecar_build.r512, containing="key column 'image_key' is missing")
    assert report.check(SHARD_COMPLETE).passed and report.check(AUDIT_CONSISTENT).passed


def test_empty_image_bytes_count_as_no_image(sidecar_build):
    prefix = sidecar_build.prefixes["512"]
    row = first_row(sidecar_build.r512, REL, f"{prefix}_valid", True)
    images = column(sidecar_build.r512, REL, "image")
    images[row] = b""
    rewrite_shard(sidecar_build.r512, REL, lambda t: replace_column(t, "image", images))
    report = sidecar_build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, sidecar_build.r512, containing="valid row has no image")
    assert row not in report.check(SAMPLE_IMAGES).metadata["sampled_rows"]


def test_image_column_of_the_wrong_type_fails_without_raising(sidecar_build):
    rewrite_shard(sidecar_build.r512, REL, lambda t: t.set_column(1, "image", pa.array(range(t.num_rows), pa.int64())))
    report = sidecar_build.verify("512")
    assert_failed(report, AUDIT_CONSISTENT, sidecar_build.r512, containing="has type int64, not encoded bytes")
    assert_failed(report, SAMPLE_IMAGES, sidecar_build.r512, containing="has type int64")
    assert report.check(KEYS_MATCH).passed


def test_only_the_sampled_images_leave_arrow(sidecar_build, monkeypatch):
    # Presence is computed in Arrow; Python sees the bytes of the sampled rows only.
    from fixed_res_sidecar.shards.verify import resized as verify

    copied = []
    real = verify.image_bytes_array

    class Counting:
        def __init__(self, array):
            self.array = array

        def take(self, indices):
            copied.extend(indices)
            return self.array.take(indices)

    monkeypatch.setattr(verify, "image_bytes_array", lambda cells: Counting(real(cells)))
    report = sidecar_build.verify("1024", sample=2)
    assert report.passed and report.check(SAMPLE_IMAGES).metadata["sampled"] == 2
    # The decoded sample and the fidelity window (2 rows not compared before), nothing else.
    sampled = report.check(SAMPLE_IMAGES).metadata["sampled_rows"]
    assert len(copied) == len(set(copied)) <= 4 and set(sampled) <= set(copied)


def test_resized_verification_problems_name_the_shard_and_failed_checks(sidecar_build):
    options = VerifyOptions(sample=2)
    assert resized_verification_problems(sidecar_build.layout(), REL, options) == []
    prefix = sidecar_build.prefixes["1024"]
    row = first_row(sidecar_build.r1024, REL, f"{prefix}_valid", True)
    images = column(sidecar_build.r1024, REL, "image")
    images[row] = None
    rewrite_shard(sidecar_build.r1024, REL, lambda t: replace_column(t, "image", images))
    (problem,) = resized_verification_problems(sidecar_build.layout(), REL, options)
    assert problem.startswith(
        f"resized 1024 shard {sidecar_build.r1024.child(REL)} did not pass the verifier: audit_consistent ("
    )
    assert "valid row has no image" in problem


# -- transient and persistent S3 errors (a fault-injecting proxy in front of moto) ------------


def on_s3(sidecar_build, bucket: str) -> dict[str, Location]:
    """The build on S3 (made before any fault is injected): main copied, its outputs made from that copy
    (copies of the outputs would be stale: the copied main shards are other objects)."""
    from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard

    roots = {name: Location.parse(f"s3://{bucket}/data/{name}") for name in ("main", "512", "1024", "sidecar")}
    copy_files(sidecar_build.main, roots["main"])
    layout = sidecar_layout(roots["main"], roots["512"], roots["1024"], roots["sidecar"])
    for rel in roots["main"].list_shards():
        build_resized_shard(layout, rel)
        build_crop_bbox_shard(layout, rel)
    return roots


def without_since(report) -> dict:
    """A report as a dict, without the time its fidelity window started (each verification's own clock)."""
    found = report.to_dict()
    found["stats"].get(COVERAGE_STAT, {}).pop("since", None)
    return found


@pytest.mark.stress
def test_verifier_and_gate_ride_out_injected_s3_errors(sidecar_build, faulty_s3, fast_retries, s3_bucket):
    """500/503 with an error body longer than the range, on the first small ranged GET of every
    object and range size and on the first GET of every object: the same reports as without."""
    roots = on_s3(sidecar_build, s3_bucket)
    layout = sidecar_layout(roots["main"], roots["512"], roots["1024"], roots["sidecar"])
    shards = roots["main"].list_shards()

    def reports() -> dict:  # when each fidelity window started aside
        return {
            (rel, r): without_since(verify_resized_shard(layout, rel, r)) for rel in shards for r in ("512", "1024")
        }

    clean = reports()
    assert all(report["passed"] for report in clean.values())
    faulty_s3.inject(any_of(first_get_of_each_key, small_ranges_first_attempt(400)))
    assert reports() == clean
    assert len([size for _, size in faulty_s3.faults if size is not None and size < 400]) >= 12
    faulty_s3.inject(small_ranges_first_attempt(400))  # the crop gate: the same verifier
    for rel in shards:
        assert resized_verification_problems(layout, rel, VerifyOptions()) == []
    assert faulty_s3.faults


def test_storage_that_keeps_failing_is_no_verdict(sidecar_build, faulty_s3, fast_retries, s3_bucket):
    """Every GET fails: after the retries the verifier and the gate raise
    StorageError naming the object; no report says a check failed or passed."""
    roots = on_s3(sidecar_build, s3_bucket)
    layout = sidecar_layout(roots["main"], roots["512"], roots["1024"], roots["sidecar"])
    faulty_s3.inject(every_object_get)
    with pytest.raises(StorageError, match=rf"storage failed reading s3://{s3_bucket}/data/.* after 10 attempts"):
        verify_resized_shard(layout, REL, "512")
    (failed_range,) = set(faulty_s3.faults)  # the first read (main's footer), tried S3_MAX_ATTEMPTS times
    assert faulty_s3.faults == [failed_range] * S3_MAX_ATTEMPTS
    with pytest.raises(StorageError):
        resized_verification_problems(layout, REL, VerifyOptions())
    with pytest.raises(StorageError):
        require_verified(layout, REL, VerifyOptions())
    with pytest.raises(StorageError):
        verify_crop_bbox_shard(layout, REL)


# -- damaged pages --------------------------------------------------------------------------


def test_a_damaged_page_fails_shard_complete_naming_the_column_and_row_group(sidecar_build):
    """One image's bytes altered in the file, footer intact, in a row the image sample misses:
    the page checksums catch it."""
    prefix = sidecar_build.prefixes["512"]
    valid = [row for row, flag in enumerate(column(sidecar_build.r512, REL, f"{prefix}_valid")) if flag]
    sampled = sample_rows(valid, 1, REL)
    row = next(r for r in valid if r not in sampled)
    damage_value(sidecar_build.r512.child(REL), column(sidecar_build.r512, REL, "image")[row])

    report = sidecar_build.verify("512", sample=1)
    message = assert_failed(report, SHARD_COMPLETE, sidecar_build.r512, containing="column 'image' in row group 0")
    assert "does not match its checksum" in message and "CRC checksum verification failed" in message
    assert all(not check.passed and check.message.startswith("not checked: ") for check in report.checks[1:])
    assert sidecar_build.verify("1024", sample=1).passed  # the other resolution is intact
