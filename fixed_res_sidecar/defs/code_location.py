"""The code location's datasets file, and how its runs get it wherever they run.

The code server is the one process that must have the datasets file (`SIDECAR_DATASETS`, else
`datasets.yaml` in its folder). Runs load the code location again in their own process: on the code
server's machine (the default launcher), in a pod or in a Ray job on a node that has the package
(the cluster image) but not necessarily the file. So the code location publishes what its runs need
to load the same definitions, as the metadata of its definitions (`RUN_ENV_METADATA_KEY`, read by the
webserver and the daemon with the rest of the code location's snapshot):

- `SIDECAR_DATASETS_TEXT`: the datasets file as the code server read it (zlib, base64);
- `SIDECAR_DATASETS`: its path on the code server (its folder is where relative paths in it
  are resolved from, and messages name it);
- the run-time settings the code server was started with (`SIDECAR_SKIP_EXISTING`,
  `SIDECAR_THREADS_PER_SHARD`, see resources.py), so runs behave as the code location says.

A run launcher that starts runs elsewhere puts these in the run's environment (`ray_launcher.py`
does, for Ray jobs); `code_location_config()` in the run then parses the carried text instead of
looking for a file: the run uses exactly the config its code location had, and no node needs the
file or a shared folder. Without `SIDECAR_DATASETS_TEXT` it reads the file, as before.
"""

import base64
import binascii
import logging
import os
import zlib
from pathlib import Path

import yaml

from fixed_res_sidecar.defs.config import (
    DATASETS_ENV,
    ConfigError,
    SidecarConfig,
    _UniqueKeyLoader,
    datasets_file,
    load_code_location_config,
    parse_config,
)

DATASETS_TEXT_ENV = "SIDECAR_DATASETS_TEXT"
RUN_ENV_METADATA_KEY = "fixed_res_sidecar/run_env"
CARRIED_SETTINGS = ("SIDECAR_SKIP_EXISTING", "SIDECAR_THREADS_PER_SHARD")
# One environment variable holds at most 128 KiB (Linux's MAX_ARG_STRLEN); a compressed datasets
# file this big would describe thousands of datasets.
MAX_CARRIED_CHARS = 120 * 1024


def encode_text(text: str) -> str:
    return base64.b64encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii")


def decode_text(value: str) -> str:
    try:
        return zlib.decompress(base64.b64decode(value, validate=True)).decode("utf-8")
    except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{DATASETS_TEXT_ENV}: not a datasets file carried by the run launcher ({exc})") from None


def parse_text(text: str, path: Path, source: str) -> SidecarConfig:
    """A datasets file's text, parsed and validated as `load_config` does a file at `path`."""
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    config = parse_config(raw, base_dir=path.parent, source=source)
    for dataset in config.datasets:
        if problem := dataset.main_problem():
            logging.getLogger(__name__).warning(f"{source}: {problem}; the other datasets load as usual")
    return config


def code_location_config() -> tuple[SidecarConfig, dict[str, str]]:
    """The datasets config of this code location (carried to this run, else the datasets file), and
    the environment its runs need to load the same definitions (see the module's docstring)."""
    path = datasets_file()
    carried = os.environ.get(DATASETS_TEXT_ENV)
    if carried:
        text = decode_text(carried)
        source = f"{path} (as its code location read it; carried to this run in {DATASETS_TEXT_ENV})"
    else:
        try:
            text = path.read_text()
        except FileNotFoundError:
            load_code_location_config()  # raises its ConfigError: "no such datasets file; set ..."
            raise
        source = str(path)
    config = parse_text(text, path, source)
    run_env = {DATASETS_ENV: str(path), DATASETS_TEXT_ENV: encode_text(text)}
    run_env |= {name: os.environ[name] for name in CARRIED_SETTINGS if os.environ.get(name)}
    if len(run_env[DATASETS_TEXT_ENV]) > MAX_CARRIED_CHARS:
        raise ConfigError(
            f"{path}: too large to carry to the runs ({len(run_env[DATASETS_TEXT_ENV]):,} characters compressed, "
            f"at most {MAX_CARRIED_CHARS:,}); split it into several code locations"
        )
    return config, run_env


def published_run_env(metadata) -> dict[str, str] | None:
    """The run environment a code location published (its definitions' metadata), or None."""
    value = (metadata or {}).get(RUN_ENV_METADATA_KEY)
    data = getattr(value, "value", value)  # a JsonMetadataValue, or the plain mapping
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        return None
    return data
