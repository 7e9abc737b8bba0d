"""Every Dagster name of one dataset, derived from its name in one place.

Assets live under a key prefix of the dataset name (`sample/main`, `sample/resized_512`,
...), in a group of that name, partitioned by a partitions definition of that name.
Jobs and sensors carry the name as a prefix, so two datasets never share anything.
"""

from dataclasses import dataclass
from functools import cached_property

import dagster as dg

from fixed_res_sidecar.core import resolutions

# Run tag that names the dataset: dagster.yaml limits concurrent runs per unique value.
from fixed_res_sidecar.defs.run_resources import DATASET_TAG  # noqa: F401 (re-exported)

# A run of the fidelity sweep (defs/fidelity_sweep.py) carries this tag set to "true": its shards are
# verified again although their results are on record, each comparing rows not compared before.
SWEEP_TAG = "sidecar/fidelity_sweep"
AUTOMATION_TAG = "sidecar/automation"  # on the automation sensor's runs and backfills (defs/automation.py)

# The resolution names ("512", "1024") in asset names (`resized_512`, `verify_1024`), from the
# one table of resolutions (area, audit prefix, dataset folder: `core.resolutions.RESOLUTIONS`).
RESOLUTION_NAMES = resolutions.RESOLUTION_NAMES


@dataclass(frozen=True)
class DatasetKeys:
    dataset: str

    def asset(self, name: str) -> dg.AssetKey:
        return dg.AssetKey([self.dataset, name])

    @cached_property
    def main(self) -> dg.AssetKey:
        return self.asset("main")

    def resized(self, resolution: str) -> dg.AssetKey:
        return self.asset(f"resized_{_known(resolution)}")

    def verify(self, resolution: str) -> dg.AssetKey:
        return self.asset(f"verify_{_known(resolution)}")

    @cached_property
    def crop_bbox(self) -> dg.AssetKey:
        return self.asset("crop_bbox")

    @cached_property
    def shard_assets(self) -> tuple[dg.AssetKey, ...]:
        """Everything built per shard, in build order (main is external, never part of a run)."""
        return (
            *(self.resized(r) for r in RESOLUTION_NAMES),
            *(self.verify(r) for r in RESOLUTION_NAMES),
            self.crop_bbox,
        )

    @property
    def group(self) -> str:
        return self.dataset

    @property
    def partitions(self) -> str:
        """Name of the dataset's DynamicPartitionsDefinition (its shards)."""
        return f"{self.dataset}_shards"

    @property
    def shard_job(self) -> str:
        """Resize, verify and crop one shard (what the sensor requests, what backfills run)."""
        return f"{self.dataset}__build_shards"

    @property
    def discovery_sensor(self) -> str:
        return f"{self.dataset}__discover_shards"

    @property
    def automation_sensor(self) -> str:
        return f"{self.dataset}__automation"

    @property
    def shard_op(self) -> str:
        """The one step that resizes, verifies and crops the shards of a run."""
        return f"{self.dataset}__shard_batch"

    @cached_property
    def audit(self) -> dg.AssetKey:
        """The dataset audit: an unpartitioned asset whose materializations hold the dataset's totals."""
        return self.asset("audit")

    @property
    def audit_job(self) -> str:
        return f"{self.dataset}__dataset_audit"

    @property
    def audit_schedule(self) -> str:
        return f"{self.dataset}__audit_hourly"

    @property
    def audit_sensor(self) -> str:
        """Audits the dataset after its runs end (defs/audit_triggers.py)."""
        return f"{self.dataset}__audit_after_runs"

    @property
    def fidelity_sweep(self) -> str:
        """The schedule that verifies shards again, comparing rows not compared before (off by default)."""
        return f"{self.dataset}__fidelity_sweep"

    @property
    def dataset_audit(self) -> dg.AssetCheckKey:
        return dg.AssetCheckKey(self.audit, "dataset_audit")


def _known(resolution: str) -> str:
    if resolution not in RESOLUTION_NAMES:
        raise ValueError(f"unknown resolution {resolution!r}; the resolutions are {list(RESOLUTION_NAMES)}")
    return resolution
