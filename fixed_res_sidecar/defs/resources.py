"""Run-time settings shared by every dataset's assets and sensors, chosen in one place.

Storage needs no resource: locations take S3 settings from the standard AWS chain
(profile, `AWS_ENDPOINT_URL`, region), in runs and sensors alike. What a dataset is and
how it is built lives in the datasets file; what may differ between environments (a laptop,
a cluster) is here, and can be set from the environment:

    SIDECAR_SKIP_EXISTING=0        rebuild output shards even when they are up to date
    SIDECAR_THREADS_PER_SHARD=8    resize threads inside one shard run (default: the dataset's)
    SIDECAR_STORAGE_WAIT_SECONDS=120  how long a run waits for the instance's storage through an
                                   outage before it fails (`defs/history.STORAGE_RETRY`)
"""

import os

import dagster as dg

RESOURCE_KEY = "sidecar"


class SidecarRuntime(dg.ConfigurableResource):
    """How shard runs and the discovery sensor behave here."""

    # SPEC 2 skip rule: an output shard whose row count and recorded build settings match is
    # kept, so re-running a shard (or the demo) only redoes what changed.
    skip_existing: bool = True
    # Resize threads inside one shard run; 0 uses each dataset's `threads_per_shard`.
    threads_per_shard: int = 0
    # Parallel footer reads when the discovery sensor observes new shards.
    observe_threads: int = 16

    def threads_for(self, dataset_threads: int) -> int:
        return self.threads_per_shard if self.threads_per_shard > 0 else dataset_threads


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1/0, true/false, yes/no or on/off, got {value!r}")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must not be negative, got {number}")
    return number


def runtime_from_env() -> SidecarRuntime:
    return SidecarRuntime(
        skip_existing=_env_flag("SIDECAR_SKIP_EXISTING", True),
        threads_per_shard=_env_int("SIDECAR_THREADS_PER_SHARD", 0),
    )


def default_resources() -> dict[str, object]:
    return {RESOURCE_KEY: runtime_from_env()}
