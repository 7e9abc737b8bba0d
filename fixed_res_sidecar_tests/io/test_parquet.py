"""Opening shards (one ShardError naming the shard) and main shards' fingerprints."""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.parquet import ShardError, open_shard, read_columns, source_fingerprint, text_as_bytes
from fixed_res_sidecar_tests.fixtures.datasets import damage_column_chunk

ROWS = 10


def write_shard(location: Location, rel: str, images: list[bytes], keys: pa.Array | None = None) -> None:
    keys = keys if keys is not None else pa.array([f"k{i}" for i in range(len(images))])
    table = pa.table({"image_key": keys, "image": pa.array(images, pa.binary())})
    with location.write_atomic(rel) as tmp:
        pq.write_table(table, tmp, row_group_size=4, write_page_checksum=True)


@pytest.fixture
def shards(tmp_path) -> Location:
    location = Location.parse(tmp_path / "main")
    write_shard(location, "a.parquet", [b"image-%d" % i for i in range(ROWS)])
    return location


def test_open_shard_names_the_shard_and_what_is_wrong(shards, tmp_path):
    uri = shards.child("a.parquet")
    assert open_shard(shards, "a.parquet", "main", columns=["image"], rows=ROWS).metadata.num_rows == ROWS
    with pytest.raises(ShardError, match=f"main shard {shards.child('b.parquet')} is missing"):
        open_shard(shards, "b.parquet", "main")
    with pytest.raises(ShardError, match=f"resized 512 shard {uri} lacks column\\(s\\) \\['caption'\\]"):
        open_shard(shards, "a.parquet", "resized 512", columns=["image", "caption"])
    with pytest.raises(ShardError, match=f"sidecar shard {uri} has {ROWS} rows, the main shard has 11"):
        open_shard(shards, "a.parquet", "sidecar", rows=11)
    (tmp_path / "main" / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ShardError, match="main shard .*junk.parquet is not a readable Parquet file"):
        open_shard(shards, "junk.parquet", "main")


def test_a_damaged_page_names_its_column_and_row_group(shards):
    damage_column_chunk(shards.child("a.parquet"), "image", row_group=1)
    parquet_file = open_shard(shards, "a.parquet", "main")  # the footer is intact
    assert read_columns(parquet_file, ["image_key"], "A").num_rows == ROWS
    with pytest.raises(ShardError, match="A: column 'image' in row group 1 could not be read .*damaged after"):
        read_columns(parquet_file, ["image_key", "image"], "A")


def test_a_fingerprint_changes_with_the_shard_and_only_with_it(shards):
    first = source_fingerprint(shards, "a.parquet")
    assert source_fingerprint(shards, "a.parquet") == first
    _stamp, rows, footer = first.rsplit(":", 2)
    assert rows == str(ROWS) and len(footer) == 16

    # Other images of the same size, same keys and rows: the footer (statistics, offsets) may even
    # match, the stamp does not.
    path = shards.child("a.parquet")
    before = os.stat(path)
    write_shard(shards, "a.parquet", [b"IMAGE-%d" % i for i in range(ROWS)])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    assert os.path.getsize(path) == before.st_size
    assert source_fingerprint(shards, "a.parquet") != first

    # Touched only (same bytes): the stamp changes, the footer hash and rows do not.
    write_shard(shards, "a.parquet", [b"image-%d" % i for i in range(ROWS)])
    again = source_fingerprint(shards, "a.parquet")
    assert again != first and again.rsplit(":", 2)[1:] == [rows, footer]

    with pytest.raises(ShardError, match="main shard .*gone.parquet is missing"):
        source_fingerprint(shards, "gone.parquet")


def test_a_same_size_rewrite_with_its_modification_time_restored_changes_the_fingerprint(shards):
    """Reported: rewritten in place with the same size and footer, its mtime set back, a local main shard kept
    its fingerprint. The inode's change time cannot be set back; another file renamed over it has another inode."""
    path = shards.child("a.parquet")
    first, before = source_fingerprint(shards, "a.parquet"), os.stat(path)
    data = bytearray(Path(path).read_bytes())
    offset = data.index(b"image-3")
    data[offset : offset + 7] = b"IMAGE-3"
    with open(path, "r+b") as file:  # in place: same inode, same size, the footer untouched
        file.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert source_fingerprint(shards, "a.parquet") != first
    # Replaced by a copy of the same bytes, its times set back: another inode.
    second = source_fingerprint(shards, "a.parquet")
    copy = shards.child("copy.parquet")
    with open(copy, "wb") as file:
        file.write(data)
    os.utime(copy, ns=(after.st_atime_ns, after.st_mtime_ns))
    os.replace(copy, path)
    assert source_fingerprint(shards, "a.parquet") != second


def test_keys_that_are_not_utf8_are_fingerprinted_without_decoding(shards):
    """A string column holding bytes that are not UTF-8 (what a writer that does not check leaves)
    has statistics that cannot be decoded: the fingerprint hashes the footer's bytes instead."""
    raw = [b"\xff\xfe-%d" % i for i in range(ROWS)]
    keys = pa.Array.from_buffers(pa.string(), ROWS, pa.array(raw, pa.binary()).buffers())
    write_shard(shards, "bytes.parquet", [b"x"] * ROWS, keys=keys)
    assert source_fingerprint(shards, "bytes.parquet").split(":")[-2] == str(ROWS)


def test_s3_fingerprints_carry_the_etag(shards, s3_bucket):
    s3 = Location.parse(f"s3://{s3_bucket}/main")
    s3.write_bytes("a.parquet", shards.read_bytes("a.parquet"))
    local, remote = source_fingerprint(shards, "a.parquet"), source_fingerprint(s3, "a.parquet")
    assert remote.rsplit(":", 2)[1:] == local.rsplit(":", 2)[1:]  # same rows and footer
    assert remote != local and s3.fingerprint("a.parquet") in remote


@pytest.mark.parametrize(
    ("text_type", "bytes_type"),
    [(pa.string(), pa.binary()), (pa.large_string(), pa.large_binary()), (pa.string_view(), pa.binary_view())],
    ids=str,
)
def test_text_that_is_not_utf8_is_read_as_the_bytes_stored(text_type, bytes_type):
    stored = [b'{"a": 1}', b"caf\xe9", None]
    text = pa.array(stored, bytes_type).view(text_type)
    with pytest.raises(UnicodeDecodeError):
        text.to_pylist()
    assert text_as_bytes(text).to_pylist() == stored
    assert text_as_bytes(pa.chunked_array([text, text])).to_pylist() == stored * 2
    assert text_as_bytes(pa.array([1, 2])).to_pylist() == [1, 2]  # other types as they are
