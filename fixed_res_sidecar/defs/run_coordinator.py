"""A queued run coordinator that tags every run of a dataset with its dataset.

Runs of a dataset's jobs carry `fixed_res_sidecar/dataset` (and the dataset's CPU and memory
tags) from the job, but runs launched from an asset page use Dagster's implicit `__ASSET_JOB`,
which carries none; nothing in a code location can add run tags to it. Every launch path
(the UI, asset and job backfills, sensors, automation, retries) submits its runs through the
instance's run coordinator, so that is where the tag is added: the per-dataset concurrency
limit in dagster.yaml then counts every run, and the dataset audit sees every run as work
under way. Configure it in dagster.yaml:

    run_coordinator:
      module: fixed_res_sidecar.defs.run_coordinator
      class: DatasetRunCoordinator

Runs executed in process (`dagster asset materialize`, `execute_in_process`) do not pass through
a coordinator.
"""

import functools

import dagster as dg

from fixed_res_sidecar.defs.run_resources import DATASET_TAG, dataset_run_tags


class DatasetRunCoordinator(dg.QueuedRunCoordinator):
    """The queued run coordinator, adding the dataset's tags to runs that lack them."""

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        # Dagster refuses run limits in two places only for its own class name: keep that guard.
        mixed = [f for f in ("max_concurrent_runs", "tag_concurrency_limits") if config_value.get(f) is not None]
        if mixed:
            raise dg.DagsterInvalidConfigError(
                f"Found config value for {mixed} in `run_coordinator`; set run limits under `concurrency > runs`",
                [],
                None,
            )
        return super().from_config_value(inst_data, config_value)

    def submit_run(self, context: dg.SubmitRunContext) -> dg.DagsterRun:
        run = context.dagster_run
        if DATASET_TAG not in run.tags:
            tags = tags_for(run)
            if tags:
                self._instance.add_run_tags(run.run_id, tags)
                context = dg.SubmitRunContext(self._instance.get_run_by_id(run.run_id), context.workspace)
        return super().submit_run(context)


def tags_for(run: dg.DagsterRun) -> dict[str, str]:
    """The tags a run of one dataset should carry; empty when the run is not one dataset's."""
    keys = [*(run.asset_selection or ()), *(check.asset_key for check in run.asset_check_selection or ())]
    names = {key.path[0] for key in keys if len(key.path) == 2}
    if not keys and "__" in run.job_name and not run.job_name.startswith("__"):
        names = {run.job_name.split("__", 1)[0]}  # a whole job of a dataset, `<dataset>__build_shards`
    if len(names) != 1:
        return {}
    (name,) = names
    dataset = _datasets().get(name)
    if dataset is None:  # no datasets file here, or not one of its datasets: the dataset tag alone
        return {DATASET_TAG: name} if keys and all(len(key.path) == 2 for key in keys) else {}
    return {k: v for k, v in dataset_run_tags(dataset).items() if k not in run.tags}


@functools.lru_cache(maxsize=1)
def _datasets() -> dict:
    """The datasets of the datasets file, when this process can read it (webserver and daemon usually can)."""
    from fixed_res_sidecar.defs.config import ConfigError, load_config

    try:
        return {dataset.name: dataset for dataset in load_config().datasets}
    except ConfigError:
        return {}
