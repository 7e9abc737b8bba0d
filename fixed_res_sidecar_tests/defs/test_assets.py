"""The asset graph end to end, in process on test instances: local disk, S3, subsets and the gate."""

import json
import os
from pathlib import Path

import dagster as dg
import pytest

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.defs.automation import automation_tick
from fixed_res_sidecar.defs.dataset_audit import audit_dataset
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.history import FAILED_VERIFICATION
from fixed_res_sidecar.defs.names import RESOLUTION_NAMES, DatasetKeys
from fixed_res_sidecar.defs.run_resources import RETRY_ON_FAILURE_TAG
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar_tests.defs.conftest import (
    QUIET,
    TINY_ROWS,
    TINY_SHARDS,
    check_partition_status,
    dataset_entry,
    failed_partitions,
    make_config,
    register,
    run_shard,
    swap_two_keys,
    write_tiny,
)
from fixed_res_sidecar_tests.fixtures.datasets import column
from fixed_res_sidecar_tests.fixtures.faulty_s3 import every_object_get, no_get

KEYS = DatasetKeys("tiny")
ALL_ASSETS = {*(KEYS.resized(r) for r in RESOLUTION_NAMES), *(KEYS.verify(r) for r in RESOLUTION_NAMES), KEYS.crop_bbox}
RESIZED_CHECK_KEYS = [
    dg.AssetCheckKey(KEYS.verify(r), name) for r in RESOLUTION_NAMES for name in verify.RESIZED_CHECKS
]


def materialized(result: dg.ExecuteInProcessResult) -> set[dg.AssetKey]:
    return {e.asset_key for e in result.get_asset_materialization_events()}


def metadata_of(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> dict:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key == key]
    return {k: v.value for k, v in event.materialization.metadata.items()}


