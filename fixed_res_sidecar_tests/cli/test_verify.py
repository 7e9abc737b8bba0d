"""`verify-resized` and `verify-crop-bbox` through their own argparse parsers, on real builds."""

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.cli import verify as verify_cli
from fixed_res_sidecar.cli.common import STORAGE_FAILED
from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.core.bbox import CROP_COLUMNS
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.s3 import s3_client
from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard
from fixed_res_sidecar_tests.fixtures.datasets import sidecar_layout
from fixed_res_sidecar_tests.fixtures.faulty_s3 import (
    any_of,
    copy_files,
    every_object_get,
    first_get_of_each_key,
    small_ranges_first_attempt,
)
from fixed_res_sidecar_tests.fixtures.permissions import permission_checks_enforced, unreadable

REL = "nested/b/part-00002.parquet"


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="sidecar-ops")
    verify_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


@pytest.fixture
def paths(sidecar_build) -> dict[str, Path]:
    return {
        "main": Path(sidecar_build.main.path),
        "512": Path(sidecar_build.r512.path),
        "1024": Path(sidecar_build.r1024.path),
        "sidecar": Path(sidecar_build.sidecar.path),
    }


def resized_args(paths, resolution="512", *extra):
    prefix = {"512": "0_26mp_process", "1024": "1_05mp_process"}[resolution]
    return (
        "verify-resized",
        "--main-prefix",
        paths["main"],
        "--output-prefix",
        paths[resolution],
        "--key-column",
        "image_key",
        "--audit-prefix",
        prefix,
        *extra,
    )


def crop_args(paths, *extra):
    return (
        "verify-crop-bbox",
        "--main-prefix",
        paths["main"],
        "--resized-512-prefix",
        paths["512"],
        "--resized-1024-prefix",
        paths["1024"],
        "--sidecar-prefix",
        paths["sidecar"],
        "--key-column",
        "image_key",
        *extra,
    )


def test_verify_resized_passes_and_writes_the_full_report(paths, tmp_path, capsys):
    report_file = tmp_path / "reports" / "512.json"
    assert run(*resized_args(paths, "512", "--report", report_file)) == 0
    out = capsys.readouterr().out
    assert "shards: 3 checked, 3 passed, 0 failed; rows: 30" in out
    assert out.strip().endswith("PASSED")
    document = json.loads(report_file.read_text())
    # The counts line sums the per-shard counts per error code.
    totals = Counter()
    for shard in document["shards"]:
        totals.update(shard["error_counts"])
    assert set(totals) <= set(ERROR_CODES) and sum(totals.values()) >= 3
    assert "counts: " + ", ".join(f"{code} {n}" for code, n in sorted(totals.items())) in out
    assert f"valid: {30 - sum(totals.values())}, invalid: {sum(totals.values())}" in out
    assert "invalid examples:" in out
    assert document["passed"] is True and document["command"] == "verify-resized"
    assert [s["rel"] for s in document["shards"]] == sorted(s["rel"] for s in document["shards"])
    assert all(s["target_area"] == 262144 and s["passed"] for s in document["shards"])
    assert document["dataset"]["outputs"]["512"]["missing"] == []
    assert document["dataset"]["main"]["shards"] == 3


def test_verify_resized_with_the_same_report_file_compares_rows_not_compared_before(paths, tmp_path, capsys):
    """Each run reads the previous --report file: its fidelity window follows the one it recorded."""
    report_file = tmp_path / "512.json"
    windows = []
    for _ in range(3):
        assert run(*resized_args(paths, "512", "--fidelity-sample", "3", "--report", report_file)) == 0
        document = json.loads(report_file.read_text())
        windows.append({s["rel"]: s["stats"]["fidelity_coverage"] for s in document["shards"]})
    capsys.readouterr()
    for rel, first in windows[0].items():
        assert [w[rel]["window"] for w in windows] == [0, 1, 2]
        assert [w[rel]["compared_ever"] for w in windows] == [3, 6, first["comparable"]]  # 8 valid rows: 3+3+2


