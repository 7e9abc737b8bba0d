import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fixed_res_sidecar.core.audit import AUDIT_TYPES, read_audit_records
from fixed_res_sidecar.core.geometry import AREA_512, geometry
from fixed_res_sidecar.core.pixels import PixelOptions
from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.io.parquet import ShardError
from fixed_res_sidecar.sample_data import write_sample_dataset
from fixed_res_sidecar.shards import resize
from fixed_res_sidecar.shards.layout import ResizedOutput
from fixed_res_sidecar.shards.resize import build_resized_shard
from fixed_res_sidecar.shards.settings import read_settings
from fixed_res_sidecar_tests.fixtures.datasets import SHARDS, build_all, layout_of, resized_outputs


def _snapshot(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(folder, name), root): open(os.path.join(folder, name), "rb").read()
        for folder, _, files in os.walk(root)
        for name in files
    }


def check_resized_dataset(
    main: Location, output: ResizedOutput, shards=None, key_column="image_key", image_column="image"
):
    """Layout, rows, keys, schema and audited sizes of one resized dataset (or some shards) against main."""
    if shards is None:
        shards = main.list_shards()
        assert output.location.list_shards() == shards
    for rel in shards:
        source = main.parquet_file(rel).read()
        built_file = output.location.parquet_file(rel)
        built = built_file.read()
        audit_names = [f"{output.audit_prefix}_{name}" for name in AUDIT_TYPES]
        assert built.column_names == [key_column, image_column, *audit_names]
        assert built.schema.field(key_column).type == source.schema.field(key_column).type
        assert built.column(key_column).equals(source.column(key_column))
        assert read_settings(built_file)["target_area"] == output.area
        images = built.column(image_column).to_pylist()
        for record, image in zip(read_audit_records(built, output.audit_prefix), images):
            if isinstance(image, dict):
                image = image["bytes"]
            assert record.valid == (image is not None)
            if not record.valid:
                assert record.error and record.error_detail
                continue
            decoded = Image.open(io.BytesIO(image))
            assert decoded.format == "WEBP"
            assert decoded.size == (record.width, record.height)
            expected = geometry(record.src_width, record.src_height, output.area)
            assert (record.width, record.height) == expected.target_size
            assert record.scale == pytest.approx(expected.scale)
            assert record.out_bytes == len(image)


def test_fused_round_trip_nested_local(sample_main, tmp_path):
    outputs = resized_outputs(tmp_path)
    results = [build_resized_shard(layout_of(sample_main, outputs), rel, threads=2) for rel in SHARDS]
    for output in outputs:
        check_resized_dataset(sample_main, output)
    # Every row is accounted for, and the sample's bad rows are audited, not dropped.
    for result in results:
        for summary in result.outputs:
            assert summary.status == "built"
            assert summary.valid + sum(summary.error_counts.values()) == result.rows == 10
    codes = {code for r in results for s in r.outputs for code in s.error_counts}
    assert codes == {"missing_image", "decode_error", "too_small", "aspect_ratio"}


def test_each_resolution_alone_equals_the_fused_build(sample_main, tmp_path):
    fused = resized_outputs(tmp_path / "fused")
    alone = resized_outputs(tmp_path / "alone")
    rel = SHARDS[1]
    build_resized_shard(layout_of(sample_main, fused), rel)
    for output in alone:
        build_resized_shard(layout_of(sample_main, [output]), rel)
    for a, b in zip(fused, alone):
        table_a, table_b = a.location.parquet_file(rel).read(), b.location.parquet_file(rel).read()
        # The fused build may resample the smaller output from an intermediate (SPEC 3 allows
        # it within 40 dB PSNR), so compare pixels by PSNR and every other column exactly.
        same = [c for c in table_a.column_names if c not in ("image", f"{a.audit_prefix}_out_bytes")]
        assert table_a.select(same).equals(table_b.select(same))
        for image_a, image_b in zip(table_a.column("image").to_pylist(), table_b.column("image").to_pylist()):
            assert (image_a is None) == (image_b is None)
            if image_a is not None:
                assert _psnr(image_a, image_b) >= 40


def _psnr(encoded_a: bytes, encoded_b: bytes) -> float:
    a = np.asarray(Image.open(io.BytesIO(encoded_a)).convert("RGB"), dtype=np.float64)
    b = np.asarray(Image.open(io.BytesIO(encoded_b)).convert("RGB"), dtype=np.float64)
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def test_struct_image_layout_is_kept(tmp_path):
    main = Location.parse(tmp_path / "main")
    write_sample_dataset(main, shards=["s.parquet"], rows_per_shard=7, struct_images=True)
    outputs = resized_outputs(tmp_path / "out")
    build_resized_shard(layout_of(main, outputs), "s.parquet")
    built = outputs[0].location.parquet_file("s.parquet").read()
    assert built.schema.field("image").type == main.parquet_file("s.parquet").schema_arrow.field("image").type
    cells = built.column("image").to_pylist()
    assert cells[0]["path"] == "shard000-img00000.jpg" and cells[0]["bytes"][:4] == b"RIFF"
    check_resized_dataset(main, outputs[0])


