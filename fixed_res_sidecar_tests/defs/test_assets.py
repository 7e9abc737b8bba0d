"""The asset graph end to end, in process on test instances: local disk, S3, subsets and the gate."""

import json
from pathlib import Path

import dagster as dg
import pytest

from fixed_res_sidecar.defs.assets import CROP_BBOX_CONDITION
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.keys import RESOLUTIONS, DatasetKeys
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar_tests.defs.conftest import (
    TINY_ROWS,
    TINY_SHARDS,
    check_partition_status,
    dataset_entry,
    make_config,
    register,
    run_shard,
    swap_two_keys,
    write_tiny,
)

KEYS = DatasetKeys("tiny")
ALL_ASSETS = {*(KEYS.resized(r) for r in RESOLUTIONS), *(KEYS.verify(r) for r in RESOLUTIONS), KEYS.crop_bbox}
RESIZED_CHECK_KEYS = [dg.AssetCheckKey(KEYS.verify(r), name) for r in RESOLUTIONS for name in verify.RESIZED_CHECKS]


def materialized(result: dg.ExecuteInProcessResult) -> set[dg.AssetKey]:
    return {e.asset_key for e in result.get_asset_materialization_events()}


def metadata_of(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> dict:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key == key]
    return {k: v.value for k, v in event.materialization.metadata.items()}


def test_graph_shape():
    config = make_config(dataset_entry("tiny", "/m/tiny", "/o"))
    graph = build_definitions(config).resolve_asset_graph()
    assert set(graph.get(KEYS.resized("512")).parent_keys) == {KEYS.main}
    assert set(graph.get(KEYS.verify("1024")).parent_keys) == {KEYS.resized("1024")}
    assert set(graph.get(KEYS.crop_bbox).parent_keys) == {
        *(KEYS.resized(r) for r in RESOLUTIONS),
        *(KEYS.verify(r) for r in RESOLUTIONS),
    }
    assert graph.get(KEYS.main).is_external and not graph.get(KEYS.main).is_materializable
    # One multi-asset (one decode) holds both resolutions and can be subset.
    resized = graph.assets_def_for_key(KEYS.resized("512"))
    assert resized is graph.assets_def_for_key(KEYS.resized("1024")) and resized.can_subset
    assert graph.get(KEYS.crop_bbox).automation_condition == CROP_BBOX_CONDITION
    for resolution in RESOLUTIONS:
        checks = [graph.get(k) for k in graph.asset_check_keys if k.asset_key == KEYS.verify(resolution)]
        assert sorted(c.key.name for c in checks) == sorted(verify.RESIZED_CHECKS)
        assert all(c.blocking for c in checks)
        assert all(c.partitions_def is not None and c.partitions_def.name == "tiny_shards" for c in checks)


