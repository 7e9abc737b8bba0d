"""defs/dataset_audit.py: the dataset audit tells the truth from the instance's records, and stays incremental."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import dagster as dg
import pyarrow.parquet as pq
import pytest

from fixed_res_sidecar.defs import audit_state, dataset_audit
from fixed_res_sidecar.defs.names import DATASET_TAG, RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.shards.verify import RESIZED_CHECKS
from fixed_res_sidecar_tests.defs.conftest import TINY_ROWS, register, run_shard, swap_two_keys

KEYS = DatasetKeys("tiny")
GOOD, BAD = "part-a.parquet", "nested/x/part-b.parquet"


def run_audit(defs: dg.Definitions, instance) -> tuple[dg.AssetCheckEvaluation, dg.AssetCheckEvaluation | None, dict]:
    """The audit's two verdicts (dataset_audit: failed shards, ERROR; dataset_complete: work left, WARN,
    None while work is under way: not judged) and its metadata."""
    result = defs.resolve_job_def(KEYS.audit_job).execute_in_process(instance=instance, raise_on_error=False)
    assert result.success  # the audit's verdict is its checks, not the run
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    audit, complete = evaluations["dataset_audit"], evaluations.get("dataset_complete")
    assert audit.severity == dg.AssetCheckSeverity.ERROR
    assert complete is None or complete.severity == dg.AssetCheckSeverity.WARN
    (materialization,) = result.get_asset_materialization_events()
    metadata = {k: v.value for k, v in materialization.materialization.metadata.items()}
    return audit, complete, metadata


@pytest.mark.heavy
def test_a_damaged_shard_fails_the_audit_by_name_and_the_repair_passes_it(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    audit, complete, metadata = run_audit(tiny_defs, instance)
    assert audit.passed and complete is not None and not complete.passed  # nothing built: nothing failed, not complete
    assert audit.description.startswith("**tiny passed") and complete.description.startswith("**tiny incomplete")
    assert metadata["2. shards"] == 2 and metadata["2. 512: shards not verified yet"] == 2

    for rel in (GOOD, BAD):
        assert run_shard(tiny_defs, instance, "tiny__build_shards", rel).success
    audit, complete, metadata = run_audit(tiny_defs, instance)
    assert complete is not None and audit.passed and complete.passed, complete.description
    assert metadata["verdict"] == "tiny passed: 2 of 2 shard(s) verified and cropped"
    rows = {r: metadata[f"4. rows {r}: valid"] + metadata[f"4. rows {r}: invalid"] for r in RESOLUTION_NAMES}
    assert rows == {"512": 2 * TINY_ROWS, "1024": 2 * TINY_ROWS} and metadata["2. main: rows"] == 2 * TINY_ROWS
    invalid = [metadata[f"4. rows 512: invalid {c}"] for c in ("missing_image", "decode_error")]
    assert metadata["4. rows 512: invalid"] == sum(invalid)
    assert (
        metadata["2. crop_bbox: shards"] == 2
        and metadata["2. 512: size (MB)"] > 0
        and metadata["2. main: size (MB)"] > 0
    )
    assert f"main 2 shards, {2 * TINY_ROWS} rows, " in metadata["totals"] and " kB" in metadata["totals"]
    # Every number sorts after the words, failures first: the UI plots them by name.
    numbers = [name for name, value in metadata.items() if isinstance(value, int | float) or value is None]
    assert numbers == sorted(numbers) and numbers[0].startswith("1. ")

    # One resized shard loses its key order: its verifier fails, crop_bbox alone is refused.
    swap_two_keys(dataset.output("resized_512"), BAD)
    assert not run_shard(tiny_defs, instance, "tiny__build_shards", BAD, selection=[KEYS.verify("512")]).success
    assert not run_shard(
        tiny_defs, instance, "tiny__build_shards", BAD, selection=[KEYS.crop_bbox]
    ).success  # refused: fails
    audit, complete, metadata = run_audit(tiny_defs, instance)
    assert not audit.passed and audit.description.startswith("**tiny FAILED: 1 of 2 shard(s) failed a check")
    assert complete is not None and not complete.passed  # a failed shard is not a finished one
    page = f"/assets/tiny/verify_512?view=partitions&partition={quote(BAD, safe='')}"
    assert f"- [{BAD}]({page}): verify_512:keys_match" in audit.description
    repair = f"/guess/tiny__build_shards?partition={quote(BAD, safe='')}"
    assert f"([repair them: run them again]({repair}))" in audit.description
    # The materialization leads with the verdict, the failing shard's page and the repair.
    assert list(metadata)[:3] == ["verdict", "repair the failed shards", f"failed: {BAD} (verify_512:keys_match)"]
    assert metadata["repair the failed shards"] == repair and metadata[f"failed: {BAD} (verify_512:keys_match)"] == page
    assert metadata["1. failed shards"] == 1
    (problem,) = [r.data for r in audit.metadata["0. problem shards"].records]
    assert problem == {"shard": BAD, "problem": "tiny/verify_512:keys_match failed"}

    # Repaired: the damaged shard is rebuilt and verified, its crop_bbox follows; the audit passes.
    Path(dataset.output("resized_512").child(BAD)).unlink()
    assert run_shard(tiny_defs, instance, "tiny__build_shards", BAD).success
    audit, complete, metadata = run_audit(tiny_defs, instance)
    assert complete is not None and audit.passed and complete.passed, audit.description
    assert metadata["1. failed shards"] == 0 and metadata["2. 512: shards verified"] == 2


@pytest.mark.heavy
def test_a_verified_shard_without_crop_bbox_fails_unless_work_is_under_way(tiny_config, tiny_defs, instance):
    register(instance, tiny_config)
    for rel in (GOOD, BAD):
        selection = [*(KEYS.resized(r) for r in RESOLUTION_NAMES), *(KEYS.verify(r) for r in RESOLUTION_NAMES)]
        assert run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=selection).success
    assert run_shard(tiny_defs, instance, "tiny__build_shards", GOOD, selection=[KEYS.crop_bbox]).success
    audit, _, _ = run_audit(tiny_defs, instance)
    assert not audit.passed
    assert f"1 verified shard(s) without crop_bbox: {BAD}" in audit.description

    # A run of the dataset not finished yet: work is under way, not a failure; completeness is not judged.
    job = tiny_defs.resolve_job_def("tiny__build_shards")
    instance.create_run_for_job(job, tags={DATASET_TAG: "tiny"}, status=dg.DagsterRunStatus.NOT_STARTED)
    # An audit run waiting to start is not work under way.
    audit_job = tiny_defs.resolve_job_def(KEYS.audit_job)
    instance.create_run_for_job(audit_job, tags={DATASET_TAG: "tiny"}, status=dg.DagsterRunStatus.NOT_STARTED)
    audit, complete, metadata = run_audit(tiny_defs, instance)
    assert audit.passed and complete is None
    assert audit.metadata["0. under way"].value == "1 run(s) queued or running, 0 backfill(s) in progress"
    assert metadata["verdict"].startswith("tiny under way: ")


def test_the_audit_reads_only_what_was_recorded_since_its_last_run(tiny_config, tiny_defs, instance):
    register(instance, tiny_config)
    keys = KEYS
    first = audit_state.load_audit_state(instance, "tiny")
    assert audit_state.update_state(instance, keys, first) == 2  # the two shards recorded on main
    audit_state.save_audit_state(instance, "tiny", first)
    again = audit_state.load_audit_state(instance, "tiny")
    assert again.shards == first.shards and audit_state.update_state(instance, keys, again) == 0

    assert run_shard(tiny_defs, instance, "tiny__build_shards", GOOD).success
    # 2 resized, 2 verifier and 1 sidecar materializations, and 10 + 6 check results of one shard.
    assert audit_state.update_state(instance, keys, again) == 5 + 16
    assert audit_state.update_state(instance, keys, again) == 0
    audit_state.save_audit_state(instance, "tiny", again)
    assert audit_state.load_audit_state(instance, "tiny") == again
    instance.run_storage.set_cursor_values({audit_state.STATE_KEY.format(dataset="tiny"): "not a state"})
    assert audit_state.load_audit_state(instance, "tiny").shards == {}  # unreadable: read everything again


@pytest.mark.heavy
def test_an_output_gone_or_changed_on_storage_after_it_was_verified_fails_the_audit(tiny_config, tiny_defs, instance):
    """Reported: the audit read only the event log, so an output deleted or rewritten on disk after it was
    verified left it passing. It lists each output prefix once and compares with what was verified."""
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    for rel in (GOOD, BAD):
        assert run_shard(tiny_defs, instance, "tiny__build_shards", rel).success
    audit, complete, _ = run_audit(tiny_defs, instance)
    assert audit.passed and complete.passed

    Path(dataset.output("resized_512").child(GOOD)).unlink()
    crop = dataset.output("crop_bbox").child(BAD)
    pq.write_table(pq.read_table(crop), crop)  # the same rows and footer, another object than the one verified
    audit, _, metadata = run_audit(tiny_defs, instance)
    assert not audit.passed and audit.description.startswith("**tiny FAILED")
    assert "2 shard(s) whose outputs on storage are not what was verified" in audit.description
    problems = {r.data["shard"]: r.data["problem"] for r in audit.metadata["0. problem shards"].records}
    assert problems[GOOD].startswith("its 512 output is gone from storage (verified by run ")
    assert problems[BAD].startswith("its crop_bbox on storage is not the object verified by run ")
    assert metadata["1. shards changed on storage since verified"] == 2 and metadata["1. failed shards"] == 2
    assert metadata["2. 512: shards verified"] == 1 and metadata["2. 1024: shards verified"] == 2
    # The audit from scratch says the same.
    scratch = audit_state.AuditState()
    audit_state.update_state(instance, KEYS, scratch)
    assert dataset_audit.evaluate(instance, KEYS, scratch, dataset_audit.stored_outputs(dataset.layout)).changed == {
        GOOD: {"resized_512": problems[GOOD]},
        BAD: {"crop_bbox": problems[BAD]},
    }

    # A run of each shard rebuilds (or verifies again) what changed; the audit passes again.
    for rel in (GOOD, BAD):
        assert run_shard(tiny_defs, instance, "tiny__build_shards", rel).success
    audit, complete, metadata = run_audit(tiny_defs, instance)
    assert audit.passed and complete.passed, audit.description
    assert metadata["1. shards changed on storage since verified"] == 0


@pytest.mark.heavy
def test_after_a_run_is_deleted_the_incremental_audit_equals_one_from_scratch(tiny_config, tiny_defs, instance):
    """Reported: after a run was deleted from the instance, the incremental audit (passed) differed from an
    audit from scratch (incomplete): the state still held the deleted run's materializations."""
    layout = tiny_config.datasets[0].layout
    register(instance, tiny_config)
    runs = {rel: run_shard(tiny_defs, instance, "tiny__build_shards", rel) for rel in (GOOD, BAD)}
    assert all(run.success for run in runs.values())
    state = audit_state.AuditState()
    audit_state.update_state(instance, KEYS, state)
    stored = dataset_audit.stored_outputs(layout)
    assert dataset_audit.evaluate(instance, KEYS, state, stored).verdict() == "passed"

    instance.delete_run(runs[GOOD].run_id)
    audit_state.update_state(instance, KEYS, state)
    scratch = audit_state.AuditState()
    audit_state.update_state(instance, KEYS, scratch)
    assert state.shards == scratch.shards
    incremental = dataset_audit.evaluate(instance, KEYS, state, stored)
    assert incremental == dataset_audit.evaluate(instance, KEYS, scratch, stored)
    assert incremental.verdict() == "incomplete" and incremental.not_verified["512"] == [GOOD]
    # Through the audit asset (its state saved between runs) too.
    audit, complete, _ = run_audit(tiny_defs, instance)
    assert audit.passed and not complete.passed and f"not verified at 512 yet: {GOOD}" in complete.description


