"""Dataset locations: a local folder or an `s3://bucket/prefix`, behind one interface.

Reads go through pyarrow's filesystem (random access, so Parquet is streamed by row
group); listing and uploads go through boto3 (paginated listing, and an upload that
either completes or leaves nothing: io/uploads.py). Both take S3 settings from the standard
AWS chain, `AWS_ENDPOINT_URL` included, and retry transient errors with backoff (io/s3.py);
S3 reads also retry the one transient error pyarrow's client does not (io/retry.py). Reading
or listing that still fails raises `StorageError`. What interrupted writes leave, and how it
is removed: io/leftovers.py.

Commits can be guarded (`commit_guard`): a callable that raises to forbid the commit is called
right before every `write_atomic` publishes (the rename, the upload). A Dagster run's step installs
its run fence's ownership check there (defs/fencing.py), so a run worker that lost its run (failed
by monitoring, retried elsewhere) never publishes a shard the retry builds.
"""

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from fixed_res_sidecar.core.errors import describe_exception
from fixed_res_sidecar.io.leftovers import (
    NAME_MAX_BYTES,
    STALE_TEMPORARY_SECONDS,
    TEMP_DIR_PREFIX,
    TEMPORARY_NAME,
    UPLOAD_RECORD_SUFFIX,
    Cleanup,
    abort_stale_uploads,
    fitting_name,
    remove_local_leftovers,
    remove_stale_file,
    remove_temp_dir_leftovers,
    temporary_stem,
    writer_tag,
)
from fixed_res_sidecar.io.retry import RetryingFile, RetryPolicy, StorageError
from fixed_res_sidecar.io.s3 import S3_MAX_ATTEMPTS, s3_client, s3_filesystem
from fixed_res_sidecar.io.uploads import upload_file

SHARD_SUFFIX = ".parquet"
S3_KEY_MAX_BYTES = 1024
S3_READ_RETRY = RetryPolicy(S3_MAX_ATTEMPTS)  # the same attempts and backoff as boto3's standard mode


_COMMIT_GUARDS: list[Callable[[], None]] = []  # this process's, innermost last


@contextlib.contextmanager
def commit_guard(check: Callable[[], None] | None) -> Iterator[None]:
    """While inside: `check()` runs right before each `write_atomic` of this process publishes, and what
    it raises aborts that write (the temporary is removed, nothing appears at the final name)."""
    if check is None:
        yield
        return
    _COMMIT_GUARDS.append(check)
    try:
        yield
    finally:
        _COMMIT_GUARDS.remove(check)


def _before_commit() -> None:
    for check in list(_COMMIT_GUARDS):
        check()


class ShardEntry(NamedTuple):
    """A shard as a listing shows it."""

    rel: str
    size: int
    stamp: str  # changes when the object is rewritten: "size:mtime_ns:ctime_ns:inode" locally, "size:etag" on S3


def _local_stamp(stat: os.stat_result) -> str:
    """A local file's identity from one stat: size and modification time, which a same-size rewrite can
    restore (`touch -d`, `os.utime`, `rsync -t`), and what nobody can set back: the inode's change time
    (set by every write and every `utime`) and the inode's number (another file renamed over it).
    Also changed by chmod, chown, a new hard link or a copy: such a shard counts as changed (rebuilt, to
    the same bytes). A content hash would cost a full read of every main shard on every check."""
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}"


def _s3_stamp(size: int, etag: str) -> str:
    return f"{size}:{etag.strip(chr(34))}"


class LocationError(ValueError):
    """A location that must not be used the way it was asked to be."""


