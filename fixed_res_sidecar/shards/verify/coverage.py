"""Rolling fidelity coverage: each verification of an output compares rows not compared before.

A shard's comparable rows (its valid rows: they have an image) are put in one order, a permutation
seeded by the shard's path, and cut into windows of `size` rows. Successive verifications of the same
bytes compare successive windows, so after ceil(comparable / size) verifications every comparable row
was compared once, and the rotation starts over. What a verification compared is recorded with its
report (`COVERAGE_STAT` in the report's stats): the bytes' fingerprint, the window size, the window
compared, how many windows of these bytes were compared so far, since when, and how many rows that
makes. The next verification continues from it; new bytes (another fingerprint: a rebuild) start
again from the first window, since nothing of them was compared.

Pure: rows and numbers in, a plan out; the verifier reads the previous record and the rows.
"""

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

COVERAGE_STAT = "fidelity_coverage"


@dataclass(frozen=True)
class Coverage:
    """What one verification compares, and what the verifications of the same bytes have compared so far."""

    fingerprint: str | None  # the output object (its bytes) the windows were compared on
    size: int  # rows per window (0: every comparable row at once)
    window: int  # the window this verification compares
    windows_done: int  # windows of these bytes compared, this one included (at most `windows`)
    windows: int  # windows of the shard's comparable rows
    comparable: int  # comparable (valid) rows of the output
    compared_ever: int  # of those, compared by this verification or an earlier one of the same bytes
    since: float  # when these bytes were first verified (unix time)

    @property
    def complete(self) -> bool:
        return self.compared_ever >= self.comparable

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def row_order(rel: str, candidates: Sequence[int]) -> list[int]:
    """The shard's comparable rows in the order the windows take them (the same for every resolution)."""
    seed = int.from_bytes(hashlib.sha256(f"fidelity coverage {rel}".encode()).digest()[:8], "big")
    order = list(candidates)
    random.Random(seed).shuffle(order)
    return order


def window_rows(order: Sequence[int], size: int, window: int) -> list[int]:
    """The rows of one window, sorted (size 0: all of them)."""
    if size <= 0:
        return sorted(order)
    return sorted(order[window * size : (window + 1) * size])


def plan(
    previous: Mapping[str, Any] | None,
    comparable: int,
    size: int | None,
    fingerprint: str | None,
    now: float,
) -> Coverage:
    """The window this verification compares, from what the previous verification of the shard recorded
    (`previous`, a `Coverage.to_json()`, or None). `size` None: every comparable row at once."""
    if size is None or size >= comparable:
        return Coverage(fingerprint, 0, 0, 1, 1, comparable, comparable, _since(previous, fingerprint, comparable, now))
    windows = math.ceil(comparable / size)
    same = (
        previous is not None
        and fingerprint is not None
        and previous.get("fingerprint") == fingerprint
        and previous.get("size") == size
        and previous.get("comparable") == comparable
    )
    if same:
        assert previous is not None
        window = (int(previous.get("window", -1)) + 1) % windows
        done = min(int(previous.get("windows_done", 0)) + 1, windows)
        since = float(previous.get("since", now))
    else:
        window, done, since = 0, 1, now
    # The windows compared on these bytes: `done` consecutive ones ending at `window` (disjoint), the
    # last one of the order being short.
    compared = sum(_window_size(w % windows, windows, size, comparable) for w in range(window - done + 1, window + 1))
    return Coverage(fingerprint, size, window, done, windows, comparable, compared, since)


def _window_size(window: int, windows: int, size: int, comparable: int) -> int:
    return comparable - (windows - 1) * size if window == windows - 1 else size


def _since(previous: Mapping[str, Any] | None, fingerprint: str | None, comparable: int, now: float) -> float:
    if previous is not None and previous.get("fingerprint") == fingerprint and previous.get("comparable") == comparable:
        return float(previous.get("since", now))
    return now


def previous_coverage(report: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The coverage a shard's earlier report recorded, if it is one."""
    if not isinstance(report, Mapping):
        return None
    stats = report.get("stats")
    found = stats.get(COVERAGE_STAT) if isinstance(stats, Mapping) else None
    return found if isinstance(found, Mapping) else None
