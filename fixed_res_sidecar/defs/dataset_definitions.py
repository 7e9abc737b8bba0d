"""The Dagster definitions of the datasets of a datasets file (`definitions.py` loads them).

Per dataset (see `dataset_definitions`): its assets and checks, one shard job (what the
discovery sensor requests and what a UI backfill of the job runs, one run per batch of up to
`shards_per_run` shards), the audit job with its schedule and its run-status sensor
(defs/audit_triggers.py), the fidelity sweep (defs/fidelity_sweep.py), the discovery sensor and the
automation sensor.
Everything runs in process: shard steps are few and sequential, and on small machines the
multiprocess executor costs seconds per step.
"""

import dagster as dg

from fixed_res_sidecar.defs.assets import dataset_assets
from fixed_res_sidecar.defs.audit_triggers import audit_after_runs_sensor, audit_run_tags, audit_schedule
from fixed_res_sidecar.defs.automation import automation_sensor
from fixed_res_sidecar.defs.config import DatasetConfig, SidecarConfig
from fixed_res_sidecar.defs.fidelity_sweep import fidelity_sweep_schedule
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar.defs.partitions import shard_partitions
from fixed_res_sidecar.defs.resources import default_resources
from fixed_res_sidecar.defs.run_resources import dataset_run_tags
from fixed_res_sidecar.defs.sensors import discovery_sensor


def shard_job_selection(keys: DatasetKeys) -> dg.AssetSelection:
    """Everything built per shard (main is external and never part of a run)."""
    return dg.AssetSelection.assets(*keys.shard_assets)


def dataset_definitions(dataset: DatasetConfig) -> dg.Definitions:
    keys = DatasetKeys(dataset.name)
    partitions = shard_partitions(keys)
    shard_job = dg.define_asset_job(
        keys.shard_job,
        selection=shard_job_selection(keys),
        executor_def=dg.in_process_executor,
        # `tags`, not `run_tags`: job backfills copy the job's tags onto every run they create.
        tags=dataset_run_tags(dataset),
        description=(
            f"Resize, verify and crop shards of {dataset.name}: each run takes a batch of up to "
            f"{dataset.shards_per_run} shards (partitions). Backfill it from the UI to build many shards."
        ),
    )
    audit_job = dg.define_asset_job(
        keys.audit_job,
        selection=dg.AssetSelection.assets(keys.audit),
        executor_def=dg.in_process_executor,
        # Not the dataset's tag: an audit is not held back by the dataset's run limit (defs/audit_triggers.py).
        tags=audit_run_tags(),
        description=(
            f"The dataset audit of {dataset.name}: the verdict, failed shards and their repair, totals, fidelity. "
            "It runs after every run of the dataset that ends and on its schedule."
        ),
    )
    return dg.Definitions(
        assets=dataset_assets(dataset, partitions),
        jobs=[shard_job, audit_job],
        schedules=[audit_schedule(dataset, audit_job), fidelity_sweep_schedule(dataset)],
        sensors=[discovery_sensor(dataset), automation_sensor(dataset), audit_after_runs_sensor(dataset)],
    )


def build_definitions(config: SidecarConfig, run_env: dict[str, str] | None = None) -> dg.Definitions:
    """All datasets of a config, merged, with the shared resources and the in-process executor.

    `run_env`: what this code location's runs need to load the same definitions wherever they run
    (`code_location.code_location_config`), published as the definitions' metadata for the run
    launcher (`ray_launcher.py`)."""
    from fixed_res_sidecar.defs.code_location import RUN_ENV_METADATA_KEY

    merged = dg.Definitions.merge(*(dataset_definitions(d) for d in config.datasets))
    metadata = {RUN_ENV_METADATA_KEY: dg.MetadataValue.json(run_env)} if run_env else None
    shared = dg.Definitions(resources=default_resources(), executor=dg.in_process_executor, metadata=metadata)
    return dg.Definitions.merge(merged, shared)
