"""The real `sidecar-ops` console script, as a user runs it."""

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fixed_res_sidecar.cli import make_parser
from fixed_res_sidecar.cli.build import format_summary
from fixed_res_sidecar.core.pixel_settings import OUTPUT_FORMATS, SETTING_BOUNDS
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.s3 import s3_client
from fixed_res_sidecar.sample_data import sample_shard_table, write_sample_dataset
from fixed_res_sidecar.shards.runner import RunSummary
from fixed_res_sidecar.shards.verify.report import sample_rows
from fixed_res_sidecar_tests.fixtures.datasets import (
    SHARDS,
    SLOW_ROWS,
    SLOW_SHARDS,
    damage_value,
    recrawl_main_shard,
    tree_snapshot,
)
from fixed_res_sidecar_tests.fixtures.permissions import WITHOUT_PERMISSION_OVERRIDE, unreadable
from fixed_res_sidecar_tests.fixtures.pixels import bound_edges
from fixed_res_sidecar_tests.fixtures.processes import pool_workers, read_to_eof, resume, started, wait_until_gone
from fixed_res_sidecar_tests.fixtures.slow_link import slow_uplink

SIDECAR_OPS = [sys.executable, "-m", "fixed_res_sidecar.cli"]


def sidecar_ops(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*SIDECAR_OPS, *args], capture_output=True, text=True, timeout=timeout)


def test_the_documented_command_builds_every_shard(sample_main, tmp_path):
    out = tmp_path / "0_262mp_version_all_in_one" / "sample"
    # The command data teams run today, minus --use-ray (covered by the Ray tests).
    args = [
        "build-0-262mp", "--main-prefix", sample_main.uri, "--output-prefix", str(out),
        "--key-column", "image_key", "--audit-prefix", "0_26mp_process", "--patch-size", "32",
        "--skip-existing", "--max-inflight", "32", "--task-cpus", "1", "--task-memory-gb", "12",
        "--threads-per-shard", "2", "--output-format", "webp", "--quality", "95",
    ]  # fmt: skip
    first = sidecar_ops(*args)
    assert first.returncode == 0, first.stderr
    assert Location.parse(out).list_shards() == sorted(SHARDS)
    assert "shards: 3 total, 3 built, 0 skipped, 0 failed (30 rows" in first.stdout
    assert "0_26mp_process (built shards): valid" in first.stdout and "missing_image" in first.stdout
    assert "[3/3 shards, 0 failed" in first.stderr
    second = sidecar_ops(*args)
    assert second.returncode == 0 and "3 total, 0 built, 3 skipped" in second.stdout