@dataclass(frozen=True)
class Location:
    """A dataset root. Shards and reports are addressed by a relative path `rel` under it."""

    scheme: str  # "file" or "s3"
    bucket: str  # "" for local
    path: str  # absolute local path, or the key prefix without slashes at either end

    @classmethod
    def parse(cls, uri: str | os.PathLike) -> "Location":
        text = os.fspath(uri).strip()
        if not text:
            raise LocationError("a location must not be empty")
        if text.startswith("s3://"):
            bucket, _, prefix = text[len("s3://") :].partition("/")
            if not bucket:
                raise LocationError(f"{text!r} has no bucket")
            parts = [p for p in prefix.split("/") if p]
            if any(p in (".", "..") for p in parts):
                raise LocationError(f"{text!r} must not contain '.' or '..' segments")
            return cls("s3", bucket, "/".join(parts))
        if "://" in text:
            raise LocationError(f"{text!r}: only local paths and s3:// URIs are supported")
        return cls("file", "", str(Path(text).expanduser().resolve()))

    @property
    def is_s3(self) -> bool:
        return self.scheme == "s3"

    @property
    def uri(self) -> str:
        if self.is_s3:
            return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"
        return self.path

    def __str__(self) -> str:
        return self.uri

    def _parts(self) -> tuple[str, ...]:
        if self.is_s3:
            return (self.bucket, *[p for p in self.path.split("/") if p])
        return Path(self.path).parts

    def overlaps(self, other: "Location") -> bool:
        """True when one location is the other, is inside it, or holds it."""
        if self.scheme != other.scheme:
            return False
        a, b = self._parts(), other._parts()
        n = min(len(a), len(b))
        return a[:n] == b[:n]

    def child(self, rel: str) -> str:
        """The full URI (or local path) of `rel` under this location."""
        rel = _check_rel(rel)
        if self.is_s3:
            return f"s3://{self.bucket}/{self._key(rel)}"
        return str(Path(self.path, rel))

    def _key(self, rel: str) -> str:
        return f"{self.path}/{rel}" if self.path else rel

    def _fs_path(self, rel: str) -> str:
        return f"{self.bucket}/{self._key(rel)}" if self.is_s3 else str(Path(self.path, rel))

    @property
    def filesystem(self) -> pafs.FileSystem:
        return s3_filesystem() if self.is_s3 else pafs.LocalFileSystem()

    # -- listing -------------------------------------------------------------------

    def iter_shard_pages(
        self, suffix: str = SHARD_SUFFIX, page_size: int = 1000, start_after: str | None = None
    ) -> Iterator[list[str]]:
        """Relative paths of shards at any depth, in pages, in key order, after `start_after`.

        `start_after` lets a sensor resume a listing of 100,000 shards without reading it all.
        """
        for page in self.iter_shard_entries(suffix, page_size, start_after):
            yield [entry.rel for entry in page]

    def list_shards(self, suffix: str = SHARD_SUFFIX) -> list[str]:
        """Every shard's (or, with another `suffix`, file's) relative path at any depth, sorted."""
        return list(self.shard_sizes(suffix))

    def shard_sizes(self, suffix: str = SHARD_SUFFIX) -> dict[str, int]:
        """rel -> bytes of every shard, sorted by rel (what `aws s3 ls --recursive` shows)."""
        return dict(sorted((e.rel, e.size) for page in self.iter_shard_entries(suffix, 1000) for e in page))

    def shard_stamps(self, suffix: str = SHARD_SUFFIX) -> dict[str, str]:
        """rel -> stamp (what `fingerprint` gives) of every shard, from one listing (no stat or HEAD per shard)."""
        return {e.rel: e.stamp for page in self.iter_shard_entries(suffix, 1000) for e in page}

    def iter_shard_entries(
        self, suffix: str = SHARD_SUFFIX, page_size: int = 1000, start_after: str | None = None
    ) -> Iterator[list["ShardEntry"]]:
        """Shards at any depth with their size and stamp (what `fingerprint` gives), in pages, in key order."""
        if self.is_s3:
            paginator = s3_client().get_paginator("list_objects_v2")
            prefix = f"{self.path}/" if self.path else ""
            extra = {"StartAfter": prefix + start_after} if start_after else {}
            pages = paginator.paginate(
                Bucket=self.bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size}, **extra
            )
            for page in _storage_errors(pages, f"listing {self.uri}"):
                entries = [
                    ShardEntry(obj["Key"][len(prefix) :], obj["Size"], _s3_stamp(obj["Size"], obj["ETag"]))
                    for obj in page.get("Contents", [])
                ]
                entries = [entry for entry in entries if _is_shard(entry.rel, suffix)]
                if entries:
                    yield entries
            return
        found, _ = self._walk_local(suffix, start_after)
        for start in range(0, len(found), page_size):
            yield found[start : start + page_size]

    def skipped_symlinks(self, suffix: str = SHARD_SUFFIX) -> dict[str, str]:
        """rel -> where it points, for every symbolic link the local listing did not follow.

        A dataset is what is stored under its folder: a symlinked shard or folder may point
        anywhere (another dataset, an output that gets rewritten), so the listing never
        follows one. Callers report these so nothing is skipped silently. Always empty on S3.
        """
        return {} if self.is_s3 else self._walk_local(suffix)[1]

    def _walk_local(self, suffix: str, start_after: str | None = None) -> tuple[list["ShardEntry"], dict[str, str]]:
        """(sorted entries of shards, rel -> target of symlinks not followed), after `start_after`.

        Hidden folders are skipped; a folder whose every path sorts at or before `start_after` is
        not read at all, so a tick that resumes late in a large dataset does not walk it whole.

        A folder that cannot be read (no permission, vanished meanwhile, an I/O error) raises
        StorageError naming it: leaving it out would make its shards look removed. Only a root
        that does not exist lists as empty, as an S3 prefix without objects does (an output
        before its first shard); a root that is a file raises LocationError (bad configuration).
        """
        found, links = [], {}
        folders = [""]
        while folders:
            folder = folders.pop()
            path = os.path.join(self.path, folder) if folder else self.path
            try:
                entries = list(os.scandir(path))
                for entry in entries:
                    rel = f"{folder}/{entry.name}" if folder else entry.name
                    is_dir = entry.is_dir()  # a link to a folder counts as a folder, as os.walk sees it
                    if is_dir and entry.name.startswith("."):
                        continue
                    if entry.is_symlink():  # never followed
                        if is_dir or _is_shard(rel, suffix):
                            links[rel] = os.readlink(entry.path)
                    elif is_dir:
                        if start_after is None or not _sorts_before(rel + "/", start_after):
                            folders.append(rel)
                    elif _is_shard(rel, suffix) and (start_after is None or rel > start_after):
                        stat = entry.stat(follow_symlinks=False)
                        found.append(ShardEntry(rel, stat.st_size, _local_stamp(stat)))
            except OSError as exc:
                if not folder and not os.path.lexists(path):
                    break  # the root does not exist: no shards
                if not folder and not os.path.isdir(path):  # not storage failing: a wrong location
                    what = "a file" if os.path.isfile(path) else "not a folder"
                    raise LocationError(f"{self.uri} is {what}, not a folder of shards") from None
                raise StorageError(
                    f"storage failed listing {path} (in {self.uri}): {describe_exception(exc, 300)}"
                ) from exc
        found.sort()
        return found, dict(sorted(links.items()))

    # -- reading -------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        return self.size(rel) is not None

    def size(self, rel: str) -> int | None:
        """Bytes of the file at `rel`, None when there is none; StorageError when storage cannot say."""
        path = self._fs_path(_check_rel(rel))
        try:
            info = self.filesystem.get_file_info(path)
        except OSError as exc:
            raise StorageError(f"storage failed looking up {self.child(rel)}: {describe_exception(exc, 300)}") from exc
        return info.size if info.type == pafs.FileType.File else None

    def open_input(self, rel: str) -> pa.NativeFile:
        """A random-access file for `rel`. On S3 every read rides out transient errors with the
        build's retry policy, and a read that keeps failing raises StorageError."""
        path = self._fs_path(_check_rel(rel))
        if not self.is_s3:
            return self.filesystem.open_input_file(path)
        try:
            raw = self.filesystem.open_input_file(path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StorageError(f"storage failed opening {self.child(rel)}: {describe_exception(exc, 300)}") from exc
        return pa.PythonFile(RetryingFile(raw, self.child(rel), S3_READ_RETRY), mode="r")

    def parquet_file(self, rel: str) -> pq.ParquetFile:
        """`rel` as Parquet. Every page read is checked against its checksum, where the writer
        stored one (ours do): a damaged page raises instead of returning wrong values."""
        return pq.ParquetFile(self.open_input(rel), page_checksum_verification=True)

    def read_bytes(self, rel: str) -> bytes:
        with self.open_input(rel) as f:
            return f.read()

    def fingerprint(self, rel: str) -> str | None:
        """What changes when the object at `rel` is rewritten: size, modification and change times and inode
        locally (`_local_stamp`), size and ETag on S3 (one stat or HEAD; nothing is read). None when it does
        not exist."""
        rel = _check_rel(rel)
        if self.is_s3:
            try:
                head = s3_client().head_object(Bucket=self.bucket, Key=self._key(rel))
            except s3_client().exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise
            return _s3_stamp(head["ContentLength"], head["ETag"])
        try:
            return _local_stamp(os.stat(Path(self.path, rel)))
        except FileNotFoundError:
            return None

    def link(self, rel: str, expires_seconds: int = 7 * 24 * 3600) -> str:
        """Where a person can open `rel`: a presigned HTTPS URL on S3 (at most 7 days), else the local path."""
        if not self.is_s3:
            return self.child(rel)
        return s3_client().generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(_check_rel(rel))}, ExpiresIn=expires_seconds
        )

    # -- writing -------------------------------------------------------------------

    @contextlib.contextmanager
    def write_atomic(self, rel: str, protect: Sequence["Location"] = ()) -> Iterator[str]:
        """Yield a local temporary path; when the block succeeds, publish it at `rel` whole.

        Local: a hidden temporary file in the target folder, renamed over the final
        name. S3: a file staged in TMPDIR, uploaded with one PUT or one completed
        multipart upload. On error (Ctrl-C and SIGTERM included) the temporary is removed
        and the upload aborted; after a crash, nothing appears at the final name and a
        later write removes what is left (see io/leftovers.py).

        Nothing is written at, inside or above a `protect` location: the check compares the
        locations, and locally also the real path of every file and folder this creates or
        renames (symbolic links resolved in every component), before and after creating
        folders and again just before the rename.
        """
        rel = self.check_name(rel)
        target = Location.parse(self.child(rel)) if self.is_s3 else Location(self.scheme, "", str(Path(self.path, rel)))
        check_writable(target, [("the read-only location", p) for p in protect], what="refusing to write")
        if self.is_s3:
            yield from self._write_s3(rel)
            return
        final = Path(self.path, rel)
        _refuse_protected_real_path(final, protect)
        final.parent.mkdir(parents=True, exist_ok=True)
        _refuse_protected_real_path(final, protect)  # a link may have appeared meanwhile
        self.remove_stale_temporaries(rel, older_than=STALE_TEMPORARY_SECONDS)
        tmp = final.with_name(f".{temporary_stem(final.name)}.{writer_tag()}-{uuid.uuid4().hex[:8]}.tmp")
        try:
            yield str(tmp)
            _refuse_protected_real_path(final, protect)
            _before_commit()
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def _write_s3(self, rel: str) -> Iterator[str]:
        key = self._key(rel)
        # Leftovers of writers killed on this machine. Best effort: a write never fails for someone else's.
        with contextlib.suppress(Exception):
            remove_temp_dir_leftovers()
        tmp_dir = tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}{writer_tag()}-")
        # The staged file's name is only for people; its upload's record is named after it.
        tmp = os.path.join(tmp_dir, fitting_name(PurePosixPath(rel).name, NAME_MAX_BYTES - len(UPLOAD_RECORD_SUFFIX)))
        try:
            yield tmp
            _before_commit()
            upload_file(s3_client(), tmp, self.bucket, key)
        finally:
            if os.path.exists(tmp + UPLOAD_RECORD_SUFFIX):  # an upload that could not be aborted: keep its record
                Path(tmp).unlink(missing_ok=True)
            else:
                shutil.rmtree(tmp_dir, ignore_errors=True)

    def check_name(self, rel: str) -> str:
        """`rel`, when this location can hold a file by that name; else LocationError, before any work.

        Locally every file and folder name takes at most NAME_MAX_BYTES bytes; on S3 a key at most
        S3_KEY_MAX_BYTES. (Names of temporaries are shortened to fit: io/leftovers.py.) The message
        says why first: the path, named last, may be long.
        """
        rel = _check_rel(rel)
        if self.is_s3:
            size = len(self._key(rel).encode("utf-8", "surrogateescape"))
            if size > S3_KEY_MAX_BYTES:
                raise LocationError(
                    f"{size}-byte key, longer than S3 allows ({S3_KEY_MAX_BYTES} bytes): cannot write {self.child(rel)}"
                )
            return rel
        longest = max(len(os.fsencode(name)) for name in rel.split("/"))
        if longest > NAME_MAX_BYTES:
            raise LocationError(
                f"{longest}-byte name, longer than a file name can be ({NAME_MAX_BYTES} bytes): "
                f"cannot write {self.child(rel)}"
            )
        return rel

    def write_bytes(self, rel: str, data: bytes, protect: Sequence["Location"] = ()) -> None:
        with self.write_atomic(rel, protect) as tmp:
            Path(tmp).write_bytes(data)

    @classmethod
    def file(cls, uri: str | os.PathLike) -> tuple["Location", str]:
        """A single file's URI as (its folder, its name), to write it like any other `rel`."""
        target = cls.parse(uri)
        if target.is_s3:
            folder, _, name = target.path.rpartition("/")
            if not name:
                raise LocationError(f"{target.uri!r} needs a key under a bucket")
            return cls("s3", target.bucket, folder), name
        path = Path(target.path)
        return cls("file", "", str(path.parent)), path.name

    def remove_stale_temporaries(self, rel: str, older_than: float = 0.0) -> int:
        """Delete temporaries that interrupted local writes left beside `rel`: those whose writer
        is dead (same machine) or that have not changed for `older_than` s. Returns how many."""
        if self.is_s3:
            return 0
        final = Path(self.path, _check_rel(rel))
        stem = temporary_stem(final.name)
        now = time.time()
        removed = 0
        for tmp in final.parent.glob(f".{stem}.*.tmp") if final.parent.is_dir() else []:
            match = TEMPORARY_NAME.fullmatch(tmp.name)
            if match and match["name"] == stem and remove_stale_file(tmp, match, now, older_than):
                removed += 1
        return removed

    def remove_leftovers(self, older_than: float = STALE_TEMPORARY_SECONDS) -> Cleanup:
        """Remove what interrupted writes left anywhere under this location (a command does this first).

        Local: this package's hidden temporaries (`.<name>.<machine>-<pid>-<random>.tmp`) whose
        writer is dead (same machine, pid gone) or that have not changed for `older_than` s;
        symbolic links are never followed. S3: incomplete multipart uploads of output files
        (keys under this prefix ending in .parquet, .json or .png) initiated more than
        `older_than` s ago; the uploads of writers that died on this machine are aborted at
        once by `remove_temp_dir_leftovers`, which knows their IDs.
        """
        if self.is_s3:
            return abort_stale_uploads(s3_client(), self.bucket, f"{self.path}/" if self.path else "", older_than)
        return remove_local_leftovers(self.path, older_than)


