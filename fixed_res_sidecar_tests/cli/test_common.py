import subprocess
import sys
import tempfile

import pytest

from fixed_res_sidecar.cli.common import UsageError, clean_leftovers, main_shards, usage_error
from fixed_res_sidecar.io.leftovers import machine_id
from fixed_res_sidecar.io.locations import Location


def test_usage_error_prints_and_returns_2(capsys):
    assert usage_error("bad flag") == 2
    assert capsys.readouterr().err == "sidecar-ops: error: bad flag\n"


def test_an_empty_main_dataset_is_a_usage_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no shards here")
    with pytest.raises(UsageError, match="no \\*.parquet shards under"):
        main_shards(Location.parse(tmp_path))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.parquet").write_bytes(b"")
    assert main_shards(Location.parse(tmp_path)) == ["a/x.parquet"]


def test_leftovers_that_cannot_be_removed_are_a_warning_not_a_failure(s3_env, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / "out" / f".x.parquet.{machine_id()}-{dead.pid}-0123abcd.tmp"
    leftover.parent.mkdir()
    leftover.write_bytes(b"half a shard")
    missing_bucket = Location.parse("s3://no-such-bucket-here/out")  # listing its uploads fails
    cleanup = clean_leftovers([Location.parse(tmp_path / "out"), missing_bucket])
    assert cleanup.removed == [str(leftover)] and not leftover.exists()
    assert len(cleanup.problems) == 1 and "NoSuchBucket" in cleanup.problems[0]
    err = capsys.readouterr().err
    assert f"removed 1 leftover(s) of interrupted runs: {leftover}" in err
    assert "warning: a leftover of an interrupted run was not removed: " in err
