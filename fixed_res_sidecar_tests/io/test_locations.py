import functools
import operator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.io.locations import Location, LocationError, check_output_location, commit_guard
from fixed_res_sidecar.io.retry import StorageError
from fixed_res_sidecar.shards.runner import Terminated
from fixed_res_sidecar_tests.fixtures.datasets import touch
from fixed_res_sidecar_tests.fixtures.permissions import permission_checks_enforced, unreadable
from fixed_res_sidecar_tests.fixtures.s3 import incomplete_uploads


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
        touch(tmp_path, rel)
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


class Lost(Exception):
    pass


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_commit_guard_that_refuses_publishes_nothing(where, tmp_path, request):
    """A run fence's check (io.locations.commit_guard) runs right before the rename / the upload: when it
    refuses, nothing appears at the final name and no temporary is left; outside the guard writes go on."""
    if where == "s3":
        location = Location.parse(f"s3://{request.getfixturevalue('s3_bucket')}/out")
    else:
        location = Location.parse(tmp_path / "out")
    calls = []

    def owner_lost():
        calls.append(1)
        raise Lost("the run is FAILURE elsewhere")

    with commit_guard(owner_lost), pytest.raises(Lost), location.write_atomic("a/b.parquet") as tmp:
        Path(tmp).write_bytes(b"whole, but no longer ours")
    assert calls == [1] and not location.exists("a/b.parquet")
    if where == "local":
        assert list((tmp_path / "out" / "a").iterdir()) == []
    with commit_guard(lambda: None):
        location.write_bytes("a/b.parquet", b"ours")
    location.write_bytes("a/c.parquet", b"unguarded")
    assert location.read_bytes("a/b.parquet") == b"ours" and location.exists("a/c.parquet")


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
    touch(main, "a/b/victim.parquet", b"main bytes")
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
    touch(tmp_path / "captions", "x/c.parquet", b"captions")
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
    touch(main, "real/a.parquet")
    touch(tmp_path, "outside/b.parquet")
    touch(tmp_path, "outside/deep/c.parquet")
    (main / "linked-folder").symlink_to(tmp_path / "outside")
    (main / "real" / "linked.parquet").symlink_to(tmp_path / "outside" / "b.parquet")
    (main / "real" / "notes.txt").symlink_to(tmp_path / "outside" / "b.parquet")  # not a shard: not reported
    location = Location.parse(main)
    assert location.list_shards() == ["real/a.parquet"]
    assert location.skipped_symlinks() == {
        "linked-folder": str(tmp_path / "outside"),
        "real/linked.parquet": str(tmp_path / "outside" / "b.parquet"),
    }


def test_a_local_folder_that_cannot_be_listed_is_an_error_naming_it(tmp_path):
    """Reported: an unreadable subfolder was left out of the listing, so its shards looked removed."""
    for rel in ("a.parquet", "sub/b.parquet", "sub/deeper/c.parquet"):
        touch(tmp_path / "main", rel)
    location = Location.parse(tmp_path / "main")
    folder = tmp_path / "main" / "sub"
    with unreadable(folder), permission_checks_enforced():
        for listing in (location.list_shards, location.skipped_symlinks, lambda: list(location.iter_shard_pages())):
            with pytest.raises(StorageError, match=rf"storage failed listing {folder} .*Permission denied"):
                listing()
        with unreadable(tmp_path / "main"), pytest.raises(StorageError, match=f"listing {tmp_path / 'main'} "):
            location.list_shards()
    # A location that does not exist yet (an output before its first shard) holds no shards, as on S3.
    assert Location.parse(tmp_path / "not-yet").list_shards() == []
    # A file given for a folder is a wrong location, not storage failing (which a rerun would not fix).
    with pytest.raises(LocationError, match=f"{tmp_path / 'main' / 'a.parquet'} is a file, not a folder of shards"):
        Location.parse(tmp_path / "main" / "a.parquet").list_shards()


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


@pytest.mark.parametrize(
    ("where", "too_long", "refusal"),
    [
        (
            "local",
            "a/" + "x" * 251 + ".json",
            r"256-byte name, longer than a file name can be \(255 bytes\): cannot write .*/a/x+\.json$",
        ),
        (
            "s3",
            "a/" + "x" * 1020 + ".json",
            r"1031-byte key, longer than S3 allows \(1024 bytes\): cannot write s3://.*/a/x+\.json$",
        ),
    ],
    ids=["local", "s3"],
)
def test_a_name_as_long_as_a_file_name_can_be_is_written_and_a_longer_one_refused_first(
    tmp_path, s3_bucket, staging, where, too_long, refusal
):
    """Reported: names of ~230 bytes failed once written, their temporaries' names being too long."""
    location = Location.parse(tmp_path / "out" if where == "local" else f"s3://{s3_bucket}/out")
    longest = "é" * 123 + ".parquet"  # 254 bytes of UTF-8
    location.write_bytes(f"a/{longest}", b"x")
    assert location.list_shards() == [f"a/{longest}"]
    # A name the storage cannot hold (255 bytes a name locally, 1024 a key on S3) is refused before the block.
    with pytest.raises(LocationError, match=refusal), location.write_atomic(too_long):
        pytest.fail("the block ran")


# -- an interrupted write removes its own leftovers (a killed writer's: test_leftovers.py) --

FAILURES = [RuntimeError("disk full"), KeyboardInterrupt(), Terminated("signal 15")]


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
    assert Location.parse(f"s3://{s3_bucket}/out").list_shards() == [] and incomplete_uploads(s3_bucket) == []
