pytest_plugins = [
    "fixed_res_sidecar_tests.fixtures.images",
    "fixed_res_sidecar_tests.fixtures.datasets",
    "fixed_res_sidecar_tests.fixtures.s3",
    "fixed_res_sidecar_tests.fixtures.faulty_s3",
    "fixed_res_sidecar_tests.fixtures.postgres",
    "fixed_res_sidecar_tests.fixtures.dagster_deployment",
    "fixed_res_sidecar_tests.fixtures.ray_cluster",
]