@pytest.fixture
def postgres_instance(postgres_database, tmp_path):
    """An instance whose storage is the test's Postgres database (as deploy/dagster.yaml's)."""
    with postgres_database.instance(tmp_path) as instance:
        yield instance


WRITERS, SHARDS_PER_WRITER, LATE_PER_WRITER = 4, 25, 2  # 4 x 27 shards x 5 events = 540 events
EVENTS_PER_SHARD = 5  # 2 materializations, 3 check results
SETTLE_SECONDS = 5.0  # above the late commits' delay below (and a writer's usual milliseconds)
# A writer that commits late: its event has taken its storage id when the insert is held up (a real
# trigger in the database), so events with larger ids become visible first. Applied to the
# materializations of main and the first check's result of the shards under `late/`.
LATE_COMMITS = """
CREATE FUNCTION commit_late() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(1.5); RETURN NEW; END $$;
CREATE TRIGGER late_materialization BEFORE INSERT ON event_logs FOR EACH ROW
    WHEN (NEW.partition LIKE 'late/%' AND NEW.dagster_event_type = 'ASSET_MATERIALIZATION'
          AND NEW.asset_key LIKE '%main%') EXECUTE FUNCTION commit_late();
CREATE TRIGGER late_check_result BEFORE INSERT ON asset_check_executions FOR EACH ROW
    WHEN (NEW.partition LIKE 'late/%' AND NEW.check_name = '{check}') EXECUTE FUNCTION commit_late();
"""


