"""What the Dagster scale benchmark reads back from the instance: backfill runs and their timings (their
launches from the deployment fixture), tick summaries, the shards' own work, and the printed table."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from fixed_res_sidecar_tests.fixtures.dagster_deployment import launched_at
from fixed_res_sidecar_tests.fixtures.postgres import PostgresServer
from fixed_res_sidecar_tests.fixtures.processes import family

BACKFILL_TAG = "dagster/backfill"


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def median_of(call: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """Median seconds of `repeats` calls, and every call's seconds."""
    seconds = [timed(call)[0] for _ in range(repeats)]
    return statistics.median(seconds), seconds


def cpu_seconds(leader: int, pids: set[int]) -> float:
    """User and system CPU seconds of `pids` (a process family, from /proc), and of the children `leader`
    has waited for (those that ended)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in {leader, *pids}:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
        total += (utime + stime + (cutime + cstime if pid == leader else 0)) / tick
    return total


def server_cpu_seconds(server: PostgresServer) -> float:
    """CPU seconds so far of a PostgreSQL server with its backends (those that ended too) and its pooler."""
    return sum(cpu_seconds(leader.pid, family(leader.pid)) for leader in server.leaders)


def tick_summary(ticks: Sequence) -> dict[str, float]:
    """Count, mean and max seconds of finished ticks."""
    seconds = [t.end_timestamp - t.timestamp for t in ticks if t.end_timestamp is not None]
    if not seconds:
        return {"ticks": 0, "mean_s": 0.0, "max_s": 0.0}
    return {"ticks": len(seconds), "mean_s": statistics.mean(seconds), "max_s": max(seconds)}


def backfill_runs(instance: dg.DagsterInstance, backfill_id: str) -> list[dg.RunRecord]:
    return list(instance.get_run_records(dg.RunsFilter(tags={BACKFILL_TAG: backfill_id})))


def shard_work(
    instance: dg.DagsterInstance, crop_key: dg.AssetKey, rels: Sequence[str]
) -> dict[str, tuple[str, float]]:
    """rel -> (run id, seconds of its own work): `seconds` of its latest crop_bbox build (a restated,
    up-to-date shard's materialization repeats the build's figures and is passed over), the wall time
    of resize + verify + crop of that shard inside the run (Dagster's events not included)."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=crop_key, asset_partitions=list(rels)), limit=10 * len(rels) + 10
    ).records
    work: dict[str, tuple[str, float]] = {}
    for record in records:  # newest first: keep the latest per shard
        metadata = record.asset_materialization.metadata
        if record.partition_key not in work and "restated_from_run" not in metadata:
            work[record.partition_key] = (record.run_id, float(metadata["seconds"].value))
    return work


def run_timings(
    instance: dg.DagsterInstance,
    records: list[dg.RunRecord],
    shards: int,
    slots: int,
    work: dict[str, tuple[str, float]] | None = None,
) -> dict[str, Any]:
    """Per-run and amortised figures of one backfill's runs (`work`: rel -> (run id, seconds), None when
    the shards were up to date and nothing was built).

    - queue_to_success_s: run created (queued) to success, mean per run; includes waiting for a slot.
    - launch_to_success_s: dequeued and launched to success, mean per run: the run's own time.
    - overhead_per_shard_s: sum over runs of (launch to success - the shards' own work) / shards.
    - wall_s, shards_per_minute: first launch to last success, and shards / that time.
    - slot_overhead_per_shard_s: (wall * slots - own work) / shards: everything the run slots spent
      on anything but shard work, queue gaps and dequeue intervals included.
    """
    launches = {r.dagster_run.run_id: launched_at(instance, r.dagster_run.run_id) for r in records}
    ends = {r.dagster_run.run_id: r.end_time for r in records}
    created = {r.dagster_run.run_id: r.create_timestamp.timestamp() for r in records}
    own = {run_id: 0.0 for run_id in ends}
    for run_id, seconds in (work or {}).values():
        if run_id in own:
            own[run_id] += seconds
    busy = [ends[r] - launches[r] for r in ends]
    wall = max(ends.values()) - min(launches.values())
    total_work = sum(own.values())
    return {
        "runs": len(records),
        "shards": shards,
        "statuses": sorted({r.dagster_run.status.value for r in records}),
        "queue_to_success_s": statistics.mean(ends[r] - created[r] for r in ends),
        "launch_to_success_s": statistics.mean(busy),
        "work_per_shard_s": total_work / shards if work is not None else 0.0,
        "overhead_per_shard_s": (sum(busy) - total_work) / shards,
        "wall_s": wall,
        "shards_per_minute": 60.0 * shards / wall,
        "slot_overhead_per_shard_s": (wall * slots - total_work) / shards,
    }