def test_one_shard_end_to_end_locally(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    assert register(instance, tiny_config) == sorted(TINY_SHARDS)
    rel, other = "nested/x/part-b.parquet", "part-a.parquet"

    result = run_shard(tiny_defs, instance, "tiny__shard", rel)
    assert result.success
    assert materialized(result) == ALL_ASSETS

    # Outputs, reports and overlay pictures, where the config says.
    for name in ("resized_512", "resized_1024", "crop_bbox"):
        assert dataset.output(name).exists(rel) and not dataset.output(name).exists(other)
    for what in ("resized_512", "resized_1024", "crop_bbox"):
        report = json.loads(dataset.layout.report_location(what).read_bytes(verify.report_rel(rel)))
        assert report["passed"] and report["rel"] == rel
    overlays = list(Path(dataset.layout.report_location("overlays").child("nested/x/part-b")).glob("*.png"))
    assert len(overlays) == 1

    # Every check passed, and its result is stored for this shard's partition only.
    evaluations = result.get_asset_check_evaluations()
    assert len(evaluations) == 4 + 4 + 5 and all(e.passed for e in evaluations)
    statuses = check_partition_status(instance, RESIZED_CHECK_KEYS, [rel, other])
    assert statuses == {(k.to_user_string(), rel): "SUCCEEDED" for k in RESIZED_CHECK_KEYS}
    assert instance.get_materialized_partitions(KEYS.crop_bbox) == {rel}

    resized = metadata_of(result, KEYS.resized("1024"))
    assert (resized["status"], resized["valid"], resized["invalid"]) == ("built", TINY_ROWS - 1, 1)
    assert sum(resized["error_counts"].values()) == 1 and resized["dagster/row_count"] == TINY_ROWS
    (code,) = resized["error_counts"]
    audit = next(
        e for e in evaluations if e.asset_key == KEYS.verify("1024") and e.check_name == verify.AUDIT_CONSISTENT
    )
    assert audit.metadata["error_counts"].value == {code: 1}
    assert audit.metadata["invalid_examples"].value[0]["error"] == code
    assert code in audit.metadata["invalid_examples_table"].value
    crop = metadata_of(result, KEYS.crop_bbox)
    assert crop["passed"] and "data:image/png;base64," in crop["overlays"]

    # A second run of the shard keeps the outputs (skip-existing) and passes again.
    again = run_shard(tiny_defs, instance, "tiny__shard", rel)
    assert again.success and metadata_of(again, KEYS.resized("1024"))["status"] == "skipped"
    assert metadata_of(again, KEYS.crop_bbox)["status"] == "skipped"


def test_one_shard_end_to_end_on_s3(s3_bucket, instance):
    main = Location.parse(f"s3://{s3_bucket}/lake/main/tiny")
    write_tiny(main, shards=("a/part-0.parquet",))
    config = make_config(dataset_entry("tiny", main, f"s3://{s3_bucket}/lake/out"))
    defs = build_definitions(config)
    assert register(instance, config) == ["a/part-0.parquet"]

    result = run_shard(defs, instance, "tiny__shard", "a/part-0.parquet")
    assert result.success and materialized(result) == ALL_ASSETS
    assert all(e.passed for e in result.get_asset_check_evaluations())
    dataset = config.datasets[0]
    assert dataset.output("resized_1024").uri == f"s3://{s3_bucket}/lake/out/1_05mp_version_all_in_one/tiny"
    assert dataset.output("crop_bbox").exists("a/part-0.parquet")
    assert metadata_of(result, KEYS.verify("512"))["report"].startswith(
        f"s3://{s3_bucket}/lake/out/verifier_reports/tiny/"
    )
    statuses = check_partition_status(instance, RESIZED_CHECK_KEYS, ["a/part-0.parquet"])
    assert set(statuses.values()) == {"SUCCEEDED"} and len(statuses) == len(RESIZED_CHECK_KEYS)
    assert "data:image/png;base64," in metadata_of(result, KEYS.crop_bbox)["overlays"]


def test_one_resolution_can_be_built_alone(tiny_config, tiny_defs, instance):
    register(instance, tiny_config)
    result = run_shard(tiny_defs, instance, "tiny__shard", "part-a.parquet", selection=[KEYS.resized("1024")])
    assert result.success and materialized(result) == {KEYS.resized("1024")}
    dataset = tiny_config.datasets[0]
    assert dataset.output("resized_1024").exists("part-a.parquet")
    assert not dataset.output("resized_512").exists("part-a.parquet")


def test_the_datasets_run_memory_bounds_its_decoded_images(tiny_main, tmp_path, instance):
    """run_resources.memory_gb is the decode budget's source in Dagster, as --task-memory-gb on the CLI."""
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", run_resources={"memory_gb": 0.0001}))
    register(instance, config)
    result = run_shard(build_definitions(config), instance, "tiny__shard", "part-a.parquet", [KEYS.resized("512")])
    assert result.success
    metadata = metadata_of(result, KEYS.resized("512"))
    # Every image alone needs more than half of 0.0001 GiB: too_large, never decoded; the null image stays missing.
    assert metadata["error_counts"] == {"missing_image": 1, "too_large": TINY_ROWS - 1}


def test_unreadable_main_shard_fails_its_run_naming_it(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    main.write_bytes("broken.parquet", b"this is not parquet")
    config = make_config(dataset_entry("tiny", main, tmp_path / "out"))
    register(instance, config)
    result = run_shard(build_definitions(config), instance, "tiny__shard", "broken.parquet")
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "broken.parquet is not a readable Parquet file" in failure.event_specific_data.error.to_string()
    assert not materialized(result)


@pytest.mark.filterwarnings("ignore::dagster.BetaWarning")  # raised inside Dagster's own evaluator
def test_damaged_shard_is_gated_in_the_same_run_and_across_runs(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    good, bad = "part-a.parquet", "nested/x/part-b.parquet"
    register(instance, tiny_config)
    automation = dg.evaluate_automation_conditions(defs=tiny_defs, instance=instance)  # the daemon's first tick

    resized, verifiers = [KEYS.resized(r) for r in RESOLUTIONS], [KEYS.verify(r) for r in RESOLUTIONS]
    for rel in (good, bad):
        assert run_shard(tiny_defs, instance, "tiny__shard", rel, selection=resized).success
    swap_two_keys(dataset.output("resized_512"), bad)  # same rows and settings: skip-existing keeps it

    # Verify both shards in runs without crop_bbox: the damaged one fails its blocking check.
    assert run_shard(tiny_defs, instance, "tiny__shard", good, selection=verifiers).success
    failed_run = run_shard(tiny_defs, instance, "tiny__shard", bad, selection=verifiers)
    assert not failed_run.success
    failed = [(e.asset_key, e.check_name) for e in failed_run.get_asset_check_evaluations() if not e.passed]
    assert failed == [(KEYS.verify("512"), verify.KEYS_MATCH)]
    statuses = check_partition_status(instance, [dg.AssetCheckKey(KEYS.verify("512"), verify.KEYS_MATCH)], [good, bad])
    assert statuses == {
        ("tiny/verify_512:keys_match", good): "SUCCEEDED",
        ("tiny/verify_512:keys_match", bad): "FAILED",
    }

    # Across runs: automation requests crop_bbox for the good shard only.
    automation = dg.evaluate_automation_conditions(defs=tiny_defs, instance=instance, cursor=automation.cursor)
    assert automation.get_requested_partitions(KEYS.crop_bbox) == {good}
    assert automation.total_requested == 1  # nothing else: the verifiers ran after their inputs

    # In the same run: the whole shard job; the damaged shard stops at its verifier.
    bad_run = run_shard(tiny_defs, instance, "tiny__shard", bad)
    assert not bad_run.success
    assert KEYS.crop_bbox not in materialized(bad_run)
    started = {e.step_key for e in bad_run.all_events if e.event_type_value == "STEP_START"}
    assert "tiny__verify_512" in started and "tiny__crop_bbox" not in started  # never started
    good_run = run_shard(tiny_defs, instance, "tiny__shard", good)
    assert good_run.success and KEYS.crop_bbox in materialized(good_run)
    assert instance.get_materialized_partitions(KEYS.crop_bbox) == {good}
    assert dataset.output("crop_bbox").exists(good) and not dataset.output("crop_bbox").exists(bad)

    # Afterwards automation still does not build it, and a run of crop_bbox alone is refused.
    automation = dg.evaluate_automation_conditions(defs=tiny_defs, instance=instance, cursor=automation.cursor)
    assert automation.get_requested_partitions(KEYS.crop_bbox) == set() and automation.total_requested == 0
    alone = run_shard(tiny_defs, instance, "tiny__shard", bad, selection=[KEYS.crop_bbox])
    assert not alone.success
    failure = next(e for e in alone.all_events if e.event_type_value == "STEP_FAILURE")
    message = failure.event_specific_data.error.to_string()
    assert "gated on the verifiers" in message and "tiny/verify_512:keys_match failed" in message
    assert not dataset.output("crop_bbox").exists(bad)


def test_crop_bbox_alone_is_refused_after_its_resized_shard_was_rebuilt_unverified(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    rel = "part-a.parquet"
    register(instance, tiny_config)
    assert run_shard(tiny_defs, instance, "tiny__shard", rel).success  # built, verified, cropped
    crop = dataset.output("crop_bbox")
    crop_mtime = Path(crop.child(rel)).stat().st_mtime_ns

    # resized_512 is materialised again, without its verifier: the verifier's checks still read
    # "succeeded", but they are about the previous build.
    assert run_shard(tiny_defs, instance, "tiny__shard", rel, selection=[KEYS.resized("512")]).success
    statuses = check_partition_status(instance, RESIZED_CHECK_KEYS, [rel])
    assert set(statuses.values()) == {"SUCCEEDED"}

    alone = run_shard(tiny_defs, instance, "tiny__shard", rel, selection=[KEYS.crop_bbox])
    assert not alone.success and KEYS.crop_bbox not in materialized(alone)
    failure = next(e for e in alone.all_events if e.event_type_value == "STEP_FAILURE")
    message = failure.event_specific_data.error.to_string()
    assert "gated on the verifiers" in message
    assert "tiny/resized_512 was materialised again" in message and "after tiny/verify_512 last verified it" in message
    assert "tiny/resized_1024" not in message  # 1024 is still verified
    assert Path(crop.child(rel)).stat().st_mtime_ns == crop_mtime  # the sidecar was not touched

    # Once the verifier ran on the current build, crop_bbox alone goes through.
    assert run_shard(tiny_defs, instance, "tiny__shard", rel, selection=[KEYS.verify("512")]).success
    again = run_shard(tiny_defs, instance, "tiny__shard", rel, selection=[KEYS.crop_bbox])
    assert again.success and materialized(again) == {KEYS.crop_bbox}


@pytest.mark.parametrize("overlay_sample", [0])
def test_without_overlays_the_overlay_check_is_not_declared(tiny_main, tmp_path, overlay_sample):
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", overlay_sample=overlay_sample))
    graph = build_definitions(config).resolve_asset_graph()
    names = {k.name for k in graph.asset_check_keys if k.asset_key == KEYS.crop_bbox}
    assert names == set(verify.CROP_BBOX_CHECKS)