def write_shard_events(instance, rels: list[str]) -> None:
    """What a shard run records of each shard, as runless events: main and resized_512 materialised,
    verify_512's checks evaluated (Dagster stores each check result in a second transaction)."""
    for rel in rels:
        for key, row_count in ((KEYS.main, 7), (KEYS.resized("512"), None)):
            metadata = {"bytes": 1000 + len(rel)} | ({"dagster/row_count": row_count} if row_count else {})
            instance.report_runless_asset_event(dg.AssetMaterialization(key, partition=rel, metadata=metadata))
        for name in RESIZED_CHECKS[:3]:
            evaluation = dg.AssetCheckEvaluation(
                asset_key=KEYS.verify("512"), check_name=name, passed=True, partition=rel
            )
            instance.report_runless_asset_event(evaluation)


def test_the_incremental_audit_misses_no_event_committed_out_of_order(postgres_instance, postgres_database):
    """4 writers record events on Postgres, some committing late (after events with larger storage ids),
    while the audit updates incrementally in a loop: its state ends equal to an audit computed from scratch."""
    instance = postgres_instance
    postgres_database.server.execute(LATE_COMMITS.format(check=RESIZED_CHECKS[0]), postgres_database.name)
    slices = [[f"w{w}/part-{i:04d}.parquet" for i in range(SHARDS_PER_WRITER)] for w in range(WRITERS)]
    for w, rels in enumerate(slices):
        for i in range(LATE_PER_WRITER):
            rels.insert(3 + 10 * i, f"late/w{w}-{i}.parquet")  # among the others, not at the end
    instance.add_dynamic_partitions(KEYS.partitions, [rel for rels in slices for rel in rels])
    state, updates = audit_state.AuditState(), 0
    with ThreadPoolExecutor(WRITERS) as pool:
        writing = [pool.submit(write_shard_events, instance, rels) for rels in slices]
        while not all(w.done() for w in writing) or not state.cursors.get("settled"):
            audit_state.update_state(instance, KEYS, state, settle_seconds=SETTLE_SECONDS)
            updates += 1
        for w in writing:
            w.result()
    audit_state.update_state(instance, KEYS, state, settle_seconds=SETTLE_SECONDS)

    scratch = audit_state.AuditState()
    assert audit_state.update_state(instance, KEYS, scratch) == sum(map(len, slices)) * EVENTS_PER_SHARD
    missed = {
        rel: (want, state.shards.get(rel)) for rel, want in scratch.shards.items() if state.shards.get(rel) != want
    }
    print(f"\n{updates} incremental updates; shards differing from an audit from scratch: {len(missed)}")
    assert not missed, list(missed.items())[:5]
    assert dataset_audit.evaluate(instance, KEYS, state) == dataset_audit.evaluate(instance, KEYS, scratch)
    assert 0 < state.cursors["settled"] <= state.cursors["high"]  # the incremental reads moved on