def test_verify_resized_fails_naming_the_damaged_shard(paths, capsys):
    path = paths["1024"] / REL
    table = pq.read_table(path)
    keys = table.column("image_key").to_pylist()
    keys[0], keys[1] = keys[1], keys[0]
    pq.write_table(table.set_column(0, table.schema.field(0), pa.array(keys, table.schema.field(0).type)), path)
    assert run(*resized_args(paths, "1024")) == 1
    out = capsys.readouterr().out
    assert f"FAILED keys_match on {REL}: {path}: row 0" in out
    assert "2 passed, 1 failed" in out and out.strip().endswith("FAILED")


@pytest.mark.parametrize("command", ["verify-resized", "verify-crop-bbox"])
def test_a_main_folder_that_cannot_be_listed_is_no_pass(paths, capsys, command):
    """Reported: a main subfolder that could not be listed was skipped, and the verifier said PASSED."""
    folder = paths["main"] / "nested"
    args = resized_args(paths, "512") if command == "verify-resized" else crop_args(paths)
    with unreadable(folder), permission_checks_enforced():
        assert run(*args) == STORAGE_FAILED
    captured = capsys.readouterr()
    assert f"storage failed listing {folder} " in captured.err and "Permission denied" in captured.err
    assert "PASSED" not in captured.out


def test_verify_resized_reports_missing_shards(paths, capsys):
    (paths["512"] / REL).unlink()
    assert run(*resized_args(paths, "512", "--threads", "1")) == 1
    out = capsys.readouterr().out
    assert "512: 2 shards" in out and f"missing 1: {REL}" in out
    assert f"FAILED shard_complete on {REL}: output shard {paths['512'] / REL} is missing" in out


def test_verify_resized_one_shard_and_explicit_target_area(paths, capsys):
    assert run(*resized_args(paths, "1024", "--shard", REL, "--target-area", "1048576", "--sample", "2")) == 0
    assert "shards: 1 checked, 1 passed" in capsys.readouterr().out
    # The wrong target area fails the sampled-image check.
    assert run(*resized_args(paths, "1024", "--shard", REL, "--target-area", "262144")) == 1
    assert "FAILED sample_images on" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--audit-prefix", "custom_process"), "no default target area"),
        (("--sample", "0"), "--sample must be at least 1"),
        (("--sample", "some"), "must be an integer or 'all'"),
        (("--shard", "nope.parquet"), "not shards of"),
    ],
)
def test_verify_resized_usage_errors(paths, capsys, extra, message):
    try:
        code = run(*resized_args(paths, "512", *extra))
    except SystemExit as exit:  # argparse refuses what is not a count
        code = exit.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_report_inside_main_is_refused_before_any_work(paths, capsys):
    assert run(*resized_args(paths, "512", "--report", paths["main"] / "report.json")) == 2
    assert "read-only" in capsys.readouterr().err
    assert not (paths["main"] / "report.json").exists()


def test_a_report_name_longer_than_a_file_name_can_be_is_refused_before_any_work(paths, tmp_path, capsys):
    report = tmp_path / ("r" * 251 + ".json")
    assert run(*resized_args(paths, "512", "--report", report)) == 2
    captured = capsys.readouterr()
    assert "256-byte name, longer than a file name can be (255 bytes)" in captured.err
    assert captured.out == ""  # refused before any shard was checked


def test_report_and_overlays_through_a_symlink_into_main_are_refused(paths, tmp_path, capsys):
    from fixed_res_sidecar_tests.fixtures.datasets import tree_snapshot

    before = tree_snapshot(paths["main"])
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "linked").symlink_to(paths["main"] / "nested")
    assert run(*resized_args(paths, "512", "--report", reports / "linked" / "report.json")) == 2
    assert "read-only" in capsys.readouterr().err  # refused up front: the path is resolved when parsed
    overlays = tmp_path / "overlays"
    overlays.mkdir()
    (overlays / "nested").symlink_to(paths["main"] / "nested")  # where nested shards' pictures go
    assert run(*crop_args(paths, "--overlay-dir", overlays)) == 1
    out = capsys.readouterr().out
    assert "OVERLAYS FAILED on nested/a/part-00001.parquet" in out and "symbolic links" in out
    assert tree_snapshot(paths["main"]) == before


