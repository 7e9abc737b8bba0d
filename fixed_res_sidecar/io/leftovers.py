"""What interrupted writes leave, how it is named, and the sweeps that remove it.

A write that is interrupted (an exception, Ctrl-C, SIGTERM) removes its temporary
and aborts its multipart upload on the way out. A writer killed outright (SIGKILL, out of
memory) cannot; what it leaves carries its name (`<machine>-<pid>`, the machine being this
kernel boot and pid namespace), so a later writer on the same machine removes it as soon as
that pid is gone, and any writer once it is older than `STALE_TEMPORARY_SECONDS`:
`Location.remove_leftovers` (a whole output, at the start of a command) and
`remove_temp_dir_leftovers` (the S3 staging folders in TMPDIR), and each write beside its own file.
"""

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.io.s3 import s3_client

OUTPUT_SUFFIXES = (".parquet", ".json", ".png")  # what the commands write: shards, reports, overlays
# A leftover whose writer is not known to be dead is removed once it has not changed for this
# long (local temporaries, TMPDIR staging folders) or was initiated this long ago (incomplete
# multipart uploads): far longer than writing or uploading one shard takes.
STALE_TEMPORARY_SECONDS = 6 * 3600
TEMP_DIR_PREFIX = "sidecar-"  # S3 writes stage their file in TMPDIR/sidecar-<machine>-<pid>-<random>/
UPLOAD_RECORD_SUFFIX = ".multipart-upload.json"  # beside the staged file while its upload is open

NAME_MAX_BYTES = 255  # the longest file or folder name of common local file systems (NAME_MAX: ext4, XFS, Btrfs)
# A temporary adds `.` before the name and `.<machine>-<pid>-<random>.tmp` after it: at most 31 bytes
# (8 hex digits, a pid of at most 7 digits, 8 of random), so names of up to 224 bytes are kept whole.
TEMPORARY_STEM_BYTES = NAME_MAX_BYTES - len(".." + "0" * 8 + "-" + "0" * 7 + "-" + "0" * 8 + ".tmp")
# `.<name>.<machine>-<pid>-<random>.tmp`; `.<name>.<12 hex>.tmp` from versions that did not name the writer.
TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.(?:(?P<machine>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}|[0-9a-f]{12})\.tmp")
# `sidecar-<machine>-<pid>-<mkdtemp's 8>`; `sidecar-<mkdtemp's 8>` from versions that did not name the writer.
_TEMP_DIR_NAME = re.compile(r"sidecar-(?:(?P<machine>[0-9a-f]{8})-(?P<pid>\d+)-[a-z0-9_]{8}|[a-z0-9_]{8})")


@dataclass
class Cleanup:
    """What a sweep for leftovers of interrupted writes removed, and what it had to leave."""

    removed: list[str] = field(default_factory=list)  # paths, and uploads as `s3://bucket/key (upload ID)`
    problems: list[str] = field(default_factory=list)  # what could not be removed, and why

    def add(self, other: "Cleanup") -> None:
        self.removed += other.removed
        self.problems += other.problems


def remove_local_leftovers(root: str, older_than: float) -> Cleanup:
    """Remove this package's hidden temporaries anywhere under the local folder `root` whose
    writer is dead (same machine, pid gone) or that have not changed for `older_than` s."""
    cleanup = Cleanup()
    now = time.time()
    for folder, dirs, files in os.walk(root):  # never descends into a symlinked folder
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            path = Path(folder, name)
            try:
                if (match := TEMPORARY_NAME.fullmatch(name)) and remove_stale_file(path, match, now, older_than):
                    cleanup.removed.append(str(path))
            except OSError as exc:
                cleanup.problems.append(f"{path}: {describe_exception(exc, max_chars=200)}")
    return cleanup


def abort_stale_uploads(client, bucket: str, prefix: str, older_than: float, exact: bool = False) -> Cleanup:
    """Abort incomplete uploads of output files under `prefix` (or of the key `prefix`) started
    more than `older_than` s ago."""
    cutoff = datetime.now(UTC) - timedelta(seconds=older_than)
    cleanup = Cleanup()
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        for upload in page.get("Uploads", []):
            key, upload_id = upload["Key"], upload["UploadId"]
            if (key == prefix if exact else key.endswith(OUTPUT_SUFFIXES)) and upload["Initiated"] <= cutoff:
                try:
                    if abort_upload(client, bucket, key, upload_id):
                        cleanup.removed.append(f"s3://{bucket}/{key} (incomplete upload {upload_id})")
                except Exception as exc:  # noqa: BLE001 - reported; a later run tries again
                    cleanup.problems.append(f"s3://{bucket}/{key}: {describe_exception(exc, max_chars=200)}")
    return cleanup


