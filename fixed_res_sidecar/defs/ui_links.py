"""Links into the Dagster UI, for the texts and metadata an operator reads (checks, the audit, run logs).

Relative to the webserver's root, so they work wherever it is served (not under a `--path-prefix`).

- `shard_page`: an asset's Partitions tab with one shard selected (its status, its latest events).
- `repair`: the shard job's page with `partition=` naming the shards; its **Materialize all…** button
  opens the launch dialog with exactly those shards selected, and **Launch backfill** (**Launch 1 run**
  for one shard) starts the repair: three clicks, nothing typed. The job's runs rebuild an output whose
  latest verification failed on its current bytes (`defs/ledger.py`), so no option is needed.
  `/guess/<job>` is the UI's route that finds a job in whichever code location holds it.
"""

from collections.abc import Sequence
from urllib.parse import quote, urlencode

import dagster as dg

from fixed_res_sidecar.defs.names import DatasetKeys

# The UI's launch dialog reads its initial selection from `partition=`: keys separated by commas
# (partition keys never hold one: defs/partitions.py refuses them).
MAX_LINKED_SHARDS = 200  # a repair link names at most this many shards (URLs stay short)


def shard_page(asset: dg.AssetKey, rel: str) -> str:
    path = "/".join(quote(part, safe="") for part in asset.path)
    return f"/assets/{path}?{urlencode({'view': 'partitions', 'partition': rel})}"


def repair(keys: DatasetKeys, rels: Sequence[str]) -> str:
    """The shard job's page with `rels` (the first MAX_LINKED_SHARDS) selected in its launch dialog."""
    return f"/guess/{quote(keys.shard_job, safe='')}?{urlencode({'partition': ','.join(rels[:MAX_LINKED_SHARDS])})}"


def markdown_link(text: str, url: str) -> str:
    return f"[{text}]({url})"
