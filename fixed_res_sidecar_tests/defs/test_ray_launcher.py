"""defs/ray_launcher.py (the Ray job a run becomes) and the run coordinator's refusal of retries that
would fail as their parent did. No cluster: the job client is a stub that records the submission."""

import json
import shutil
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import dagster as dg
import pytest
from dagster._core.code_pointer import ModuleCodePointer
from dagster._core.events import EngineEventData
from dagster._core.instance.ref import InstanceRef
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.remote_origin import GrpcServerCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._utils.error import SerializableErrorInfo

from fixed_res_sidecar.defs import run_coordinator
from fixed_res_sidecar.defs.code_location import RUN_ENV_METADATA_KEY
from fixed_res_sidecar.defs.dagster_private import PARENT_RUN_ID_TAG, RETRY_NUMBER_TAG
from fixed_res_sidecar.defs.ray_launcher import SidecarRayRunLauncher
from fixed_res_sidecar.defs.run_resources import RAY_CONFIG_TAG, launcher_tags

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RUN_ENV = {"SIDECAR_DATASETS": "/srv/datasets.yaml", "SIDECAR_DATASETS_TEXT": "eJw=", "SIDECAR_SKIP_EXISTING": "0"}
ENV = {"DAGSTER_PG_HOST": "pg", "DAGSTER_PG_USERNAME": "u", "DAGSTER_PG_PASSWORD": "p", "DAGSTER_PG_DB": "d",
       "RAY_JOB_SUBMISSION_ADDRESS": "http://ray-head:8265", "DAGSTER_COMPUTE_LOG_BUCKET": "logs"}  # fmt: skip


class FakeJobClient:
    def __init__(self):
        self.submitted = []

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)


def workspace_publishing(metadata):
    repository = SimpleNamespace(repository_snap=SimpleNamespace(metadata=metadata))
    location = SimpleNamespace(has_repository=lambda name: True, get_repository=lambda name: repository)
    return SimpleNamespace(get_code_location=lambda name: location)


@pytest.fixture
def launcher(tmp_path, monkeypatch, instance):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(DEPLOY / "dagster-ray.yaml", home / "dagster.yaml")
    launcher = InstanceRef.from_dir(str(home)).run_launcher_data.rehydrate()
    assert isinstance(launcher, SidecarRayRunLauncher)
    launcher.__dict__["client"] = FakeJobClient()  # the cached property: no cluster
    launcher.register_instance(instance)
    return launcher


def origins() -> dict:
    location = GrpcServerCodeLocationOrigin(host="code", port=3030, location_name="fixed_res_sidecar")
    remote = RemoteJobOrigin(RemoteRepositoryOrigin(location, "__repository__"), "tiny__build_shards")
    pointer = ModuleCodePointer("fixed_res_sidecar.defs.definitions", "defs", None)
    code = JobPythonOrigin("tiny__build_shards", RepositoryPythonOrigin(sys.executable, pointer))
    return {"remote_job_origin": remote, "job_code_origin": code}


def run_with(tags, **fields) -> dg.DagsterRun:
    return dg.DagsterRun(job_name="tiny__build_shards", run_id=str(uuid.uuid4()), tags=tags, **origins(), **fields)


def submitted_env(launcher, run, workspace) -> tuple[dict, dict]:
    with_env = launcher._with_run_env(run, workspace)
    launcher._launch_ray_job(f"dagster-run-{run.run_id}", "dagster api execute_run '{}'", with_env)
    job = launcher.client.submitted[-1]
    return job, job["runtime_env"]["env_vars"]


def test_the_job_gets_the_datasets_file_of_the_code_location(launcher):
    run = run_with(launcher_tags(2, 3, dataset="tiny"))
    job, env = submitted_env(
        launcher, run, workspace_publishing({RUN_ENV_METADATA_KEY: dg.MetadataValue.json(RUN_ENV)})
    )
    assert {k: env[k] for k in RUN_ENV} == RUN_ENV
    assert env["DAGSTER_PG_HOST"] == "pg" and env["DAGSTER_COMPUTE_LOG_BUCKET"] == "logs"  # deploy's env_vars
    assert (job["entrypoint_num_cpus"], job["entrypoint_memory"]) == (2.0, 3 * 2**30)  # the dataset's tag
    assert job["metadata"]["dagster/run-id"] == run.run_id
    assert run.tags[RAY_CONFIG_TAG] == launcher_tags(2, 3)[RAY_CONFIG_TAG]  # the stored run is left alone


