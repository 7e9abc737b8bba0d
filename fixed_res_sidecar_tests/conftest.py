import os
import resource
import sqlite3
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from fixed_res_sidecar_tests.fixtures.signals import sigint_as_in_a_terminal

pytest_plugins = [
    "fixed_res_sidecar_tests.fixtures.images",
    "fixed_res_sidecar_tests.fixtures.datasets",
    "fixed_res_sidecar_tests.fixtures.s3",
    "fixed_res_sidecar_tests.fixtures.faulty_s3",
    "fixed_res_sidecar_tests.fixtures.postgres",
    "fixed_res_sidecar_tests.fixtures.dagster_deployment",
    "fixed_res_sidecar_tests.fixtures.ray_cluster",
]

# The test tiers (markers registered in pyproject.toml). A test that starts one of these servers or
# clusters through a fixture gets its marker here, so no such test can land in the fast tier by
# omission; tests that start them by other means carry the marker themselves.
FIXTURE_MARKERS = {
    "postgres_server": "postgres",
    "private_postgres_server": "postgres",
    "deployment_slot": "deployment",
    "dagster_deployment": "deployment",
    "private_dagster_deployment": "deployment",
    "browser": "browser",
    "ray_cluster": "ray",
    "two_node_ray_cluster": "ray_cluster",
}
# Every marker of a tier that `-m "not slow"` (the developer loop) leaves out.
SLOW_MARKERS = {"postgres", "deployment", "browser", "ray", "ray_cluster", "image", "install", "benchmark"}
SLOW_MARKERS |= {"stress", "heavy"}  # no server: long runs (killed, signalled, repaired) and heavy pipelines
# Tests holding these hold a whole deployment: they run one after another in their lane, each lane a
# group of one pytest-xdist worker (`deployment_lane`, `deployment_slot`; the 2-node Ray cluster's
# deployment takes its lane's lock too), without another worker waiting for the lock.
DEPLOYMENT_FIXTURES = {"deployment_slot", "two_node_ray_cluster"}


# Bytecode caches for the test modules, whatever PYTHONDONTWRITEBYTECODE says (this machine sets it):
# without one, each worker rewrites and compiles every test module again, 8 CPU-s a collection against 4.
# The checkout's __pycache__ folders are ignored by git and left out of the container image.
sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    sigint_as_in_a_terminal()  # for this process and every command the tests start, however pytest was started


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject): one worker per core, and one per deployment lane when the slow tier runs.
    The lanes' tests mostly wait on the daemon's loops (sensors, backfills) while two workers keep the
    cores busy (`work_order`); each lane's worker takes other tests once its lane is done. The fast
    tier is all CPU: one worker per core."""
    cores = len(os.sched_getaffinity(0))
    return cores if "not slow" in (config.option.markexpr or "") else cores + 2


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` handing out its work in `work_order`."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Scheduling(LoadGroupScheduling):
        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "ordered", False):  # the first call: every unit of work is queued
                self.workqueue = OrderedDict((scope, self.workqueue[scope]) for scope in work_order(self.workqueue))
                self.ordered = True
            super()._assign_work_unit(node)

    return Scheduling(config, log)


def work_order(scopes: Iterable[str]) -> list[str]:
    """The order in which the workers get their work (xdist's scopes: a group's name, or one test's id):
    the deployment lanes first, a worker each; then the single tests (mostly CPU), with the other groups
    (module fixtures: a UI's `dagster dev`, a Ray cluster, the image; mostly waiting) spread over the
    first half of them, so that while the lanes wait a worker on CPU work keeps the cores busy. xdist
    itself hands out the biggest groups first, which left every worker waiting for the first 11 minutes
    (1.5 of 2 cores busy) and the cores oversubscribed after. The single tests keep their collection
    order (`pytest_collection_modifyitems`: the slow ones first, the longest of them first)."""
    from fixed_res_sidecar_tests.fixtures.dagster_deployment import DEPLOYMENT_LANES

    scopes = list(scopes)
    lanes = [scope for scope in scopes if scope in DEPLOYMENT_LANES]
    groups = [scope for scope in scopes if "::" not in scope and scope not in DEPLOYMENT_LANES]
    singles = [scope for scope in scopes if "::" in scope]
    ordered = list(singles)
    for index, group in reversed(list(enumerate(groups))):
        ordered.insert(index * (len(singles) // 2) // len(groups), group)
    return lanes + ordered


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tiers' markers and the xdist groups; then the slow tests of no group go first (grouped tests
    keep their place, with their module's fixture), so that the quick ones fill the workers' last minute
    (`work_order` keeps this order among single tests): last, a 29 s test began 3 s before the quick ones
    ran out, and took the run's last 21 s alone (c71). Among the slow ones, those of the package's
    top-level modules (installs, benchmarks, the documented commands: the longest) first: last, one took
    45 s alone with the other core idle (c70)."""
    slow_singles = []
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in FIXTURE_MARKERS:
                item.add_marker(FIXTURE_MARKERS[fixture])
        if any(item.get_closest_marker(name) for name in SLOW_MARKERS):
            item.add_marker("slow")
        slow = item.get_closest_marker("slow") is not None  # a tier's marker, or `slow` itself
        if group := _xdist_group(item):
            item.add_marker(pytest.mark.xdist_group(group))
        elif slow:
            slow_singles.append(item)
    slow_singles.sort(key=lambda item: item.nodeid.count("/") > 1)  # fixed_res_sidecar_tests/test_x.py::... first
    first = set(slow_singles)
    items[:] = slow_singles + [item for item in items if item not in first]


def _xdist_group(item: pytest.Item) -> str | None:
    """`--dist loadgroup` (pyproject): each test goes to whichever worker is free, but the deployments
    run one at a time in each of two lanes, a worker each, and the tests of a module that share a module
    fixture (the UI's `dagster dev`, a Ray cluster, the image) stay on one worker, so that fixture is
    made once."""
    fixtures = getattr(item, "_fixtureinfo", None)
    definitions = fixtures.name2fixturedefs if fixtures is not None else {}
    if DEPLOYMENT_FIXTURES & set(definitions):
        # imported once pytest_plugins loaded it (its asserts rewritten)
        from fixed_res_sidecar_tests.fixtures.dagster_deployment import deployment_lane

        return deployment_lane(item.module.__name__)
    if any(defs and defs[-1].scope == "module" for defs in definitions.values()):
        return item.module.__name__
    return None


# A test instance's SQLite storage (`dg.instance_for_test`, the demo's Dagster home) need not survive a
# power cut: no sync to disk on commit. SQLite otherwise syncs its write-ahead log on every commit,
# about 1,000 fdatasync calls per shard run in process (1-2 ms each on this machine's disk).
@event.listens_for(Engine, "connect")
def _sqlite_without_sync(connection, _record) -> None:
    if isinstance(connection, sqlite3.Connection):
        connection.execute("PRAGMA synchronous=OFF")


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that ended (servers a fixture started and stopped)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """SIDECAR_TEST_CPU=FILE: one line per test (CPU seconds, wall seconds, test id) appended to FILE, to
    see where the suite's CPU goes (docs/testing.md). A child's CPU counts when it is reaped (one a test
    left unwaited counts in a later test of the worker); detached processes (a container's, the nodes of
    `ray start`) are not counted."""
    report = os.environ.get("SIDECAR_TEST_CPU")
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    if report:
        with open(report, "a") as out:  # short lines in append mode: the workers' lines never mix
            out.write(f"{_cpu_seconds() - cpu:.1f}\t{time.monotonic() - wall:.1f}\t{item.nodeid}\n")
