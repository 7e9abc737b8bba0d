import functools
import operator
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from botocore.exceptions import ClientError

from fixed_res_sidecar.io import locations
from fixed_res_sidecar.io.locations import (
    STALE_TEMPORARY_SECONDS,
    Location,
    LocationError,
    check_output_location,
    remove_temp_dir_leftovers,
    s3_client,
)
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar.shards.runner import Terminated, raise_terminated


def _touch(root: Path, rel: str, data: bytes = b"x") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_parse_local_and_s3(tmp_path):
    assert Location.parse(tmp_path).uri == str(tmp_path)
    s3 = Location.parse("s3://bucket//data/main/")
    assert (s3.bucket, s3.path, s3.uri) == ("bucket", "data/main", "s3://bucket/data/main")
    assert s3.child("a/b.parquet") == "s3://bucket/data/main/a/b.parquet"
    for bad in ("", "s3://", "s3://b/x/../y", "gs://bucket/x"):
        with pytest.raises(LocationError):
            Location.parse(bad)


def test_relative_paths_cannot_escape(tmp_path):
    location = Location.parse(tmp_path)
    for bad in ("../x.parquet", "/etc/passwd", "a//b.parquet", ""):
        with pytest.raises(LocationError):
            location.child(bad)


def test_local_listing_any_depth_sorted_without_temporaries(tmp_path):
    for rel in ("b.parquet", "a/z/2.parquet", "a/1.parquet", "notes.txt", ".a.parquet.123.tmp", ".hidden/x.parquet"):
        _touch(tmp_path, rel)
    location = Location.parse(tmp_path)
    assert location.list_shards() == ["a/1.parquet", "a/z/2.parquet", "b.parquet"]
    assert list(location.iter_shard_pages(page_size=2)) == [["a/1.parquet", "a/z/2.parquet"], ["b.parquet"]]
    assert list(location.iter_shard_pages(start_after="a/1.parquet")) == [["a/z/2.parquet", "b.parquet"]]
    assert location.shard_sizes() == {"a/1.parquet": 1, "a/z/2.parquet": 1, "b.parquet": 1}
    assert Location.parse(tmp_path / "missing").list_shards() == []


@pytest.mark.parametrize(
    "main, output, refused",
    [
        ("/data/main", "/data/main", True),
        ("/data/main", "/data/main/out", True),
        ("/data/main", "/data", True),
        ("/data/main", "/data/main-512", False),
        ("/data/main", "/data/out/main", False),
        ("s3://b/main", "s3://b/main/", True),
        ("s3://b/main", "s3://b/main/x", True),
        ("s3://b/main", "s3://b", True),
        ("s3://b/main", "s3://b/main2", False),
        ("s3://b/main", "s3://other/main", False),
        ("s3://b/main", "/b/main", False),
    ],
)
def test_output_must_not_overlap_main(main, output, refused):
    if refused:
        with pytest.raises(LocationError, match="read-only"):
            check_output_location(Location.parse(main), Location.parse(output))
    else:
        check_output_location(Location.parse(main), Location.parse(output))


def test_write_atomic_publishes_whole_or_nothing(tmp_path):
    location = Location.parse(tmp_path / "out")
    with pytest.raises(RuntimeError), location.write_atomic("a/b.parquet") as tmp:
        Path(tmp).write_bytes(b"partial")
        assert Path(tmp).parent == tmp_path / "out" / "a"  # same folder, so the rename is atomic
        raise RuntimeError("crash mid-write")
    assert not location.exists("a/b.parquet")
    assert list((tmp_path / "out" / "a").iterdir()) == []
    location.write_bytes("a/b.parquet", b"whole")
    assert location.read_bytes("a/b.parquet") == b"whole"
    assert location.size("a/b.parquet") == 5


def test_write_path_refuses_protected_location(tmp_path):
    main = Location.parse(tmp_path / "main")
    with (
        pytest.raises(LocationError),
        Location.parse(tmp_path / "main" / "inside").write_atomic("x.parquet", protect=[main]),
    ):
        pass
    assert not (tmp_path / "main").exists()


def _main_with_victim(tmp_path: Path) -> Path:
    main = tmp_path / "data" / "main"
    _touch(main, "a/b/victim.parquet", b"main bytes")
    return main


