"""dagster-ray's RayRunLauncher, with what this code location's runs need to load in a Ray job.

Each run is one Ray job (`JobSubmissionClient.submit_job`) whose entrypoint is `dagster api
execute_run ...`, run by the job supervisor on whichever node has the entrypoint's CPUs and memory
(the run's `dagster-ray/config` tag: `run_resources.launcher_tags`). What reaches the job:

- the code: the package installed on the node, from the cluster image (the entrypoint imports the
  code location's module, `fixed_res_sidecar.defs.definitions`, like the code server does); no
  `working_dir` upload;
- the instance: in the entrypoint's arguments (`dagster.yaml` as the daemon has it, its secrets as
  `{env: ...}` references), with the variables named by `env_vars` in deploy/dagster-ray.yaml
  taken from the daemon's environment (Postgres, the compute-log bucket);
- the datasets file and the code location's settings: from the code location itself, which
  publishes them with its definitions (`code_location.RUN_ENV_METADATA_KEY`); this launcher reads
  them from the workspace at launch and adds them to the job's `runtime_env.env_vars`. So the job
  loads exactly the config the code location had when the run was launched, and no node needs the
  datasets file. (A variable a run's own `dagster-ray/config` tag sets wins over these.)

A code location that publishes nothing (an older image of the code server) gets an engine event
saying so, and its runs read `SIDECAR_DATASETS` on the node, as before.
"""

import json

from dagster_ray.core.run_launcher import RayRunLauncher

from fixed_res_sidecar.defs.code_location import published_run_env
from fixed_res_sidecar.defs.dagster_private import LaunchRunContext, ResumeRunContext
from fixed_res_sidecar.defs.run_resources import RAY_CONFIG_TAG


def code_location_run_env(workspace, run) -> dict[str, str] | None:
    """What the run's code location published for its runs, from the workspace; None if nothing."""
    origin = run.remote_job_origin
    if workspace is None or origin is None:
        return None
    repository_origin = origin.repository_origin
    location = workspace.get_code_location(repository_origin.code_location_origin.location_name)
    if not location.has_repository(repository_origin.repository_name):
        return None
    repository = location.get_repository(repository_origin.repository_name)
    return published_run_env(repository.repository_snap.metadata)


class SidecarRayRunLauncher(RayRunLauncher):
    """RayRunLauncher whose jobs get the code location's datasets file and settings."""

    def _with_run_env(self, run, workspace):
        env = code_location_run_env(workspace, run)
        if not env:
            self._instance.report_engine_event(
                "The code location publishes no datasets file for its runs: the Ray job reads SIDECAR_DATASETS "
                "(or datasets.yaml in its working folder) on its node.",
                run,
                cls=self.__class__,
            )
            return run
        config = json.loads(run.tags.get(RAY_CONFIG_TAG) or "{}")
        runtime_env = dict(config.get("runtime_env") or self.runtime_env or {})
        runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
        tags = {**run.tags, RAY_CONFIG_TAG: json.dumps({**config, "runtime_env": runtime_env})}
        return run.with_tags(tags)  # this launch's copy: the stored run keeps its tags

    def launch_run(self, context: LaunchRunContext) -> None:
        super().launch_run(
            LaunchRunContext(self._with_run_env(context.dagster_run, context.workspace), context.workspace)
        )

    def resume_run(self, context: ResumeRunContext) -> None:
        run = self._with_run_env(context.dagster_run, context.workspace)
        super().resume_run(ResumeRunContext(run, context.workspace, context.resume_attempt_number))
