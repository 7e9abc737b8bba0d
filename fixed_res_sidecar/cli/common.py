"""What every `sidecar-ops` command does the same way."""

import sys

from fixed_res_sidecar.io.locations import Location


class UsageError(ValueError):
    """Bad configuration or arguments: refused before any work, exit status 2."""


def usage_error(message: object) -> int:
    print(f"sidecar-ops: error: {message}", file=sys.stderr)
    return 2


def main_shards(main: Location) -> list[str]:
    """The main dataset's shards; an empty dataset is a usage error, not a success."""
    shards = main.list_shards()
    if not shards:
        raise UsageError(f"no *.parquet shards under {main.uri}")
    return shards
