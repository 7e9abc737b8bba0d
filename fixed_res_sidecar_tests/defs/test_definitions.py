"""The code location loads and validates (in process and with the real `dagster` CLI); datasets stay apart."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from fixed_res_sidecar.defs.config import DATASETS_ENV, load_config
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.names import DATASET_TAG, DatasetKeys
from fixed_res_sidecar.defs.resources import SidecarRuntime
from fixed_res_sidecar.io.locations import LocationError
from fixed_res_sidecar.sample_data import write_sample_dataset
from fixed_res_sidecar_tests.defs.conftest import dataset_entry, make_config, run_request, write_tiny
from fixed_res_sidecar_tests.fixtures import REPO_ROOT


def dagster_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dagster", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def cli_env(tmp_path: Path, datasets: Path | None = None) -> dict[str, str]:
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")  # validates the repo's instance file too
    env = {k: v for k, v in os.environ.items() if k != DATASETS_ENV}
    env["DAGSTER_HOME"] = str(home)
    if datasets is not None:
        env[DATASETS_ENV] = str(datasets)
    return env


def repo_datasets_with_sample(tmp_path: Path) -> Path:
    """The repository's datasets file, copied next to a small sample main dataset where it points."""
    datasets = tmp_path / "datasets.yaml"
    shutil.copy(REPO_ROOT / "datasets.yaml", datasets)
    write_sample_dataset(load_config(datasets).dataset("sample").main, shards=["part-0.parquet"], rows_per_shard=2)
    return datasets


def test_repo_definitions_load_and_validate(tmp_path, monkeypatch):
    import importlib

    monkeypatch.setenv(DATASETS_ENV, str(repo_datasets_with_sample(tmp_path)))
    definitions = importlib.import_module("fixed_res_sidecar.defs.definitions")  # loaded with the variable set
    defs = importlib.reload(definitions).defs
    dg.Definitions.validate_loadable(defs)
    keys = DatasetKeys("sample")
    assert {k.to_user_string() for k in defs.resolve_all_asset_keys()} == {
        "sample/main",
        "sample/resized_512",
        "sample/resized_1024",
        "sample/verify_512",
        "sample/verify_1024",
        "sample/crop_bbox",
        "sample/audit",
    }
    job = defs.resolve_job_def(keys.shard_job)
    assert job.partitions_def.name == "sample_shards"
    assert job.executor_def is dg.in_process_executor
    assert job.run_tags[DATASET_TAG] == "sample"
    assert defs.resolve_sensor_def(keys.discovery_sensor).default_status == dg.DefaultSensorStatus.RUNNING
    assert defs.resolve_sensor_def(keys.automation_sensor).default_status == dg.DefaultSensorStatus.RUNNING
    assert defs.resolve_schedule_def("sample__audit_hourly").cron_schedule == "0 * * * *"


def test_dagster_cli_validates_the_workspace(tmp_path):
    result = dagster_cli(
        "definitions", "validate", "-w", "workspace.yaml", env=cli_env(tmp_path, repo_datasets_with_sample(tmp_path))
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Validation successful for code location fixed_res_sidecar" in result.stdout + result.stderr


def datasets_with_one_main_missing(tmp_path: Path) -> tuple[Path, Path]:
    """A datasets file: `present` (a small main dataset) and `missing` (its main folder does not exist)."""
    present, missing = tmp_path / "present" / "main", tmp_path / "missing" / "main"
    write_tiny(present, shards=("part-0.parquet",))
    datasets = tmp_path / "datasets.yaml"
    entries = [
        dataset_entry(name, main, tmp_path / name / "out")
        for name, main in (("missing", missing), ("present", present))
    ]
    datasets.write_text(yaml.safe_dump({"datasets": entries}))
    return datasets, missing


def test_dagster_cli_loads_the_other_datasets_and_names_the_missing_main_folder(tmp_path):
    """Reported: one dataset whose local main folder was missing took the code location down for all."""
    datasets, missing = datasets_with_one_main_missing(tmp_path)
    result = dagster_cli("definitions", "validate", "-w", "workspace.yaml", env=cli_env(tmp_path, datasets))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Validation successful for code location fixed_res_sidecar" in output
    assert f"dataset 'missing', field 'main_prefix': {missing} does not exist" in output


def test_a_dataset_whose_main_folder_is_missing_fails_alone_and_the_others_run(tmp_path, monkeypatch, caplog):
    import importlib

    datasets, missing = datasets_with_one_main_missing(tmp_path)
    monkeypatch.setenv(DATASETS_ENV, str(datasets))
    definitions = importlib.import_module("fixed_res_sidecar.defs.definitions")
    defs = importlib.reload(definitions).defs
    assert f"dataset 'missing', field 'main_prefix': {missing} does not exist" in caplog.text
    dg.Definitions.validate_loadable(defs)

    def tick(dataset: str, instance: dg.DagsterInstance) -> dg.SensorResult:
        sensor = defs.resolve_sensor_def(DatasetKeys(dataset).discovery_sensor)
        return sensor(dg.build_sensor_context(instance=instance, resources={"sidecar": SidecarRuntime()}))

    with dg.instance_for_test() as instance:
        # The other dataset discovers its shard and runs it.
        found = tick("present", instance)
        assert instance.get_dynamic_partitions(DatasetKeys("present").partitions) == ["part-0.parquet"]
        (request,) = found.run_requests
        assert run_request(defs, instance, request).success
        # The dataset without its folder fails each tick, naming the folder, and records nothing.
        with pytest.raises(LocationError, match=f"{missing} does not exist"):
            tick("missing", instance)
        assert instance.get_dynamic_partitions(DatasetKeys("missing").partitions) == []
        # Once the folder is there, its next tick works, without reloading the code location.
        write_tiny(missing, shards=("part-0.parquet",))
        tick("missing", instance)
        assert instance.get_dynamic_partitions(DatasetKeys("missing").partitions) == ["part-0.parquet"]


def test_dagster_cli_refuses_bad_config_naming_dataset_and_field(tmp_path):
    bad = tmp_path / "datasets.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "datasets": [
                    {
                        "name": "laion",
                        "main_prefix": str(tmp_path / "main"),
                        "output_root": str(tmp_path / "main" / "out"),
                    }
                ]
            }
        )
    )
    result = dagster_cli("definitions", "validate", "-w", "workspace.yaml", env=cli_env(tmp_path, bad))
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "dataset 'laion', field 'outputs.resized_512'" in output and "read-only" in output


