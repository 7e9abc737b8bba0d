"""io/leftovers.py: a killed writer's temporaries, staging folders and incomplete uploads go at a later
write or sweep: at once when its writer is dead (same machine, pid gone), otherwise once they are old."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixed_res_sidecar.io.leftovers import (
    STALE_TEMPORARY_SECONDS,
    UPLOAD_RECORD_SUFFIX,
    machine_id,
    remove_temp_dir_leftovers,
)
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.s3 import s3_client
from fixed_res_sidecar_tests.fixtures.datasets import touch
from fixed_res_sidecar_tests.fixtures.s3 import incomplete_uploads


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid():
    """The pid of another process that is running (a writer at work)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield child.pid
    child.kill()
    child.wait()


def _temporary(name: str, pid: int, machine: str | None = None) -> str:
    return f".{name}.{machine or machine_id()}-{pid}-0123abcd.tmp"


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old), follow_symlinks=False)


def test_remove_stale_temporaries(tmp_path):
    touch(tmp_path, "a/.b.parquet.0123456789ab.tmp")
    touch(tmp_path, "a/b.parquet")
    location = Location.parse(tmp_path)
    assert location.remove_stale_temporaries("a/b.parquet", older_than=3600) == 0  # may be a live writer's
    assert location.remove_stale_temporaries("a/b.parquet") == 1
    assert location.list_shards() == ["a/b.parquet"] and len(list((tmp_path / "a").iterdir())) == 1


def test_a_write_removes_temporaries_crashed_writers_left_long_ago(tmp_path):
    touch(tmp_path, "a/.b.parquet.000000000000.tmp")
    touch(tmp_path, "a/.b.parquet.111111111111.tmp")
    old = time.time() - STALE_TEMPORARY_SECONDS - 60
    os.utime(tmp_path / "a/.b.parquet.000000000000.tmp", (old, old))
    Location.parse(tmp_path).write_bytes("a/b.parquet", b"x")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".b.parquet.111111111111.tmp", "b.parquet"]


def test_remove_leftovers_takes_temporaries_of_dead_or_long_gone_writers_only(tmp_path, live_pid):
    out, dead = tmp_path / "out", _dead_pid()
    gone = [
        f"a/{_temporary('x.parquet', dead)}",  # its writer died on this machine: removed at once
        f"a/b/{_temporary('y.parquet', live_pid)}",  # a live writer's, but untouched for too long
        "a/.z.parquet.0123456789ab.tmp",  # an earlier version's name, long untouched
    ]
    kept = [
        f"a/{_temporary('w.parquet', live_pid)}",  # a live writer's
        f"a/{_temporary('v.parquet', dead, machine='0badf00d')}",  # another machine's: its pid means nothing here
        "a/.u.parquet.0123456789ab.tmp",  # an earlier version's name, fresh
        "a/.u.parquet.tmp",  # not a name this package writes
        f".hidden/{_temporary('x.parquet', dead)}",  # no output lives in hidden folders
    ]
    for rel in gone + kept:
        touch(out, rel)
    for rel in gone[1:]:
        _age(out / rel, STALE_TEMPORARY_SECONDS + 60)
    # Links are never followed: neither a link named like a temporary, nor a linked folder.
    touch(tmp_path, "elsewhere/target.parquet")
    touch(tmp_path, f"elsewhere/{_temporary('t.parquet', dead)}")
    (out / "a" / _temporary("link.parquet", dead)).symlink_to(tmp_path / "elsewhere" / "target.parquet")
    (out / "linked").symlink_to(tmp_path / "elsewhere")
    cleanup = Location.parse(out).remove_leftovers()
    assert sorted(cleanup.removed) == sorted(str(out / rel) for rel in gone) and cleanup.problems == []
    for rel in kept:
        assert (out / rel).exists()
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == sorted(
        ["target.parquet", _temporary("t.parquet", dead)]
    )
    assert (out / "a" / _temporary("link.parquet", dead)).is_symlink()


