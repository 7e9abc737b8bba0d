"""deploy/: the production Dagster instance config, checked without Postgres or a cluster.

Dagster validates dagster.yaml in two steps: the instance schema when the instance
config is read (`InstanceRef.from_dir`), and each pluggable class's own schema (storage,
run launcher, coordinator, compute logs) only when that class is built, which for
Postgres and Kubernetes means connecting. These tests do both steps: the second one by
running each class's `config_type()` the way `ConfigurableClassData.rehydrate` does,
and by building the classes that do not connect (the coordinator, the K8s launcher
with its kube-config loading stubbed, the Ray launcher, whose client is lazy).
"""

import shutil
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._config import process_config, resolve_to_config_type
from dagster._core.instance.ref import InstanceRef
from dagster._utils.tags import TagConcurrencyLimitsCounter

from fixed_res_sidecar.defs.run_resources import DATASET_TAG, launcher_tags

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
INSTANCES = {"k8s": "dagster.yaml", "ray": "dagster-ray.yaml"}
NEEDS = {"k8s": ("dagster_postgres", "dagster_k8s"), "ray": ("dagster_postgres", "dagster_ray")}
ENV = {
    "DAGSTER_PG_HOST": "postgres.example",
    "DAGSTER_PG_USERNAME": "dagster",
    "DAGSTER_PG_PASSWORD": "secret",
    "DAGSTER_PG_DB": "dagster",
    "DAGSTER_K8S_PIPELINE_RUN_NAMESPACE": "sidecar",
    "DAGSTER_K8S_PIPELINE_RUN_ENV_CONFIGMAP": "sidecar-run-env",
    "DAGSTER_COMPUTE_LOG_BUCKET": "dagster-logs",
    "RAY_JOB_SUBMISSION_ADDRESS": "http://ray-head:8265",
}


@pytest.fixture
def env(monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)


def instance_ref(kind: str, tmp_path: Path) -> InstanceRef:
    """Read deploy/<file> as DAGSTER_HOME/dagster.yaml: the instance schema check."""
    for module in NEEDS[kind]:
        pytest.importorskip(module, reason="production integrations are in the [deploy] extra")
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(DEPLOY / INSTANCES[kind], home / "dagster.yaml")
    return InstanceRef.from_dir(str(home))


def class_config(data) -> tuple[type, dict]:
    """A pluggable class and its config, validated by the class's own schema (no connecting)."""
    import importlib

    klass = getattr(importlib.import_module(data.module_name), data.class_name)
    result = process_config(resolve_to_config_type(klass.config_type()), data.config_dict)
    assert result.success, f"{data.module_name}.{data.class_name}: {[e.message for e in result.errors]}"
    return klass, result.value


@pytest.mark.parametrize("kind", sorted(INSTANCES))
def test_every_section_validates(kind, tmp_path, env):
    ref = instance_ref(kind, tmp_path)
    expected = {
        "storage_data": "DagsterPostgresStorage",
        "run_launcher_data": {"k8s": "K8sRunLauncher", "ray": "SidecarRayRunLauncher"}[kind],
        "run_coordinator_data": "DatasetRunCoordinator",
        "compute_logs_data": "S3ComputeLogManager",
    }
    for attribute, class_name in expected.items():
        data = getattr(ref, attribute)
        assert data.class_name == class_name
        class_config(data)
    for attribute in ("local_artifact_storage_data", "scheduler_data", "secrets_loader_data"):
        if getattr(ref, attribute) is not None:
            class_config(getattr(ref, attribute))


@pytest.mark.parametrize("kind", sorted(INSTANCES))
def test_postgres_url_uses_the_psycopg2_driver(kind, tmp_path, env):
    import sqlalchemy
    from dagster_postgres.utils import pg_url_from_config

    _, config = class_config(instance_ref(kind, tmp_path).storage_data)
    url = pg_url_from_config(config)
    assert url.startswith("postgresql+psycopg2://dagster:secret@postgres.example:5432/dagster")
    engine = sqlalchemy.create_engine(url)  # loads the dialect and the DBAPI; connects lazily
    assert engine.dialect.driver == "psycopg2"
    engine.dispose()


def test_a_broken_config_is_caught(tmp_path, env):
    """The checks above are not vacuous: a typo in a class's config, or run limits in two
    places, are refused."""
    ref = instance_ref("k8s", tmp_path)
    broken = ref.run_launcher_data._replace(config_yaml=ref.run_launcher_data.config_yaml + "job_namepsace: x\n")
    with pytest.raises(AssertionError, match="job_namepsace"):
        class_config(broken)

    config = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    config["run_coordinator"]["config"]["max_concurrent_runs"] = 5
    home = tmp_path / "mixed"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(dg.DagsterInvalidConfigError, match="concurrency > runs"):
        InstanceRef.from_dir(str(home)).run_coordinator  # noqa: B018 - builds the coordinator from its config