def test_two_datasets_stay_separate(tmp_path):
    config = make_config(
        dataset_entry(
            "laion", tmp_path / "laion" / "main", tmp_path / "laion" / "out", run_resources={"cpu": 4, "memory_gb": 16}
        ),
        dataset_entry("coco", tmp_path / "coco" / "main", tmp_path / "coco" / "out"),
    )
    defs = build_definitions(config)
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    laion, coco = DatasetKeys("laion"), DatasetKeys("coco")
    for keys in (laion, coco):
        own = [k for k in graph.get_all_asset_keys() if k.path[0] == keys.dataset]
        assert len(own) == 7
        assert {graph.get(k).group_name for k in own} == {keys.dataset}
        partitioned = [k for k in own if k != keys.audit]  # the audit is one asset per dataset
        assert {graph.get(k).partitions_def.name for k in partitioned} == {keys.partitions}
        # No edge crosses datasets.
        for key in own:
            assert all(parent.path[0] == keys.dataset for parent in graph.get(key).parent_keys)
        job = defs.resolve_job_def(keys.shard_job)
        assert {k.path[0] for k in job.asset_layer.executable_asset_keys} == {keys.dataset}
        assert job.run_tags[DATASET_TAG] == keys.dataset
        checks = [k for k in graph.asset_check_keys if k.asset_key.path[0] == keys.dataset]
        assert len(checks) == 5 + 5 + 6 + 2  # verifiers, sidecar, the audit's two
    assert '"num_cpus": 4.0' in defs.resolve_job_def(laion.shard_job).run_tags["dagster-ray/config"]
    for keys in (laion, coco):  # each discovery sensor targets its own dataset's shard assets
        selection = defs.resolve_sensor_def(keys.discovery_sensor).asset_selection
        assert selection.resolve(graph) == set(keys.shard_assets)
    assert defs.resolve_sensor_def(laion.automation_sensor) is not defs.resolve_sensor_def(coco.automation_sensor)

    # Partitions of one dataset are not partitions of the other.
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(laion.partitions, ["part-0.parquet"])
        laion_parts = graph.get(laion.crop_bbox).partitions_def
        coco_parts = graph.get(coco.crop_bbox).partitions_def
        assert laion_parts.get_partition_keys(dynamic_partitions_store=instance) == ["part-0.parquet"]
        assert coco_parts.get_partition_keys(dynamic_partitions_store=instance) == []


def test_instance_file_limits_runs_per_dataset(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        queue = instance.get_concurrency_config().run_queue_config
        assert queue.max_concurrent_runs >= 1
        (limit,) = queue.tag_concurrency_limits
        assert limit["key"] == DATASET_TAG and limit["value"] == {"applyLimitPerUniqueValue": True}


def test_workspace_points_at_the_definitions_module():
    workspace = yaml.safe_load((REPO_ROOT / "workspace.yaml").read_text())
    (location,) = workspace["load_from"]
    assert location["python_module"]["module_name"] == "fixed_res_sidecar.defs.definitions"
