"""The one retry helper (`retry_call`), its policy, and `StorageError`, the one family of
"storage kept failing" errors.

Every retry of the project goes through `retry_call`: S3 reads here (`RetryingFile`) and the
Dagster instance's storage calls (`defs/history.storage_call`, whose `EventLogUnavailable` is a
`StorageError`). boto3 and pyarrow's own clients retry with the same attempts and backoff
(`io/s3.py`).

Reads from S3 that ride out transient errors: pyarrow's S3 filesystem retries what the AWS SDK
classifies as retryable, with the build's policy (`S3_MAX_ATTEMPTS`, exponential backoff). One
transient failure escapes it: a ranged GET answered 500 or 503 whose error body is longer than
the range. The SDK writes every response body, an error's included, into a buffer the size of
the range; the write overflows, curl aborts the transfer, the status code is lost, and the SDK
reports INTERNAL_FAILURE "Failed to flush response stream", which it never retries. Parquet
readers ask for ranges of tens of bytes (a key column chunk, audit column chunks), so this hits
the verifier and the crop builder; the build's image reads are larger than any error body.

`RetryingFile` wraps one S3 object. Every ranged read, whatever asked for it (a Parquet footer,
a column chunk, a page, a whole report), is retried here when it fails that way: after a
backoff, with the range widened to `RETRY_RANGE_BYTES`, which any error document fits in. The
client then sees the real status and applies its own policy to it: a 503 is retried with the
build's attempts and backoff, a 404 or 403 fails at once. If even the wide range overflows,
the read is retried here, up to the same number of attempts. Retrying at this level is exact:
a range read is idempotent, and an error raised here comes from storage, never from decoding,
so "storage failed" (`StorageError`) and "the file is damaged" (pyarrow's own errors) stay
apart. (pyarrow has no minimum request size to set instead, and retrying whole Parquet reads
would re-read images and could not tell storage errors from damaged data.)
"""

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa

from fixed_res_sidecar.core.errors import describe_exception

# What the SDK reports for a transient error it does not retry (see above).
TRANSIENT_UNRETRIED = ("Failed to flush response stream",)
RETRY_RANGE_BYTES = 64 * 1024  # a retried read asks for at least this much; S3 error documents are < 1 KB


class StorageError(RuntimeError):
    """Storage kept failing (after retries) or refused a read: an infrastructure error, never a
    verdict on the data. The message names the object. A run that meets one fails and can be
    retried; a verifier never records it as a check that failed or passed."""


T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying: at most `attempts` attempts and/or `budget_seconds` of waiting, with
    exponential backoff from `base_seconds` capped at `max_seconds`; with full jitter (the AWS SDKs'
    standard mode) or, without, plain doubling."""

    attempts: int | None = None
    base_seconds: float = 1.0
    max_seconds: float = 20.0
    budget_seconds: float | None = None
    jitter: bool = True

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first retry)."""
        cap = min(self.max_seconds, self.base_seconds * 2**retry)
        return random.uniform(0, cap) if self.jitter else cap

    def gives_up(self, attempt: int, waited: float, delay: float) -> bool:
        """Whether attempt number `attempt` (from 1) was the last: no attempts left, or waiting
        `delay` more would pass the budget."""
        if self.attempts is not None and attempt >= self.attempts:
            return True
        return self.budget_seconds is not None and waited + delay > self.budget_seconds


def retry_call(
    call: Callable[[], T],
    policy: RetryPolicy,
    transient: Callable[[BaseException], bool],
    fail: Callable[[BaseException, int, float], StorageError],
    name: str = "a call",
    log: logging.Logger | None = None,
) -> T:
    """`call()`, tried again after each transient error (`transient(exc)`) as `policy` allows. Other
    errors pass through at once; when the policy gives up, `fail(exc, attempts, seconds)` is raised
    from the last error. With `log`, each wait and the recovery are logged, naming the call."""
    started = time.monotonic()
    attempt = 1
    while True:
        try:
            result = call()
        except Exception as exc:
            if not transient(exc):
                raise
            waited, delay = time.monotonic() - started, policy.delay(attempt - 1)
            if policy.gives_up(attempt, waited, delay):
                raise fail(exc, attempt, waited) from exc
            if log is not None:
                log.warning(
                    "storage unavailable (attempt %d of %s, %.1f s so far): %s; retrying in %.1f s",
                    *(attempt, name, waited, first_line(exc), delay),
                )
            time.sleep(delay)
            attempt += 1
            continue
        if attempt > 1 and log is not None:
            log.warning("storage answered again after %.1f s (%d attempts)", time.monotonic() - started, attempt)
        return result


def first_line(exc: BaseException, limit: int = 300) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:limit]


def is_transient_unretried(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and any(marker in str(exc) for marker in TRANSIENT_UNRETRIED)


class RetryingFile:
    """One S3 object as a Python file for `pa.PythonFile`: reads at a position, each retried.

    `raw` is the object opened by pyarrow's S3 filesystem (its size is known from the open).
    pyarrow serialises calls on one `PythonFile`, so the position needs no lock.
    """

    def __init__(self, raw: pa.NativeFile, uri: str, policy: RetryPolicy):
        self._raw, self.uri, self._policy = raw, uri, policy
        self._size = raw.size()
        self._position = 0

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def close(self) -> None:
        self._raw.close()

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def read_buffer(self, nbytes: int | None = -1) -> pa.Buffer:
        remaining = max(0, self._size - self._position)
        count = remaining if nbytes is None or nbytes < 0 else min(nbytes, remaining)
        buffer = self._read_at(self._position, count)
        self._position += buffer.size
        return buffer

    def read(self, nbytes: int | None = -1) -> bytes:
        return self.read_buffer(nbytes).to_pybytes()

    def _read_at(self, offset: int, count: int) -> pa.Buffer:
        widened = min(self._size, max(count, RETRY_RANGE_BYTES))  # a retry's range (see the module's docstring)
        starts: list[int] = []

        def read() -> pa.Buffer:
            start, length = (offset, count) if not starts else (max(0, min(offset, self._size - widened)), widened)
            starts.append(start)
            self._raw.seek(start)
            data = self._raw.read_buffer(length)
            return data if (start, length) == (offset, count) else data.slice(offset - start, count)

        def fail(exc: BaseException, *_) -> StorageError:
            after = f" after {len(starts)} attempts" if len(starts) > 1 else ""
            return StorageError(
                f"storage failed reading {self.uri} (bytes {offset}-{offset + count - 1}){after}: "
                f"{describe_exception(exc, max_chars=300)}"
            )

        try:
            return retry_call(read, self._policy, is_transient_unretried, fail)
        except OSError as exc:  # not transient (e.g. the widened read's 404): final, named as storage
            raise fail(exc) from exc
