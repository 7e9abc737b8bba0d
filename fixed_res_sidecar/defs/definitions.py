"""The code location: `defs`, built from the datasets file when this module is loaded.

dagster dev -w workspace.yaml                       # loads this module
SIDECAR_DATASETS=/path/datasets.yaml dagster dev -m fixed_res_sidecar.defs.definitions
"""

from fixed_res_sidecar.defs.config import load_code_location_config
from fixed_res_sidecar.defs.dataset_definitions import build_definitions

defs = build_definitions(load_code_location_config())
