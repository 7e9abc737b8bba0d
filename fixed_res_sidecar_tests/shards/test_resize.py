import io
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fixed_res_sidecar.core.audit import AUDIT_TYPES, read_audit_records
from fixed_res_sidecar.core.decoding import MAX_COUNTED_FRAMES, decode_memory_estimate, open_image
from fixed_res_sidecar.core.geometry import AREA_512, geometry
from fixed_res_sidecar.core.pixel_settings import PixelOptions
from fixed_res_sidecar.io.locations import Location, LocationError
from fixed_res_sidecar.io.parquet import ShardError
from fixed_res_sidecar.sample_data import write_sample_dataset
from fixed_res_sidecar.shards import resize
from fixed_res_sidecar.shards.layout import ResizedOutput
from fixed_res_sidecar.shards.resize import ResizeTargets, build_resized_shard
from fixed_res_sidecar.shards.settings import read_settings
from fixed_res_sidecar_tests.fixtures.datasets import SHARDS, build_all, layout_of, resized_outputs
from fixed_res_sidecar_tests.fixtures.images import (
    gif_with_frames,
    header_bombs,
    jpeg_bytes,
    photo_like,
    truncated_with_end_marker,
)


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
    result = build_resized_shard(layout_of(sample_main, outputs), rel, targets=ResizeTargets(skip_existing=True))
    assert [o.status for o in result.outputs] == ["built", "built"]
    check_resized_dataset(sample_main, outputs[0], shards=[rel])


def test_skip_existing_follows_row_count_and_settings(sample_main, tmp_path):
    outputs = resized_outputs(tmp_path / "out")
    rel = SHARDS[0]
    build_resized_shard(layout_of(sample_main, outputs), rel)
    first = outputs[0].location.read_bytes(rel)
    again = build_resized_shard(layout_of(sample_main, outputs), rel, targets=ResizeTargets(skip_existing=True))
    assert [o.status for o in again.outputs] == ["skipped", "skipped"]
    assert outputs[0].location.read_bytes(rel) == first
    # Other settings: rebuilt.
    changed = build_resized_shard(
        layout_of(sample_main, outputs),
        rel,
        options=PixelOptions(quality=80),
        targets=ResizeTargets(skip_existing=True),
    )
    assert [o.status for o in changed.outputs] == ["built", "built"]
    assert outputs[0].location.read_bytes(rel) != first
    # Same settings but a different row count in the footer: rebuilt.
    path = outputs[1].location.child(rel)
    table = pq.ParquetFile(path).read()
    pq.write_table(table.slice(0, 3), path)
    partial = build_resized_shard(
        layout_of(sample_main, outputs),
        rel,
        options=PixelOptions(quality=80),
        targets=ResizeTargets(skip_existing=True),
    )
    assert [o.status for o in partial.outputs] == ["skipped", "built"]
    assert outputs[1].location.parquet_file(rel).metadata.num_rows == 10


def test_skip_existing_rebuilds_a_shard_whose_footer_lies_about_its_settings(sample_main, tmp_path):
    """A footer edited to record other settings than the shard was built with (its pictures untouched) is
    not up to date: skip-existing compares the footer with the current settings and rebuilds it."""
    import json

    from fixed_res_sidecar.shards.settings import SETTINGS, SETTINGS_KEY

    outputs = resized_outputs(tmp_path / "out")
    rel = SHARDS[0]
    build_resized_shard(layout_of(sample_main, outputs), rel)
    path = outputs[0].location.child(rel)
    table = pq.read_table(path)
    metadata = dict(table.schema.metadata)
    metadata[SETTINGS_KEY] = json.dumps({**json.loads(metadata[SETTINGS_KEY]), "quality": 10}).encode()
    pq.write_table(table.replace_schema_metadata(metadata), path, write_page_checksum=True, row_group_size=4)
    again = build_resized_shard(layout_of(sample_main, outputs), rel, targets=ResizeTargets(skip_existing=True))
    assert [(o.status, o.reason) for o in again.outputs] == [("built", SETTINGS), ("skipped", None)]
    assert json.loads(pq.read_schema(path).metadata[SETTINGS_KEY])["quality"] == 95