def restated(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> str | None:
    """The run whose materialization of `key` this run restated (None: it made a new one)."""
    return metadata_of(result, key).get("restated_from_run")


def test_graph_shape():
    config = make_config(dataset_entry("tiny", "/m/tiny", "/o"))
    graph = build_definitions(config).resolve_asset_graph()
    assert set(graph.get(KEYS.resized("512")).parent_keys) == {KEYS.main}
    assert set(graph.get(KEYS.verify("1024")).parent_keys) == {KEYS.resized("1024")}
    assert set(graph.get(KEYS.crop_bbox).parent_keys) == {
        *(KEYS.resized(r) for r in RESOLUTION_NAMES),
        *(KEYS.verify(r) for r in RESOLUTION_NAMES),
    }
    assert graph.get(KEYS.main).is_external and not graph.get(KEYS.main).is_materializable
    # One multi-asset (one decode) holds both resolutions and can be subset.
    resized = graph.assets_def_for_key(KEYS.resized("512"))
    assert resized is graph.assets_def_for_key(KEYS.resized("1024")) and resized.can_subset
    assert graph.get(KEYS.crop_bbox).automation_condition is None  # the automation sensor's (defs/automation.py)
    for resolution in RESOLUTION_NAMES:
        checks = [graph.get(k) for k in graph.asset_check_keys if k.asset_key == KEYS.verify(resolution)]
        assert sorted(c.key.name for c in checks) == sorted(verify.RESIZED_CHECKS)
        assert all(c.blocking for c in checks)
        assert all(c.partitions_def is not None and c.partitions_def.name == "tiny_shards" for c in checks)


def test_one_shard_end_to_end_locally(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    assert register(instance, tiny_config) == sorted(TINY_SHARDS)
    rel, other = "nested/x/part-b.parquet", "part-a.parquet"

    result = run_shard(tiny_defs, instance, "tiny__build_shards", rel)
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
    assert len(evaluations) == 5 + 5 + 6 and all(e.passed for e in evaluations)
    statuses = check_partition_status(instance, RESIZED_CHECK_KEYS, [rel, other])
    assert statuses == {(k.to_user_string(), rel): "SUCCEEDED" for k in RESIZED_CHECK_KEYS}
    assert instance.get_materialized_partitions(KEYS.crop_bbox) == {rel}

    resized = metadata_of(result, KEYS.resized("1024"))
    assert (resized["status"], resized["valid"], resized["invalid"]) == ("built", TINY_ROWS - 1, 1)
    assert resized["dagster/row_count"] == TINY_ROWS
    (code,) = [code for code in ERROR_CODES if resized[f"invalid_{code}"]]
    assert resized[f"invalid_{code}"] == 1
    audit = next(
        e for e in evaluations if e.asset_key == KEYS.verify("1024") and e.check_name == verify.AUDIT_CONSISTENT
    )
    # Counts are plain numbers, one per error code (shown inline); examples are a table.
    assert audit.metadata[f"invalid_{code}"].value == 1 and audit.metadata["invalid"].value == 1
    assert all(audit.metadata[f"invalid_{other}"].value == 0 for other in ERROR_CODES if other != code)
    (example,) = audit.metadata["invalid_examples"].records
    assert example.data["error"] == code
    verified = metadata_of(result, KEYS.verify("1024"))
    assert verified[f"invalid_{code}"] == 1 and verified["valid"] == TINY_ROWS - 1
    crop = metadata_of(result, KEYS.crop_bbox)
    assert crop["passed"] and "data:image/webp;base64," in crop["overlays"]
    assert Path(crop["overlay_full_size"]).is_file()  # locally, the path of the full-size picture

    # A second run of the shard builds nothing (its outputs are up to date) and restates its results:
    # the same materializations again, each saying which run made it.
    again = run_shard(tiny_defs, instance, "tiny__build_shards", rel)
    assert again.success and all(restated(again, key) == result.run_id for key in materialized(result))
    assert all(e.passed and "restated_from_run" in e.metadata for e in again.get_asset_check_evaluations())


def test_a_long_shard_name_is_built_and_one_whose_report_cannot_be_named_is_refused_before_any_work(tmp_path, instance):
    """Reported: shard names of ~230 bytes failed once the work was done (their temporaries' names
    went over the 255-byte limit of a file name)."""
    long = "l" * 232 + ".parquet"  # 240 bytes: a legal name, and its output's
    too_long = "t" * 244 + ".parquet"  # 252 bytes: its report, <stem>.verify.json, would take 256
    main = Location.parse(tmp_path / "main" / "tiny")
    write_tiny(main, shards=("a.parquet", "b.parquet"))
    os.rename(main.child("a.parquet"), main.child(long))
    os.rename(main.child("b.parquet"), main.child(too_long))
    config = make_config(dataset_entry("tiny", main, tmp_path / "out"))
    dataset, defs = config.datasets[0], build_definitions(config)
    register(instance, config)

    built = run_shard(defs, instance, "tiny__build_shards", long)
    assert built.success and materialized(built) == ALL_ASSETS
    for what in ("resized_512", "resized_1024", "crop_bbox"):
        report = json.loads(dataset.layout.report_location(what).read_bytes(verify.report_rel(long)))
        assert report["passed"] and report["rel"] == long

    refused = run_shard(defs, instance, "tiny__build_shards", too_long)
    assert not refused.success and not materialized(refused)
    (failure,) = [e for e in refused.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    message = failure.event_specific_data.error.to_string()
    assert f"{too_long}: LocationError: 256-byte name, longer than a file name can be (255 bytes)" in message
    for name in ("resized_512", "resized_1024", "crop_bbox"):
        assert not dataset.output(name).exists(too_long)  # refused before any work


def test_one_shard_end_to_end_on_s3(s3_env, s3_bucket, instance):
    main = Location.parse(f"s3://{s3_bucket}/lake/main/tiny")
    write_tiny(main, shards=("a/part-0.parquet",))
    config = make_config(dataset_entry("tiny", main, f"s3://{s3_bucket}/lake/out"))
    defs = build_definitions(config)
    assert register(instance, config) == ["a/part-0.parquet"]

    result = run_shard(defs, instance, "tiny__build_shards", "a/part-0.parquet")
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
    crop = metadata_of(result, KEYS.crop_bbox)
    assert "data:image/webp;base64," in crop["overlays"]
    # On S3 the full-size picture opens through a presigned URL.
    link = crop["overlay_full_size"]
    assert link.startswith(s3_env) and "Signature=" in link and "/overlays/a/part-0/" in link
    import urllib.request

    with urllib.request.urlopen(link) as response:
        assert response.read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_resolution_can_be_built_alone(tiny_config, tiny_defs, instance):
    register(instance, tiny_config)
    result = run_shard(tiny_defs, instance, "tiny__build_shards", "part-a.parquet", selection=[KEYS.resized("1024")])
    assert result.success and materialized(result) == {KEYS.resized("1024")}
    dataset = tiny_config.datasets[0]
    assert dataset.output("resized_1024").exists("part-a.parquet")
    assert not dataset.output("resized_512").exists("part-a.parquet")


def test_the_datasets_run_memory_bounds_its_decoded_images(tiny_main, tmp_path, instance):
    """run_resources.memory_gb is the decode budget's source in Dagster, as --task-memory-gb on the CLI."""
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", run_resources={"memory_gb": 0.0001}))
    register(instance, config)
    result = run_shard(
        build_definitions(config), instance, "tiny__build_shards", "part-a.parquet", [KEYS.resized("512")]
    )
    assert result.success
    metadata = metadata_of(result, KEYS.resized("512"))
    # Every image alone needs more than half of 0.0001 GiB: too_large, never decoded; the null image stays missing.
    invalid = {code: metadata[f"invalid_{code}"] for code in ERROR_CODES if metadata[f"invalid_{code}"]}
    assert invalid == {"missing_image": 1, "too_large": TINY_ROWS - 1}


def test_unreadable_main_shard_fails_its_run_naming_it(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    main.write_bytes("broken.parquet", b"this is not parquet")
    config = make_config(dataset_entry("tiny", main, tmp_path / "out"))
    register(instance, config)
    result = run_shard(build_definitions(config), instance, "tiny__build_shards", "broken.parquet")
    assert not result.success  # its blocking checks failed
    failed = [e for e in result.get_asset_check_evaluations() if not e.passed]
    assert len(failed) == 10 and all(e.partition == "broken.parquet" for e in failed)
    assert all("broken.parquet is not a readable Parquet file" in e.description for e in failed)
    # The failed verifications are not materialised (their assets read Failed); each is observed with its report.
    assert materialized(result) == set()
    assert failed_verifications(result) == {
        (KEYS.verify("512"), "broken.parquet"),
        (KEYS.verify("1024"), "broken.parquet"),
    }
    refusal(result, "broken.parquet")
    assert retried_on_failure(instance, result) == "false"  # the data's failure: a retry would repeat it


def retried_on_failure(instance, result: dg.ExecuteInProcessResult) -> str:
    """Whether run retries retry the run after a step failure (every run of a dataset starts with "true")."""
    return instance.get_run_by_id(result.run_id).tags[RETRY_ON_FAILURE_TAG]


def observations(result: dg.ExecuteInProcessResult) -> list[dg.AssetObservation]:
    return [e.asset_observation_data.asset_observation for e in result.get_asset_observation_events()]


def failed_verifications(result: dg.ExecuteInProcessResult) -> set[tuple[dg.AssetKey, str | None]]:
    """(asset, shard) of every verification the run found failed: observed, not materialised."""
    return {(o.asset_key, o.partition) for o in observations(result) if FAILED_VERIFICATION in o.metadata}


def refusal(result: dg.ExecuteInProcessResult, rel: str) -> str:
    """The reason a crop_bbox run refused shard `rel`: nothing materialised, an observation says why,
    and the run failed naming the shard (a refusal is never a green run), with one message and no
    stack trace (the data failed, not the code)."""
    assert not result.success
    crops = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()]
    assert not [m for m in crops if m.asset_key == KEYS.crop_bbox and m.partition == rel]
    (observation,) = [o for o in observations(result) if o.asset_key == KEYS.crop_bbox and o.partition == rel]
    assert observation.metadata["gate"].value == "refused: nothing built"
    assert observation.metadata["status"].value.startswith("refused by the gate: not rebuilt; ")
    assert observation.metadata["repair"].value.startswith("/guess/tiny__build_shards?partition=")
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    error = failure.event_specific_data.error
    assert f"{rel}: " in error.message and "crop_bbox refused" in error.message
    assert error.stack == [] and error.cls_name == "DataFailure" and error.cause is None
    return observation.description


@pytest.mark.stress
def test_damaged_shard_is_gated_in_the_same_run_and_across_runs(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    good, bad = "part-a.parquet", "nested/x/part-b.parquet"
    register(instance, tiny_config)
    automation = automation_tick(dataset, instance, None)  # the sensor's first tick

    resized, verifiers = [KEYS.resized(r) for r in RESOLUTION_NAMES], [KEYS.verify(r) for r in RESOLUTION_NAMES]
    for rel in (good, bad):
        assert run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=resized).success
    swap_two_keys(dataset.output("resized_512"), bad)  # same rows and settings: skip-existing keeps it

    # Verify both shards in runs without crop_bbox: the damaged one fails its blocking check.
    assert run_shard(tiny_defs, instance, "tiny__build_shards", good, selection=verifiers).success
    failed_run = run_shard(tiny_defs, instance, "tiny__build_shards", bad, selection=verifiers)
    assert not failed_run.success
    failed = [(e.asset_key, e.check_name) for e in failed_run.get_asset_check_evaluations() if not e.passed]
    assert failed == [(KEYS.verify("512"), verify.KEYS_MATCH)]
    statuses = check_partition_status(instance, [dg.AssetCheckKey(KEYS.verify("512"), verify.KEYS_MATCH)], [good, bad])
    assert statuses == {
        ("tiny/verify_512:keys_match", good): "SUCCEEDED",
        ("tiny/verify_512:keys_match", bad): "FAILED",
    }

    # Across runs: the automation sensor requests crop_bbox for the good shard only.
    automation = automation_tick(dataset, instance, automation.cursor)
    (request,) = automation.run_requests  # nothing else: the verifiers ran after their inputs
    assert request.partition_key == good and request.asset_selection == [KEYS.crop_bbox]

    # In the same run: verified again and cropped; the damaged shard stops at its verifier. (A run that
    # also builds it rebuilds the output its verification failed on: test_wrong_pictures_... below.)
    bad_run = run_shard(tiny_defs, instance, "tiny__build_shards", bad, selection=[*verifiers, KEYS.crop_bbox])
    assert "keys_match" in refusal(bad_run, bad)  # no crop_bbox, and why
    good_run = run_shard(tiny_defs, instance, "tiny__build_shards", good)
    assert good_run.success and KEYS.crop_bbox in materialized(good_run)
    assert instance.get_materialized_partitions(KEYS.crop_bbox) == {good}
    assert dataset.output("crop_bbox").exists(good) and not dataset.output("crop_bbox").exists(bad)

    # Afterwards automation still does not build it, and a run of crop_bbox alone is refused.
    assert not automation_tick(dataset, instance, automation.cursor).run_requests
    alone = run_shard(tiny_defs, instance, "tiny__build_shards", bad, selection=[KEYS.crop_bbox])
    message = refusal(alone, bad)
    assert (
        "gated on the verifiers" in message and "its 512 output failed" in message and "when it was verified" in message
    )
    assert not dataset.output("crop_bbox").exists(bad)
    # The sidecar's checks are not claimed failed: they did not run on anything new.
    crop_checks = [dg.AssetCheckKey(KEYS.crop_bbox, name) for name in verify.CROP_BBOX_CHECKS]
    assert "FAILED" not in check_partition_status(instance, crop_checks, [bad]).values()


def test_a_verifier_restated_after_the_crop_keeps_its_place_and_the_crop_is_restated(tiny_config, tiny_defs, instance):
    """A verifier run alone for an up-to-date shard (a user's run: it is restated, materialised after
    crop_bbox), then crop_bbox alone. The restatement keeps its place in the build order, so crop_bbox is
    restated too, not rebuilt, and the audit does not call it stale."""
    rel = "part-a.parquet"
    register(instance, tiny_config)
    built = run_shard(tiny_defs, instance, "tiny__build_shards", rel)
    assert built.success
    verified = run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[KEYS.verify("1024")])
    assert verified.success and restated(verified, KEYS.verify("1024")) == built.run_id
    cropped = run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[KEYS.crop_bbox])
    assert cropped.success and restated(cropped, KEYS.crop_bbox) == built.run_id
    audit = audit_dataset(instance, KEYS, tiny_config.datasets[0].layout)
    assert audit.crop_stale == [] and audit.crop_missing == [] and audit.changed == {}


@pytest.mark.heavy
def test_crop_bbox_alone_is_refused_after_its_resized_shard_was_rebuilt_unverified(tiny_config, tiny_defs, instance):
    dataset = tiny_config.datasets[0]
    rel = "part-a.parquet"
    register(instance, tiny_config)
    assert run_shard(tiny_defs, instance, "tiny__build_shards", rel).success  # built, verified, cropped
    crop = dataset.output("crop_bbox")
    crop_mtime = Path(crop.child(rel)).stat().st_mtime_ns

    # resized_512 is materialised again, without its verifier: the verifier's checks still read
    # "succeeded", but they are about the previous build.
    assert run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[KEYS.resized("512")]).success
    statuses = check_partition_status(instance, RESIZED_CHECK_KEYS, [rel])
    assert set(statuses.values()) == {"SUCCEEDED"}

    alone = run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[KEYS.crop_bbox])
    message = refusal(alone, rel)
    assert "gated on the verifiers" in message
    assert "its 512 output was built again" in message and "after it was verified" in message
    assert "1024" not in message.split("gated on the verifiers")[1].split("Fix or rebuild")[0]  # 1024 is still verified
    assert Path(crop.child(rel)).stat().st_mtime_ns == crop_mtime  # the sidecar was not touched

    # Once the verifier ran on the current build, crop_bbox alone goes through.
    assert run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[KEYS.verify("512")]).success
    again = run_shard(tiny_defs, instance, "tiny__build_shards", rel, selection=[KEYS.crop_bbox])
    assert again.success and materialized(again) == {KEYS.crop_bbox}


