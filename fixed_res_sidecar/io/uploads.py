"""Publishing a staged file to S3: one PUT, or one multipart upload that is completed or aborted.

While a multipart upload is open, a record of it lies beside the staged file, so that a later
run on this machine aborts it if this process is killed (io/leftovers.py).
"""

import contextlib
import functools
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.io.leftovers import (
    STALE_TEMPORARY_SECONDS,
    UPLOAD_RECORD_SUFFIX,
    abort_stale_uploads,
    abort_upload,
)

# An S3 write of this size or more is one multipart upload of parts this size (S3's minimum
# part is 5 MiB, its maximum part count 10,000), a few parts at a time; smaller, one PUT.
MULTIPART_THRESHOLD_BYTES = 8 * 2**20
MULTIPART_PART_BYTES = 8 * 2**20
MULTIPART_MAX_PARTS = 10_000
MULTIPART_THREADS = 4
PART_LANDING_SECONDS = 2.0  # on failure, how long parts already on their way may take before the abort


def upload_file(client, path: str, bucket: str, key: str) -> None:
    """Publish the file at `path` as `key`: one PUT, or one multipart upload, completed or aborted."""
    size = os.path.getsize(path)
    if size < MULTIPART_THRESHOLD_BYTES:
        with open(path, "rb") as body:
            client.put_object(Bucket=bucket, Key=key, Body=body)
        return
    # Stale uploads of this very key (best effort: listing uploads may not be allowed).
    with contextlib.suppress(Exception):
        abort_stale_uploads(client, bucket, key, STALE_TEMPORARY_SECONDS, exact=True)
    # As boto3's own transfers do: CRC32 part checksums unless the AWS config says "when_required".
    checksum = {"ChecksumAlgorithm": "CRC32"} if _checksums_by_default(client) else {}
    pool = ThreadPoolExecutor(MULTIPART_THREADS, thread_name_prefix="upload-part")
    # Created in a thread: an interrupt of this thread (Ctrl-C, SIGTERM) that lands after the
    # server made the upload but before its id got here would otherwise lose the id to abort.
    # The future exists before the thread starts, so no interrupt can come between them either;
    # on the way out it is cancelled if the creation has not started, else awaited.
    created: Future = Future()
    record = Path(path + UPLOAD_RECORD_SUFFIX)
    parts: list[Future] = []
    try:
        pool.submit(_create_upload, created, client, bucket, key, checksum)
        upload_id = created.result()
        # If this process is killed, a later run on this machine finds the record and aborts the upload.
        record.write_text(json.dumps({"bucket": bucket, "key": key, "upload_id": upload_id}))
        part_bytes = max(MULTIPART_PART_BYTES, -(-size // MULTIPART_MAX_PARTS))
        send = functools.partial(_upload_part, client, path, part_bytes, bucket, key, upload_id, checksum)
        parts = [pool.submit(send, number) for number in range(1, -(-size // part_bytes) + 1)]
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": [p.result() for p in parts]}
        )
        # Still under the handler: an interrupt here (joining the threads takes a moment) must not
        # leave the record, which keeps its staging folder (aborting a completed upload is a no-op).
        pool.shutdown()
        record.unlink(missing_ok=True)
    except BaseException as exc:
        pool.shutdown(wait=False, cancel_futures=True)  # no further part starts
        upload_id = _created_upload_id(created)
        if upload_id is None or _abandon_upload(client, bucket, key, upload_id, parts, exc):
            record.unlink(missing_ok=True)
        raise


def _create_upload(created: Future, client, bucket: str, key: str, checksum: dict) -> None:
    if not created.set_running_or_notify_cancel():
        return  # the caller was interrupted before this started: it never starts
    try:
        created.set_result(client.create_multipart_upload(Bucket=bucket, Key=key, **checksum)["UploadId"])
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        created.set_exception(exc)


def _created_upload_id(created: Future) -> str | None:
    """The id of the upload `created` holds, for a caller on its way out; None if there is none.

    A creation that has not started is cancelled: it never starts. One that has is awaited,
    however long the server takes to answer (the client's timeouts and retries bound it): the
    server may have made the upload already, and without its id neither this process nor a later
    run could abort it (the record needs the id). Giving up sooner gains nothing: the process's
    exit waits for the creating thread anyway, and a stopping worker that runs out of time is
    killed by its parent (runner.py), which leaves no more than giving up would.
    """
    if created.cancel():
        return None
    try:
        return created.result()
    except Exception:  # noqa: BLE001 - not created (or not known to be: the next runs' stale sweep removes it)
        return None


def _checksums_by_default(client) -> bool:
    return getattr(client.meta.config, "request_checksum_calculation", None) != "when_required"


def _upload_part(
    client, path: str, part_bytes: int, bucket: str, key: str, upload_id: str, checksum: dict, number: int
) -> dict:
    """Upload part `number` (from 1) of the file at `path`; its entry for completing the upload."""
    with open(path, "rb") as f:
        f.seek((number - 1) * part_bytes)
        data = f.read(part_bytes)
    response = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data, **checksum)
    part = {"PartNumber": number, "ETag": response["ETag"]}
    if "ChecksumCRC32" in response:
        part["ChecksumCRC32"] = response["ChecksumCRC32"]
    return part


def _abandon_upload(client, bucket: str, key: str, upload_id: str, parts: list[Future], error: BaseException) -> bool:
    """Abort a multipart upload that failed with `error`; False (and a note on `error`) if that failed too."""
    try:
        # Parts in flight land before the abort, so it frees them too; a stopping process has only
        # seconds, so the wait is short (a part landing after the abort fails: no such upload).
        wait(parts, timeout=PART_LANDING_SECONDS)
    finally:
        try:
            abort_upload(client, bucket, key, upload_id)
        except Exception as abort_error:  # noqa: BLE001 - `error` is what the caller sees; this is its note
            error.add_note(
                f"the incomplete upload {upload_id} of s3://{bucket}/{key} could not be aborted "
                f"({describe_exception(abort_error, max_chars=200)}); the next run removes it"
            )
            return False
    return True