def test_s3_round_trip(s3_bucket):
    main = Location.parse(f"s3://{s3_bucket}/datasets/main")
    write_sample_dataset(main, shards=["a/part-0.parquet", "b/c/part-1.parquet"], rows_per_shard=6)
    outputs = resized_outputs(f"s3://{s3_bucket}/derived")
    build_all(main, outputs)
    for output in outputs:
        check_resized_dataset(main, output)


def test_interrupted_build_leaves_nothing_and_rerun_completes(sample_main, tmp_path, monkeypatch):
    monkeypatch.setattr(resize, "OUTPUT_ROW_GROUP_ROWS", 4)  # 10 rows: the crash comes with rows in flight
    outputs = resized_outputs(tmp_path / "out")
    rel = SHARDS[0]
    flushed = []

    def crash_after_first_row_group(rows):
        flushed.append(rows)
        raise KeyboardInterrupt("worker stopped mid-shard")

    with pytest.raises(KeyboardInterrupt):
        build_resized_shard(layout_of(sample_main, outputs), rel, threads=2, on_rows=crash_after_first_row_group)
    assert flushed == [4]  # one row group written to the temporary, six rows to go
    for output in outputs:
        assert not output.location.exists(rel)
        folder = tmp_path / "out" / os.path.relpath(output.location.path, tmp_path / "out")
        assert not folder.exists() or list(folder.iterdir()) == []
    result = build_resized_shard(layout_of(sample_main, outputs), rel, skip_existing=True)
    assert [o.status for o in result.outputs] == ["built", "built"]
    check_resized_dataset(sample_main, outputs[0], shards=[rel])


def test_skip_existing_follows_row_count_and_settings(sample_main, tmp_path):
    outputs = resized_outputs(tmp_path / "out")
    rel = SHARDS[0]
    build_resized_shard(layout_of(sample_main, outputs), rel)
    first = outputs[0].location.read_bytes(rel)
    again = build_resized_shard(layout_of(sample_main, outputs), rel, skip_existing=True)
    assert [o.status for o in again.outputs] == ["skipped", "skipped"]
    assert outputs[0].location.read_bytes(rel) == first
    # Other settings: rebuilt.
    changed = build_resized_shard(
        layout_of(sample_main, outputs), rel, options=PixelOptions(quality=80), skip_existing=True
    )
    assert [o.status for o in changed.outputs] == ["built", "built"]
    assert outputs[0].location.read_bytes(rel) != first
    # Same settings but a different row count in the footer: rebuilt.
    path = outputs[1].location.child(rel)
    table = pq.ParquetFile(path).read()
    pq.write_table(table.slice(0, 3), path)
    partial = build_resized_shard(
        layout_of(sample_main, outputs), rel, options=PixelOptions(quality=80), skip_existing=True
    )
    assert [o.status for o in partial.outputs] == ["skipped", "built"]
    assert outputs[1].location.parquet_file(rel).metadata.num_rows == 10


@pytest.mark.parametrize("target", ["", "inside", ".."])
def test_output_overlapping_main_is_refused_and_changes_nothing(sample_main, target):
    root = os.path.normpath(os.path.join(sample_main.path, target)) if target else sample_main.path
    before = _snapshot(sample_main.path)
    with pytest.raises(LocationError, match="read-only"):
        build_resized_shard(layout_of(sample_main, [ResizedOutput(Location.parse(root), AREA_512, "p")]), SHARDS[0])
    assert _snapshot(sample_main.path) == before


def test_unreadable_shard_fails_with_its_name(tmp_path):
    main = Location.parse(tmp_path / "main")
    main.write_bytes("broken.parquet", b"this is not parquet")
    with pytest.raises(ShardError, match="broken.parquet"):
        build_resized_shard(layout_of(main, resized_outputs(tmp_path / "out")), "broken.parquet")
    main2 = Location.parse(tmp_path / "main2")
    with main2.write_atomic("nokey.parquet") as tmp:
        pq.write_table(pa.table({"id": ["a"], "image": [b"x"]}), tmp)
    with pytest.raises(ShardError, match=r"nokey.parquet.*image_key"):
        build_resized_shard(layout_of(main2, resized_outputs(tmp_path / "out")), "nokey.parquet")


def test_row_groups_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(resize, "OUTPUT_ROW_GROUP_ROWS", 4)
    main = Location.parse(tmp_path / "main")
    write_sample_dataset(main, shards=["s.parquet"], rows_per_shard=10, row_group_size=10, bad_rows=False)
    output = resized_outputs(tmp_path / "out")[0]
    build_resized_shard(layout_of(main, [output]), "s.parquet", threads=3)
    metadata = output.location.parquet_file("s.parquet").metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [4, 4, 2]
    check_resized_dataset(main, output)
