"""A budget of bytes shared by the threads that decode one shard's images.

Each image reserves what decoding it is estimated to need (core/decoding.py estimates it from
the header, before any pixel is decoded) and gives it back when its outputs are made. A
reservation waits while others hold too much of the budget, first come first served, so a
large image is not starved by a stream of small ones; one larger than the whole budget is
refused at once (the caller audits it `too_large`), never waited for.
"""

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class OverBudget(Exception):
    """A reservation larger than the whole budget: it could never be granted."""


class MemoryBudget:
    def __init__(self, total_bytes: int) -> None:
        if total_bytes <= 0:
            raise ValueError(f"a memory budget must be positive, got {total_bytes}")
        self.total = total_bytes
        self._used = 0
        self._waiting: deque[object] = deque()
        self._changed = threading.Condition()

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        with self._changed:
            return self._used

    @property
    def waiting(self) -> int:
        """Reservations waiting for their turn."""
        with self._changed:
            return len(self._waiting)

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` of the budget for the duration of the block, waiting until they are free.

        Raises OverBudget when `nbytes` exceeds the whole budget.
        """
        if nbytes > self.total:
            raise OverBudget(f"needs {nbytes} bytes, the whole budget is {self.total}")
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            while self._waiting[0] is not ticket or self._used + nbytes > self.total:
                self._changed.wait()
            self._waiting.popleft()
            self._used += nbytes
            self._changed.notify_all()  # the next in line may fit too
        try:
            yield
        finally:
            with self._changed:
                self._used -= nbytes
                self._changed.notify_all()
