"""io/uploads.py: a big S3 write is one multipart upload, completed, or aborted on any failure."""

import os
import signal
import sys
import threading

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
    """Ctrl-C or SIGTERM (as a terminal and the command line handle them) at any moment of a multipart upload."""
    location = Location.parse(f"s3://{s3_bucket}/out")
    client, sent, sending = s3_client(), [], threading.Lock()

    def signal_once(request=None, http_response=None, **_):
        # This test's upload only (a part of an earlier test's may still be on its way on the
        # shared client), and one signal only, though parts go out side by side.
        if s3_bucket not in (request or http_response).url:
            return
        with sending:
            if sent:
                return
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


def test_an_interrupt_while_the_server_creates_the_upload_aborts_it_however_late_its_answer(
    s3_bucket, staging, monkeypatch
):
    """Ctrl-C while CreateMultipartUpload is on its way: the server has made the upload, its id has
    not reached the caller. The caller waits for that answer, however late (here it comes only once
    the interrupt has reached the caller, and the caller spares nothing for parts on their way), and
    aborts the upload: giving up instead would leave it open, recorded nowhere."""
    monkeypatch.setattr(uploads, "PART_LANDING_SECONDS", 0.0)
    location = Location.parse(f"s3://{s3_bucket}/out")
    client, interrupted = s3_client(), threading.Event()

    def interrupt(signum, frame):  # Ctrl-C, noting that it reached the caller
        interrupted.set()
        raise KeyboardInterrupt

    def answer_late(http_response, **_):  # in the creating thread: the upload exists, its id is not handed over yet
        if s3_bucket in http_response.url:
            os.kill(os.getpid(), signal.SIGINT)
            interrupted.wait(timeout=120)  # (the timeout only keeps a broken signal path from hanging the run)

    previous = signal.signal(signal.SIGINT, interrupt)
    client.meta.events.register("after-call.s3.CreateMultipartUpload", answer_late)
    try:
        with pytest.raises(KeyboardInterrupt):
            location.write_bytes("b.parquet", os.urandom(2 * uploads.MULTIPART_PART_BYTES))
    finally:
        client.meta.events.unregister("after-call.s3.CreateMultipartUpload", answer_late)
        signal.signal(signal.SIGINT, previous)
    assert interrupted.is_set()
    assert incomplete_uploads(s3_bucket) == [] and not location.exists("b.parquet")
    assert list(staging.iterdir()) == []


class _InterruptAtLine:
    """A trace function of this thread: KeyboardInterrupt at the `at`-th line `upload_file` runs, as
    a Ctrl-C landing just there would raise it (tracing ends with it); `lines` counts them."""

    def __init__(self, at: int):
        self.at, self.lines = at, 0

    def __call__(self, frame, event, arg):
        return self._line if event == "call" and frame.f_code is uploads.upload_file.__code__ else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                raise KeyboardInterrupt
        return self._line


def test_an_interrupt_at_any_line_of_a_multipart_upload_leaves_nothing_open(s3_bucket, staging):
    """Ctrl-C before each statement of `upload_file` in turn, until one run has none left to
    interrupt: never an open upload or a staged file, and at the final name nothing or all of it
    (an interrupt after the completion comes too late to undo it). Before the creation has
    started (the interrupt at the very line that submits it), nothing is waited for."""
    location = Location.parse(f"s3://{s3_bucket}/out")
    data = os.urandom(2 * uploads.MULTIPART_PART_BYTES + 1)
    at = 0
    while True:
        at += 1
        tracer, rel = _InterruptAtLine(at), f"b{at}.parquet"
        sys.settrace(tracer)
        try:
            location.write_bytes(rel, data)
        except KeyboardInterrupt:
            assert tracer.lines == at
        else:
            assert tracer.lines < at  # every line was interrupted once: the uninterrupted run completes
            assert location.read_bytes(rel) == data
            break
        finally:
            sys.settrace(None)
        assert incomplete_uploads(s3_bucket) == [], f"interrupted at line {at}"
        assert list(staging.iterdir()) == [], f"interrupted at line {at}"
        assert not location.exists(rel) or location.read_bytes(rel) == data, f"interrupted at line {at}"
    assert at > 10  # it ran through upload_file, not some other path
