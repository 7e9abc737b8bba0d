"""Dagster at scale (issue 12, item 4): `python -m benchmarks --dagster-scale`.

On a real deployment (the test fixtures' PostgreSQL server and DagsterDeployment: deploy/dagster.yaml
with the default run launcher, a code server, dagster-daemon and dagster-webserver), with a dataset
of `partitions` tiny shards and one of `metadata_partitions` for metadata only, it measures:

1. discovery: the discovery sensor turned on with no shard known, ticks and seconds until every shard
   is a partition and recorded on main, and the CPU seconds the code server, the daemon and PostgreSQL
   spent on it; the automation sensor's ticks at that many partitions;
2. definitions load (code server, webserver, in process, `dagster definitions validate`) and the
   launch of a backfill of every partition of each dataset (GraphQL round trip, then the daemon's
   first runs);
3. per-shard overhead of shard runs for each `shards_per_run` in `batch_sizes` (a backfill of
   `sample_shards` consecutive shards, each size on its own shards) and the daemon's throughput;
4. the cost of an up-to-date shard (a second backfill of every shard built);
5. the UI's GraphQL queries at that many partitions (median of `repeats`);
6. the dataset audit: first evaluation and an incremental one.

The queue is held (max_concurrent_runs 0) during discovery and the launch of the big backfills, so
the runs they request are only created, never launched; the backfills are cancelled once measured
and their runs deleted before the run measurements, which use the deployment's limits (2 runs at once). Every process is stopped at the
end, and the data, the database and its server are removed.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.execution.backfill import BulkActionStatus

from benchmarks import dagster_scale_data as data
from benchmarks import dagster_ui as ui
from benchmarks.common import log
from benchmarks.dagster_scale_metrics import (
    backfill_runs,
    cpu_seconds,
    median_of,
    run_timings,
    server_cpu_seconds,
    shard_work,
    tick_summary,
    timed,
)
from fixed_res_sidecar.defs.audit_state import AuditState, load_audit_state, save_audit_state, update_state
from fixed_res_sidecar.defs.config import DEFAULT_SHARDS_PER_RUN, load_config
from fixed_res_sidecar.defs.dataset_audit import audit_dataset
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.history import read_ledger, read_ledgers
from fixed_res_sidecar.defs.names import DATASET_TAG, RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.shards.verify import RESIZED_CHECKS
from fixed_res_sidecar_tests.fixtures.dagster_deployment import (
    CODE_MODULE,
    REPOSITORY,
    DagsterDeployment,
    InstanceSettings,
    sensor_ticks,
    tick_finished,
    wait_until,
)
from fixed_res_sidecar_tests.fixtures.postgres import PostgresDatabase, start_postgres, stop_postgres
from fixed_res_sidecar_tests.fixtures.processes import family

BUILT, METADATA = "scale", "meta"  # the two datasets' names
# The deployment's limits (2 runs at once) and Dagster's own 30 s backfill loop, as shipped.
RUNNING = InstanceSettings(max_runtime_seconds=1800, backfill_loop_seconds=None)
HELD = replace(RUNNING, max_concurrent_runs=0)  # queued runs stay queued
DONE = {BulkActionStatus.COMPLETED_SUCCESS, BulkActionStatus.COMPLETED_FAILED, BulkActionStatus.FAILED}
ENDED = DONE | {BulkActionStatus.CANCELED}
UI_TARGET_S = 2.0
OVERHEAD_TARGET_S = 1.0
# Issue 23's targets: a first discovery of 10,000 / 100,000 new shards, the automation sensor's tick at
# 100,000 partitions, the first runs of a backfill of 100,000 partitions.
DISCOVERY_TARGET_S = {10_000: 60.0, 100_000: 600.0}
AUTOMATION_TARGET_S = 10.0
BACKFILL_START_TARGET_S = 60.0


@dataclass(frozen=True)
class ScaleOptions:
    partitions: int = 10_000
    metadata_partitions: int = 100_000
    sample_shards: int = 64
    batch_sizes: tuple[int, ...] = (1, 8, 16)
    rows: int = 4  # rows per built shard
    # max_new_shards_per_tick, and the shards the sensor takes in the measurement (one tick's worth)
    per_tick: int = 5000
    metadata_per_tick: int = 5000
    automation_ticks: int = 3  # the automation sensor's ticks measured once discovery is done
    # Shorter than the shipped deployment's only for a quick run (the test's): a backfill's first runs
    # wait for the backfill loop (None: Dagster's fixed 30 s), the automation ticks for their interval.
    backfill_loop_seconds: int | None = None
    automation_interval_seconds: int = 30
    repeats: int = 3
    timeout: float = 1800.0  # bound of every wait


def run_dagster_scale(workdir: Path, options: ScaleOptions) -> dict[str, Any]:
    """Run every measurement; returns the report (see module docstring)."""
    needed = options.sample_shards * len(options.batch_sizes)
    if needed > options.partitions:
        raise ValueError(
            f"--sample-shards x batch sizes = {needed} shards, more than --partitions {options.partitions}"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dagster-scale-", dir=workdir))
    pg_root = Path(tempfile.mkdtemp(prefix="sidecar-scale-pg-"))  # not under workdir: the server (nobody) reads it
    saved_env = dict(os.environ)
    server = deployment = None
    started = time.monotonic()
    report: dict[str, Any] = {
        "options": asdict(options),
        "partitions": options.partitions,
        "metadata_partitions": options.metadata_partitions,
        "machine": {"cores": os.cpu_count(), "load_before": _load()},
    }
    try:
        seconds, _ = timed(lambda: _write_datasets(root, options))
        report["datasets_written_s"] = seconds
        server = start_postgres(pg_root)
        database = PostgresDatabase(server, server.create_database("dagster_scale"))
        deployment = DagsterDeployment(root / "deployment", database, HELD)
        os.environ.update(deployment.env)
        ScaleBench(deployment, root, options, report).run()
    finally:
        if deployment is not None:
            deployment.stop()
        if server is not None:
            stop_postgres(server)
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pg_root, ignore_errors=True)
    report["machine"]["load_after"] = _load()
    report["total_s"] = time.monotonic() - started
    return report


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _write_datasets(root: Path, options: ScaleOptions) -> None:
    data.write_linked_dataset(root / "main" / BUILT, options.partitions, data.built_shard_table(options.rows))
    data.write_linked_dataset(root / "main" / METADATA, options.metadata_partitions, data.metadata_shard_table())


class ScaleBench:
    def __init__(self, deployment: DagsterDeployment, root: Path, options: ScaleOptions, report: dict[str, Any]):
        self.deployment, self.root, self.options, self.report = deployment, root, options, report
        self.keys = DatasetKeys(BUILT)
        self.shards = data.shard_names(options.partitions)
        self.first_audit_states: dict[str, AuditState] = {}  # dataset -> the state its first audit left
        self.running = replace(RUNNING, backfill_loop_seconds=options.backfill_loop_seconds)
        self.held = replace(self.running, max_concurrent_runs=0)
        self.started_as: tuple[InstanceSettings, int] | None = None  # what the deployment runs with

    # -- the deployment ----------------------------------------------------------------------

    def write_datasets(self, shards_per_run: int) -> None:
        options = self.options
        automation = {"interval_seconds": options.automation_interval_seconds}
        entries = data.dataset_entries(
            self.root, shards_per_run, options.per_tick, options.metadata_per_tick, automation
        )
        self.deployment.write_datasets({"datasets": entries})

    def start(self, settings: InstanceSettings, shards_per_run: int, backfill: list[str] | None = None) -> dict:
        """(Re)start code server and webserver (timed), launch `backfill` if given, then start the daemon:
        its first backfill iteration then submits the runs at once instead of up to 30 s later. A
        deployment already running with these settings keeps its code server and webserver (their
        times are then None); only its daemon starts again."""
        code_server_s = webserver_s = None
        if self.started_as != (settings, shards_per_run):
            if self.deployment.code_server is not None:
                self.deployment.stop()
            self.deployment.write_instance(settings)
            self.write_datasets(shards_per_run)
            code_server_s, _ = timed(self.deployment.start_code_server)
            webserver_s, _ = timed(self.deployment.start_webserver)
            self.started_as = (settings, shards_per_run)
        elif self.deployment.daemon is not None:
            self.deployment.stop_daemon()
        launched = self.launch(backfill) if backfill else None
        self.deployment.start_daemon()
        return {"code_server_s": code_server_s, "webserver_s": webserver_s, "backfill": launched}

    def graphql(self, query: str, **variables) -> dict:
        """A query or mutation that drives the deployment (not timed); a failed answer is tried again twice
        (a mutation sent just after the webserver started once got a bare 500)."""
        for attempt in range(3):
            try:
                return self.deployment.graphql(query, variables)
            except urllib.error.HTTPError as exc:
                body = exc.read()[:2000]
                if attempt == 2:
                    raise RuntimeError(f"GraphQL answered {exc.code}: {body!r}") from None
                log(f"dagster-scale: GraphQL answered {exc.code} ({body[:200]!r}); trying again")
                time.sleep(2)
        raise AssertionError("unreachable")

    def named(self, name: str) -> dict:
        return {"repositoryName": REPOSITORY, "location": self.deployment.location, "name": name}

    def launch(self, partitions: list[str], job: str | None = None) -> dict:
        """Launch a backfill of a shard job (the built dataset's by default) as the UI does; returns its id and
        the round trip."""
        started = time.time()
        job = job or self.keys.shard_job
        seconds, backfill_id = timed(lambda: self.deployment.launch_backfill(job, partitions))
        return {"id": backfill_id, "mutation_s": seconds, "at": started}

    def set_sensor(self, name: str, running: bool) -> None:
        if running:
            result = self.graphql(ui.START_SENSOR, **self.named(name))["startSensor"]
            assert result["__typename"] == "Sensor", result
            return
        state = self.graphql(ui.STOP_SENSOR_STATE, **self.named(name))["sensorOrError"]["sensorState"]
        self.graphql(ui.STOP_SENSOR, id=state["id"])

    def stop_schedules(self) -> None:
        """The hourly audits stay off: they would take a run slot in the middle of a measurement."""
        for dataset in (BUILT, METADATA):
            found = self.graphql(ui.SCHEDULE_STATE, **self.named(f"{dataset}__audit_hourly"))["scheduleOrError"]
            self.graphql(ui.STOP_SCHEDULE, id=found["scheduleState"]["id"])

    # -- the measurements --------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Log the phase and keep its wall time in the report (where a run's time went)."""
        log(f"dagster-scale: {name}")
        started = time.monotonic()
        yield
        self.report.setdefault("phases_s", {})[name] = time.monotonic() - started

    def run(self) -> None:
        options, report = self.options, self.report
        with self.phase("start"):
            first = self.start(self.held, DEFAULT_SHARDS_PER_RUN)
            self.stop_schedules()
            report["definitions"] = {**first, **self.definitions_in_process()}
        with self.phase("discovery"):
            report["discovery"] = {
                BUILT: self.discover(BUILT, options.partitions, options.per_tick),
                METADATA: self.discover(METADATA, options.metadata_partitions, options.metadata_per_tick),
            }
        with self.phase("backfill of every partition"):
            report["backfill_all"] = self.launch_all(BUILT, self.shards)
            report["backfill_all_metadata"] = self.launch_all(METADATA, data.shard_names(options.metadata_partitions))
        with self.phase("first audits"), self.deployment.instance() as instance:
            self.deployment.kill_daemon()  # nothing may launch or create the held runs any more
            report["deleted_held_runs"] = self.delete_unfinished_runs(instance)
            report["audit"] = {BUILT: self.audit_first(instance, BUILT), METADATA: self.audit_first(instance, METADATA)}
        # The automation sensor (its ticks at scale are measured above) stays off for the run measurements:
        # a tick that falls inside a batch run may answer its shards with restating runs of its own, which
        # would take run slots from the runs measured.
        self.set_sensor(self.keys.automation_sensor, False)
        report["batches"] = {}
        blocks = self.sample_blocks()
        for size, block in blocks.items():
            with self.phase(f"shards_per_run {size}"):
                report["batches"][str(size)] = self.measure_batch(size, block)
        with self.phase("up-to-date backfill"):
            report["up_to_date"] = self.measure_up_to_date([rel for block in blocks.values() for rel in block])
        with self.phase("probes and incremental audits"), self.deployment.instance() as instance:
            report["probes"] = self.probes(instance, blocks)
            for name in (BUILT, METADATA):
                self.audit_incremental(instance, name, report["audit"][name])
            report["automation_ticks"] = {
                name: tick_summary(sensor_ticks(instance, DatasetKeys(name).automation_sensor))
                for name in (BUILT, METADATA)
            }
        with self.phase("UI queries"):
            report["graphql"] = self.ui_queries(report["backfill_all"]["id"], report["up_to_date"]["backfill_id"])
        report["targets"] = self.targets()

    def definitions_in_process(self) -> dict[str, float]:
        """Loading the definitions in this process, and `dagster definitions validate` as a user runs it."""
        file = self.deployment.datasets_file

        def load() -> None:
            defs = build_definitions(load_config(file))
            dg.Definitions.validate_loadable(defs)
            defs.resolve_asset_graph()

        in_process_s, _ = timed(load)
        env = {**os.environ, **self.deployment.env}
        command = ["dagster", "definitions", "validate", "-m", CODE_MODULE]
        validate_s, done = timed(lambda: subprocess.run(command, env=env, capture_output=True, text=True, timeout=300))
        assert done.returncode == 0, done.stdout + done.stderr
        return {"in_process_s": in_process_s, "validate_cli_s": validate_s}

    def discover(self, dataset: str, count: int, per_tick: int) -> dict[str, Any]:
        """The discovery sensor at scale: turned on with none of the `count` shards known, it takes them all,
        at most `per_tick` per tick. Measured from the sensor turned on to the end of the last tick that
        found shards (every shard a partition and recorded on main, its runs or backfill requested), with
        the CPU seconds the code server (the sensor's body), the daemon and PostgreSQL spent meanwhile;
        then two ticks with nothing new (the end of the listing, a full pass), and `automation_ticks` ticks
        of the automation sensor at that many partitions. The backfills it requested are cancelled (their
        runs are held, never launched)."""
        keys = DatasetKeys(dataset)
        with self.deployment.instance() as instance:
            cpu_before = self.cpu()
            started = time.time()
            self.set_sensor(keys.discovery_sensor, True)

            def settled():
                ticks = [t for t in sensor_ticks(instance, keys.discovery_sensor) if t.timestamp >= started - 1]
                work = [t for t in ticks if t.run_ids]
                idle = [
                    t
                    for t in ticks
                    if tick_finished(t) and not t.run_ids and (not work or t.timestamp > work[-1].timestamp)
                ]
                if not work or not all(tick_finished(t) for t in work) or len(idle) < 2:
                    return None
                return (work, idle) if len(instance.get_dynamic_partitions(keys.partitions)) == count else None

            work, idle = wait_until(settled, self.options.timeout, f"discovery of {count} shards", interval=1.0)
            seconds = work[-1].end_timestamp - started
            cpu = {name: after - cpu_before[name] for name, after in self.cpu().items()}  # till the idle ticks
            self.set_sensor(keys.discovery_sensor, False)
            partitions = len(instance.get_dynamic_partitions(keys.partitions))
            recorded = len(instance.get_materialized_partitions(keys.main))
            assert partitions == recorded == count, (
                f"{dataset}: {partitions} partitions, {recorded} on main, expected {count}"
            )
            automation = self.automation_ticks(instance, keys, after=work[-1].end_timestamp)
            cancelled = self.cancel_backfills(instance, dataset)
        summary = tick_summary(work)
        return {
            "partitions": partitions,
            "per_tick": per_tick,
            "work_ticks": len(work),
            "sensor_s": seconds,
            "tick_mean_s": summary["mean_s"],
            "tick_max_s": summary["max_s"],
            "tick_seconds": [t.end_timestamp - t.timestamp for t in work],
            "tick_s_per_1000_shards": 1000 * sum(t.end_timestamp - t.timestamp for t in work) / count,
            "cpu_s": cpu,
            "idle_tick_s": max(t.end_timestamp - t.timestamp for t in idle[:2]),
            "requests": sum(len(t.run_ids) for t in work),
            "backfills_requested": cancelled,
            "automation": automation,
        }

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the code server, the daemon and PostgreSQL with PgBouncer in front of it
        (each with its children, those that ended too: a backend per server connection)."""
        deployment = self.deployment
        leaders = {"code_server": deployment.code_server, "daemon": deployment.daemon}
        cpu = {name: cpu_seconds(p.pid, family(p.pid)) if p is not None else 0.0 for name, p in leaders.items()}
        return {**cpu, "postgres": server_cpu_seconds(deployment.database.server)}

    def automation_ticks(self, instance: dg.DagsterInstance, keys: DatasetKeys, after: float) -> dict[str, Any]:
        """The automation sensor's ticks that started after `after`, at that many partitions."""
        sensor = keys.automation_sensor

        def enough():
            ticks = [t for t in sensor_ticks(instance, sensor) if t.timestamp > after and tick_finished(t)]
            return ticks if len(ticks) >= self.options.automation_ticks else None

        count = self.options.automation_ticks
        ticks = wait_until(enough, self.options.timeout, f"{count} ticks of {sensor}", interval=1.0)
        seconds = [t.end_timestamp - t.timestamp for t in ticks]
        return {"ticks": len(ticks), "seconds": seconds, "mean_s": statistics.mean(seconds), "max_s": max(seconds)}

    def cancel_backfills(self, instance: dg.DagsterInstance, dataset: str) -> int:
        """Cancel the dataset's backfills still going (what discovery requested) and wait until they ended."""
        ids = [
            b.backfill_id
            for b in instance.get_backfills()
            if b.tags.get(DATASET_TAG) == dataset and b.status not in ENDED
        ]
        for backfill_id in ids:
            self.graphql(ui.CANCEL_BACKFILL, backfillId=backfill_id)
        wait_until(
            lambda: all(instance.get_backfill(b).status in ENDED for b in ids),
            self.options.timeout,
            f"{len(ids)} backfill(s) of {dataset} cancelled",
        )
        return len(ids)

    def launch_all(self, dataset: str, partitions: list[str]) -> dict[str, Any]:
        """A backfill of every partition of `dataset`, as the UI launches it: the round trip, and the time
        until the daemon created its first runs (held in the queue); then it is cancelled."""
        launched = self.launch(partitions, DatasetKeys(dataset).shard_job)
        with self.deployment.instance() as instance:
            runs = wait_until(
                lambda: backfill_runs(instance, launched["id"]), self.options.timeout, "the first backfill runs"
            )
            first_created = min(r.create_timestamp.timestamp() for r in runs)
            cancel_s, _ = timed(lambda: self.graphql(ui.CANCEL_BACKFILL, backfillId=launched["id"]))
            return {
                "id": launched["id"],
                "partitions": len(partitions),
                "mutation_s": launched["mutation_s"],
                "first_runs_s": first_created - (launched["at"] + launched["mutation_s"]),
                "runs_seen": len(runs),
                "cancel_s": cancel_s,
            }

    def delete_unfinished_runs(self, instance: dg.DagsterInstance) -> int:
        """The runs discovery and the big backfill requested (held, never launched)."""
        ids = instance.get_run_ids(
            dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED])
        )
        for run_id in ids:
            instance.delete_run(run_id)
        return len(ids)

    def audit_first(self, instance: dg.DagsterInstance, dataset: str) -> dict[str, Any]:
        keys, layout = DatasetKeys(dataset), load_config(self.deployment.datasets_file).dataset(dataset).layout
        seconds, audit = timed(lambda: audit_dataset(instance, keys, layout))  # with its listing of the outputs
        self.first_audit_states[dataset] = load_audit_state(instance, dataset)
        return {"shards": audit.shards, "first_s": seconds}

    def audit_incremental(self, instance: dg.DagsterInstance, dataset: str, row: dict[str, Any]) -> None:
        """The audit after the shards built since the first one: from the state that audit left (the audits
        the deployment ran meanwhile, after each run, are set aside)."""
        keys, layout = DatasetKeys(dataset), load_config(self.deployment.datasets_file).dataset(dataset).layout
        state = self.first_audit_states[dataset]
        save_audit_state(instance, dataset, state)
        new_events = update_state(instance, keys, copy.deepcopy(state))  # what the audit will read
        seconds, _ = timed(lambda: audit_dataset(instance, keys, layout))
        row.update(incremental_s=seconds, incremental_events=new_events)

    def sample_blocks(self) -> dict[int, list[str]]:
        """Consecutive shards per batch size (one range, so a backfill's runs are full batches), spread over
        the dataset; the default size comes last so the up-to-date re-run keeps its code location."""
        sizes = sorted(self.options.batch_sizes, key=lambda s: (s == DEFAULT_SHARDS_PER_RUN, s))
        n, step = self.options.sample_shards, self.options.partitions // len(sizes)
        return {size: self.shards[i * step : i * step + n] for i, size in enumerate(sizes)}

    def measure_batch(self, size: int, block: list[str]) -> dict[str, Any]:
        started = self.start(self.running, size, backfill=block)
        backfill = started["backfill"]
        with self.deployment.instance() as instance:
            records = self.wait_for_backfill(instance, backfill["id"])
            work = shard_work(instance, self.keys.crop_bbox, block)
            assert set(work) == set(block), f"shards without crop_bbox: {sorted(set(block) - set(work))[:5]}"
            row = run_timings(instance, records, len(block), self.running.max_concurrent_runs, work)
        row.update(
            shards_per_run=size,
            code_server_s=started["code_server_s"],
            webserver_s=started["webserver_s"],
            mutation_s=backfill["mutation_s"],
            backfill_id=backfill["id"],
        )
        return row

    def measure_up_to_date(self, rels: list[str]) -> dict[str, Any]:
        """A second backfill of shards already built and verified: each is restated, not rebuilt. At the
        default batch size when it was measured (it is measured last), else the last size measured."""
        size = sorted(self.options.batch_sizes, key=lambda s: (s == DEFAULT_SHARDS_PER_RUN, s))[-1]
        with self.deployment.instance() as instance:
            before = shard_work(instance, self.keys.crop_bbox, rels)
        launch = self.start(self.running, size, backfill=rels)["backfill"]  # runs: batches of each consecutive block
        with self.deployment.instance() as instance:
            records = self.wait_for_backfill(instance, launch["id"])
            after = shard_work(instance, self.keys.crop_bbox, rels)
            row = run_timings(instance, records, len(rels), self.running.max_concurrent_runs)
            rebuilt = {rel: (after.get(rel) or ("",))[0] for rel in rels if after.get(rel) != before.get(rel)}
            # Which run rebuilt each (a backfill's or automation's) and what it logged of the shard: a
            # rebuild of an up-to-date shard is a defect, and the deployment is gone once this returns.
            why = {rel: _run_story(instance, run_id, rel) for rel, run_id in rebuilt.items()}
        return {
            **row,
            "shards_per_run": size,
            "rebuilt": len(rebuilt),
            "rebuilt_why": why,
            "wall_per_shard_s": row["wall_s"] / len(rels),
            "slot_per_shard_s": row["wall_s"] * self.running.max_concurrent_runs / len(rels),
            "backfill_id": launch["id"],
        }

    def wait_for_backfill(self, instance: dg.DagsterInstance, backfill_id: str) -> list[dg.RunRecord]:
        def done() -> list[dg.RunRecord] | None:
            if instance.get_backfill(backfill_id).status not in DONE:
                return None
            records = backfill_runs(instance, backfill_id)
            return records if records and all(r.dagster_run.is_finished for r in records) else None

        return wait_until(done, self.options.timeout, f"backfill {backfill_id}", detail=self.deployment.report)

    def probes(self, instance: dg.DagsterInstance, blocks: dict[int, list[str]]) -> dict[str, float]:
        """The event-log reads a shard run makes before any work, in ms per shard (on built shards): one
        shard's ledger alone, and a batch of `shards_per_run` ledgers read together."""
        rels = [rel for block in blocks.values() for rel in block][:20]
        alone = [timed(lambda rel=rel: read_ledger(instance, self.keys, rel))[0] for rel in rels]
        batch = rels[:DEFAULT_SHARDS_PER_RUN]
        together = timed(lambda: read_ledgers(instance, self.keys, batch))[0] / max(1, len(batch))
        return {"ledger_ms": 1000 * statistics.mean(alone), "batch_ledger_ms": 1000 * together}

    def ui_queries(self, big_backfill: str, small_backfill: str) -> dict[str, dict[str, Any]]:
        """The UI pages' queries through the webserver's /graphql endpoint, median of `repeats`."""
        keys, meta = self.keys, DatasetKeys(METADATA)
        scale_assets = [
            keys.main,
            *(keys.resized(r) for r in RESOLUTION_NAMES),
            *(keys.verify(r) for r in RESOLUTION_NAMES),
        ]
        asks = {
            "asset partitions page": [
                (f"{keys.resized('512').to_user_string()}", {"assetKey": _key(keys.resized("512"))}),
                (f"{keys.main.to_user_string()}", {"assetKey": _key(keys.main)}),
                (f"{meta.main.to_user_string()} ({self.options.metadata_partitions:,})", {"assetKey": _key(meta.main)}),
            ],
            "asset check partitions": [
                (
                    f"{keys.verify('512').to_user_string()}:{RESIZED_CHECKS[0]}",
                    {"assetKey": _key(keys.verify("512")), "checkName": RESIZED_CHECKS[0]},
                )
            ],
            "backfill page": [
                (f"backfill of all {self.options.partitions:,}", {"backfillId": big_backfill}),
                ("up-to-date backfill", {"backfillId": small_backfill}),
            ],
            "asset page (definition)": [
                (keys.resized("512").to_user_string(), {"assetKey": _key(keys.resized("512"))})
            ],
            "asset page (live data)": [(f"{len(scale_assets)} assets", {"assetKeys": [_key(k) for k in scale_assets]})],
        }
        results = {}
        for page, variants in asks.items():
            query = ui.ui_query(ui.UI_QUERIES[page])
            for what, variables in variants:
                ask = partial(self.deployment.graphql, query, variables)
                first_s, _ = timed(ask)  # reported apart: the first answer may also fill caches
                median, seconds = median_of(ask, self.options.repeats)
                label = page if len(variants) == 1 else f"{page}: {what}"
                results[label] = {
                    "query": ui.UI_QUERIES[page],
                    "what": what,
                    "median_s": median,
                    "first_s": first_s,
                    "seconds": seconds,
                }
        return results

    def targets(self) -> dict[str, bool]:
        report = self.report
        default = report["batches"].get(str(DEFAULT_SHARDS_PER_RUN))
        pages = [row for label, row in report["graphql"].items() if "partitions" in label and "meta" not in row["what"]]
        return {
            f"per-shard overhead < {OVERHEAD_TARGET_S:.0f} s at shards_per_run {DEFAULT_SHARDS_PER_RUN}": (
                default is not None and default["overhead_per_shard_s"] < OVERHEAD_TARGET_S
            ),
            f"partition pages < {UI_TARGET_S:.0f} s at {self.options.partitions:,} partitions": all(
                row["median_s"] < UI_TARGET_S for row in pages
            ),
            "up-to-date shard < 1 s amortised": report["up_to_date"]["wall_per_shard_s"] < 1.0,
            **{
                f"first discovery of {row['partitions']:,} shards < {DISCOVERY_TARGET_S[row['partitions']]:.0f} s": (
                    row["sensor_s"] < DISCOVERY_TARGET_S[row["partitions"]]
                )
                for row in report["discovery"].values()
                if row["partitions"] in DISCOVERY_TARGET_S
            },
            **{
                f"automation tick < {AUTOMATION_TARGET_S:.0f} s at {row['partitions']:,} partitions": (
                    row["automation"]["max_s"] < AUTOMATION_TARGET_S
                )
                for row in report["discovery"].values()
                if row["partitions"] >= 100_000
            },
            **{
                f"first runs of a backfill of {row['partitions']:,} < {BACKFILL_START_TARGET_S:.0f} s": (
                    row["first_runs_s"] < BACKFILL_START_TARGET_S
                )
                for row in (report["backfill_all"], report["backfill_all_metadata"])
                if row["partitions"] >= 100_000
            },
        }


def _run_story(instance: dg.DagsterInstance, run_id: str, rel: str) -> dict[str, Any]:
    """A run's tags and the log lines that name shard `rel` (what it decided about it)."""
    run = instance.get_run_by_id(run_id) if run_id else None
    if run is None:
        return {"run_id": run_id, "tags": {}, "log": []}
    lines = [
        record.event_log_entry.user_message
        for record in instance.get_records_for_run(run_id, limit=2000).records
        if rel in (record.event_log_entry.user_message or "")
    ]
    return {"run_id": run_id, "tags": dict(run.tags), "log": lines[:20]}


def _key(key: dg.AssetKey) -> dict[str, list[str]]:
    return {"path": list(key.path)}
