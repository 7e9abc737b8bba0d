"""The code location: `defs`, built from the datasets file when this module is loaded.

dagster dev -w workspace.yaml                       # loads this module
SIDECAR_DATASETS=/path/datasets.yaml dagster dev -m fixed_res_sidecar.defs.definitions

In a run launched elsewhere (a Ray job, a pod) the datasets file comes with the run
(`code_location.py`). If loading fails in a run worker, the failure is deterministic (the datasets
file, the packages of the image): the run is marked not to be retried before Dagster fails it
(`load_guard.py`).
"""

from fixed_res_sidecar.defs.load_guard import load_failures_not_retried

with load_failures_not_retried():
    from fixed_res_sidecar.defs.code_location import code_location_config
    from fixed_res_sidecar.defs.dataset_definitions import build_definitions

    _config, _run_env = code_location_config()
    defs = build_definitions(_config, _run_env)
