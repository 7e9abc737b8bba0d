"""Dagster's storage calls straight to PostgreSQL, against the same calls through PgBouncer.

Dagster's Postgres storage opens a connection per call (no pool), and PostgreSQL starts a backend for
each, which warms its caches again; PgBouncer in session mode hands out backends already warm. Both
paths go to one server (the test fixtures' PostgreSQL with its pooler), in alternating rounds of the
same calls. Each round is measured by its wall time and by the CPU time of the client (this process),
the server (with every backend it started, those that ended too) and the pooler together.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import dagster as dg

from benchmarks.dagster_scale_metrics import server_cpu_seconds
from fixed_res_sidecar_tests.fixtures.postgres import PostgresServer, fresh_database, running_postgres

PATHS = ("direct", "pooled")


def client_and_server_cpu(server: PostgresServer) -> float:
    """CPU seconds so far of this process, the server with its backends, and the pooler."""
    return time.process_time() + server_cpu_seconds(server)


def _calls(instance: dg.DagsterInstance, count: int) -> None:
    """`count` storage calls, half on the run storage and half on the event log, as a daemon's loops make."""
    key = dg.AssetKey("storage_pool")
    for index in range(count):
        if index % 2:
            instance.get_latest_materialization_event(key)
        else:
            instance.get_runs(limit=1)


def run_storage_pool(calls: int = 800, rounds: int = 3) -> dict[str, Any]:
    """`rounds` rounds of `calls` storage calls on each path, alternating; returns the figures."""
    measured: dict[str, dict[str, list[float]]] = {path: {"cpu_s": [], "wall_s": []} for path in PATHS}
    with ExitStack() as stack:
        server = stack.enter_context(running_postgres())
        database = stack.enter_context(fresh_database(server))
        ports = {"direct": server.port, "pooled": server.pool_port}
        instances = {
            path: stack.enter_context(database.instance(Path(stack.enter_context(tempfile.TemporaryDirectory())), port))
            for path, port in ports.items()
        }
        for instance in instances.values():
            _calls(instance, 2)  # the tables made, the first connections open
        for _ in range(rounds):
            for path, instance in instances.items():
                cpu, wall = client_and_server_cpu(server), time.monotonic()
                _calls(instance, calls)
                measured[path]["cpu_s"].append(client_and_server_cpu(server) - cpu)
                measured[path]["wall_s"].append(time.monotonic() - wall)
    per_call = {path: 1000 * sum(measured[path]["cpu_s"]) / (calls * rounds) for path in PATHS}
    return {
        "calls": calls,
        "rounds": rounds,
        **measured,
        "cpu_ms_per_call": per_call,
        "pooled_to_direct": per_call["pooled"] / per_call["direct"] if per_call["direct"] else float("nan"),
    }


def print_storage_pool(report: dict[str, Any]) -> None:
    print(
        f"\n## Dagster storage calls: straight to PostgreSQL and through PgBouncer ({report['calls']} calls a round)\n"
    )
    print("| path | CPU per round (client, server, pooler) | wall per round | CPU per call |")
    print("|---|---|---|---|")
    for path in PATHS:
        cpu = ", ".join(f"{value:.2f}" for value in report[path]["cpu_s"])
        wall = ", ".join(f"{value:.2f}" for value in report[path]["wall_s"])
        print(f"| {path} | {cpu} s | {wall} s | {report['cpu_ms_per_call'][path]:.1f} ms |")
    print(f"\npooled / direct CPU per call: {report['pooled_to_direct']:.2f}x")