def test_a_run_tag_s_own_variables_win(launcher):
    tag = {"num_cpus": 1, "runtime_env": {"env_vars": {"SIDECAR_SKIP_EXISTING": "1", "EXTRA": "x"}}}
    run = run_with({RAY_CONFIG_TAG: json.dumps(tag)})
    _, env = submitted_env(launcher, run, workspace_publishing({RUN_ENV_METADATA_KEY: dg.MetadataValue.json(RUN_ENV)}))
    assert env["SIDECAR_SKIP_EXISTING"] == "1" and env["EXTRA"] == "x" and env["SIDECAR_DATASETS_TEXT"] == "eJw="


def test_a_code_location_that_publishes_nothing_leaves_the_job_as_dagster_ray_makes_it(launcher):
    _, env = submitted_env(launcher, run_with({}), workspace_publishing({}))
    assert "SIDECAR_DATASETS_TEXT" not in env and env["DAGSTER_PG_DB"] == "d"
    _, env = submitted_env(launcher, run_with({}), None)
    assert "SIDECAR_DATASETS_TEXT" not in env


# -- the coordinator refuses a retry that would fail as its parent did --------------------------------


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "inst").mkdir()
    overrides = {"run_coordinator": {"module": run_coordinator.__name__, "class": "DatasetRunCoordinator"}}
    with dg.instance_for_test(temp_dir=str(tmp_path / "inst"), overrides=overrides) as instance:
        yield instance


def failed_to_load(instance, error: SerializableErrorInfo, started_a_step: bool = False) -> dg.DagsterRun:
    parent = instance.add_run(run_with({}, status=dg.DagsterRunStatus.STARTING))
    if started_a_step:
        instance.report_engine_event("a step went further", parent)
        from dagster._core.events import DagsterEvent, DagsterEventType

        instance.report_dagster_event(
            DagsterEvent(DagsterEventType.STEP_START.value, job_name=parent.job_name, step_key="s"), parent.run_id
        )
    instance.report_engine_event("Could not load job definition.", parent, EngineEventData(error=error))
    instance.report_run_failed(parent)
    return parent


def retry_of(instance, parent) -> dg.DagsterRun:
    tags = {PARENT_RUN_ID_TAG: parent.run_id, RETRY_NUMBER_TAG: "1", "dagster/root_run_id": parent.run_id}
    return instance.add_run(run_with(tags, parent_run_id=parent.run_id, root_run_id=parent.run_id))


def error(cls_name: str, message: str, cause=None) -> SerializableErrorInfo:
    return SerializableErrorInfo(f"{cls_name}: {message}\n", [], cls_name, cause=cause)


def submit(instance, run) -> dg.DagsterRun:
    return instance.run_coordinator.submit_run(dg.SubmitRunContext(run, workspace=None))


def test_a_retry_of_a_run_that_could_not_load_is_canceled_unlaunched(instance):
    wrapped = error(
        "DagsterImportError", "Encountered ImportError", cause=error("ModuleNotFoundError", "fixed_res_sidecar")
    )
    parent = failed_to_load(instance, wrapped)
    retry = submit(instance, retry_of(instance, parent))
    assert retry.status == dg.DagsterRunStatus.CANCELED  # never queued, never launched
    messages = [e.message for e in instance.all_logs(retry.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]
    assert any("would fail as its parent did" in m and parent.run_id in m for m in messages), messages


def test_retries_that_may_succeed_are_queued(instance):
    outage = error("ConfigError", "datasets", cause=error("OperationalError", "could not connect to server"))
    for parent in (
        failed_to_load(instance, outage),  # storage during the load: it may pass
        failed_to_load(instance, error("ConfigError", "x"), started_a_step=True),  # not a load failure
        failed_to_load(instance, error("RuntimeError", "who knows")),  # unknown: retried
    ):
        assert submit(instance, retry_of(instance, parent)).status == dg.DagsterRunStatus.QUEUED
    manual = instance.add_run(run_with({PARENT_RUN_ID_TAG: "x"}))
    assert submit(instance, manual).status == dg.DagsterRunStatus.QUEUED  # a user's re-execution is theirs