@pytest.mark.parametrize("overlay_sample", [0])
def test_without_overlays_the_overlay_check_is_not_declared(tiny_main, tmp_path, overlay_sample):
    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", overlay_sample=overlay_sample))
    graph = build_definitions(config).resolve_asset_graph()
    names = {k.name for k in graph.asset_check_keys if k.asset_key == KEYS.crop_bbox}
    assert names == set(verify.CROP_BBOX_CHECKS)


ALL_CHECK_KEYS = [
    *RESIZED_CHECK_KEYS,
    *(dg.AssetCheckKey(KEYS.crop_bbox, name) for name in verify.CROP_BBOX_CHECKS),
]


def run_batch(defs: dg.Definitions, instance, first: str, last: str) -> dg.ExecuteInProcessResult:
    """A run of the shard job over the partitions first..last (in the order they were added)."""
    from fixed_res_sidecar.defs.dagster_private import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    return defs.resolve_job_def("tiny__build_shards").execute_in_process(
        instance=instance,
        raise_on_error=False,
        run_config=QUIET,
        tags={ASSET_PARTITION_RANGE_START_TAG: first, ASSET_PARTITION_RANGE_END_TAG: last},
    )


def output_files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


@pytest.mark.heavy
def test_a_batch_is_one_run_with_per_shard_results_and_a_per_shard_gate(tmp_path):
    main = Location.parse(tmp_path / "main")
    shards = ["b1.parquet", "b2.parquet", "b3.parquet"]
    write_tiny(main, shards=shards)
    entry = dataset_entry("tiny", main, tmp_path / "out", shards_per_run=3, run_resources={"cpu": 2, "memory_gb": 2})
    config = make_config(entry)
    defs, dataset = build_definitions(config), config.datasets[0]
    damaged = shards[1]
    with dg.instance_for_test() as instance:
        register(instance, config)
        order = instance.get_dynamic_partitions("tiny_shards")
        assert run_shard(defs, instance, "tiny__build_shards", damaged, selection=[KEYS.resized("512")]).success
        swap_two_keys(dataset.output("resized_512"), damaged)  # same rows and settings: skip-existing keeps it

        batch = run_batch(defs, instance, order[0], order[-1])
        assert not batch.success  # one shard failed a blocking check
        assert {e.partition for e in batch.get_asset_check_evaluations()} == set(shards)
        batch_statuses = check_partition_status(instance, ALL_CHECK_KEYS, shards)
        assert instance.get_materialized_partitions(KEYS.crop_bbox) == set(shards) - {damaged}
        assert "keys_match" in refusal(batch, damaged)

    # Exactly what one-shard runs record (a fresh instance; the same outputs are kept).
    with dg.instance_for_test() as single:
        register(single, config)
        for rel in shards:
            run_shard(defs, single, "tiny__build_shards", rel)
        assert check_partition_status(single, ALL_CHECK_KEYS, shards) == batch_statuses
    good = {(k.to_user_string(), rel): "SUCCEEDED" for k in ALL_CHECK_KEYS for rel in shards if rel != damaged}
    assert {key: status for key, status in batch_statuses.items() if key[1] != damaged} == good
    assert batch_statuses[("tiny/verify_512:keys_match", damaged)] == "FAILED"
    assert batch_statuses[("tiny/verify_1024:keys_match", damaged)] == "SUCCEEDED"
    assert "SUCCEEDED" not in {s for (name, rel), s in batch_statuses.items() if rel == damaged and "crop_bbox" in name}


