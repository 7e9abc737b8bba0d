import sqlite3

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

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
SLOW_MARKERS = {"postgres", "deployment", "browser", "ray", "ray_cluster", "image", "install", "benchmark", "stress"}
# Session fixtures too costly to make twice (one per pytest-xdist worker): their tests stay on one worker.
ONE_WORKER_SESSION_FIXTURES = {"two_node_ray_cluster"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in FIXTURE_MARKERS:
                item.add_marker(FIXTURE_MARKERS[fixture])
        if any(item.get_closest_marker(name) for name in SLOW_MARKERS):
            item.add_marker("slow")
        # `--dist loadgroup` (pyproject): each test goes to whichever worker is free, but the tests of a
        # module that share a module fixture (the UI's `dagster dev`, a Ray cluster, the image) stay
        # on one worker, so that fixture is made once.
        if _shares_a_costly_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _shares_a_costly_fixture(item: pytest.Item) -> bool:
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return False
    return any(
        name in ONE_WORKER_SESSION_FIXTURES or (defs and defs[-1].scope == "module")
        for name, defs in definitions.name2fixturedefs.items()
    )


# A test instance's SQLite storage (`dg.instance_for_test`, the demo's Dagster home) need not survive a
# power cut: no sync to disk on commit. SQLite otherwise syncs its write-ahead log on every commit,
# about 1,000 fdatasync calls per shard run in process (1-2 ms each on this machine's disk).
@event.listens_for(Engine, "connect")
def _sqlite_without_sync(connection, _record) -> None:
    if isinstance(connection, sqlite3.Connection):
        connection.execute("PRAGMA synchronous=OFF")
