"""defs/audit.py: the dataset audit tells the truth from the instance's records, and stays incremental."""

from pathlib import Path

import dagster as dg

from fixed_res_sidecar.defs import audit as audit_module
from fixed_res_sidecar.defs.keys import DATASET_TAG, RESOLUTIONS, DatasetKeys
from fixed_res_sidecar_tests.defs.conftest import TINY_ROWS, register, run_shard, swap_two_keys

KEYS = DatasetKeys("tiny")
GOOD, BAD = "part-a.parquet", "nested/x/part-b.parquet"


def run_audit(defs: dg.Definitions, instance) -> tuple[dg.AssetCheckEvaluation, dict]:
    result = defs.resolve_job_def(KEYS.audit_job).execute_in_process(instance=instance, raise_on_error=False)
    assert result.success  # the audit's verdict is its check, not the run
    (evaluation,) = result.get_asset_check_evaluations()
    (materialization,) = result.get_asset_materialization_events()
    metadata = {k: v.value for k, v in materialization.materialization.metadata.items()}
    return evaluation, metadata


def test_a_damaged_shard_fails_the_audit_by_name_and_the_repair_passes_it(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    register(instance, tiny_config)
    evaluation, metadata = run_audit(tiny_defs, instance)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN  # nothing built yet
    assert metadata["shards"] == 2 and metadata["512_not_verified_shards"] == 2

    for rel in (GOOD, BAD):
        assert run_shard(tiny_defs, instance, "tiny__shard", rel).success
    evaluation, metadata = run_audit(tiny_defs, instance)
    assert evaluation.passed, evaluation.description
    rows = {r: metadata[f"{r}_valid_rows"] + metadata[f"{r}_invalid_rows"] for r in RESOLUTIONS}
    assert rows == {"512": 2 * TINY_ROWS, "1024": 2 * TINY_ROWS} and metadata["main_rows"] == 2 * TINY_ROWS
    assert metadata["512_invalid_rows"] == sum(metadata[f"512_invalid_{c}"] for c in ("missing_image", "decode_error"))
    assert metadata["crop_bbox_shards"] == 2 and metadata["512_bytes"] > 0 and metadata["main_bytes"] > 0

    # One resized shard loses its key order: its verifier fails, crop_bbox alone is refused.
    swap_two_keys(dataset.output("resized_512"), BAD)
    assert not run_shard(tiny_defs, instance, "tiny__shard", BAD, selection=[KEYS.verify("512")]).success
    assert run_shard(tiny_defs, instance, "tiny__shard", BAD, selection=[KEYS.crop_bbox]).success  # refused, recorded
    evaluation, metadata = run_audit(tiny_defs, instance)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert f"tiny/verify_512:keys_match FAILED on 1 shard(s): {BAD}" in evaluation.description
    assert metadata["failed_shards"] == 1
    (problem,) = [r.data for r in evaluation.metadata["problem_shards"].records]
    assert problem == {"shard": BAD, "problem": "tiny/verify_512:keys_match failed"}

    # Repaired: the damaged shard is rebuilt and verified, its crop_bbox follows; the audit passes.
    Path(dataset.output("resized_512").child(BAD)).unlink()
    assert run_shard(tiny_defs, instance, "tiny__shard", BAD).success
    evaluation, metadata = run_audit(tiny_defs, instance)
    assert evaluation.passed, evaluation.description
    assert metadata["failed_shards"] == 0 and metadata["512_verified_shards"] == 2


def test_a_verified_shard_without_crop_bbox_fails_unless_work_is_under_way(tiny_config, tiny_defs, instance):
    register(instance, tiny_config)
    for rel in (GOOD, BAD):
        selection = [*(KEYS.resized(r) for r in RESOLUTIONS), *(KEYS.verify(r) for r in RESOLUTIONS)]
        assert run_shard(tiny_defs, instance, "tiny__shard", rel, selection=selection).success
    assert run_shard(tiny_defs, instance, "tiny__shard", GOOD, selection=[KEYS.crop_bbox]).success
    evaluation, _ = run_audit(tiny_defs, instance)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert f"1 verified shard(s) without crop_bbox: {BAD}" in evaluation.description

    # A run of the dataset not finished yet: work is under way, so only a warning.
    job = tiny_defs.resolve_job_def("tiny__shard")
    instance.create_run_for_job(job, tags={DATASET_TAG: "tiny"}, status=dg.DagsterRunStatus.NOT_STARTED)
    evaluation, _ = run_audit(tiny_defs, instance)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
    assert evaluation.metadata["under_way"].value == "1 run(s) queued or running, 0 backfill(s) in progress"


def test_the_audit_reads_only_what_was_recorded_since_its_last_run(tiny_config, tiny_defs, instance):
    register(instance, tiny_config)
    keys = KEYS
    first = audit_module.load_state(instance, "tiny")
    assert audit_module.update_state(instance, keys, first) == 2  # the two shards recorded on main
    audit_module.save_state(instance, "tiny", first)
    again = audit_module.load_state(instance, "tiny")
    assert again.shards == first.shards and audit_module.update_state(instance, keys, again) == 0

    assert run_shard(tiny_defs, instance, "tiny__shard", GOOD).success
    # 2 resized, 2 verifier and 1 sidecar materializations, and 10 + 6 check results of one shard.
    assert audit_module.update_state(instance, keys, again) == 5 + 16
    assert audit_module.update_state(instance, keys, again) == 0
    audit_module.save_state(instance, "tiny", again)
    assert audit_module.load_state(instance, "tiny") == again
    instance.run_storage.set_cursor_values({audit_module.STATE_KEY.format(dataset="tiny"): "not a state"})
    assert audit_module.load_state(instance, "tiny").shards == {}  # unreadable: read everything again