def test_verify_crop_bbox_passes_with_overlays(paths, tmp_path, capsys):
    overlays = tmp_path / "overlays"
    report_file = tmp_path / "crop.json"
    code = run(*crop_args(paths, "--overlay-dir", overlays, "--overlay-sample", "2", "--report", report_file))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "overlays: 6 picture(s)" in out
    assert len(list(overlays.rglob("*.png"))) == 6
    document = json.loads(report_file.read_text())
    assert document["passed"] and set(document["dataset"]["outputs"]) == {"512", "1024", "sidecar"}
    assert all(shard["stats"]["caption_status"]["ok"] > 0 for shard in document["shards"])
    assert "counts: " in out and "512_invalid" in out  # the sample has bad images in every shard


def test_verify_crop_bbox_fails_on_an_out_of_range_box(paths, capsys):
    path = paths["sidecar"] / REL
    table = pq.read_table(path)
    column = CROP_COLUMNS["1024"]
    crops = table.column(column).to_pylist()
    row = next(i for i, text in enumerate(crops) if text)
    crops[row] = json.dumps({"objects": [{"bbox": [0, 0, 500, 1200]}]})
    index = table.schema.get_field_index(column)
    pq.write_table(table.set_column(index, table.schema.field(index), pa.array(crops, pa.string())), path)
    assert run(*crop_args(paths)) == 1
    out = capsys.readouterr().out
    assert f"FAILED boxes_valid on {REL}: {path}: 1 bad box(es); row {row}" in out


def test_verify_crop_bbox_refuses_an_overlay_dir_inside_main(paths, capsys):
    assert run(*crop_args(paths, "--overlay-dir", paths["main"] / "overlays")) == 2
    assert "read-only" in capsys.readouterr().err


def test_verify_crop_bbox_box_keys_default_to_the_sidecars_settings(paths, capsys):
    # Rebuild one shard's sidecar with the boxes under a custom key, then break one of them.
    main = Location.parse(paths["main"])
    source = pq.read_table(paths["main"] / REL)
    captions = [
        None if t is None else t.replace('"bbox"', '"region"')
        for t in source.column("structured_description").to_pylist()
    ]
    index = source.schema.get_field_index("structured_description")
    pq.write_table(
        source.set_column(index, source.schema.field(index), pa.array(captions, pa.string())), paths["main"] / REL
    )
    sidecar = Location.parse(paths["sidecar"])
    layout = sidecar_layout(
        main, Location.parse(paths["512"]), Location.parse(paths["1024"]), sidecar, bbox_keys=["region"]
    )
    build_crop_bbox_shard(layout, REL)
    assert run(*crop_args(paths, "--shard", REL)) == 0
    capsys.readouterr()

    path = paths["sidecar"] / REL
    table = pq.read_table(path)
    column = CROP_COLUMNS["512"]
    crops = table.column(column).to_pylist()
    row = next(i for i, text in enumerate(crops) if text and '"region": [' in text)
    caption = json.loads(crops[row])
    caption["objects"][0]["region"] = [0, 0, 500, 1200]
    crops[row] = json.dumps(caption)
    index = table.schema.get_field_index(column)
    pq.write_table(table.set_column(index, table.schema.field(index), pa.array(crops, pa.string())), path)

    assert run(*crop_args(paths, "--shard", REL)) == 1  # the recorded key "region" is checked
    assert f"FAILED boxes_valid on {REL}: {path}: 1 bad box(es); row {row}" in capsys.readouterr().out
    # Explicit keys override the recorded ones for the box checks: under "bbox" and "box_2d" no box is bad.
    # The re-derivation follows what the sidecar was built with and still finds the damaged row.
    assert run(*crop_args(paths, "--shard", REL, "--bbox-key", "bbox", "--bbox-key", "box_2d")) == 1
    out = capsys.readouterr().out
    assert "FAILED boxes_valid" not in out and f"FAILED boxes_rederived on {REL}: {path}: 1 of 10" in out
    assert run(*crop_args(paths, "--shard", REL, "--bbox-key", "region", "--caption-frame", "oriented")) == 1
    assert "FAILED boxes_valid" in capsys.readouterr().out