def test_run_limits_retries_and_monitoring_take_effect():
    """The deploy settings on a throwaway sqlite instance: Dagster reads the limits as meant."""
    config = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    settings = ("run_coordinator", "concurrency", "run_monitoring", "run_retries", "sensors", "schedules", "backfills")
    with dg.instance_for_test(overrides={key: config[key] for key in settings}) as instance:
        queue = instance.get_concurrency_config().run_queue_config
        assert type(instance.run_coordinator).__name__ == "DatasetRunCoordinator"
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        assert not instance.run_retries_retry_on_asset_or_op_failure
        assert instance.run_monitoring_enabled

    limits = queue.tag_concurrency_limits
    per_dataset = next(limit for limit in limits if limit["key"] == DATASET_TAG)
    assert per_dataset["value"] == {"applyLimitPerUniqueValue": True}
    running = [
        dg.DagsterRun(job_name="shard", tags=launcher_tags(1, 4, dataset="a")) for _ in range(per_dataset["limit"])
    ]
    counter = TagConcurrencyLimitsCounter(limits, running)
    assert counter.is_blocked(dg.DagsterRun(job_name="shard", tags=launcher_tags(1, 4, dataset="a")))
    assert not counter.is_blocked(dg.DagsterRun(job_name="shard", tags=launcher_tags(1, 4, dataset="b")))
    assert queue.max_concurrent_runs > per_dataset["limit"]


def test_k8s_run_pods_get_the_dataset_resources(tmp_path, env, monkeypatch):
    """Build the real K8sRunLauncher from deploy/dagster.yaml (kube-config loading stubbed)
    and the Job it would create: the run pod requests what launcher_tags asked for."""
    ref = instance_ref("k8s", tmp_path)
    import dagster_k8s.launcher
    from dagster_k8s.job import construct_dagster_k8s_job

    monkeypatch.setattr(dagster_k8s.launcher, "load_kubernetes_config", lambda **_: None)
    launcher = ref.run_launcher_data.rehydrate()

    def run_pod(tags):
        run = dg.DagsterRun(job_name="resize_shard", tags=tags)
        context = launcher.get_container_context_for_run(run)
        job_config = context.get_k8s_job_config(job_image="registry.example/sidecar:1", run_launcher=launcher)
        job = construct_dagster_k8s_job(
            job_config,
            ["dagster", "api", "execute_run"],
            "dagster-run-x",
            user_defined_k8s_config=context.run_k8s_config,
        )
        return job, context

    job, context = run_pod(launcher_tags(6, 24, dataset="big"))
    container = job.spec.template.spec.containers[0]
    assert container.resources.requests == {"cpu": "6", "memory": "24Gi"}
    assert container.resources.limits == {"memory": "24Gi"}
    assert context.namespace == "sidecar"
    assert job.spec.backoff_limit == 0
    env_from = {e.config_map_ref.name for e in container.env_from if e.config_map_ref}
    assert "sidecar-run-env" in env_from

    default, _ = run_pod({})
    assert default.spec.template.spec.containers[0].resources.requests == {"cpu": "1", "memory": "4Gi"}


def test_ray_run_jobs_get_the_dataset_resources(tmp_path, env):
    ref = instance_ref("ray", tmp_path)
    from dagster_ray.core.run_launcher import RayLauncherConfig

    launcher = ref.run_launcher_data.rehydrate()  # the job client connects lazily
    assert launcher.address == "http://ray-head:8265"
    assert (launcher.num_cpus, launcher.memory) == (1, 4 * 2**30)
    from_tags = RayLauncherConfig.from_tags(launcher_tags(6, 24, dataset="big"))
    assert (from_tags.num_cpus, from_tags.memory) == (6.0, 24 * 2**30)


def test_the_two_instances_differ_only_in_the_run_launcher_and_the_start_timeout():
    """The Ray instance starts runs without image pulls or pending pods: its start timeout is shorter (a run
    whose node died before the run started waits that long for its retry), yet well above a run's start
    on a loaded node (over 60 s seen on this machine) and below Ray's own limit for a job to start."""
    k8s, ray = (yaml.safe_load((DEPLOY / name).read_text()) for name in (INSTANCES["k8s"], INSTANCES["ray"]))
    assert k8s.pop("run_launcher")["class"] == "K8sRunLauncher"
    assert ray.pop("run_launcher")["class"] == "SidecarRayRunLauncher"
    k8s_start = k8s["run_monitoring"].pop("start_timeout_seconds")
    ray_start = ray["run_monitoring"].pop("start_timeout_seconds")
    assert k8s == ray
    from ray.dashboard.consts import DEFAULT_JOB_START_TIMEOUT_SECONDS

    assert 3 * 60 <= ray_start < k8s_start and ray_start < DEFAULT_JOB_START_TIMEOUT_SECONDS
    assert ray_start >= 2 * ray["run_monitoring"]["poll_interval_seconds"]


def test_workspace_points_at_the_code_server():
    from dagster._core.workspace.config_schema import ensure_workspace_config

    path = DEPLOY / "workspace.yaml"
    config = ensure_workspace_config(yaml.safe_load(path.read_text()), str(path))
    (entry,) = config["load_from"]
    assert entry["grpc_server"]["location_name"] == "fixed_res_sidecar"
