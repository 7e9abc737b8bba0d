import pytest

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


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in FIXTURE_MARKERS:
                item.add_marker(FIXTURE_MARKERS[fixture])
        if any(item.get_closest_marker(name) for name in SLOW_MARKERS):
            item.add_marker("slow")