# -- transient S3 errors (a fault-injecting proxy in front of moto) ---------------------------


def pipeline_commands(root: str, report_dir: str) -> list[list[str]]:
    """build-both, both verifiers, build-crop-bbox and verify-crop-bbox with overlays, on `root`. At WebP
    effort 0 (the encoder's fastest; each verifier and the crop's gate encode the rows they compare):
    these runs are about storage faults, not the encoder."""
    main, r512, r1024, sidecar = (f"{root}/{name}" for name in ("main", "512", "1024", "sidecar"))
    common = ["--main-prefix", main, "--key-column", "image_key"]
    resized = [*common, "--resized-512-prefix", r512, "--resized-1024-prefix", r1024]
    effort = ["--webp-method", "0"]
    return [
        ["build-both", *common, "--output-prefix-512", r512, "--output-prefix-1024", r1024, "--max-inflight", "2",
         *effort],
        ["verify-resized", *common, "--output-prefix", r512, "--audit-prefix", "0_26mp_process",
         "--report", f"{report_dir}/verify-512.json", *effort],
        ["verify-resized", *common, "--output-prefix", r1024, "--audit-prefix", "1_05mp_process",
         "--report", f"{report_dir}/verify-1024.json", *effort],
        ["build-crop-bbox", *resized, "--output-prefix", sidecar, *effort],
        ["verify-crop-bbox", *resized, "--sidecar-prefix", sidecar, "--overlay-dir", f"{root}/overlays",
         "--overlay-sample", "2", "--report", f"{report_dir}/verify-crop.json"],
    ]  # fmt: skip


def files_under(location: Location) -> dict[str, object]:
    """What each file under `location` holds: its bytes, or for a shard its table with the footer's
    settings (the recorded source fingerprints differ between copies of main: local stamps, ETags)."""
    from fixed_res_sidecar.shards.settings import SOURCES_KEY

    def content(rel: str):
        if not rel.endswith(".parquet"):
            return location.read_bytes(rel)
        table = location.parquet_file(rel).read()
        metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != SOURCES_KEY}
        return table.replace_schema_metadata(metadata)

    return {rel: content(rel) for rel in location.list_shards(suffix="")}


@pytest.mark.stress
def test_every_command_rides_out_injected_s3_errors(
    sample_main_template, faulty_s3, fast_retries, s3_bucket, tmp_path, capsys
):
    """500s and 503s on the first GET of every object and listing, and on the first small ranged
    GET of every range size (the error body is longer than the range): every command succeeds
    and writes what a clean run writes (byte for byte, but for the sources its shards record), reports
    included."""
    from fixed_res_sidecar.cli import main as sidecar_ops

    clean_root, s3_root = str(tmp_path / "clean"), f"s3://{s3_bucket}/lake"
    shutil.copytree(sample_main_template, f"{clean_root}/main")
    copy_files(Location.parse(sample_main_template), Location.parse(f"{s3_root}/main"))
    for command in pipeline_commands(clean_root, str(tmp_path / "clean-reports")):
        assert sidecar_ops(command) == 0, capsys.readouterr()
        capsys.readouterr()

    faulty_s3.inject(any_of(first_get_of_each_key, small_ranges_first_attempt(400)))
    for command in pipeline_commands(s3_root, str(tmp_path / "s3-reports")):
        code, output = sidecar_ops(command), capsys.readouterr()
        assert code == 0, (command[0], output.out[-3000:])
    # Faults hit every dataset's objects, listings, and small ranges (the ones pyarrow does not retry).
    datasets = {key.split("/")[2] for key, _ in faulty_s3.faults if key.count("/") >= 2}
    assert datasets == {"main", "512", "1024", "sidecar"}
    assert s3_bucket in [key for key, _ in faulty_s3.faults]
    assert len([size for _, size in faulty_s3.faults if size is not None and size < 400]) >= 9

    for name in ("512", "1024", "sidecar", "overlays"):
        clean = files_under(Location.parse(f"{clean_root}/{name}"))
        assert clean and files_under(Location.parse(f"{s3_root}/{name}")) == clean, name

    def report(path: Path, root: str) -> str:
        # Output shards hold their sources' fingerprints, longer on S3 (ETags): their byte totals differ.
        text = re.sub(r'"total_bytes": \d+', '"total_bytes": N', path.read_text().replace(root, "ROOT"))
        text = re.sub(r'"(output_)?fingerprint": "[^"]*"', '"fingerprint": F', text)  # stat vs ETag
        return re.sub(r'"since": [0-9.e+]+', '"since": T', text)  # when the fidelity window started

    for name in ("verify-512.json", "verify-1024.json", "verify-crop.json"):
        assert report(tmp_path / "s3-reports" / name, s3_root) == report(tmp_path / "clean-reports" / name, clean_root)
    # Nothing left behind: no incomplete upload, no temporary file.
    assert "Uploads" not in s3_client().list_multipart_uploads(Bucket=s3_bucket)
    assert not [path for path in Path(clean_root).rglob(".*") if path.is_file()]


