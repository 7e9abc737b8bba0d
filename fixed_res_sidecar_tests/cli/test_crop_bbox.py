"""`build-crop-bbox` on the command line: all shards, progress, summary, exit status."""

import argparse
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.cli import crop_bbox
from fixed_res_sidecar.cli.common import STORAGE_FAILED
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.settings import SETTINGS_KEY
from fixed_res_sidecar_tests.fixtures.faulty_s3 import copy_files, every_object_get
from fixed_res_sidecar_tests.fixtures.permissions import permission_checks_enforced, unreadable


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sidecar-ops")
    crop_bbox.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["build-crop-bbox", *argv])
    return args.func(args)


def cli_args(main, out_512, out_1024, output, *extra) -> list[str]:
    return [
        "--main-prefix", main.uri,
        "--resized-512-prefix", out_512.location.uri,
        "--resized-1024-prefix", out_1024.location.uri,
        "--output-prefix", str(output),
        "--key-column", "image_key",
        "--threads", "2",
        *extra,
    ]  # fmt: skip


@pytest.mark.heavy
def test_builds_every_shard_with_progress_and_summary(sample_build, tmp_path, capsys):
    main, (out_512, out_1024) = sample_build
    output = tmp_path / "sidecar"
    assert run_cli(cli_args(main, out_512, out_1024, output)) == 0
    captured = capsys.readouterr()
    shards = main.list_shards()
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert len(progress) == len(shards)
    assert all("built (10 rows" in line for line in progress)
    assert f"crop-bbox shards: {len(shards)} total, {len(shards)} built, 0 skipped, 0 failed (30 rows" in captured.out
    assert "captions (built shards): ok 28, missing 2, invalid_json 0" in captured.out
    for rel in shards:
        assert pq.read_metadata(output / rel).num_rows == 10

    # Again with --skip-existing: nothing to do.
    assert run_cli(cli_args(main, out_512, out_1024, output, "--skip-existing")) == 0
    assert f"0 built, {len(shards)} skipped, 0 failed" in capsys.readouterr().out


@pytest.mark.heavy
def test_a_sidecar_folder_linked_into_main_or_captions_never_gets_written(sample_build, tmp_path, capsys):
    from fixed_res_sidecar_tests.fixtures.datasets import tree_snapshot

    main, (out_512, out_1024) = sample_build
    output = tmp_path / "sidecar"
    (output / "nested").mkdir(parents=True)
    (output / "nested" / "a").symlink_to(Path(main.path) / "nested" / "a")
    (output / "part-00000.parquet").symlink_to(Path(main.path) / "part-00000.parquet")
    before = tree_snapshot(main.path)
    assert run_cli(cli_args(main, out_512, out_1024, output)) == 1
    out = capsys.readouterr().out
    assert "2 failed" in out and out.count("refusing to write") == 2
    assert tree_snapshot(main.path) == before


def test_a_failing_shard_does_not_stop_the_others(sample_build, tmp_path, capsys):
    main, (out_512, out_1024) = sample_build
    shards = main.list_shards()
    broken = shards[1]
    os.remove(out_512.location.child(broken))
    output = tmp_path / "sidecar"
    assert run_cli(cli_args(main, out_512, out_1024, output)) == 1
    out = capsys.readouterr().out
    assert f"{len(shards) - 1} built, 0 skipped, 1 failed" in out
    assert f"FAILED {broken}: ShardError: resized 512 shard" in out
    written = sorted(p.relative_to(output).as_posix() for p in output.rglob("*.parquet"))
    assert written == [rel for rel in shards if rel != broken]


def test_a_main_folder_that_cannot_be_listed_fails_the_command_naming_it(sample_build, tmp_path, capsys):
    """Reported: a main subfolder that could not be listed was skipped, and the command exited 0."""
    main, (out_512, out_1024) = sample_build
    folder = Path(main.path) / "nested"
    output = tmp_path / "sidecar"
    with unreadable(folder), permission_checks_enforced():
        assert run_cli(cli_args(main, out_512, out_1024, output)) == STORAGE_FAILED
    err = capsys.readouterr().err
    assert f"storage failed listing {folder} " in err and "Permission denied" in err
    assert not output.exists()


@pytest.mark.heavy
def test_options_reach_the_job(sample_build, tmp_path):
    main, (out_512, out_1024) = sample_build
    output = tmp_path / "sidecar"
    extra = ["--caption-frame", "raw", "--bbox-key", "bbox", "--audit-prefix-512", "0_26mp_process"]
    assert run_cli(cli_args(main, out_512, out_1024, output, *extra)) == 0
    settings = json.loads(pq.read_schema(output / main.list_shards()[0]).metadata[SETTINGS_KEY])
    assert settings["caption_frame"] == "raw"
    assert settings["bbox_keys"] == ["bbox"]
    assert settings["caption_column"] == "structured_description"


def test_bad_configuration_does_no_work(sample_build, tmp_path, capsys):
    main, (out_512, out_1024) = sample_build
    inside_main = Path(main.path, "sidecar")
    assert run_cli(cli_args(main, out_512, out_1024, inside_main)) == 2
    assert "read-only" in capsys.readouterr().err
    assert not inside_main.exists()

    assert run_cli(cli_args(main, out_512, out_1024, out_1024.location.uri)) == 2
    assert "resized_1024 output" in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    args = cli_args(main, out_512, out_1024, tmp_path / "sidecar")
    args[args.index("--main-prefix") + 1] = str(empty)
    assert run_cli(args) == 2
    assert "no *.parquet shards" in capsys.readouterr().err