def test_skip_existing_rebuilds_after_a_same_size_rewrite_of_main_with_its_mtime_restored(sample_main, tmp_path):
    """Reported: invisible to --skip-existing (same size, same footer, mtime set back)."""
    from fixed_res_sidecar.shards.settings import SOURCES
    from fixed_res_sidecar_tests.fixtures.datasets import damage_value

    outputs = resized_outputs(tmp_path / "out")
    rel = SHARDS[0]
    build_resized_shard(layout_of(sample_main, outputs), rel)
    path = sample_main.child(rel)
    before = os.stat(path)
    images = pq.read_table(path, columns=["image"]).column("image").to_pylist()
    damage_value(path, max((i for i in images if i), key=len))  # one image's bytes changed in place
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    again = build_resized_shard(layout_of(sample_main, outputs), rel, targets=ResizeTargets(skip_existing=True))
    assert [(o.status, o.reason) for o in again.outputs] == [("built", SOURCES), ("built", SOURCES)]


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


# ----------------------------------------------------------------------------- one bad row never fails its shard


def _write_main(root, images: pa.Array, keys: pa.Array | None = None, rel: str = "s.parquet") -> Location:
    main = Location.parse(root)
    if keys is None:
        keys = pa.array([f"row-{i:03d}" for i in range(len(images))])
    with main.write_atomic(rel) as tmp:
        pq.write_table(pa.table({"image_key": keys, "image": images}), tmp)
    return main


def _audits(output: ResizedOutput, rel: str = "s.parquet"):
    return read_audit_records(output.location.parquet_file(rel).read(), output.audit_prefix)


def test_hostile_rows_are_audited_and_no_row_is_lost(tmp_path):
    """Header bombs (2^31 and 2^32 - 1 px sides, a 5e9 FITS axis, 2^31 APNG frames), a million-frame
    GIF and a JPEG cut short with an end marker, between good rows: every row is audited."""
    good = jpeg_bytes(photo_like(320, 240, seed=31))
    rows = {
        "good-first": good,
        **header_bombs(),
        "gif_1m_frames": gif_with_frames(1_000_000),
        "jpeg_cut_with_end_marker": truncated_with_end_marker(good, 0.6),
        "good-last": good,
    }
    main = _write_main(tmp_path / "main", pa.array(list(rows.values()), pa.binary()), pa.array(list(rows)))
    outputs = resized_outputs(tmp_path / "out")
    result = build_resized_shard(layout_of(main, outputs), "s.parquet", threads=2)
    assert result.rows == len(rows)
    for output, summary in zip(outputs, result.outputs):
        assert summary.valid + sum(summary.error_counts.values()) == len(rows)  # rows lost: 0
        built = output.location.parquet_file("s.parquet").read()
        assert built.column("image_key").to_pylist() == list(rows)
        audits = dict(zip(rows, _audits(output)))
        for name in header_bombs():
            if name != "apng_2_31_frames":
                assert audits[name].error == "too_large", name
        assert (audits["ppm_2_32"].src_width, audits["fits_5e9"].src_width) == (2**32 - 1, 5_000_000_000)
        for name in ("apng_2_31_frames", "gif_1m_frames"):
            assert audits[name].valid and audits[name].n_frames == MAX_COUNTED_FRAMES
        assert audits["jpeg_cut_with_end_marker"].error == "decode_error"
        assert audits["good-first"].valid and audits["good-last"].valid
    check_resized_dataset(main, outputs[0])


def test_an_image_column_of_fixed_size_binary_is_read_and_written_as_binary(tmp_path):
    """Encoded outputs differ in size, so a fixed_size_binary column becomes binary (SPEC 5)."""
    image = jpeg_bytes(photo_like(320, 240, seed=32))
    padded = image + bytes(16)  # JPEG decoders stop at the end marker; fixed-size cells are often padded
    width = len(padded)
    main = _write_main(tmp_path / "main", pa.array([padded, None, padded], pa.binary(width)))
    outputs = resized_outputs(tmp_path / "out")
    result = build_resized_shard(layout_of(main, outputs), "s.parquet")
    assert [o.valid for o in result.outputs] == [2, 2]
    for output in outputs:
        built = output.location.parquet_file("s.parquet").read()
        assert built.schema.field("image").type == pa.binary()
        assert [r.error for r in _audits(output)] == [None, "missing_image", None]
        check_resized_dataset(main, output)