def check_writable(output: Location, others: Iterable[tuple[str, Location]], what: str = "output") -> None:
    """Refuse an output at, inside or above any of `others` ((description, location) pairs).

    SPEC 2's one rule: nothing is written at, inside or above the main dataset (or any other
    input, or another output). Configuration checks, the command line and the write path
    all ask this function.
    """
    for description, location in others:
        if output.overlaps(location):
            raise LocationError(f"{what} {output.uri} is at, inside or above {description} {location.uri}")


def check_output_location(main: Location, output: Location, what: str = "output location") -> None:
    """Refuse an output at, inside or above the main dataset (SPEC 2)."""
    check_writable(output, [("the read-only main dataset", main)], what)


def _refuse_protected_real_path(path: Path, protect: Sequence[Location]) -> None:
    """Refuse a local write whose real path (every symlink resolved) is at, inside or above a protected location."""
    real = Path(os.path.realpath(path))
    for protected in protect:
        if protected.is_s3:
            continue
        protected_real = Path(os.path.realpath(protected.path))
        n = min(len(real.parts), len(protected_real.parts))
        if real.parts[:n] == protected_real.parts[:n]:
            raise LocationError(
                f"refusing to write {path}: through symbolic links it is {real}, at, inside or above "
                f"{protected.uri}, which is read-only"
            )


def _storage_errors(items: Iterable, what: str) -> Iterator:
    """`items`, with boto3's errors (raised after its own retries) as StorageError naming `what`."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield from items
    except (BotoCoreError, ClientError) as exc:
        raise StorageError(f"storage failed {what}: {describe_exception(exc, 300)}") from exc


def _sorts_before(prefix: str, key: str) -> bool:
    """Whether every path starting with `prefix` sorts at or before `key`."""
    return prefix < key and not key.startswith(prefix)


def _is_shard(rel: str, suffix: str) -> bool:
    return rel.endswith(suffix) and not any(part.startswith(".") for part in rel.split("/"))


def _check_rel(rel: str) -> str:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise LocationError(f"{rel!r} is not a relative shard path")
    return rel
