"""A dataset's run resources (CPU, memory) as the run tags Dagster's run launchers read.

Each run (one shard of one dataset) gets its own pod or Ray job. How big it must be comes
from the dataset config; the launcher learns it from standard tags on the run:

- `dagster-k8s/config` (K8sRunLauncher, CeleryK8sRunLauncher, k8s_job_executor): the run
  pod's container requests `cpu` and `memory`; the memory limit equals the request, so a
  run that outgrows its budget is OOM-killed in its own pod (and retried by
  `run_retries`) instead of starving its neighbours. No CPU limit: a limit only throttles.
- `dagster-ray/config` (dagster-ray's RayRunLauncher): the run's Ray job entrypoint
  `num_cpus` and `memory` (bytes).

Each launcher ignores the other's tag, so both are always set and deploy/dagster.yaml
decides which one is used. `dataset=` adds the tag that deploy/dagster.yaml's
per-dataset run concurrency limit counts; `dataset_run_tags` gives all of a dataset's tags.

Memory is in GiB (2**30 bytes), as `--task-memory-gb` of the CLI.
"""

import json
import math

K8S_CONFIG_TAG = "dagster-k8s/config"  # dagster_k8s.job.USER_DEFINED_K8S_CONFIG_KEY
RAY_CONFIG_TAG = "dagster-ray/config"  # dagster_ray.configs.USER_DEFINED_RAY_KEY
DATASET_TAG = "fixed_res_sidecar/dataset"  # deploy/dagster.yaml limits runs per value of this tag
# dagster._core.storage.tags.RETRY_ON_ASSET_OR_OP_FAILURE_TAG: "true" retries a run that failed in a step
# (deploy/dagster.yaml's run_retries) although the instance's retry_on_asset_or_op_failure says no.
RETRY_ON_FAILURE_TAG = "dagster/retry_on_asset_or_op_failure"
GIB = 2**30


def launcher_tags(cpu: float, memory_gb: float, *, dataset: str | None = None) -> dict[str, str]:
    """Tags that make a run's pod (K8s) or Ray job get `cpu` CPUs and `memory_gb` GiB."""
    cpu, memory_gb = _positive("cpu", cpu), _positive("memory_gb", memory_gb)
    cpu_quantity, memory_quantity = k8s_cpu(cpu), k8s_memory(memory_gb)
    k8s = {
        "container_config": {
            "resources": {
                "requests": {"cpu": cpu_quantity, "memory": memory_quantity},
                "limits": {"memory": memory_quantity},
            }
        }
    }
    ray = {"num_cpus": cpu, "memory": math.ceil(memory_gb * GIB)}
    tags = {K8S_CONFIG_TAG: json.dumps(k8s, sort_keys=True), RAY_CONFIG_TAG: json.dumps(ray, sort_keys=True)}
    if dataset is not None:
        if not dataset or not dataset.strip():
            raise ValueError("dataset must be a non-empty name")
        tags[DATASET_TAG] = dataset
    return tags


def dataset_run_tags(dataset) -> dict[str, str]:
    """Tags on every run of one dataset (`DatasetConfig`): shard runs, automation runs, backfills.

    `fixed_res_sidecar/dataset` (dagster.yaml limits runs per unique value), the dataset's
    CPU and memory as `dagster-k8s/config` and `dagster-ray/config`, and a retry of a run that
    failed in a step (a storage outage; a run whose data failed sets it to "false": `history.retry_run_on_failure`).
    """
    tags = launcher_tags(dataset.run_resources.cpu, dataset.run_resources.memory_gb, dataset=dataset.name)
    return {**tags, RETRY_ON_FAILURE_TAG: "true"}


def k8s_cpu(cpu: float) -> str:
    """A Kubernetes CPU quantity: whole CPUs as "2", else millicores ("500m")."""
    millicores = math.ceil(round(_positive("cpu", cpu) * 1000, 6))
    return str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"


def k8s_memory(memory_gb: float) -> str:
    """A Kubernetes memory quantity: whole GiB as "8Gi", else MiB rounded up ("1536Mi")."""
    mebibytes = math.ceil(round(_positive("memory_gb", memory_gb) * 1024, 6))
    return f"{mebibytes // 1024}Gi" if mebibytes % 1024 == 0 else f"{mebibytes}Mi"


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)
