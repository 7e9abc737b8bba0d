"""A queued run coordinator that tags every run of a dataset with its dataset.

Runs of a dataset's jobs carry `fixed_res_sidecar/dataset` (and the dataset's CPU and memory
tags) from the job, but runs launched from an asset page use Dagster's implicit `__ASSET_JOB`,
which carries none; nothing in a code location can add run tags to it. Every launch path
(the UI, asset and job backfills, sensors, automation, retries) submits its runs through the
instance's run coordinator, so that is where the tag is added: the per-dataset concurrency
limit in dagster.yaml then counts every run, and the dataset audit sees every run as work
under way. Runs that only audit a dataset are left untagged: they are not work on its shards, and
must not wait behind its limit (the audit follows every run within a minute). Configure it in dagster.yaml:

    run_coordinator:
      module: fixed_res_sidecar.defs.run_coordinator
      class: DatasetRunCoordinator

Runs executed in process (`dagster asset materialize`, `execute_in_process`) do not pass through
a coordinator.

It also refuses to launch a retry that would fail as its parent did: a parent whose worker could not
load the job ("Could not load job definition." with an error that repeats: a missing or invalid
datasets file, a module missing from the image) and never started a step. The retry is canceled
at once, saying why, and never reaches the run launcher (`deterministic_parent_failure`). Workers
that load this package mark such runs not to be retried before they fail (`load_guard.py`); this
covers the workers that cannot.
"""

import functools

import dagster as dg

from fixed_res_sidecar.defs.dagster_private import PARENT_RUN_ID_TAG, RETRY_NUMBER_TAG
from fixed_res_sidecar.defs.names import DatasetKeys
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
        if why := deterministic_parent_failure(self._instance, run):
            message = f"Not launched: this retry would fail as its parent did ({why})."
            self._instance.report_engine_event(message, run)
            self._instance.report_run_canceled(run, message=message)
            return self._instance.get_run_by_id(run.run_id) or run  # None: deleted meanwhile
        if DATASET_TAG not in run.tags:
            tags = tags_for(run)
            if tags:
                self._instance.add_run_tags(run.run_id, tags)
                tagged = self._instance.get_run_by_id(run.run_id)
                if tagged is None:  # deleted while it was being submitted
                    raise dg.DagsterRunNotFoundError(
                        f"run {run.run_id} is gone from run storage", invalid_run_id=run.run_id
                    )
                context = dg.SubmitRunContext(tagged, context.workspace)
        return super().submit_run(context)


def tags_for(run: dg.DagsterRun) -> dict[str, str]:
    """The tags a run of one dataset should carry; empty when the run is not one dataset's, or only
    audits it (a light run that must not wait behind the dataset's own limit: defs/audit_triggers.py)."""
    keys = [*(run.asset_selection or ()), *(check.asset_key for check in run.asset_check_selection or ())]
    names = {key.path[0] for key in keys if len(key.path) == 2}
    if not keys and "__" in run.job_name and not run.job_name.startswith("__"):
        names = {run.job_name.split("__", 1)[0]}  # a whole job of a dataset, `<dataset>__build_shards`
    if len(names) != 1:
        return {}
    (name,) = names
    audit = DatasetKeys(name)
    if run.job_name == audit.audit_job or (keys and all(key == audit.audit for key in keys)):
        return {}
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


# "Could not load job definition." (dagster._grpc.impl.core_execute_run): the run worker's load failed.
LOAD_FAILURE_MESSAGE = "Could not load job definition."
# Errors of a load that repeat (by class name, anywhere in the error's cause chain)...
DETERMINISTIC_LOAD_ERRORS = frozenset(
    {"ConfigError", "ImportError", "ModuleNotFoundError", "SyntaxError", "ValidationError",
     "DagsterInvalidDefinitionError", "DagsterInvalidConfigError", "NameError", "AttributeError"}
)  # fmt: skip
# ...unless one that may pass is in it too (storage, network, the code server).
TRANSIENT_LOAD_ERRORS = frozenset(
    {"OperationalError", "InterfaceError", "ConnectionError", "TimeoutError", "OSError", "EventLogUnavailable",
     "DagsterUserCodeUnreachableError", "DagsterUserCodeProcessError"}
)  # fmt: skip


def _error_classes(error) -> set[str]:
    names, todo = set(), [error]
    while todo:
        current = todo.pop()
        if current is None:
            continue
        names.add(current.cls_name or "")
        todo += [current.cause, current.context]
    return names


def deterministic_parent_failure(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """Why retry `run` would fail as its parent did (a load failure that repeats), or None."""
    parent_id = run.tags.get(PARENT_RUN_ID_TAG)
    if parent_id is None or RETRY_NUMBER_TAG not in run.tags:
        return None  # not an automatic retry: a user's re-execution is theirs to decide
    events = instance.all_logs(parent_id, of_type={dg.DagsterEventType.ENGINE_EVENT, dg.DagsterEventType.STEP_START})
    if any(e.dagster_event and e.dagster_event.event_type == dg.DagsterEventType.STEP_START for e in events):
        return None
    for entry in events:
        event = entry.dagster_event
        if entry.message != LOAD_FAILURE_MESSAGE or event is None:
            continue
        error = event.engine_event_data.error
        if error is None:
            continue
        classes = _error_classes(error)
        if classes & DETERMINISTIC_LOAD_ERRORS and not classes & TRANSIENT_LOAD_ERRORS:
            first = (error.message or "").strip().splitlines()
            return f"run {parent_id} could not load its job: {first[0] if first else error.cls_name}"[:1000]
    return None