@pytest.mark.heavy
def test_through_the_sidecar_ops_dispatcher(sample_build, tmp_path, capsys):
    from fixed_res_sidecar.cli import main as sidecar_ops

    main, (out_512, out_1024) = sample_build
    assert sidecar_ops(["build-crop-bbox", *cli_args(main, out_512, out_1024, tmp_path / "sidecar")]) == 0
    assert "0 failed" in capsys.readouterr().out


def replace_image(location, rel: str, row_of, value) -> int:
    """Set the image of the row `row_of(table)` picks in a resized shard (a damaged copy for a test)."""
    path = location.child(rel)
    table = pq.read_table(path)
    row = row_of(table)
    images = table.column("image").to_pylist()
    images[row] = value
    index = table.schema.get_field_index("image")
    pq.write_table(
        table.set_column(index, table.schema.field(index), pa.array(images, table.schema.field(index).type)), path
    )
    return row


def first_valid(prefix: str):
    return lambda table: table.column(f"{prefix}_valid").to_pylist().index(True)


@pytest.mark.heavy
def test_gate_a_resized_shard_that_fails_the_verifier_fails_only_its_shard(sample_build, tmp_path, capsys):
    main, (out_512, out_1024) = sample_build
    shards = main.list_shards()
    damaged = shards[2]
    row = replace_image(out_1024.location, damaged, first_valid("1_05mp_process"), None)  # a valid row without image
    output = tmp_path / "sidecar"
    assert run_cli(cli_args(main, out_512, out_1024, output)) == 1
    out = capsys.readouterr().out
    assert f"{len(shards) - 1} built, 0 skipped, 1 failed" in out
    failure = next(line for line in out.splitlines() if line.startswith(f"  FAILED {damaged}:"))
    assert f"GateError: resized 1024 shard {out_1024.location.child(damaged)} did not pass the verifier" in failure
    assert "audit_consistent" in failure and f"row {row}" in failure and "valid row has no image" in failure
    assert "resized 512 shard" not in failure  # the 512 shard passed
    written = sorted(p.relative_to(output).as_posix() for p in output.rglob("*.parquet"))
    assert written == [rel for rel in shards if rel != damaged]


@pytest.mark.heavy
def test_gate_decodes_verify_sample_images(sample_build, tmp_path, capsys):
    main, (out_512, out_1024) = sample_build
    shards = main.list_shards()
    damaged = shards[0]
    replace_image(out_512.location, damaged, first_valid("0_26mp_process"), b"not an image")
    output = tmp_path / "sidecar"
    assert run_cli(cli_args(main, out_512, out_1024, output)) == 1
    out = capsys.readouterr().out
    assert f"FAILED {damaged}: GateError: resized 512 shard" in out and "sample_images" in out
    # With no images decoded the gate checks rows, keys and audit only, and this shard passes.
    assert run_cli(cli_args(main, out_512, out_1024, output, "--verify-sample", "0", "--skip-existing")) == 0
    assert "1 built, 2 skipped, 0 failed" in capsys.readouterr().out


@pytest.mark.heavy
def test_gate_uses_the_patch_size_and_square_given(sample_build, tmp_path, capsys):
    main, (out_512, out_1024) = sample_build
    output = tmp_path / "sidecar"
    # The sample build is not square: checked as square, every shard's sampled images fail.
    assert run_cli(cli_args(main, out_512, out_1024, output, "--square")) == 1
    out = capsys.readouterr().out
    assert "0 built, 0 skipped, 3 failed" in out and "sample_images" in out
    assert not output.exists()


def test_gate_options_are_checked_first(sample_build, tmp_path, capsys):
    main, (out_512, out_1024) = sample_build
    assert run_cli(cli_args(main, out_512, out_1024, tmp_path / "sidecar", "--verify-sample", "-1")) == 2
    assert "--verify-sample must be at least 0" in capsys.readouterr().err
    assert not (tmp_path / "sidecar").exists()


def test_storage_that_keeps_failing_fails_the_shard_not_the_gate(
    sample_build, faulty_s3, fast_retries, s3_bucket, capsys
):
    """Storage failing after the retries is not a verifier failure: each shard fails naming the
    object that could not be read, nothing is written, and the run can be repeated."""
    main, (out_512, out_1024) = sample_build
    roots = {name: Location.parse(f"s3://{s3_bucket}/lake/{name}") for name in ("main", "512", "1024", "sidecar")}
    for name, location in (("main", main), ("512", out_512.location), ("1024", out_1024.location)):
        copy_files(location, roots[name])
    faulty_s3.inject(every_object_get)
    prefixes = {"main-prefix": "main", "resized-512-prefix": "512", "resized-1024-prefix": "1024"}
    args = [part for flag, name in prefixes.items() for part in (f"--{flag}", roots[name].uri)]
    assert run_cli([*args, "--output-prefix", roots["sidecar"].uri, "--key-column", "image_key"]) == 1
    out = capsys.readouterr().out
    for rel in main.list_shards():
        assert f"FAILED {rel}: StorageError: storage failed reading s3://{s3_bucket}/lake/" in out
    assert "did not pass the verifier" not in out and "0 built, 0 skipped, 3 failed" in out
    assert roots["sidecar"].list_shards() == []