# Symlinks in the output tree that resolve into main: (link, target relative to tmp_path, rel written).
SYMLINKS_INTO_MAIN = {
    "folder at depth 1": ("out/a", "data/main/a", "a/b/victim.parquet"),
    "folder at depth 2": ("out/a/b", "data/main/a/b", "a/b/victim.parquet"),
    "file": ("out/a/b/victim.parquet", "data/main/a/b/victim.parquet", "a/b/victim.parquet"),
    "folder onto main itself": ("out/a", "data/main", "a/b/victim.parquet"),
    "folder above main": ("out/a", "data", "a/main/a/b/victim.parquet"),
    "dangling folder link to a new folder in main": ("out/new", "data/main/new", "new/x.parquet"),
    "relative link": ("out/a", "../data/main/a", "a/b/victim.parquet"),
}


@pytest.mark.parametrize("case", SYMLINKS_INTO_MAIN)
def test_a_write_through_a_symlink_into_main_is_refused(tmp_path, case):
    from fixed_res_sidecar_tests.fixtures.datasets import tree_snapshot

    main_dir = _main_with_victim(tmp_path)
    link, target, rel = SYMLINKS_INTO_MAIN[case]
    (tmp_path / link).parent.mkdir(parents=True, exist_ok=True)
    target_path = Path(target) if target.startswith("..") else tmp_path / target
    (tmp_path / link).symlink_to(target_path)
    before = tree_snapshot(main_dir)
    output, main = Location.parse(tmp_path / "out"), Location.parse(main_dir)
    assert not output.overlaps(main)  # the prefixes alone do not overlap: only the real paths do
    with pytest.raises(LocationError, match="symbolic links"):
        output.write_bytes(rel, b"resized shard", protect=[main])
    with pytest.raises(LocationError, match="symbolic links"), output.write_atomic(rel, protect=[main]) as tmp:
        Path(tmp).write_bytes(b"resized shard")
    assert tree_snapshot(main_dir) == before


def test_a_write_through_a_symlink_into_the_caption_dataset_is_refused(tmp_path):
    main, captions = Location.parse(tmp_path / "main"), Location.parse(tmp_path / "captions")
    _touch(tmp_path / "captions", "x/c.parquet", b"captions")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").symlink_to(tmp_path / "captions" / "x")
    with pytest.raises(LocationError, match="symbolic links"):
        Location.parse(tmp_path / "out").write_bytes("x/c.parquet", b"sidecar", protect=[main, captions])
    assert (tmp_path / "captions" / "x" / "c.parquet").read_bytes() == b"captions"