@pytest.mark.parametrize("key_type", [pa.binary(), pa.string()], ids=["binary", "string_holding_bytes"])
def test_keys_that_are_not_utf8_are_copied_as_they_are(tmp_path, key_type):
    """Keys are never decoded: a binary key, or a string column a lax writer filled with bytes."""
    raw = [b"\xff\xfe-key-0", b"ok-1", b"\xc3\x28-2"]
    binary = pa.array(raw, pa.binary())
    keys = binary if key_type == pa.binary() else pa.Array.from_buffers(pa.string(), len(raw), binary.buffers())
    image = jpeg_bytes(photo_like(320, 240, seed=33))
    main = _write_main(tmp_path / "main", pa.array([image] * 3, pa.binary()), keys)
    outputs = resized_outputs(tmp_path / "out")
    build_resized_shard(layout_of(main, outputs), "s.parquet", threads=2)
    for output in outputs:
        built = output.location.parquet_file("s.parquet").read()
        assert built.schema.field("image_key").type == key_type
        assert built.column("image_key").cast(pa.binary()).to_pylist() == raw
        assert all(r.valid for r in _audits(output))


def _peak_rss_of_a_build(main: Location, out, memory_gb: float, threads: int = 4) -> int:
    """Peak RSS in bytes of a child process that builds main's shard `s.parquet` (as the OS counts it)."""
    script = (
        "import sys\n"
        "from fixed_res_sidecar.io.locations import Location\n"
        "from fixed_res_sidecar.shards.resize import ResizeTargets, build_resized_shard\n"
        "from fixed_res_sidecar_tests.fixtures.datasets import layout_of, resized_outputs\n"
        "main, out, memory_gb, threads = sys.argv[1:]\n"
        "layout = layout_of(Location.parse(main), resized_outputs(out))\n"
        "build_resized_shard(layout, 's.parquet', threads=int(threads), memory_gb=float(memory_gb))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, main.uri, str(out), str(memory_gb), str(threads)])
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0
    return usage.ru_maxrss * 1024  # KiB on Linux


def test_decoded_images_in_flight_stay_within_the_memory_budget(tmp_path, large_pngs):
    """Four 9 MP RGBA rows and one 36 MP row on 4 threads, with a 200 MiB decode budget: at most two
    9 MP images are decoded at once (about 90 MB each), the 36 MP row (about 360 MB) is too_large."""
    memory_gb = 400 / 1024
    budget = resize.decode_budget_bytes(memory_gb)
    assert budget == 200 * 2**20
    nine, thirty_six = (decode_memory_estimate(open_image(large_pngs[k])) for k in ("9_mp", "36_mp"))
    assert 2 * nine <= budget < 3 * nine and thirty_six > budget  # what the test relies on
    small = jpeg_bytes(photo_like(320, 240, seed=34))
    images = [large_pngs["9_mp"]] * 2 + [large_pngs["36_mp"]] + [large_pngs["9_mp"]] * 2 + [small, small]
    main = _write_main(tmp_path / "main", pa.array(images, pa.binary()))
    baseline_main = _write_main(tmp_path / "baseline", pa.array([small, small], pa.binary()))

    baseline = _peak_rss_of_a_build(baseline_main, tmp_path / "baseline-out", memory_gb)
    peak = _peak_rss_of_a_build(main, tmp_path / "out", memory_gb)
    assert peak - baseline <= budget, f"peak RSS {peak / 2**20:.0f} MiB, baseline {baseline / 2**20:.0f} MiB"

    for output in resized_outputs(tmp_path / "out"):
        audits = _audits(output)
        assert len(audits) == len(images)  # rows lost: 0
        assert (audits[2].error, audits[2].src_width) == ("too_large", 6000)
        assert "decode memory budget of 200 MiB" in audits[2].error_detail
        assert all(a.valid for i, a in enumerate(audits) if i != 2)