def test_a_write_removes_the_temporaries_of_dead_writers_beside_it(tmp_path, live_pid):
    dead, live = _temporary("b.parquet", _dead_pid()), _temporary("b.parquet", live_pid)
    touch(tmp_path, f"a/{dead}")
    touch(tmp_path, f"a/{live}")
    Location.parse(tmp_path).write_bytes("a/b.parquet", b"x")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted([live, "b.parquet"])


def test_the_temporaries_of_a_long_name_are_short_enough_and_still_found_beside_it(tmp_path):
    long = "n" * 240 + ".parquet"
    location = Location.parse(tmp_path)
    with location.write_atomic(f"a/{long}") as tmp:
        assert len(Path(tmp).name.encode()) <= 255 and Path(tmp).name.startswith(".nnnn")
        Path(tmp).write_bytes(b"x")
    left = Path(tmp).with_name(Path(tmp).name.replace(f"-{os.getpid()}-", f"-{_dead_pid()}-"))
    touch(tmp_path, f"a/{left.name}")  # a dead writer's
    assert location.remove_stale_temporaries(f"a/{long}") == 1
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [long]


def test_remove_leftovers_aborts_stale_incomplete_uploads_under_the_prefix_only(s3_bucket):
    client = s3_client()
    keys = ["out/a.parquet", "out/r/report.json", "out/o/pic.png", "out/notes.txt", "other/b.parquet", "out2/c.parquet"]
    for key in keys:
        client.create_multipart_upload(Bucket=s3_bucket, Key=key)
    location = Location.parse(f"s3://{s3_bucket}/out")
    # moto says every upload was initiated in 2010: younger than a century is kept, older than 6 h is not.
    assert location.remove_leftovers(older_than=100 * 365 * 86400).removed == []
    cleanup = location.remove_leftovers()
    assert sorted(r.split(" ")[0] for r in cleanup.removed) == [f"s3://{s3_bucket}/{k}" for k in sorted(keys[:3])]
    assert sorted(incomplete_uploads(s3_bucket)) == sorted(keys[3:])


def test_remove_temp_dir_leftovers_aborts_the_uploads_of_dead_writers(s3_bucket, staging, live_pid):
    client = s3_client()
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key="out/x.parquet")["UploadId"]
    client.upload_part(Bucket=s3_bucket, Key="out/x.parquet", UploadId=upload, PartNumber=1, Body=b"x" * 1000)
    machine = machine_id()
    dead = staging / f"sidecar-{machine}-{_dead_pid()}-abcd_123"
    touch(dead, "x.parquet", b"x" * 2000)
    touch(dead, f"x.parquet{UPLOAD_RECORD_SUFFIX}", json.dumps(
        {"bucket": s3_bucket, "key": "out/x.parquet", "upload_id": upload}).encode())  # fmt: skip
    live = staging / f"sidecar-{machine}-{live_pid}-abcd_456"
    touch(live, "y.parquet")
    old_style, old_fresh, not_ours = (
        staging / "sidecar-a1b2c3d4",
        staging / "sidecar-e5f6g7h8",
        staging / "sidecar-i9j0k1l2",
    )
    touch(old_style, "z.parquet")
    touch(old_fresh, "z.parquet")
    touch(not_ours, "notes.txt")
    for folder in (old_style, not_ours):
        _age(folder / next(folder.iterdir()).name, STALE_TEMPORARY_SECONDS + 60)
        _age(folder, STALE_TEMPORARY_SECONDS + 60)
    (staging / "unrelated").mkdir()
    cleanup = remove_temp_dir_leftovers()
    assert sorted(cleanup.removed) == sorted(
        [str(dead), str(old_style), f"s3://{s3_bucket}/out/x.parquet (incomplete upload {upload})"]
    )
    assert cleanup.problems == [] and incomplete_uploads(s3_bucket) == []
    assert sorted(p.name for p in staging.iterdir()) == sorted([live.name, old_fresh.name, not_ours.name, "unrelated"])
