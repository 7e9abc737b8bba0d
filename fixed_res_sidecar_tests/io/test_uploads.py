"""io/uploads.py: a big S3 write is one multipart upload, completed, or aborted on any failure."""

import os
import signal

import pytest
from botocore.exceptions import ClientError

from fixed_res_sidecar.io import uploads
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.io.s3 import s3_client
from fixed_res_sidecar.shards.runner import Terminated, raise_terminated
from fixed_res_sidecar_tests.fixtures.s3 import incomplete_uploads


def test_a_big_s3_write_is_one_completed_multipart_upload(s3_bucket, staging):
    data = os.urandom(uploads.MULTIPART_PART_BYTES * 2 + 12345)
    location = Location.parse(f"s3://{s3_bucket}/out")
    location.write_bytes("big.parquet", data)
    assert location.read_bytes("big.parquet") == data
    head = s3_client().head_object(Bucket=s3_bucket, Key="out/big.parquet")
    assert head["ETag"].endswith('-3"')  # three parts
    assert incomplete_uploads(s3_bucket) == [] and list(staging.iterdir()) == []


def test_a_multipart_upload_the_server_refuses_is_aborted(s3_bucket, staging, monkeypatch):
    # Parts under S3's 5 MiB minimum: the server refuses to complete the upload (EntityTooSmall).
    monkeypatch.setattr(uploads, "MULTIPART_THRESHOLD_BYTES", 2**20)
    monkeypatch.setattr(uploads, "MULTIPART_PART_BYTES", 2**20)
    location = Location.parse(f"s3://{s3_bucket}/out")
    with pytest.raises(ClientError, match="EntityTooSmall"):
        location.write_bytes("b.parquet", os.urandom(3 * 2**20))
    assert incomplete_uploads(s3_bucket) == [] and not location.exists("b.parquet")
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
@pytest.mark.parametrize(
    "moment",
    [
        "before-send.s3.UploadPart",  # while a part is on its way
        "after-call.s3.CreateMultipartUpload",  # the server made the upload, its id is not yet the caller's
    ],
)
def test_a_signal_during_a_multipart_upload_aborts_it(s3_bucket, staging, signum, raised, moment):
    """Ctrl-C or SIGTERM (as the command line handles it) at any moment of a multipart upload."""
    location = Location.parse(f"s3://{s3_bucket}/out")
    client, sent = s3_client(), []

    def signal_once(**_):
        if not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    client.meta.events.register(moment, signal_once)
    try:
        with pytest.raises(raised):
            location.write_bytes("b.parquet", os.urandom(3 * uploads.MULTIPART_PART_BYTES))
    finally:
        client.meta.events.unregister(moment, signal_once)
        signal.signal(signal.SIGTERM, previous)
    assert sent == [signum]
    assert incomplete_uploads(s3_bucket) == [] and not location.exists("b.parquet")
    assert list(staging.iterdir()) == []
