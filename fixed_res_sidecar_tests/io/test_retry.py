"""io/retry.py: S3 reads ride out the transient errors pyarrow's client does not retry; storage
that keeps failing is a StorageError naming the object."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.io import locations
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.retry import RetryPolicy, StorageError
from fixed_res_sidecar.io.s3 import S3_MAX_ATTEMPTS, s3_client, s3_filesystem
from fixed_res_sidecar_tests.fixtures.faulty_s3 import every_object_get, small_ranges_first_attempt

DATA = os.urandom(100_000)


@pytest.fixture
def stored(faulty_s3, s3_bucket) -> Location:
    location = Location.parse(f"s3://{s3_bucket}/objects")
    location.write_bytes("blob.bin", DATA)
    return location


@pytest.mark.parametrize("status", [500, 503])
def test_a_small_range_answered_with_a_long_error_body_is_retried(stored, faulty_s3, status):
    # The root cause: pyarrow's own client gives up on such a GET at once ...
    faulty_s3.inject(small_ranges_first_attempt(400), statuses=(status,))
    raw = s3_filesystem().open_input_file(f"{stored.bucket}/objects/blob.bin")
    with pytest.raises(OSError, match="Failed to flush response stream"):
        raw.read_at(50, 1000)
    # ... and reads through a Location retry it: the bytes come back whole.
    faulty_s3.inject(small_ranges_first_attempt(400), statuses=(status,))
    with stored.open_input("blob.bin") as file:
        assert file.read_at(50, 1000) == DATA[1000:1050]
        assert file.read_at(150, 99_000) == DATA[99_000:99_150]
        file.seek(0)
        assert file.read() == DATA
    assert [size for _, size in faulty_s3.faults] == [50, 150]
    assert faulty_s3.gets[f"{stored.bucket}/objects/blob.bin"] == 5


def test_parquet_reads_retry_every_small_range(faulty_s3, s3_bucket):
    location = Location.parse(f"s3://{s3_bucket}/shards")
    table = pa.table({"key": [f"k{i}" for i in range(300)], "value": list(range(300))})
    with location.write_atomic("s.parquet") as tmp:
        pq.write_table(table, tmp, row_group_size=50)
    faulty_s3.inject(small_ranges_first_attempt(400))
    shard = location.parquet_file("s.parquet")
    groups = [shard.read_row_group(group, columns=["value"]) for group in range(shard.num_row_groups)]
    assert pa.concat_tables(groups) == table.select(["value"])
    assert len(faulty_s3.faults) >= 3  # the first range of each size (row groups of equal size share one)


def test_storage_that_keeps_failing_raises_after_the_attempts(stored, faulty_s3, fast_retries):
    faulty_s3.inject(every_object_get)
    with stored.open_input("blob.bin") as file, pytest.raises(StorageError) as raised:
        file.read_at(50, 1000)
    message = str(raised.value)
    assert message.startswith(f"storage failed reading {stored.child('blob.bin')} (bytes 1000-1049) after 10 attempts")
    assert "Failed to flush response stream" in message
    assert faulty_s3.gets[f"{stored.bucket}/objects/blob.bin"] == S3_MAX_ATTEMPTS


def test_a_permanent_error_behind_a_flush_failure_is_not_retried_on(stored, faulty_s3, monkeypatch):
    """The object is deleted after it was opened: the 404's body overflows the 50-byte range too.
    The retry widens the range, the client sees the 404, and the read fails at once. The client names
    that 404 by its body when it read the whole body (NO_SUCH_KEY), else by its status
    (RESOURCE_NOT_FOUND): which one depends on how the body arrived (CI saw each)."""
    monkeypatch.setattr(locations, "S3_READ_RETRY", RetryPolicy(S3_MAX_ATTEMPTS, base_seconds=0.01))
    with stored.open_input("blob.bin") as file:
        s3_client().delete_object(Bucket=stored.bucket, Key="objects/blob.bin")
        gone = r"blob.bin \(bytes 0-49\) after 2 attempts: .*(RESOURCE_NOT_FOUND|NO_SUCH_KEY)"
        with pytest.raises(StorageError, match=gone):
            file.read_at(50, 0)
    assert faulty_s3.gets[f"{stored.bucket}/objects/blob.bin"] == 2


def test_a_missing_object_is_not_a_storage_failure(faulty_s3, s3_bucket):
    location = Location.parse(f"s3://{s3_bucket}/nothing")
    assert not location.exists("a.parquet")
    with pytest.raises(FileNotFoundError):
        location.open_input("a.parquet")


def test_backoff_is_exponential_with_full_jitter_and_capped():
    policy = RetryPolicy(10, base_seconds=1.0, max_seconds=20.0)
    for retry in range(12):
        delays = [policy.delay(retry) for _ in range(200)]
        cap = min(20.0, 2.0**retry)
        assert all(0 <= d <= cap for d in delays) and max(delays) > cap / 2