def test_fused_command_builds_both_resolutions(sample_main, tmp_path):
    result = sidecar_ops(
        "build-both", "--main-prefix", sample_main.uri,
        "--output-prefix-512", str(tmp_path / "512"), "--output-prefix-1024", str(tmp_path / "1024"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for folder in ("512", "1024"):
        assert Location.parse(tmp_path / folder).list_shards() == sorted(SHARDS)
    table = pq.read_table(tmp_path / "1024" / SHARDS[0])
    assert "1_05mp_process_valid" in table.column_names


def test_a_broken_shard_fails_alone_and_is_named(sample_main, tmp_path):
    sample_main.write_bytes("zz/broken.parquet", b"PAR1 but not really")
    out = tmp_path / "out"
    result = sidecar_ops("build-1-05mp", "--main-prefix", sample_main.uri, "--output-prefix", str(out))
    assert result.returncode == 1
    assert "FAILED zz/broken.parquet" in result.stdout and "not a readable Parquet file" in result.stdout
    assert Location.parse(out).list_shards() == sorted(SHARDS)


def test_a_main_prefix_that_is_a_file_is_a_usage_error_naming_it(sample_main, tmp_path):
    shard = Path(sample_main.child(SHARDS[0]))
    result = sidecar_ops("build-0-262mp", "--main-prefix", str(shard), "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr  # not 3: rerunning would not help
    assert f"sidecar-ops: error: {shard} is a file, not a folder of shards" in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_output_folder_linked_into_main_never_gets_written(sample_main, tmp_path):
    # out512/nested -> main/nested: the prefixes do not overlap, the real paths do.
    out_512 = tmp_path / "512"
    out_512.mkdir()
    (out_512 / "nested").symlink_to(Path(sample_main.path) / "nested")
    (tmp_path / "1024").mkdir()
    (tmp_path / "1024" / "part-00000.parquet").symlink_to(Path(sample_main.path) / "part-00000.parquet")
    before = tree_snapshot(sample_main.path)
    result = sidecar_ops(
        "build-both", "--main-prefix", sample_main.uri,
        "--output-prefix-512", str(out_512), "--output-prefix-1024", str(tmp_path / "1024"),
    )  # fmt: skip
    assert result.returncode == 1
    assert tree_snapshot(sample_main.path) == before
    assert "3 total, 0 built, 0 skipped, 3 failed" in result.stdout
    for rel in SHARDS:
        assert f"FAILED {rel}: LocationError: refusing to write" in result.stdout
    assert "read-only" in result.stdout


def test_symlinks_in_main_are_not_followed_and_are_reported(sample_main, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    write_sample_dataset(elsewhere, shards=["x.parquet"], rows_per_shard=2)
    (Path(sample_main.path) / "linked").symlink_to(elsewhere)
    (Path(sample_main.path) / "linked-x.parquet").symlink_to(elsewhere / "x.parquet")
    result = sidecar_ops("build-0-262mp", "--main-prefix", sample_main.uri, "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "3 total, 3 built" in result.stdout
    assert "skipped 2 symbolic link(s) in the main dataset" in result.stdout
    assert (
        f"linked -> {elsewhere}" in result.stdout and f"linked-x.parquet -> {elsewhere / 'x.parquet'}" in result.stdout
    )
    assert Location.parse(tmp_path / "out").list_shards() == sorted(SHARDS)


def test_a_main_folder_that_cannot_be_listed_fails_the_build_naming_it(sample_main, tmp_path):
    """Reported: a main subfolder that could not be listed was skipped, and the build exited 0."""
    folder = Path(sample_main.path) / "nested"
    out = tmp_path / "out"
    args = ["build-1-05mp", "--main-prefix", sample_main.uri, "--output-prefix", str(out)]
    with unreadable(folder):  # run as an operator's account would: file permissions apply
        result = subprocess.run(
            [*WITHOUT_PERMISSION_OVERRIDE, *SIDECAR_OPS, *args], capture_output=True, text=True, timeout=240
        )
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"storage failed listing {folder} " in result.stderr and "Permission denied" in result.stderr
    assert not out.exists()  # refused before any shard was built


def test_bad_configuration_is_refused_before_any_work(sample_main, tmp_path):
    out = tmp_path / "out"
    cases = [
        (["--output-prefix", str(out), "--quality", "101"], "quality"),
        (["--output-prefix", str(out), "--webp-method", "9"], "method"),
        (["--output-prefix", str(out), "--max-inflight", "0"], "--max-inflight"),
        (["--output-prefix", sample_main.uri], "read-only"),
        (["--output-prefix", str(Path(sample_main.path) / "derived")], "read-only"),
        (["--output-prefix", str(Path(sample_main.path).parent)], "read-only"),
    ]
    before = sorted(p for p in Path(sample_main.path).rglob("*"))
    for extra, message in cases:
        result = sidecar_ops("build-0-262mp", "--main-prefix", sample_main.uri, *extra)
        assert result.returncode == 2, (extra, result.stderr)
        assert message in result.stderr
    assert not out.exists()
    assert sorted(p for p in Path(sample_main.path).rglob("*")) == before


def _build_command(command: str) -> argparse.ArgumentParser:
    subcommands = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices[command]


REQUIRED = {
    "build-0-262mp": ["--main-prefix", "/m", "--output-prefix", "/a"],
    "build-1-05mp": ["--main-prefix", "/m", "--output-prefix", "/a"],
    "build-both": ["--main-prefix", "/m", "--output-prefix-512", "/a", "--output-prefix-1024", "/b"],
    # The verifiers take the same flags: the settings the dataset is expected to have been built with.
    "verify-resized": ["--main-prefix", "/m", "--output-prefix", "/a", "--key-column", "k", "--audit-prefix", "p"],
    "build-crop-bbox": ["--main-prefix", "/m", "--resized-512-prefix", "/a", "--resized-1024-prefix", "/b",
                        "--output-prefix", "/c", "--key-column", "k"],
}  # fmt: skip


@pytest.mark.parametrize("command", list(REQUIRED))
def test_pixel_flags_refuse_exactly_the_cores_bounds(command, capsys):
    """The flags' limits and formats are core.pixel_settings's, as the datasets file's are (test_config.py)."""
    parser = _build_command(command)
    required = REQUIRED[command]
    for name, bound in SETTING_BOUNDS.items():
        flag = "--" + name.replace("_", "-")
        inside, outside = bound_edges(bound)
        for value in inside:
            assert getattr(parser.parse_args([*required, flag, str(value)]), name) == value
        for value in outside:
            with pytest.raises(SystemExit) as exited:
                parser.parse_args([*required, flag, str(value)])
            assert exited.value.code == 2
            assert f"argument {flag}: must be {bound.description}, got '{value}'" in capsys.readouterr().err
    (output_format,) = [a for a in parser._actions if a.dest == "output_format"]
    assert list(output_format.choices) == list(OUTPUT_FORMATS)


def test_every_commands_patch_size_is_held_to_the_cores_bound():
    subcommands = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    inside, outside = bound_edges(SETTING_BOUNDS["patch_size"])
    commands = []
    for command, parser in subcommands.choices.items():
        for action in parser._actions:
            if action.dest == "patch_size":
                commands.append(command)
                assert [action.type(str(value)) for value in inside] == inside
                for value in outside:
                    with pytest.raises(argparse.ArgumentTypeError, match="an integer in 1..4096"):
                        action.type(str(value))
    assert {"build-both", "verify-resized", "build-crop-bbox"} <= set(commands)


def test_a_patch_size_of_4097_is_refused_before_any_work(sample_main, tmp_path):
    out = tmp_path / "out"
    args = ["--main-prefix", sample_main.uri, "--output-prefix", str(out)]
    result = sidecar_ops("build-0-262mp", *args, "--patch-size", "4097")
    assert result.returncode == 2, result.stderr
    assert "argument --patch-size: must be an integer in 1..4096, got '4097'" in result.stderr
    assert not out.exists()


@pytest.mark.stress
def test_killed_mid_shard_leaves_no_output_and_rerun_completes(tmp_path):
    main = Location.parse(tmp_path / "main")
    # 64 big photos (4.3 MP), four drawn and repeated: what keeps the shard busy is decoding and encoding
    # them, not how many pictures differ (drawing all 64 took 14 CPU-s, more than the build).
    pictures = sample_shard_table(0, 4, sizes=((2400, 1800), (1800, 2400)), bad_rows=False)
    table = pa.concat_tables([pictures] * 16).set_column(0, "image_key", pa.array([f"big-{i:05d}" for i in range(64)]))
    Path(main.path).mkdir()
    pq.write_table(table, Path(main.path) / "big.parquet", row_group_size=16)
    out = tmp_path / "out"
    # WebP effort 0: the shard still takes seconds (what the kill needs); the rerun half the CPU.
    args = ["build-1-05mp", "--main-prefix", main.uri, "--output-prefix", str(out), "--skip-existing",
            "--webp-method", "0"]  # fmt: skip
    process = subprocess.Popen([*SIDECAR_OPS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(out.glob(".big.parquet.*.tmp")):  # the shard is being written
        assert process.poll() is None and time.monotonic() < deadline, "build ended before it could be killed"
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (out / "big.parquet").exists()
    left = _temporaries(out)
    assert left  # a killed writer cannot remove its temporary...
    rerun = sidecar_ops(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert pq.ParquetFile(out / "big.parquet").metadata.num_rows == 64
    assert _temporaries(out) == []  # ...the next run does
    assert f"removed {len(left)} leftover(s) of interrupted runs" in rerun.stderr


def test_summary_lists_failures_and_error_codes():
    assert "1 failed" in format_summary(RunSummary(failures={"x.parquet": "boom"}))
    assert "FAILED x.parquet: boom" in format_summary(RunSummary(failures={"x.parquet": "boom"}))


def test_skip_existing_rebuilds_a_damaged_shard_and_only_it(sample_build):
    """One image's bytes altered in a built 1024 shard, footer intact: verify-resized fails naming
    the shard, `--skip-existing` rebuilds that output only, and it verifies clean again."""
    main, (out_512, out_1024) = sample_build
    rel = "nested/a/part-00001.parquet"
    damaged = Path(out_1024.location.child(rel))
    intact = damaged.read_bytes()
    others = {path: (path.read_bytes(), path.stat().st_mtime_ns) for o in (out_512, out_1024)
              for path in Path(o.location.path).rglob("*.parquet") if path != damaged}  # fmt: skip
    table = pq.read_table(damaged, columns=["image", f"{out_1024.audit_prefix}_valid"])
    valid = [row for row, flag in enumerate(table.column(1).to_pylist()) if flag]
    row = next(r for r in valid if r not in sample_rows(valid, 1, rel))  # a row the image sample misses
    damage_value(damaged, table.column("image")[row].as_py())
    verify = ["verify-resized", "--main-prefix", main.uri, "--output-prefix", out_1024.location.uri,
              "--key-column", "image_key", "--audit-prefix", out_1024.audit_prefix, "--sample", "1"]  # fmt: skip

    failed = sidecar_ops(*verify)
    assert failed.returncode == 1
    assert f"FAILED shard_complete on {rel}: {damaged}: column 'image' in row group 0" in failed.stdout

    result = sidecar_ops(
        "build-both", "--main-prefix", main.uri, "--skip-existing",
        "--output-prefix-512", out_512.location.uri, "--output-prefix-1024", out_1024.location.uri,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "shards: 3 total, 1 built, 2 skipped, 0 failed" in result.stdout
    assert f"{rel}: skipped 0_26mp_process, built 1_05mp_process" in result.stderr
    assert damaged.read_bytes() == intact  # the build is deterministic
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in others} == others
    assert sidecar_ops(*verify).returncode == 0


@pytest.mark.stress
def test_skip_existing_rebuilds_what_main_changed_and_the_verifiers_call_the_old_outputs_stale(sidecar_build):
    """A main shard re-crawled (other images, same keys, captions and row count): both verifiers
    fail its outputs as stale, naming the shard; `--skip-existing` rebuilds that shard's outputs
    and only them, saying why; then everything verifies."""
    build = sidecar_build
    rel = "nested/a/part-00001.parquet"
    outputs = {"512": build.r512, "1024": build.r1024, "sidecar": build.sidecar}
    before = {name: tree_snapshot(location.path) for name, location in outputs.items()}
    recrawl_main_shard(build.main, rel)
    common = ["--main-prefix", build.main.uri, "--key-column", "image_key"]
    resized = [*common, "--resized-512-prefix", build.r512.uri, "--resized-1024-prefix", build.r1024.uri]
    verify = {
        resolution: ["verify-resized", *common, "--output-prefix", build.resized(resolution).uri,
                     "--audit-prefix", build.prefixes[resolution]]
        for resolution in ("512", "1024")
    }  # fmt: skip
    verify["sidecar"] = ["verify-crop-bbox", *resized, "--sidecar-prefix", build.sidecar.uri]

    for name, args in verify.items():
        failed = sidecar_ops(*args)
        assert failed.returncode == 1, (name, failed.stdout)
        stale = [line for line in failed.stdout.splitlines() if "is stale" in line]
        assert len(stale) == 1 and f"on {rel}: " in stale[0], (name, failed.stdout)
        assert "built from another version of main" in stale[0]

    rebuilt = sidecar_ops(
        "build-both", "--main-prefix", build.main.uri, "--skip-existing",
        "--output-prefix-512", build.r512.uri, "--output-prefix-1024", build.r1024.uri,
    )  # fmt: skip
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "shards: 3 total, 1 built, 2 skipped, 0 failed" in rebuilt.stdout
    assert "rebuilt outputs: 2 main changed" in rebuilt.stdout
    assert "rebuilt because main changed: 1 shard(s)" in rebuilt.stdout
    # The sidecar was made from the old resized shards too: still stale until it is rebuilt.
    assert sidecar_ops(*verify["sidecar"]).returncode == 1
    cropped = sidecar_ops("build-crop-bbox", *resized, "--output-prefix", build.sidecar.uri, "--skip-existing")
    assert cropped.returncode == 0, cropped.stderr
    assert "crop-bbox shards: 3 total, 1 built, 2 skipped, 0 failed" in cropped.stdout
    assert "rebuilt because their sources changed: 1 shard(s)" in cropped.stdout

    for name, location in outputs.items():  # that shard, and only it, was written again
        after = tree_snapshot(location.path)
        assert {k for k in after if after[k] != before[name].get(k)} == {rel}, name
    for name, args in verify.items():
        passed = sidecar_ops(*args)
        assert passed.returncode == 0, (name, passed.stdout)


# -- stopping: a killed or terminated command leaves no process, temporary, upload or partial shard --


def _build_both_args(main: Location, out: str) -> list[str]:
    """WebP effort 0 (the encoder's fastest): these tests are about processes, signals, temporaries and
    uploads, not the encoder; at effort 4 a build of the slow shards took 1.9x the CPU."""
    return ["build-both", "--main-prefix", main.uri, "--output-prefix-512", f"{out}/512",
            "--output-prefix-1024", f"{out}/1024", "--max-inflight", "2", "--skip-existing",
            "--webp-method", "0"]  # fmt: skip


def _temporaries(out: Path) -> list[Path]:
    return list(out.rglob(".*.tmp"))


def _shard_rows(out: str, rels) -> dict[str, int | None]:
    """resolution/rel -> rows of each final output shard, None where there is none."""
    rows = {}
    for folder in ("512", "1024"):
        location = Location.parse(f"{out}/{folder}")
        for rel in rels:
            rows[f"{folder}/{rel}"] = location.parquet_file(rel).metadata.num_rows if location.exists(rel) else None
    return rows


def _assert_whole_or_absent(out: str, rels, rows: int) -> dict[str, int | None]:
    found = _shard_rows(out, rels)
    assert set(found.values()) <= {None, rows}, found  # never a partial shard at a final name
    return found


def _assert_rerun_completes(args: list[str], out: str, rels, rows: int, env=None) -> subprocess.CompletedProcess:
    rerun = subprocess.run([*SIDECAR_OPS, *args], capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr
    assert set(_shard_rows(out, rels).values()) == {rows}  # every shard, every row: none lost
    return rerun


@pytest.mark.stress
def test_workers_exit_when_the_parent_is_killed(slow_main, tmp_path):
    out = tmp_path / "out"
    args = _build_both_args(slow_main, str(out))
    with started([*SIDECAR_OPS, *args], lambda: _temporaries(out)) as (process, procs):
        os.kill(process.pid, signal.SIGKILL)  # the parent alone, as the OOM killer or a supervisor does
        process.wait()
        seconds = wait_until_gone(procs, timeout=30)
        assert read_to_eof(process.stdout, timeout=30) is not None, "a caller reading stdout never gets EOF"
    print(f"\n{len(procs)} processes under the killed parent, all gone {seconds:.2f} s after its death")
    assert _temporaries(out) == []  # the workers unwound their shards
    print(f"shards present after the kill: {_assert_whole_or_absent(str(out), SLOW_SHARDS, SLOW_ROWS)}")
    _assert_rerun_completes(args, str(out), SLOW_SHARDS, SLOW_ROWS)


@pytest.mark.stress
def test_sigterm_stops_the_workers_and_exits_143(slow_main, tmp_path):
    out = tmp_path / "out"
    args = _build_both_args(slow_main, str(out))
    # Held mid-shard while the signal is sent: it cannot finish first, however slow this test's look.
    with started([*SIDECAR_OPS, *args], lambda: _temporaries(out), paused=True) as (process, procs):
        os.kill(process.pid, signal.SIGTERM)  # the parent alone, as Kubernetes and Ray do
        stopping = time.monotonic()
        resume(process)
        _, stderr = process.communicate(timeout=60)
        seconds = time.monotonic() - stopping
        assert process.returncode == 143, stderr.decode()
        assert "terminated (SIGTERM)" in stderr.decode()
        assert not [p for p in pool_workers(procs) if p.running]  # stopped before the command exited
        wait_until_gone(procs, timeout=30)  # and the resource tracker follows its parent
    print(f"\nSIGTERM: exit 143 after {seconds:.2f} s")
    assert _temporaries(out) == []
    _assert_whole_or_absent(str(out), SLOW_SHARDS, SLOW_ROWS)
    _assert_rerun_completes(args, str(out), SLOW_SHARDS, SLOW_ROWS)


@pytest.mark.stress
def test_ctrl_c_stops_everything_and_exits_130(slow_main, tmp_path):
    out = tmp_path / "out"
    args = _build_both_args(slow_main, str(out))
    # SIGINT as a terminal gives it (even to a pytest started by a script in the background, which
    # inherits it ignored), and the build held mid-shard while it is sent: it cannot finish first.
    with started([*SIDECAR_OPS, *args], lambda: _temporaries(out), paused=True) as (process, procs):
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        resume(process)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr.decode()
        assert not [p for p in pool_workers(procs) if p.running]
        wait_until_gone(procs, timeout=30)
    assert _temporaries(out) == []
    _assert_whole_or_absent(str(out), SLOW_SHARDS, SLOW_ROWS)
    _assert_rerun_completes(args, str(out), SLOW_SHARDS, SLOW_ROWS)


# On S3: shards big enough for a multipart upload, sent through a slow link so the upload is open for seconds.
NOISE_SHARDS = ["n-0.parquet", "n-1.parquet"]
NOISE_ROWS = 14  # about 11 MB of 1024-area WebP per shard


def _noise_main(tmp_path) -> Location:
    main = Location.parse(tmp_path / "main")
    images = []
    for _ in range(NOISE_ROWS):
        data = io.BytesIO()
        Image.effect_noise((1280, 1024), 80).convert("RGB").save(data, "JPEG", quality=90)
        images.append(data.getvalue())
    table = pa.table({"image_key": [f"k{i}" for i in range(NOISE_ROWS)], "image": pa.array(images, pa.binary())})
    Path(main.path).mkdir(parents=True)
    for rel in NOISE_SHARDS:
        pq.write_table(table, Path(main.path, rel), row_group_size=4)
    return main


def _uploads(bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


@dataclass
class S3Build:
    args: list[str]  # a build of big shards to S3
    out: str
    tmpdir: Path  # the build's TMPDIR
    env: dict[str, str]  # straight to the S3 server
    slow_env: dict[str, str]  # through a slow uplink (2 MB/s per connection): uploads stay open for seconds


@pytest.fixture
def s3_build(s3_bucket, s3_server, tmp_path):
    out = f"s3://{s3_bucket}/derived"
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    with slow_uplink(s3_server, 2_000_000) as slow_endpoint:
        args = _build_both_args(_noise_main(tmp_path), out)  # the slow uplink keeps the uploads open
        yield S3Build(args, out, tmpdir, env, {**env, "AWS_ENDPOINT_URL": slow_endpoint})


@pytest.mark.stress
def test_a_killed_s3_build_leaves_uploads_and_staging_folders_that_the_next_run_removes(s3_build, s3_bucket):
    build = s3_build
    with started([*SIDECAR_OPS, *build.args], lambda: _uploads(s3_bucket), build.slow_env) as (process, procs):
        os.killpg(process.pid, signal.SIGKILL)  # everything at once: nothing can clean up
        process.wait()
        wait_until_gone(procs, timeout=30)
    left_uploads, left_folders = _uploads(s3_bucket), list(build.tmpdir.glob("sidecar-*"))
    assert left_uploads and left_folders  # what a kill leaves
    _assert_whole_or_absent(build.out, NOISE_SHARDS, NOISE_ROWS)
    rerun = _assert_rerun_completes(build.args, build.out, NOISE_SHARDS, NOISE_ROWS, build.env)
    assert _uploads(s3_bucket) == [] and list(build.tmpdir.iterdir()) == []
    assert "leftover(s) of interrupted runs" in rerun.stderr and "incomplete upload" in rerun.stderr
    print(f"\nkilled: {len(left_uploads)} uploads, {len(left_folders)} staging folders left; after the rerun: 0, 0")


@pytest.mark.stress
def test_sigterm_during_s3_uploads_aborts_them_and_leaves_nothing(s3_build, s3_bucket):
    build = s3_build
    with started([*SIDECAR_OPS, *build.args], lambda: _uploads(s3_bucket), build.slow_env) as (process, procs):
        os.kill(process.pid, signal.SIGTERM)  # while an upload is open
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 143, stderr.decode()
        wait_until_gone(procs, timeout=30)
    assert _uploads(s3_bucket) == [] and list(build.tmpdir.iterdir()) == []
    _assert_whole_or_absent(build.out, NOISE_SHARDS, NOISE_ROWS)
    _assert_rerun_completes(build.args, build.out, NOISE_SHARDS, NOISE_ROWS, build.env)


@pytest.mark.stress
def test_rebuild_failed_repairs_the_shards_a_verifier_report_failed(sample_main, tmp_path):
    """--skip-existing keeps a shard whose pictures are wrong (its footer is fine); --rebuild-failed with
    the verifier's report rebuilds it, and only while the failed object is still there."""
    from fixed_res_sidecar_tests.fixtures.datasets import DAMAGED_REL, damage_resized_images, valid_rows

    out = {r: tmp_path / r for r in ("512", "1024")}
    build = ["build-both", "--main-prefix", sample_main.uri, "--skip-existing",
             "--output-prefix-512", str(out["512"]), "--output-prefix-1024", str(out["1024"])]  # fmt: skip
    assert sidecar_ops(*build).returncode == 0
    r512 = Location.parse(out["512"])
    rows = valid_rows(r512, DAMAGED_REL, "0_26mp_process")[:3]
    damages = dict(zip(rows, ["rotated_180", "channels_reversed", "black"]))
    damage_resized_images(r512, Location.parse(out["1024"]), "0_26mp_process", damages, DAMAGED_REL)
    report = tmp_path / "verify-512.json"
    verify = ["verify-resized", "--main-prefix", sample_main.uri, "--output-prefix", str(out["512"]),
              "--key-column", "image_key", "--audit-prefix", "0_26mp_process", "--report", str(report)]  # fmt: skip
    assert sidecar_ops(*verify).returncode == 1
    assert "3 total, 0 built, 3 skipped" in sidecar_ops(*build).stdout  # skip-existing alone keeps it

    repaired = sidecar_ops(*build, "--rebuild-failed", str(report))
    assert repaired.returncode == 0, repaired.stderr
    assert (
        "3 total, 1 built, 2 skipped" in repaired.stdout and "rebuilt outputs: 1 failed verification" in repaired.stdout
    )
    assert sidecar_ops(*verify).returncode == 0
    # The report is about an object that is gone now: the same command skips the rebuilt shard.
    assert "3 total, 0 built, 3 skipped" in sidecar_ops(*build, "--rebuild-failed", str(report)).stdout


@pytest.mark.parametrize(
    ("report", "message"),
    [
        ('{"shards":[{"kind":"resized","passed":false}]}', "shards[0]: 'shard' must be the checked shard's URI"),
        ('{"shards":[{"kind":"resized","passed":false,"shard":["x"]}]}', "shards[0]: 'shard' must be the checked"),
        (
            '{"shards":[{"kind":"resized","passed":false,"shard":"x","stats":"x"}]}',
            "'stats' must be an object, got text",
        ),
        ("[" * 200_000, "not a verifier report (its JSON is nested too deeply)"),
    ],
    ids=["no_shard", "shard_a_list", "stats_text", "deep_nesting"],
)
def test_rebuild_failed_refuses_a_malformed_report_naming_the_problem(sample_main, tmp_path, report, message):
    """Reported: each of these ended in a traceback (KeyError, TypeError, AttributeError, RecursionError) and exit 1."""
    (tmp_path / "report.json").write_text(report)
    result = sidecar_ops("build-both", "--main-prefix", sample_main.uri, "--output-prefix-512", str(tmp_path / "a"),
                         "--output-prefix-1024", str(tmp_path / "b"), "--rebuild-failed", str(tmp_path / "report.json"))  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"sidecar-ops: error: --rebuild-failed {tmp_path / 'report.json'}: " in result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.heavy
def test_rebuild_failed_says_which_failed_shards_it_ignores_and_why(sample_main, tmp_path):
    """Reported: entries outside the outputs, with '../', naming main or another dataset were ignored silently,
    and a report matching no output of the build was accepted with exit 0."""
    out = {r: tmp_path / "out" / r for r in ("512", "1024")}

    def entry(shard: str) -> dict:
        return {"kind": "resized", "passed": False, "shard": shard, "stats": {"output_fingerprint": None}}

    foreign = [
        entry(f"{out['512']}/../512/{SHARDS[0]}"),
        entry(sample_main.child(SHARDS[1])),
        entry(f"{tmp_path}/other_dataset/{SHARDS[0]}"),
        entry(f"{out['512']}/gone.parquet"),
    ]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"shards": foreign}))
    build = ["build-both", "--main-prefix", sample_main.uri, "--output-prefix-512", str(out["512"]),
             "--output-prefix-1024", str(out["1024"]), "--rebuild-failed", str(report)]  # fmt: skip
    refused = sidecar_ops(*build)
    assert refused.returncode == 2 and not out["512"].exists()
    assert (
        "--rebuild-failed: none of the 4 failed shard(s) in the report(s) is an output of this build" in refused.stderr
    )
    for reason in (
        "its path holds '.' or '..' segments",
        "it is in the main dataset, which is read only",
        f"not under this build's outputs ({out['512']}, {out['1024']})",
        "the main dataset has no shard 'gone.parquet'",
    ):
        assert reason in refused.stderr
    # With one failed output of this build among them, the build goes on, naming what it ignores.
    report.write_text(json.dumps({"shards": [*foreign, entry(f"{out['1024']}/{SHARDS[2]}")]}))
    mixed = sidecar_ops(*build)
    assert mixed.returncode == 0, mixed.stderr
    assert "--rebuild-failed: 4 failed shard(s) of the reports ignored:" in mixed.stderr
    assert "--rebuild-failed: 1 failed output(s) of this build to repair" in mixed.stderr
    # A report in which nothing failed: nothing to repair, said so.
    report.write_text(json.dumps({"shards": [{**entry(f"{out['512']}/{SHARDS[0]}"), "passed": True}]}))
    passed = sidecar_ops(*build, "--skip-existing")
    assert passed.returncode == 0 and "the reports name no failed resized shard: nothing to repair" in passed.stderr
    assert "3 total, 0 built, 3 skipped" in passed.stdout


def test_rebuild_failed_refuses_an_unreadable_report(sample_main, tmp_path):
    (tmp_path / "report.json").write_text("not json")
    result = sidecar_ops("build-0-262mp", "--main-prefix", sample_main.uri, "--output-prefix", str(tmp_path / "o"),
                         "--rebuild-failed", str(tmp_path / "report.json"))  # fmt: skip
    assert result.returncode == 2 and "not a readable verifier report" in result.stderr
    assert not (tmp_path / "o").exists()
