"""defs/code_location.py and defs/load_guard.py: the datasets file reaches a run wherever it runs, and a
run that cannot load the code location is not retried."""

import sys
import uuid

import dagster as dg
import pytest
import yaml
from dagster._core.code_pointer import ModuleCodePointer
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.remote_representation.external_data import RepositorySnap
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import serialize_value

from fixed_res_sidecar.defs import dagster_private as private
from fixed_res_sidecar.defs import load_guard
from fixed_res_sidecar.defs.code_location import (
    DATASETS_TEXT_ENV,
    code_location_config,
    encode_text,
    published_run_env,
)
from fixed_res_sidecar.defs.config import DATASETS_ENV, ConfigError
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar_tests.defs.conftest import dataset_entry


@pytest.fixture
def datasets_file(tmp_path, monkeypatch):
    folder = tmp_path / "code-server"
    folder.mkdir()
    path = folder / "datasets.yaml"
    # Relative paths: resolved from the datasets file's folder on the code server.
    path.write_text(yaml.safe_dump({"datasets": [dataset_entry("tiny", "main/tiny", "out")]}))
    monkeypatch.setenv(DATASETS_ENV, str(path))
    monkeypatch.delenv(DATASETS_TEXT_ENV, raising=False)
    for name in ("SIDECAR_SKIP_EXISTING", "SIDECAR_THREADS_PER_SHARD"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_the_run_environment_carries_the_file_and_the_settings(datasets_file, monkeypatch):
    monkeypatch.setenv("SIDECAR_SKIP_EXISTING", "0")
    config, run_env = code_location_config()
    assert config.dataset("tiny").main.path == str(datasets_file.parent / "main" / "tiny")
    assert run_env[DATASETS_ENV] == str(datasets_file)
    assert run_env[DATASETS_TEXT_ENV] == encode_text(datasets_file.read_text())
    assert run_env["SIDECAR_SKIP_EXISTING"] == "0" and "SIDECAR_THREADS_PER_SHARD" not in run_env


def test_a_run_loads_the_carried_file_where_there_is_none(datasets_file, monkeypatch):
    """A Ray node without the file (nor its folder) loads the code server's config, relative paths as there."""
    expected, run_env = code_location_config()
    datasets_file.unlink()
    datasets_file.parent.rmdir()
    monkeypatch.setenv(DATASETS_TEXT_ENV, run_env[DATASETS_TEXT_ENV])
    config, again = code_location_config()
    assert config == expected and again == run_env


def test_a_broken_carried_file_is_a_clear_config_error(datasets_file, monkeypatch):
    monkeypatch.setenv(DATASETS_TEXT_ENV, "not-base64!")
    with pytest.raises(ConfigError, match=DATASETS_TEXT_ENV):
        code_location_config()
    monkeypatch.setenv(DATASETS_TEXT_ENV, encode_text("datasets: [{name: 1}]"))
    with pytest.raises(ConfigError, match="carried to this run"):
        code_location_config()


def test_no_file_and_nothing_carried_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(DATASETS_ENV, str(tmp_path / "missing.yaml"))
    monkeypatch.delenv(DATASETS_TEXT_ENV, raising=False)
    with pytest.raises(ConfigError, match="no such datasets file; set SIDECAR_DATASETS"):
        code_location_config()


def test_the_definitions_publish_the_run_environment(datasets_file):
    config, run_env = code_location_config()
    snap = RepositorySnap.from_def(build_definitions(config, run_env).get_repository_def())
    assert published_run_env(snap.metadata) == run_env
    assert published_run_env(RepositorySnap.from_def(build_definitions(config).get_repository_def()).metadata) is None


# -- load_guard ---------------------------------------------------------------------------------------


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "home").mkdir()
    overrides = {"run_retries": {"enabled": True, "max_retries": 2}}
    with dg.instance_for_test(temp_dir=str(tmp_path / "home"), overrides=overrides) as instance:
        yield instance


def as_run_worker(monkeypatch, instance, run_id: str) -> None:
    """This process's argv as a launcher starts a run worker: `dagster api execute_run ARGS`."""
    origin = JobPythonOrigin(
        "tiny__build_shards", RepositoryPythonOrigin(sys.executable, ModuleCodePointer("m", "defs", None))
    )
    args = ExecuteRunArgs(job_origin=origin, run_id=run_id, instance_ref=instance.get_ref())
    monkeypatch.setattr(sys, "argv", ["dagster", "api", "execute_run", serialize_value(args)])


def new_run(instance) -> dg.DagsterRun:
    return instance.add_run(dg.DagsterRun(job_name="tiny__build_shards", run_id=str(uuid.uuid4()),
                                          status=dg.DagsterRunStatus.STARTING))  # fmt: skip


def test_a_run_worker_that_cannot_load_marks_its_run_not_to_be_retried(instance, monkeypatch):
    run = new_run(instance)
    as_run_worker(monkeypatch, instance, run.run_id)
    with pytest.raises(ConfigError), load_guard.load_failures_not_retried():
        raise ConfigError("/srv/datasets.yaml: no such datasets file")
    assert instance.get_run_by_id(run.run_id).tags[private.MAX_RETRIES_TAG] == "0"
    instance.report_run_failed(instance.get_run_by_id(run.run_id))  # what Dagster does next
    assert instance.get_run_by_id(run.run_id).tags["dagster/will_retry"] == "false"
    messages = [e.message for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]
    assert any("not retried" in m and "no such datasets file" in m for m in messages)


def test_a_failure_that_may_pass_is_left_to_the_retries(instance, monkeypatch):
    run = new_run(instance)
    as_run_worker(monkeypatch, instance, run.run_id)
    with pytest.raises(OSError), load_guard.load_failures_not_retried():
        raise OSError("a mount that did not answer")
    assert private.MAX_RETRIES_TAG not in instance.get_run_by_id(run.run_id).tags
    instance.report_run_failed(instance.get_run_by_id(run.run_id))
    assert instance.get_run_by_id(run.run_id).tags["dagster/will_retry"] == "true"


def test_outside_a_run_worker_the_guard_only_passes_the_error_on(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dagster", "api", "grpc", "--module-name", "x"])  # the code server
    assert load_guard.run_of_this_worker() is None
    with pytest.raises(ImportError), load_guard.load_failures_not_retried():
        raise ImportError("no module named PIL")