def remove_temp_dir_leftovers(older_than: float = STALE_TEMPORARY_SECONDS) -> Cleanup:
    """Remove the TMPDIR staging folders of S3 writers that died, aborting the uploads they record.

    A folder is this package's when its name is `sidecar-<machine>-<pid>-<random>`; it is removed
    when that machine is this one and the pid is gone, or when nothing in it changed for
    `older_than` s. Folders named `sidecar-<random>` (earlier versions) count only when they hold
    nothing but one output file (.parquet, .json, .png), and only by age. When a recorded upload
    cannot be aborted, its folder stays for a later run, unless it is that old.
    """
    cleanup = Cleanup()
    now = time.time()
    with os.scandir(tempfile.gettempdir()) as entries:
        for entry in entries:
            if not (match := _TEMP_DIR_NAME.fullmatch(entry.name)) or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                _remove_temp_dir(Path(entry.path), match, now, older_than, cleanup)
            except OSError as exc:
                cleanup.problems.append(f"{entry.path}: {describe_exception(exc, max_chars=200)}")
    return cleanup


def _remove_temp_dir(folder: Path, match: re.Match, now: float, older_than: float, cleanup: Cleanup) -> None:
    files = list(folder.iterdir())
    changed = max([folder.lstat().st_mtime, *(f.lstat().st_mtime for f in files)])
    if match["machine"] is None and not (len(files) <= 1 and all(_is_output_file(f) for f in files)):
        return  # an old-style name on a folder that does not look like one of ours
    if not _writer_gone(match, changed, now, older_than):
        return
    for record in [f for f in files if f.name.endswith(UPLOAD_RECORD_SUFFIX)]:
        try:
            upload = json.loads(record.read_text())
            if abort_upload(s3_client(), upload["bucket"], upload["key"], upload["upload_id"]):
                cleanup.removed.append(
                    f"s3://{upload['bucket']}/{upload['key']} (incomplete upload {upload['upload_id']})"
                )
        except Exception as exc:  # noqa: BLE001 - reported; the folder stays for a later run, unless it is old
            cleanup.problems.append(f"{record}: {describe_exception(exc, max_chars=200)}")
            if changed > now - older_than:
                return
    shutil.rmtree(folder)
    cleanup.removed.append(str(folder))


def _is_output_file(path: Path) -> bool:
    return stat.S_ISREG(path.lstat().st_mode) and path.name.endswith(OUTPUT_SUFFIXES)


def remove_stale_file(path: Path, match: re.Match, now: float, older_than: float) -> bool:
    """Unlink `path` (a regular file named like a temporary) if its writer is gone; True if removed."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or not _writer_gone(match, info.st_mtime, now, older_than):
            return False
        path.unlink()
    except FileNotFoundError:  # its writer finished, or another sweep removed it meanwhile
        return False
    return True


def _writer_gone(match: re.Match, changed: float, now: float, older_than: float) -> bool:
    """The writer named in a leftover's name is dead (same machine, pid gone), or it has not changed for `older_than` s."""
    if match["machine"] == machine_id() and int(match["pid"]) != os.getpid() and not _pid_alive(int(match["pid"])):
        return True
    return changed <= now - older_than


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs here (a zombie has exited; another process reusing the pid counts)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2] not in "ZX"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@functools.cache
def machine_id() -> str:
    """8 hex digits for this host, kernel boot and pid namespace: where a writer's pid means that writer."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def fitting_name(name: str, max_bytes: int) -> str:
    """`name` when it takes at most `max_bytes` bytes, else its start and a hash of it all, in `max_bytes`.

    Temporaries and staged files are named after the file they become, with more around it: a name
    that is legal for the file itself must not make theirs too long to create.
    """
    encoded = os.fsencode(name)
    if len(encoded) <= max_bytes:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    return os.fsdecode(encoded[: max_bytes - len(digest) - 1]) + "~" + digest


def temporary_stem(name: str) -> str:
    """What the temporaries of the file `name` are named after (their `name` in TEMPORARY_NAME)."""
    return fitting_name(name, TEMPORARY_STEM_BYTES)


def writer_tag() -> str:
    """`<machine>-<pid>`: who writes a temporary, so that a later writer can tell when it is dead."""
    return f"{machine_id()}-{os.getpid()}"


def abort_upload(client, bucket: str, key: str, upload_id: str) -> bool:
    """Abort an incomplete multipart upload; False when it was already gone (completed or aborted)."""
    from botocore.exceptions import ClientError

    try:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchUpload", "404"):
            return False
        raise
    return True
