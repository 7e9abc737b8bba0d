"""defs/run_resources.py: a dataset's CPU and memory as run-launcher tags."""

import json
import math

import pytest

from fixed_res_sidecar.defs.run_resources import (
    DATASET_TAG,
    K8S_CONFIG_TAG,
    RAY_CONFIG_TAG,
    k8s_cpu,
    k8s_memory,
    launcher_tags,
)


def test_whole_cpus_and_gib():
    tags = launcher_tags(2, 8)
    assert set(tags) == {K8S_CONFIG_TAG, RAY_CONFIG_TAG}
    assert all(isinstance(v, str) for v in tags.values())  # Dagster tags are strings
    assert json.loads(tags[K8S_CONFIG_TAG]) == {
        "container_config": {"resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}}
    }
    assert json.loads(tags[RAY_CONFIG_TAG]) == {"num_cpus": 2.0, "memory": 8 * 2**30}


@pytest.mark.parametrize(
    ("cpu", "cpu_quantity", "memory_gb", "memory_quantity"),
    [
        (0.5, "500m", 1.5, "1536Mi"),
        (1.25, "1250m", 0.25, "256Mi"),
        (16, "16", 64, "64Gi"),
        (0.0001, "1m", 0.0001, "1Mi"),
    ],
)
def test_fractions_become_millicores_and_mebibytes(cpu, cpu_quantity, memory_gb, memory_quantity):
    assert k8s_cpu(cpu) == cpu_quantity
    assert k8s_memory(memory_gb) == memory_quantity
    resources = json.loads(launcher_tags(cpu, memory_gb)[K8S_CONFIG_TAG])["container_config"]["resources"]
    assert resources["requests"] == {"cpu": cpu_quantity, "memory": memory_quantity}
    assert json.loads(launcher_tags(cpu, memory_gb)[RAY_CONFIG_TAG])["memory"] == math.ceil(memory_gb * 2**30)


def test_dataset_tag_is_added_when_named():
    assert launcher_tags(1, 4, dataset="laion_subset")[DATASET_TAG] == "laion_subset"
    assert DATASET_TAG not in launcher_tags(1, 4)
    with pytest.raises(ValueError):
        launcher_tags(1, 4, dataset=" ")


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_nonsense_resources_are_refused(bad):
    with pytest.raises(ValueError):
        launcher_tags(bad, 4)
    with pytest.raises(ValueError):
        launcher_tags(1, bad)
    with pytest.raises(TypeError):
        launcher_tags("2", 4)


def test_dagster_k8s_reads_the_tag():
    job = pytest.importorskip("dagster_k8s.job", reason="dagster-k8s is in the [deploy] extra")
    assert job.USER_DEFINED_K8S_CONFIG_KEY == K8S_CONFIG_TAG
    parsed = job.get_user_defined_k8s_config(launcher_tags(3, 12.5))  # validates against its schema
    assert parsed.container_config["resources"] == {
        "requests": {"cpu": "3", "memory": "12800Mi"},
        "limits": {"memory": "12800Mi"},
    }


def test_dagster_ray_reads_the_tag():
    configs = pytest.importorskip("dagster_ray.configs", reason="dagster-ray is in the [deploy] extra")
    assert configs.USER_DEFINED_RAY_KEY == RAY_CONFIG_TAG
    parsed = configs.RayExecutionConfig.from_tags(launcher_tags(3, 12.5))
    assert (parsed.num_cpus, parsed.memory) == (3.0, int(12.5 * 2**30))


def test_tags_are_valid_dagster_run_tags():
    import dagster as dg

    tags = launcher_tags(2, 8, dataset="sample")
    request = dg.RunRequest(partition_key="part-00000.parquet", tags=tags)
    assert request.tags == tags