def test_storage_that_keeps_failing_fails_the_command_without_a_verdict(
    sidecar_build, faulty_s3, fast_retries, s3_bucket, tmp_path, capsys
):
    root = f"s3://{s3_bucket}/lake"
    for name, location in (("main", sidecar_build.main), ("512", sidecar_build.r512)):
        copy_files(location, Location.parse(f"{root}/{name}"))
    faulty_s3.inject(every_object_get)
    report_file = tmp_path / "report.json"
    paths = {"main": f"{root}/main", "512": f"{root}/512"}
    assert run(*resized_args(paths, "512", "--report", report_file)) == STORAGE_FAILED
    out = capsys.readouterr().out
    for rel in sidecar_build.main.list_shards():
        assert f"STORAGE FAILED on {rel}, not checked: storage failed reading s3://{s3_bucket}/lake/" in out
    assert "shards: 0 checked" in out and "FAILED " not in out.replace("STORAGE FAILED", "")
    assert out.strip().endswith("rerun") and "INCOMPLETE: storage kept failing (after retries) on 3 shard(s)" in out
    document = json.loads(report_file.read_text())
    assert document["passed"] is None and document["shards"] == []
    assert sorted(document["storage_failures"]) == sidecar_build.main.list_shards()


@pytest.mark.parametrize("key_type", ["binary", "string_holding_bytes"])
def test_keys_that_are_not_utf8_go_through_sidecar_verifiers_reports_and_overlays(tmp_path, capsys, key_type):
    """Keys are never decoded: reports and messages show them as text with \\xNN escapes."""
    from fixed_res_sidecar.sample_data import sample_shard_table
    from fixed_res_sidecar.shards.resize import build_resized_shard

    table = sample_shard_table(0, 5)  # row 4 is a bad image: the reports list its key
    raw = [b"\xff\xfe-%d" % i for i in range(5)]
    keys = pa.array(raw, pa.binary())
    if key_type == "string_holding_bytes":  # what a writer that does not check UTF-8 leaves
        keys = pa.Array.from_buffers(pa.string(), len(raw), keys.buffers())
    rel = "part-00000.parquet"
    paths = {name: tmp_path / name for name in ("main", "512", "1024", "sidecar")}
    paths["main"].mkdir()
    pq.write_table(table.set_column(0, "image_key", keys), paths["main"] / rel)
    layout = sidecar_layout(*(Location.parse(paths[name]) for name in ("main", "512", "1024", "sidecar")))
    build_resized_shard(layout, rel)
    build_crop_bbox_shard(layout, rel)

    report = tmp_path / "resized.json"
    assert run(*resized_args(paths, "512", "--report", report)) == 0, capsys.readouterr().out
    (shard,) = json.loads(report.read_text())["shards"]
    assert [example["key"] for example in shard["examples"]] == ["\\xff\\xfe-4"]

    report = tmp_path / "crop.json"
    code = run(*crop_args(paths, "--report", report, "--overlay-dir", tmp_path / "overlays", "--overlay-sample", "5"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(report.read_text())["passed"]
    assert len(list((tmp_path / "overlays").rglob("*.png"))) == 4  # the rows with a resized image


@pytest.mark.stress
def test_a_million_boxes_and_deep_nesting_stay_bounded_through_verify_with_overlays(tmp_path):
    """The real command on captions that stalled it (a million boxes: one picture did not finish in
    300 s) or crashed its overlays (980 levels: RecursionError). Bounded by a generous timeout."""
    from fixed_res_sidecar.core.bbox import MAX_CAPTION_DEPTH
    from fixed_res_sidecar.sample_data import make_photo
    from fixed_res_sidecar.shards.resize import build_resized_shard

    million = json.dumps(
        {"regions": {"bbox_2d": [[i % 900, i * 7 % 900, i % 900 + 50, i * 7 % 900 + 50] for i in range(10**6)]}}
    )

    def nested(levels: int) -> str:
        return '{"a": ' * (levels - 1) + '{"bbox": [100, 100, 600, 600]}' + "}" * (levels - 1)

    image, _ = make_photo(320, 240, seed=5)
    paths = {name: tmp_path / name for name in ("main", "512", "1024", "sidecar")}
    paths["main"].mkdir()
    shards = {"million.parquet": [million, nested(MAX_CAPTION_DEPTH - 1)], "deep.parquet": [nested(980)]}
    for rel, captions in shards.items():
        table = {"image_key": [f"{rel}-{i}" for i in range(len(captions))], "image": [image] * len(captions)}
        pq.write_table(pa.table({**table, "structured_description": captions}), paths["main"] / rel)
    layout = sidecar_layout(*(Location.parse(paths[name]) for name in ("main", "512", "1024", "sidecar")))
    for rel in shards:
        build_resized_shard(layout, rel)
        build_crop_bbox_shard(layout, rel)

    overlays, report = tmp_path / "overlays", tmp_path / "crop.json"
    args = crop_args(paths, "--overlay-dir", overlays, "--overlay-sample", "2", "--report", report)
    done = subprocess.run(
        [sys.executable, "-m", "fixed_res_sidecar.cli", *map(str, args)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.relative_to(overlays).as_posix() for p in overlays.rglob("*.png")) == [
        "deep/000000-deep.parquet-0.png",
        "million/000000-million.parquet-0.png",
        "million/000001-million.parquet-1.png",
    ]
    by_shard = {shard["rel"]: shard for shard in json.loads(report.read_text())["shards"]}
    assert by_shard["million.parquet"]["stats"]["caption_status"] == {"ok": 2}
    assert by_shard["million.parquet"]["stats"]["boxes"]["512"]["total"] == 10**6 + 1
    assert by_shard["deep.parquet"]["stats"]["caption_status"] == {"invalid_json": 1}


def test_verify_resized_names_each_wrong_picture_with_its_score_and_draws_it(sidecar_build, paths, tmp_path, capsys):
    from fixed_res_sidecar_tests.fixtures.datasets import column, damage_images, valid_rows

    rows = valid_rows(sidecar_build.r512, REL, "0_26mp_process")[:3]
    damage_images(sidecar_build, "512", dict(zip(rows, ["rotated_180", "channels_reversed", "black"])), rel=REL)
    report, pictures = tmp_path / "report.json", tmp_path / "pictures"
    code = run(*resized_args(paths, "512", "--sample", "all", "--report", report, "--picture-dir", pictures))
    out = capsys.readouterr().out
    assert code == 1 and "FAILED fidelity on nested/b/part-00002.parquet" in out
    keys = column(sidecar_build.r512, REL, "image_key")
    document = json.loads(report.read_text())
    (shard,) = [s for s in document["shards"] if s["rel"] == REL]
    (fidelity,) = [c for c in shard["checks"] if c["name"] == "fidelity"]
    found = fidelity["metadata"]
    assert found["checked"] == 8 and found["failing_rows"] == 3
    assert [f["key"] for f in found["failing"]] == [keys[r] for r in rows]
    for failing in found["failing"]:
        assert f"{failing['key']!r}: score {failing['score']:.2f} dB" in out
    assert (
        f"{REL}: 8 compared, score min {found['min_score']:.2f} dB, median {found['median_score']:.2f} dB, 3 failing"
        in out
    )
    assert "fidelity: 24 rows compared with their source, 3 failing (score below -3 dB)" in out
    assert sorted(p.name for p in (pictures / "nested/b/part-00002/512").iterdir()) == [
        f"{r:06d}-{keys[r]}.png" for r in rows
    ]
    assert shard["stats"]["fidelity_pictures"][0].endswith(f"{rows[0]:06d}-{keys[rows[0]]}.png")
    # The other shards pass, and say how faithful they are.
    others = [s for s in document["shards"] if s["rel"] != REL]
    assert all(s["passed"] for s in others)
    assert all(c["metadata"]["min_score"] >= -3 for s in others for c in s["checks"] if c["name"] == "fidelity")


@pytest.mark.parametrize(
    ("flags", "words", "failed"),
    [
        (["--quality", "80"], "quality 80 (expected 95)", {"shard_complete", "fidelity"}),
        (["--output-format", "jpeg"], 'output_format "jpeg" (expected "webp")', {"shard_complete", "sample_images"}),
        (["--patch-size", "16"], "patch_size 16 (expected 32)", {"shard_complete", "sample_images", "fidelity"}),
    ],
    ids=["quality", "format", "patch_size"],
)
@pytest.mark.heavy
def test_verify_resized_expects_its_own_flags_not_what_the_footers_say(
    sample_main, tmp_path, capsys, flags, words, failed
):
    """The expected settings are the command's flags, defaults as the build's (WebP q95, patch 32, ...): a
    dataset built otherwise fails, naming the setting, until it is verified with the flags it was built with.
    A patch-16 build verified as patch 32 fails its sampled images too."""
    from fixed_res_sidecar.cli.common import add_pixel_flags, pixel_options
    from fixed_res_sidecar_tests.fixtures.datasets import build_all, resized_outputs

    outputs = resized_outputs(tmp_path / "out")
    build_parser = argparse.ArgumentParser()
    add_pixel_flags(build_parser)
    build_all(sample_main, outputs, pixel_options(build_parser.parse_args(flags)))
    paths = {"main": Path(sample_main.path), "512": Path(outputs[0].location.path)}
    assert run(*resized_args(paths, "512")) == 1
    out = capsys.readouterr().out
    assert "shards: 3 checked, 0 passed, 3 failed" in out and words in out
    assert {line.split()[1] for line in out.splitlines() if line.startswith("FAILED ")} == failed
    assert run(*resized_args(paths, "512", *flags)) == 0, capsys.readouterr().out


def test_one_row_stored_as_jpeg_in_a_webp_shard_fails_verify_resized(sidecar_build, paths, capsys):
    """Reported: `verify-resized --sample all --fidelity-sample all` exited 0 on a WebP shard with one row
    re-encoded as JPEG q95 (footer untouched)."""
    from fixed_res_sidecar_tests.fixtures.datasets import column, first_row
    from fixed_res_sidecar_tests.shards.verify.test_resized import forge_shard, reencoded

    row = first_row(sidecar_build.r512, REL, "0_26mp_process_valid", True)
    forge_shard(sidecar_build.r512, REL, reencoded("JPEG", 95), rows={row})
    assert run(*resized_args(paths, "512", "--sample", "all", "--fidelity-sample", "all")) == 1
    out = capsys.readouterr().out
    key = column(sidecar_build.r512, REL, "image_key")[row]
    assert (
        f"FAILED sample_images on {REL}: {paths['512'] / REL}: 1 of 8 sampled images failed; row {row} ({key!r})" in out
    )
    assert "stored as JPEG, the expected output format is WEBP" in out and "2 passed, 1 failed" in out
