"""The decode memory budget shared by a shard's threads: waits, first come first served, never deadlocks."""

import threading

import pytest

from fixed_res_sidecar.core.memory import MemoryBudget, OverBudget

WAIT = 30  # seconds: generous bounds on waits that must end, never timing assertions


def hold(budget: MemoryBudget, nbytes: int, granted: list, release: threading.Event, name: str) -> threading.Thread:
    """A thread that reserves `nbytes`, notes `name` in `granted`, and holds them until `release`."""

    def run() -> None:
        with budget.reserve(nbytes):
            granted.append(name)
            release.wait(WAIT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_until(condition) -> None:
    done = threading.Event()
    for _ in range(WAIT * 100):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


def test_a_reservation_waits_until_the_bytes_are_free():
    budget = MemoryBudget(100)
    granted: list[str] = []
    release_first, release_second = threading.Event(), threading.Event()
    first = hold(budget, 60, granted, release_first, "first")
    wait_until(lambda: granted == ["first"])
    second = hold(budget, 50, granted, release_second, "second")
    wait_until(lambda: budget.waiting == 1)  # queued behind "first"
    assert granted == ["first"] and budget.used == 60
    release_first.set()
    first.join(WAIT)
    wait_until(lambda: granted == ["first", "second"])
    assert budget.used == 50
    release_second.set()
    second.join(WAIT)
    assert budget.used == 0


def test_first_come_first_served_so_a_large_image_is_not_starved():
    budget = MemoryBudget(100)
    granted: list[str] = []
    releases = {name: threading.Event() for name in ("small-1", "large", "small-2")}
    threads = [hold(budget, 30, granted, releases["small-1"], "small-1")]
    wait_until(lambda: granted == ["small-1"])
    threads.append(hold(budget, 90, granted, releases["large"], "large"))
    wait_until(lambda: budget.waiting == 1)
    threads.append(hold(budget, 30, granted, releases["small-2"], "small-2"))  # would fit now, but waits its turn
    wait_until(lambda: budget.waiting == 2)
    assert granted == ["small-1"]
    releases["small-1"].set()
    wait_until(lambda: granted == ["small-1", "large"])
    releases["large"].set()
    wait_until(lambda: granted == ["small-1", "large", "small-2"])
    releases["small-2"].set()
    for thread in threads:
        thread.join(WAIT)
    assert budget.used == 0


def test_more_than_the_whole_budget_is_refused_at_once():
    budget = MemoryBudget(100)
    with pytest.raises(OverBudget), budget.reserve(101):
        pass
    with budget.reserve(100):
        assert budget.used == 100
    assert budget.used == 0


def test_the_bytes_come_back_when_the_work_fails():
    budget = MemoryBudget(100)
    with pytest.raises(RuntimeError), budget.reserve(70):
        raise RuntimeError("decode failed")
    assert budget.used == 0


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError):
        MemoryBudget(0)
