"""defs/run_coordinator.py: runs launched from an asset page carry their dataset's tags too."""

import dagster as dg
import yaml

from fixed_res_sidecar.defs import run_coordinator
from fixed_res_sidecar.defs.names import DATASET_TAG, DatasetKeys
from fixed_res_sidecar.defs.run_resources import K8S_CONFIG_TAG
from fixed_res_sidecar_tests.defs.conftest import dataset_entry
from fixed_res_sidecar_tests.fixtures import REPO_ROOT

KEYS = DatasetKeys("tiny")


def run_of(job_name: str, assets=(), checks=(), tags=None) -> dg.DagsterRun:
    return dg.DagsterRun(
        job_name=job_name,
        asset_selection=frozenset(assets) or None,
        asset_check_selection=frozenset(checks) or None,
        tags=tags or {},
    )


def test_which_runs_get_which_tags(tmp_path, monkeypatch):
    datasets = tmp_path / "datasets.yaml"
    entry = dataset_entry("tiny", tmp_path / "main", tmp_path / "out", run_resources={"cpu": 3, "memory_gb": 6})
    datasets.write_text(yaml.safe_dump({"datasets": [entry]}))
    monkeypatch.setenv("SIDECAR_DATASETS", str(datasets))
    run_coordinator._datasets.cache_clear()
    try:
        from_asset_page = run_coordinator.tags_for(run_of("__ASSET_JOB", [KEYS.crop_bbox, KEYS.verify("512")]))
        assert from_asset_page[DATASET_TAG] == "tiny" and '"cpu": "3"' in from_asset_page[K8S_CONFIG_TAG]
        check_only = run_coordinator.tags_for(run_of("__ASSET_JOB", checks=[dg.AssetCheckKey(KEYS.verify("512"), "x")]))
        assert check_only[DATASET_TAG] == "tiny"
        assert run_coordinator.tags_for(run_of("tiny__build_shards"))[DATASET_TAG] == "tiny"
        # An audit is not work on the shards: never held back by the dataset's run limit.
        assert run_coordinator.tags_for(run_of("tiny__dataset_audit")) == {}
        assert run_coordinator.tags_for(run_of("__ASSET_JOB", [KEYS.audit], [dg.AssetCheckKey(KEYS.audit, "x")])) == {}
        # Runs of two datasets, or of assets that are not a dataset's, are left alone.
        assert run_coordinator.tags_for(run_of("__ASSET_JOB", [KEYS.main, DatasetKeys("other").main])) == {}
        assert run_coordinator.tags_for(run_of("__ASSET_JOB", [dg.AssetKey(["a", "b", "c"])])) == {}
        assert run_coordinator.tags_for(run_of("some_job")) == {}
        # A dataset this process cannot see in the datasets file still gets its dataset tag.
        assert run_coordinator.tags_for(run_of("__ASSET_JOB", [DatasetKeys("elsewhere").main])) == {
            DATASET_TAG: "elsewhere"
        }
    finally:
        run_coordinator._datasets.cache_clear()


def test_the_instance_files_use_it():
    for path in (
        REPO_ROOT / "dagster.yaml",
        REPO_ROOT / "deploy" / "dagster.yaml",
        REPO_ROOT / "deploy" / "dagster-ray.yaml",
    ):
        coordinator = yaml.safe_load(path.read_text())["run_coordinator"]
        assert (coordinator["module"], coordinator["class"]) == (run_coordinator.__name__, "DatasetRunCoordinator")
    config = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    with dg.instance_for_test(overrides={"run_coordinator": config["run_coordinator"]}) as instance:
        assert isinstance(instance.run_coordinator, run_coordinator.DatasetRunCoordinator)
