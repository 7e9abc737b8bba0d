"""What a dataset and its outputs hold, by listing alone (SPEC 7, per dataset).

Shard counts and total bytes of main and of each output (what `aws s3 ls --recursive
--summarize` shows), and which shards each output lacks or has without a main shard.
"""

from typing import Any

from fixed_res_sidecar.io.locations import Location


def dataset_summary(
    main: Location, outputs: dict[str, Location], main_sizes: dict[str, int] | None = None
) -> dict[str, Any]:
    """Counts, bytes, missing and extra shards of `outputs` (name -> location) against `main`.

    `main_sizes` is a listing of main already taken (at 100,000 shards a listing is about
    100 LIST calls).
    """
    main_sizes = main.shard_sizes() if main_sizes is None else main_sizes
    summary: dict[str, Any] = {
        "main": {"location": main.uri, "shards": len(main_sizes), "total_bytes": sum(main_sizes.values())},
        "outputs": {},
    }
    for name, location in outputs.items():
        sizes = location.shard_sizes()
        summary["outputs"][name] = {
            "location": location.uri,
            "shards": len(sizes),
            "total_bytes": sum(sizes.values()),
            "missing": sorted(set(main_sizes) - set(sizes)),
            "extra": sorted(set(sizes) - set(main_sizes)),
        }
    return summary
