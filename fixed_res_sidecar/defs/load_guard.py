"""A run whose worker cannot load the code location is not retried: it would fail the same way.

What Dagster does: the run worker (`dagster api execute_run`) loads the job first; if that raises,
it writes the engine event "Could not load job definition." and fails the run with no failure
reason. Run retries only spare STEP_FAILURE runs (`retry_on_asset_or_op_failure: false`); a run
failed without a reason is retried up to `max_retries` times, and each retry fails again (a missing
datasets file, an invalid one, a package missing from the cluster image).

Here: `definitions.py` loads everything inside `load_failures_not_retried()`. When that raises in a
run worker, the run gets the tag `dagster/max_retries: "0"` and an engine event saying why, before
the exception goes on to Dagster, which then fails the run: `WILL_RETRY` is computed from the run's
tags when its failure is stored, so the run is not retried. Errors that may pass (the network, a
storage outage: OSError) are left to the retries.

A worker that cannot even import this package gets no tag (nothing of ours runs): the run
coordinator refuses to launch its retry instead (`run_coordinator.deterministic_parent_failure`).

Imports only the standard library, Dagster and `dagster_private` (Dagster alone), so it works when
the rest of the package does not.
"""

import contextlib
import sys
from collections.abc import Iterator

# Errors of loading that are worth retrying (they may pass); any other one would repeat.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError)


def run_of_this_worker():
    """(run id, instance ref) when this process is a run worker (`dagster api execute_run ARGS` or
    `resume_run`, as every launcher but the default one starts it), else None."""
    import dagster as dg

    from fixed_res_sidecar.defs.dagster_private import ExecuteRunArgs, ResumeRunArgs

    argv = sys.argv[1:]
    if "api" not in argv or not any(a in argv for a in ("execute_run", "resume_run")) or not argv[-1].startswith("{"):
        return None
    try:
        args = dg.deserialize_value(argv[-1], (ExecuteRunArgs, ResumeRunArgs))
    except Exception:  # noqa: BLE001 - not what we thought: no run to mark
        return None
    return (args.run_id, args.instance_ref) if args.instance_ref is not None else None


def mark_not_retried(run_id: str, instance_ref, exc: BaseException) -> None:
    import dagster as dg

    from fixed_res_sidecar.defs.dagster_private import MAX_RETRIES_TAG

    text = "".join(f"{type(exc).__name__}: {exc}".splitlines(keepends=True)[:20])[:3000]
    with dg.DagsterInstance.from_ref(instance_ref) as instance:
        run = instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return
        instance.add_run_tags(run_id, {MAX_RETRIES_TAG: "0"})
        instance.report_engine_event(
            "The code location could not be loaded in this run worker; this would repeat (the datasets file or "
            f"the packages of the image), so the run is not retried.\n{text}",
            run,
        )


@contextlib.contextmanager
def load_failures_not_retried() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, TRANSIENT_ERRORS) and (worker := run_of_this_worker()) is not None:
            try:
                mark_not_retried(*worker, exc)
            except Exception as marking:  # noqa: BLE001 - the load's own error is the one to report
                print(f"could not mark run {worker[0]} as not to be retried: {marking!r}", file=sys.stderr)
        raise
