"""Small datasets and helpers for the Dagster-layer tests (runs are in process, on test instances)."""

import logging
import shutil
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.defs.config import SidecarConfig, parse_config
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.sample_data import write_sample_dataset
from fixed_res_sidecar_tests.fixtures.shared import made_once

# Two shards, one in a nested folder; row 6 of each is a bad row (null image). Small
# pictures keep a shard run to a few seconds.
TINY_SHARDS = ("part-a.parquet", "nested/x/part-b.parquet")
TINY_ROWS = 7
TINY_SIZES = ((320, 240), (240, 320), (400, 225))
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}

logging.getLogger("dagster").setLevel(logging.WARNING)


def write_tiny(location: Location | str, shards=TINY_SHARDS) -> list[str]:
    return write_sample_dataset(location, shards=shards, rows_per_shard=TINY_ROWS, row_group_size=4, sizes=TINY_SIZES)


@pytest.fixture(scope="session")
def tiny_main_template(tmp_path_factory) -> Path:
    return made_once(tmp_path_factory, "tiny-main", write_tiny)


@pytest.fixture
def tiny_main(tiny_main_template, tmp_path) -> Location:
    """A fresh local copy of a two-shard main dataset."""
    root = tmp_path / "main" / "tiny"
    shutil.copytree(tiny_main_template, root)
    return Location.parse(root)


def dataset_entry(name: str, main: Location | str, output_root: Location | str, **extra) -> dict:
    """A datasets-file entry. Its WebP effort is the encoder's fastest (`webp_method: 0`; 4 by default,
    about 2.8x the CPU per picture): these tests are about the Dagster layer, and the encode was a fifth
    of their CPU. The default effort is built by the CLI's tests, the demo and the documented commands."""
    main_uri = main.uri if isinstance(main, Location) else str(main)
    root_uri = output_root.uri if isinstance(output_root, Location) else str(output_root)
    entry = {
        "name": name,
        "main_prefix": main_uri,
        "output_root": root_uri,
        "verify_sample": 8,
        "overlay_sample": 1,
        "overlay_embed": 1,
        "webp_method": 0,
    }
    entry.update(extra)
    return entry


def make_config(*entries: dict) -> SidecarConfig:
    return parse_config({"datasets": list(entries)}, source="test config")


@pytest.fixture
def tiny_config(tiny_main, tmp_path) -> SidecarConfig:
    return make_config(dataset_entry("tiny", tiny_main, tmp_path / "out"))


@pytest.fixture
def tiny_defs(tiny_config) -> dg.Definitions:
    return build_definitions(tiny_config)


@pytest.fixture(scope="session")
def instance_template(tmp_path_factory) -> Path:
    """A new test instance's storage (its SQLite schemas), made once for the run: creating the schemas
    takes a new instance 0.37 CPU-s, copying them 0.05."""

    def make(root: Path) -> None:
        with dg.instance_for_test(temp_dir=str(root)) as instance:
            instance.get_runs()

    return made_once(tmp_path_factory, "instance-template", make)


@pytest.fixture
def instance(instance_template, tmp_path):
    """A new `dg.instance_for_test()`, its storage copied from `instance_template`."""
    home = tmp_path / "test-instance"
    shutil.copytree(instance_template, home)
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        yield instance


def register(instance: dg.DagsterInstance, config: SidecarConfig, name: str | None = None) -> list[str]:
    """Register every shard of a dataset as a partition and record it on main, as the sensor does."""
    from fixed_res_sidecar.demo import register_shards

    return register_shards(instance, config.dataset(name) if name else config.datasets[0])


def run_shard(defs: dg.Definitions, instance, job_name: str, rel: str, selection=None) -> dg.ExecuteInProcessResult:
    job = defs.resolve_job_def(job_name)
    return job.execute_in_process(
        partition_key=rel, instance=instance, raise_on_error=False, run_config=QUIET, asset_selection=selection
    )


def run_request(defs: dg.Definitions, instance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """Execute a sensor's run request in process, as the daemon would launch it: the implicit asset job of
    the dataset's shard assets (what the sensors target), its selection of them, its partition or range tags."""
    from fixed_res_sidecar.defs.names import DATASET_TAG, DatasetKeys

    shard_assets = list(DatasetKeys(request.tags[DATASET_TAG]).shard_assets)
    job = defs.get_repository_def().get_implicit_job_def_for_assets(shard_assets)
    assert job is not None
    return job.execute_in_process(
        instance=instance,
        asset_selection=list(request.asset_selection or shard_assets),
        partition_key=request.partition_key,
        tags=request.tags,
        run_config=QUIET,
        raise_on_error=False,
    )


def check_partition_status(instance, check_keys, rels) -> dict[tuple[str, str | None], str]:
    infos = instance.event_log_storage.get_asset_check_partition_info(list(check_keys), partition_keys=list(rels))
    return {(i.check_key.to_user_string(), i.partition_key): i.latest_execution_status.value for i in infos}


def swap_two_keys(location: Location, rel: str) -> None:
    """Damage a resized shard: swap the keys of rows 0 and 1, keep the footer's build settings."""
    path = Path(location.child(rel))
    table = pq.read_table(path)
    keys = table.column("image_key").to_pylist()
    keys[0], keys[1] = keys[1], keys[0]
    import pyarrow as pa

    damaged = table.set_column(0, table.schema.field(0), pa.array(keys, table.schema.field(0).type))
    pq.write_table(damaged.replace_schema_metadata(table.schema.metadata), path)


def failed_partitions(instance, defs: dg.Definitions, asset_keys) -> dict[str, set[str]]:
    """Asset (text) -> its shards the UI shows Failed: Dagster's own partition status computation
    (the latest planned materialization has none after it, and its run failed)."""
    import asyncio

    from dagster._core.loader import LoadingContextForTest
    from dagster._core.storage.partition_status_cache import get_partition_subsets

    graph = defs.resolve_asset_graph()
    failed = {}
    for key in asset_keys:
        partitions = graph.get(key).partitions_def
        _, subset, _ = asyncio.run(
            get_partition_subsets(instance, LoadingContextForTest(instance), key, instance, partitions)
        )
        failed[key.to_user_string()] = set(subset.get_partition_keys())
    return failed