@pytest.mark.heavy
def test_a_rerun_of_a_batch_builds_nothing_and_restates_its_results(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    write_tiny(main, shards=["c1.parquet", "c2.parquet"])
    config = make_config(dataset_entry("tiny", main, tmp_path / "out", shards_per_run=2))
    defs = build_definitions(config)
    register(instance, config)
    order = instance.get_dynamic_partitions("tiny_shards")
    first = run_batch(defs, instance, order[0], order[-1])
    assert first.success and len(first.get_asset_check_evaluations()) == 2 * 16
    before = output_files(tmp_path / "out")

    again = run_batch(defs, instance, order[0], order[-1])
    assert again.success  # nothing built or re-verified: the same materializations restated
    restated_runs = {
        e.materialization.metadata["restated_from_run"].value for e in again.get_asset_materialization_events()
    }
    assert restated_runs == {first.run_id} and len(again.get_asset_materialization_events()) == 2 * 5
    assert output_files(tmp_path / "out") == before
    restated = again.get_asset_check_evaluations()
    assert len(restated) == 2 * 16 and all(e.passed and "restated_from_run" in e.metadata for e in restated)
    assert set(check_partition_status(instance, ALL_CHECK_KEYS, order).values()) == {"SUCCEEDED"}


def test_storage_that_keeps_failing_fails_the_verifier_step_without_a_check_result(
    faulty_s3, fast_retries, s3_bucket, instance
):
    """No verdict is recorded for a shard whose storage kept failing: the step fails (the run can
    be retried) and none of its checks is stored as failed or passed."""
    main = Location.parse(f"s3://{s3_bucket}/lake/main/tiny")
    rel = "a/part-0.parquet"
    write_tiny(main, shards=(rel,))
    config = make_config(dataset_entry("tiny", main, f"s3://{s3_bucket}/lake/out"))
    defs = build_definitions(config)
    register(instance, config)
    assert run_shard(
        defs, instance, "tiny__build_shards", rel, selection=[KEYS.resized(r) for r in RESOLUTION_NAMES]
    ).success

    faulty_s3.inject(every_object_get)
    result = run_shard(defs, instance, "tiny__build_shards", rel, selection=[KEYS.verify("512")])
    assert not result.success and not materialized(result)
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "StorageError: storage failed reading s3://" in failure.event_specific_data.error.to_string()
    assert result.get_asset_check_evaluations() == []
    statuses = check_partition_status(instance, RESIZED_CHECK_KEYS, [rel])
    assert set(statuses.values()) == {"PLANNED"}, statuses  # planned, never evaluated
    assert retried_on_failure(instance, result) == "true"  # not the data's failure: run retries redo it

    faulty_s3.inject(no_get)  # storage is back: a rerun gives the verdict
    rerun = run_shard(defs, instance, "tiny__build_shards", rel, selection=[KEYS.verify("512")])
    assert rerun.success and all(e.passed for e in rerun.get_asset_check_evaluations())


SHARD_ASSETS = [
    *(KEYS.resized(r) for r in RESOLUTION_NAMES),
    *(KEYS.verify(r) for r in RESOLUTION_NAMES),
    KEYS.crop_bbox,
]


@pytest.mark.heavy
def test_in_a_batch_only_the_damaged_shard_shows_failed_and_a_repair_clears_it(tmp_path, instance):
    """A batch whose shards were up to date but one, which was damaged since: only that shard's
    crop_bbox shows Failed and only its verifier check failed; the run names it alone; once it is
    repaired a batch over all of them leaves nothing Failed (restating clears the old failure)."""
    main = Location.parse(tmp_path / "main")
    shards = ["d1.parquet", "d2.parquet", "d3.parquet", "d4.parquet"]
    write_tiny(main, shards=shards)
    config = make_config(dataset_entry("tiny", main, tmp_path / "out", shards_per_run=4))
    defs, dataset = build_definitions(config), config.datasets[0]
    register(instance, config)
    order = instance.get_dynamic_partitions("tiny_shards")
    assert run_batch(defs, instance, order[0], order[-1]).success
    damaged = shards[2]
    swap_two_keys(dataset.output("resized_512"), damaged)

    batch = run_batch(defs, instance, order[0], order[-1])
    assert not batch.success
    failed = failed_partitions(instance, defs, SHARD_ASSETS)
    assert failed == {
        **{k.to_user_string(): set() for k in SHARD_ASSETS},
        "tiny/verify_512": {damaged},  # its verification failed: not materialised, so Failed, as its check
        "tiny/crop_bbox": {damaged},
    }
    failure = next(e for e in batch.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.event_specific_data.error.message.startswith(
        f"1 of 4 shard(s) failed: {damaged}: verify_512 failed keys_match"
    )  # the data failed: one message, no class path, no stack trace
    assert failure.event_specific_data.error.stack == []
    statuses = check_partition_status(instance, ALL_CHECK_KEYS, shards)
    assert {key for key, status in statuses.items() if status == "FAILED"} == {("tiny/verify_512:keys_match", damaged)}
    # The UI shows that result Failed only when it is about the partition's latest materialization.
    (info,) = instance.event_log_storage.get_asset_check_partition_info(
        [dg.AssetCheckKey(KEYS.verify("512"), "keys_match")], partition_keys=[damaged]
    )
    assert info.is_current
    assert {key[1] for key, status in statuses.items() if status != "SUCCEEDED"} == {damaged}
    logs = [record.user_message for record in instance.all_logs(batch.run_id)]
    assert not [line for line in logs if "did not yield or return expected outputs" in line]
    # The log says which shards were restated and why the other one was not.
    assert [line.split(":")[0] for line in logs if ": up to date, results restated (built by run " in line] == [
        rel for rel in shards if rel != damaged
    ]
    assert f"{damaged}: to build: its 512 output changed since it was verified" in logs

    Path(dataset.output("resized_512").child(damaged)).unlink()  # the repair: rebuilt by the next run
    repaired = run_batch(defs, instance, order[0], order[-1])
    assert repaired.success
    logs = [record.user_message for record in instance.all_logs(repaired.run_id)]
    assert [line for line in logs if line.startswith(f"{damaged}: to build")] == [
        f"{damaged}: to build again: its 512 output failed keys_match when it was verified (run {batch.run_id[:8]}) "
        f"after it was built (run {batch.run_id[:8]})"
    ]
    assert failed_partitions(instance, defs, SHARD_ASSETS) == {k.to_user_string(): set() for k in SHARD_ASSETS}
    assert set(check_partition_status(instance, ALL_CHECK_KEYS, shards).values()) == {"SUCCEEDED"}


@pytest.mark.heavy
def test_a_shard_removed_from_main_is_skipped_and_its_batch_goes_on(tmp_path, instance):
    main = Location.parse(tmp_path / "main")
    shards = ["r1.parquet", "r2.parquet", "r3.parquet"]
    write_tiny(main, shards=shards)
    config = make_config(dataset_entry("tiny", main, tmp_path / "out", shards_per_run=3))
    defs = build_definitions(config)
    register(instance, config)
    order = instance.get_dynamic_partitions("tiny_shards")
    Path(main.child(shards[1])).unlink()

    batch = run_batch(defs, instance, order[0], order[-1])
    assert batch.success
    assert {e.partition for e in batch.get_asset_materialization_events()} == {shards[0], shards[2]}
    skipped = [e.asset_observation_data.asset_observation for e in batch.get_asset_observation_events()]
    assert {(o.asset_key, o.partition) for o in skipped} == {(key, shards[1]) for key in SHARD_ASSETS}
    assert all("is no longer in the main dataset: skipped" in o.description for o in skipped)
    assert failed_partitions(instance, defs, SHARD_ASSETS) == {k.to_user_string(): set() for k in SHARD_ASSETS}


@pytest.mark.stress
def test_wrong_pictures_fail_fidelity_gate_the_crop_fail_the_audit_and_a_rerun_repairs_them(
    tiny_config, tiny_defs, instance
):
    """The reported deploy: three rows of a 512 shard replaced by a turned, a channel-swapped and a
    black picture of the same size and format (checksums valid). The fidelity check fails on that
    shard, its crop_bbox is refused, the audit fails naming it; running the shard again rebuilds it."""
    from fixed_res_sidecar_tests.defs.test_dataset_audit import run_audit
    from fixed_res_sidecar_tests.fixtures.datasets import damage_resized_images, valid_rows

    dataset = tiny_config.datasets[0]
    rel, other = "nested/x/part-b.parquet", "part-a.parquet"
    register(instance, tiny_config)
    for shard in (rel, other):
        assert run_shard(tiny_defs, instance, "tiny__build_shards", shard).success
    r512, prefix = dataset.output("resized_512"), dataset.layout.resized["512"].audit_prefix
    rows = valid_rows(r512, rel, prefix)[:3]
    damage_resized_images(r512, dataset.output("resized_1024"), prefix, dict(zip(rows, ["rotated_180", "channels_reversed", "black"])), rel)  # fmt: skip

    result = run_shard(tiny_defs, instance, "tiny__build_shards", rel)
    assert not result.success  # a blocking check failed
    fidelity = {
        (e.asset_key, e.check_name): e for e in result.get_asset_check_evaluations() if e.check_name == verify.FIDELITY
    }
    failed = fidelity[(KEYS.verify("512"), verify.FIDELITY)]
    assert not failed.passed and fidelity[(KEYS.verify("1024"), verify.FIDELITY)].passed
    assert r512.child(rel) in failed.description and "3 of" in failed.description
    assert failed.metadata["failing_rows"].value == 3
    failing = failed.metadata["failing"].value
    keys = [f["key"] for f in failing]
    assert keys == [f"{k}" for k in (column(r512, rel, "image_key")[r] for r in rows)]
    assert all(f["score"] < -3 for f in failing)
    assert failed.metadata["pictures"].value.count("data:image/webp;base64,") == 3  # every failing row's, inline
    assert failed.metadata["pictures"].value.count(".png") >= 3
    statuses = check_partition_status(instance, [dg.AssetCheckKey(KEYS.verify("512"), verify.FIDELITY)], [rel, other])
    assert statuses == {
        (f"tiny/verify_512:{verify.FIDELITY}", rel): "FAILED",
        (f"tiny/verify_512:{verify.FIDELITY}", other): "SUCCEEDED",
    }
    # The gate: crop_bbox of that shard is refused (an observation saying why), not materialised.
    assert KEYS.crop_bbox not in materialized(result)
    (observation,) = [o for o in observations(result) if o.asset_key == KEYS.crop_bbox]
    assert "fidelity" in (observation.description or "")
    # The failed verification is observed (its asset reads Failed), with the numbers a materialization would hold.
    assert failed_verifications(result) == {(KEYS.verify("512"), rel)}
    (verified,) = [o.metadata for o in observations(result) if o.asset_key == KEYS.verify("512")]
    assert verified["fidelity_failing_rows"].value == 3 and verified["fidelity_score_below_-3"].value == 3

    evaluation, _, audit = run_audit(tiny_defs, instance)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert f"[{rel}](/assets/tiny/verify_512?view=partitions&partition=" in evaluation.description
    assert f"verify_512:{verify.FIDELITY}" in evaluation.description
    assert audit["1. fidelity 512: failing rows"] == 3 and audit["3. fidelity 512: rows scoring below -3 dB"] == 3
    assert audit["3. fidelity 512: rows compared"] == 2 * (TINY_ROWS - 1)
    assert audit["3. fidelity 512: lowest score (dB)"] < -3

    # The next run of the shard rebuilds it, although its footer is up to date: its latest verification
    # failed on the bytes it holds (verifying them again could only fail again). No tag, no option.
    repaired = run_shard(tiny_defs, instance, "tiny__build_shards", rel)
    assert repaired.success
    assert metadata_of(repaired, KEYS.resized("512"))["status"] == "built"
    assert metadata_of(repaired, KEYS.resized("1024"))["status"] == "skipped"
    assert all(e.passed for e in repaired.get_asset_check_evaluations())
    evaluation, complete, audit = run_audit(tiny_defs, instance)
    assert evaluation.passed and complete.passed, evaluation.description
    assert audit["1. fidelity 512: failing rows"] == 0 and audit["3. fidelity 512: lowest score (dB)"] >= -3


def test_the_verifier_expects_the_datasets_settings_not_what_a_footer_says(tiny_main, tmp_path, instance):
    """A dataset configured with quality 80 verifies its own builds; a shard whose footer was changed to
    say quality 95 (a copy from another build) fails shard_complete naming the setting, and its crop is gated."""
    import json

    import pyarrow.parquet as pq

    from fixed_res_sidecar.shards.settings import SETTINGS_KEY

    config = make_config(dataset_entry("tiny", tiny_main, tmp_path / "out", quality=80))
    defs = build_definitions(config)
    register(instance, config)
    rel = "part-a.parquet"
    assert run_shard(defs, instance, "tiny__build_shards", rel).success
    path = config.datasets[0].output("resized_512").child(rel)
    table = pq.read_table(path)
    metadata = dict(table.schema.metadata)
    metadata[SETTINGS_KEY] = json.dumps({**json.loads(metadata[SETTINGS_KEY]), "quality": 95}).encode()
    pq.write_table(table.replace_schema_metadata(metadata), path, write_page_checksum=True, row_group_size=4)

    result = run_shard(defs, instance, "tiny__build_shards", rel, selection=[KEYS.verify("512"), KEYS.crop_bbox])
    assert not result.success
    failed = {e.check_name: e.description for e in result.get_asset_check_evaluations() if not e.passed}
    assert set(failed) == {verify.SHARD_COMPLETE}
    assert (
        "its footer records other build settings than expected: quality 95 (expected 80)"
        in failed[verify.SHARD_COMPLETE]
    )
    assert "shard_complete" in refusal(result, rel)