def test_symlinks_elsewhere_in_the_output_tree_are_fine(tmp_path):
    main = Location.parse(_main_with_victim(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a").symlink_to(tmp_path / "elsewhere")
    Location.parse(tmp_path / "out").write_bytes("a/b/x.parquet", b"ok", protect=[main])
    assert (tmp_path / "elsewhere" / "b" / "x.parquet").read_bytes() == b"ok"


def test_local_listing_follows_no_symlink_and_names_each(tmp_path):
    main = tmp_path / "main"
    _touch(main, "real/a.parquet")
    _touch(tmp_path, "outside/b.parquet")
    _touch(tmp_path, "outside/deep/c.parquet")
    (main / "linked-folder").symlink_to(tmp_path / "outside")
    (main / "real" / "linked.parquet").symlink_to(tmp_path / "outside" / "b.parquet")
    (main / "real" / "notes.txt").symlink_to(tmp_path / "outside" / "b.parquet")  # not a shard: not reported
    location = Location.parse(main)
    assert location.list_shards() == ["real/a.parquet"]
    assert location.skipped_symlinks() == {
        "linked-folder": str(tmp_path / "outside"),
        "real/linked.parquet": str(tmp_path / "outside" / "b.parquet"),
    }


def test_remove_stale_temporaries(tmp_path):
    _touch(tmp_path, "a/.b.parquet.0123456789ab.tmp")
    _touch(tmp_path, "a/b.parquet")
    location = Location.parse(tmp_path)
    assert location.remove_stale_temporaries("a/b.parquet", older_than=3600) == 0  # may be a live writer's
    assert location.remove_stale_temporaries("a/b.parquet") == 1
    assert location.list_shards() == ["a/b.parquet"] and len(list((tmp_path / "a").iterdir())) == 1


def test_a_write_removes_temporaries_crashed_writers_left_long_ago(tmp_path):
    _touch(tmp_path, "a/.b.parquet.000000000000.tmp")
    _touch(tmp_path, "a/.b.parquet.111111111111.tmp")
    old = time.time() - STALE_TEMPORARY_SECONDS - 60
    os.utime(tmp_path / "a/.b.parquet.000000000000.tmp", (old, old))
    Location.parse(tmp_path).write_bytes("a/b.parquet", b"x")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".b.parquet.111111111111.tmp", "b.parquet"]


RESUME_ORDER = ["a-b.parquet", "a/x.parquet", "a/y/z.parquet", "a0.parquet", "b/c/d.parquet", "b/e.parquet"]


@pytest.mark.parametrize("start_after", [None, *RESUME_ORDER, "a/", "a/y", "b/c/", "zzz"])
def test_a_resumed_listing_is_the_same_locally_and_on_s3(tmp_path, s3_bucket, start_after):
    """Key order, not folder order ("a-b" sorts before "a/"): a local listing that resumes (and
    skips the folders entirely before the resume point) lists what S3's StartAfter lists."""
    local, s3 = Location.parse(tmp_path / "main"), Location.parse(f"s3://{s3_bucket}/main")
    for rel in RESUME_ORDER:
        local.write_bytes(rel, b"x")
        s3.write_bytes(rel, b"x")
    expected = [rel for rel in RESUME_ORDER if start_after is None or rel > start_after]
    for location in (local, s3):
        pages = location.iter_shard_pages(page_size=2, start_after=start_after)
        assert [rel for page in pages for rel in page] == expected, location.uri


def test_s3_round_trip(s3_bucket):
    location = Location.parse(f"s3://{s3_bucket}/data/main")
    table = pa.table({"k": ["a", "b"]})
    for rel in ("z.parquet", "x/y/1.parquet", "x/2.parquet"):
        with location.write_atomic(rel) as tmp:
            pq.write_table(table, tmp)
    location.write_bytes("x/report.json", b"{}")
    assert location.list_shards() == ["x/2.parquet", "x/y/1.parquet", "z.parquet"]
    pages = list(location.iter_shard_pages(page_size=2))  # 4 objects listed 2 a page; the JSON is not a shard
    assert len(pages) == 2 and functools.reduce(operator.iadd, pages, []) == location.list_shards()
    assert list(location.iter_shard_pages(start_after="x/2.parquet")) == [["x/y/1.parquet", "z.parquet"]]
    assert location.parquet_file("x/y/1.parquet").metadata.num_rows == 2
    assert location.read_bytes("x/report.json") == b"{}"
    assert location.size("missing.parquet") is None
    # A failed write leaves no object behind.
    with pytest.raises(RuntimeError), location.write_atomic("failed.parquet") as tmp:
        Path(tmp).write_bytes(b"partial")
        raise RuntimeError("crash")
    assert not location.exists("failed.parquet")


def test_an_s3_listing_that_fails_is_a_storage_error(s3_env):
    """A listing storage refuses (after boto3's retries) is a StorageError naming the location,
    never an empty dataset."""
    location = Location.parse("s3://no-such-bucket-for-sidecar/data")
    with pytest.raises(
        StorageError, match="storage failed listing s3://no-such-bucket-for-sidecar/data: .*NoSuchBucket"
    ):
        location.list_shards()


# -- leftovers: an interrupted write removes its own; a killed writer's go at the next run --

FAILURES = [RuntimeError("disk full"), KeyboardInterrupt(), Terminated("signal 15")]


@pytest.fixture
def staging(tmp_path, monkeypatch) -> Path:
    """This process's TMPDIR, fresh and empty (S3 writes stage their files there)."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _uploads(bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


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
    return f".{name}.{machine or locations._machine_id()}-{pid}-0123abcd.tmp"


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old), follow_symlinks=False)


@pytest.mark.parametrize("failure", FAILURES, ids=lambda e: type(e).__name__)
def test_a_failed_local_write_removes_its_temporary_at_once(tmp_path, failure):
    table = pa.table({"x": list(range(1000))})
    with (
        pytest.raises(type(failure)),
        Location.parse(tmp_path / "out").write_atomic("a/b.parquet") as tmp,
        pq.ParquetWriter(tmp, table.schema) as w,
    ):
        w.write_table(table)  # a row group is in the temporary
        assert Path(tmp).stat().st_size > 0
        raise failure
    assert list((tmp_path / "out" / "a").iterdir()) == []


@pytest.mark.parametrize("failure", FAILURES, ids=lambda e: type(e).__name__)
def test_a_failed_s3_write_leaves_no_object_and_no_staging_folder(s3_bucket, staging, failure):
    with pytest.raises(type(failure)), Location.parse(f"s3://{s3_bucket}/out").write_atomic("b.parquet") as tmp:
        Path(tmp).write_bytes(b"half a shard")
        raise failure
    assert list(staging.iterdir()) == []
    assert Location.parse(f"s3://{s3_bucket}/out").list_shards() == [] and _uploads(s3_bucket) == []


def test_a_big_s3_write_is_one_completed_multipart_upload(s3_bucket, staging):
    data = os.urandom(locations.MULTIPART_PART_BYTES * 2 + 12345)
    location = Location.parse(f"s3://{s3_bucket}/out")
    location.write_bytes("big.parquet", data)
    assert location.read_bytes("big.parquet") == data
    head = s3_client().head_object(Bucket=s3_bucket, Key="out/big.parquet")
    assert head["ETag"].endswith('-3"')  # three parts
    assert _uploads(s3_bucket) == [] and list(staging.iterdir()) == []


def test_a_multipart_upload_the_server_refuses_is_aborted(s3_bucket, staging, monkeypatch):
    # Parts under S3's 5 MiB minimum: the server refuses to complete the upload (EntityTooSmall).
    monkeypatch.setattr(locations, "MULTIPART_THRESHOLD_BYTES", 2**20)
    monkeypatch.setattr(locations, "MULTIPART_PART_BYTES", 2**20)
    location = Location.parse(f"s3://{s3_bucket}/out")
    with pytest.raises(ClientError, match="EntityTooSmall"):
        location.write_bytes("b.parquet", os.urandom(3 * 2**20))
    assert _uploads(s3_bucket) == [] and not location.exists("b.parquet")
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_a_signal_during_a_multipart_upload_aborts_it(s3_bucket, staging, signum, raised):
    """Ctrl-C or SIGTERM (as the command line handles it) while a part is on its way."""
    location = Location.parse(f"s3://{s3_bucket}/out")
    client, sent = s3_client(), []

    def signal_once(**_):
        if not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    client.meta.events.register("before-send.s3.UploadPart", signal_once)
    try:
        with pytest.raises(raised):
            location.write_bytes("b.parquet", os.urandom(3 * locations.MULTIPART_PART_BYTES))
    finally:
        client.meta.events.unregister("before-send.s3.UploadPart", signal_once)
        signal.signal(signal.SIGTERM, previous)
    assert sent == [signum]
    assert _uploads(s3_bucket) == [] and not location.exists("b.parquet")
    assert list(staging.iterdir()) == []


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
        _touch(out, rel)
    for rel in gone[1:]:
        _age(out / rel, STALE_TEMPORARY_SECONDS + 60)
    # Links are never followed: neither a link named like a temporary, nor a linked folder.
    _touch(tmp_path, "elsewhere/target.parquet")
    _touch(tmp_path, f"elsewhere/{_temporary('t.parquet', dead)}")
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
    _touch(tmp_path, f"a/{dead}")
    _touch(tmp_path, f"a/{live}")
    Location.parse(tmp_path).write_bytes("a/b.parquet", b"x")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted([live, "b.parquet"])


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
    assert sorted(_uploads(s3_bucket)) == sorted(keys[3:])


def test_remove_temp_dir_leftovers_aborts_the_uploads_of_dead_writers(s3_bucket, staging, live_pid):
    client = s3_client()
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key="out/x.parquet")["UploadId"]
    client.upload_part(Bucket=s3_bucket, Key="out/x.parquet", UploadId=upload, PartNumber=1, Body=b"x" * 1000)
    machine = locations._machine_id()
    dead = staging / f"sidecar-{machine}-{_dead_pid()}-abcd_123"
    _touch(dead, "x.parquet", b"x" * 2000)
    _touch(dead, f"x.parquet{locations.UPLOAD_RECORD_SUFFIX}", locations.json.dumps(
        {"bucket": s3_bucket, "key": "out/x.parquet", "upload_id": upload}).encode())  # fmt: skip
    live = staging / f"sidecar-{machine}-{live_pid}-abcd_456"
    _touch(live, "y.parquet")
    old_style, old_fresh, not_ours = (
        staging / "sidecar-a1b2c3d4",
        staging / "sidecar-e5f6g7h8",
        staging / "sidecar-i9j0k1l2",
    )
    _touch(old_style, "z.parquet")
    _touch(old_fresh, "z.parquet")
    _touch(not_ours, "notes.txt")
    for folder in (old_style, not_ours):
        _age(folder / next(folder.iterdir()).name, STALE_TEMPORARY_SECONDS + 60)
        _age(folder, STALE_TEMPORARY_SECONDS + 60)
    (staging / "unrelated").mkdir()
    cleanup = remove_temp_dir_leftovers()
    assert sorted(cleanup.removed) == sorted(
        [str(dead), str(old_style), f"s3://{s3_bucket}/out/x.parquet (incomplete upload {upload})"]
    )
    assert cleanup.problems == [] and _uploads(s3_bucket) == []
    assert sorted(p.name for p in staging.iterdir()) == sorted([live.name, old_fresh.name, not_ours.name, "unrelated"])