# -- the printed report ------------------------------------------------------------------------


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_dagster_scale(report: dict[str, Any]) -> None:
    out = ["", "## Dagster scale", ""]
    machine = report["machine"]
    out.append(
        f"{report['partitions']:,} partitions (built dataset), {report['metadata_partitions']:,} (metadata only); "
        f"load average before {machine['load_before']}, after {machine['load_after']}; total {report['total_s']:.0f} s"
    )
    out += ["", "| figure | value | note |", "|---|---|---|"]
    for name, discovery in report["discovery"].items():
        cpu = discovery["cpu_s"]
        out.append(
            f"| first discovery of {discovery['partitions']:,} shards ({name}) | {discovery['sensor_s']:.0f} s | "
            f"sensor on to the last shard recorded, {discovery['work_ticks']} tick(s) of <= {discovery['per_tick']:,} "
            f"(mean {discovery['tick_mean_s']:.1f} s, max {discovery['tick_max_s']:.1f} s; "
            f"{discovery['tick_s_per_1000_shards']:.1f} s per 1,000 shards); CPU: code server {cpu['code_server']:.0f} s, "
            f"daemon {cpu['daemon']:.0f} s, PostgreSQL {cpu['postgres']:.0f} s; {discovery['requests']} request(s), "
            f"{discovery['backfills_requested']} backfill(s); idle full pass {discovery['idle_tick_s']:.1f} s |"
        )
        automation = discovery["automation"]
        out.append(
            f"| automation tick at {discovery['partitions']:,} partitions ({name}) | {automation['mean_s']:.1f} s | "
            f"mean of {automation['ticks']} after discovery, max {automation['max_s']:.1f} s |"
        )
    load = report["definitions"]
    out.append(
        f"| definitions load: code server | {load['code_server_s']:.1f} s | process start to answering; in process "
        f"{load['in_process_s']:.2f} s; `dagster definitions validate` {load['validate_cli_s']:.1f} s |"
    )
    out.append(f"| definitions load: webserver | {load['webserver_s']:.1f} s | process start to location loaded |")
    for launch in (report["backfill_all"], report["backfill_all_metadata"]):
        out.append(
            f"| launch backfill of {launch['partitions']:,} | {launch['mutation_s']:.2f} s | GraphQL round trip; first "
            f"runs {launch['first_runs_s']:.1f} s later ({launch['runs_seen']} runs by then) |"
        )
    for size, row in report["batches"].items():
        out.append(
            f"| shards_per_run {size}: overhead per shard | {row['overhead_per_shard_s']:.2f} s | "
            f"{row['runs']} runs, {row['shards']} shards; run {row['launch_to_success_s']:.1f} s launch to success, "
            f"work {row['work_per_shard_s']:.2f} s/shard; slot overhead {row['slot_overhead_per_shard_s']:.2f} s/shard; "
            f"{row['shards_per_minute']:.1f} shards/min |"
        )
    up = report["up_to_date"]
    out.append(
        f"| up-to-date shard | {up['wall_per_shard_s']:.2f} s | {up['shards']} shards, shards_per_run "
        f"{up['shards_per_run']}, {up['runs']} runs, {up['rebuilt']} rebuilt; slot time {up['slot_per_shard_s']:.2f} s/shard |"
    )
    for page, row in report["graphql"].items():
        out.append(f"| UI: {page} | {row['median_s']:.2f} s | median of {len(row['seconds'])}; {row['what']} |")
    for name, audit in report["audit"].items():
        out.append(
            f"| audit of {audit['shards']:,} shards ({name}) | {audit['first_s']:.2f} s | first evaluation; "
            f"incremental {audit['incremental_s']:.2f} s ({audit['incremental_events']} new events) |"
        )
    probes = report["probes"]
    out.append(
        f"| per-shard event-log queries | {probes['ledger_ms']:.1f} ms | a shard's ledger (`history.read_ledger`: "
        f"its materializations and check results); {probes['batch_ledger_ms']:.1f} ms per shard in a batch |"
    )
    for name, ticks in report["automation_ticks"].items():
        out.append(
            f"| automation sensor {name}, whole run | {ticks['mean_s']:.1f} s | mean tick ({ticks['ticks']} ticks, max {ticks['max_s']:.1f} s) |"
        )
    targets = report["targets"]
    out += ["", "Targets:"]
    out += [f"- {name}: {'met' if met else 'NOT met'}" for name, met in targets.items()]
    print("\n".join(out))
