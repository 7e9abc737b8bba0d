"""Verifier reports as Dagster check results, and the dataset-level check."""

import json
from collections import Counter

import dagster as dg

from fixed_res_sidecar.defs.checks import (
    DATASET_CHECK_NAME,
    LISTED_MISSING,
    check_results,
    examples_markdown,
    metadata_value,
    summarize_dataset,
    to_metadata,
)
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.keys import DatasetKeys
from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards import verify
from fixed_res_sidecar.shards.crop_bbox import build_crop_bbox_shard
from fixed_res_sidecar_tests.defs.conftest import QUIET, dataset_entry, make_config
from fixed_res_sidecar_tests.fixtures.faulty_s3 import copy_files, first_get_of_each_key

KEY = dg.AssetKey(["ds", "verify_512"])


def resized_report(**changes) -> verify.ShardReport:
    report = verify.ShardReport(
        kind="resized",
        rel="a/part-0.parquet",
        shard="s3://b/out/a/part-0.parquet",
        resolution="512",
        rows=10,
        valid=8,
        invalid=2,
        error_counts={"decode_error": 1, "too_small": 1},
        examples=[
            {"row": 3, "key": "k3", "error": "decode_error", "detail": "cannot identify | image"},
            {"row": 7, "key": "k7", "error": "too_small", "detail": "1x1"},
        ],
        checks=[
            verify.CheckResult(verify.SHARD_COMPLETE, True, "10 rows, as in main", {"rows": 10, "main_rows": 10}),
            verify.CheckResult(
                verify.KEYS_MATCH, False, "row 0 has key 'k1' where main has 'k0'", {"first_mismatch_row": 0}
            ),
            verify.CheckResult(verify.AUDIT_CONSISTENT, True, "8 valid, 2 invalid", {"counts": {"decode_error": 1}}),
        ],
    )
    for name, value in changes.items():
        setattr(report, name, value)
    return report


def test_one_result_per_spec7_item_with_counts_and_examples():
    results = {r.check_name: r for r in check_results(resized_report(), KEY, verify.RESIZED_CHECKS)}
    assert list(results) == list(verify.RESIZED_CHECKS)
    assert results[verify.SHARD_COMPLETE].passed and results[verify.AUDIT_CONSISTENT].passed
    failed = results[verify.KEYS_MATCH]
    assert not failed.passed and failed.severity == dg.AssetCheckSeverity.ERROR
    assert "row 0 has key 'k1'" in failed.description
    assert failed.metadata["first_mismatch_row"].value == 0
    assert failed.metadata["shard"].value == "s3://b/out/a/part-0.parquet"
    # A check the verifier did not report fails rather than passing silently.
    missing = results[verify.SAMPLE_IMAGES]
    assert not missing.passed and "did not run check 'sample_images'" in missing.description
    # Counts per error code on every resized check; invalid examples on the audit check.
    for result in results.values():
        assert result.metadata["error_counts"].value == {"decode_error": 1, "too_small": 1}
        assert (result.metadata["valid"].value, result.metadata["invalid"].value) == (8, 2)
    audit = results[verify.AUDIT_CONSISTENT].metadata
    assert [e["key"] for e in audit["invalid_examples"].value] == ["k3", "k7"]
    assert "cannot identify \\| image" in audit["invalid_examples_table"].value


def test_metadata_values_keep_their_types():
    assert isinstance(metadata_value(3), dg.IntMetadataValue)
    assert isinstance(metadata_value(True), dg.BoolMetadataValue)
    assert isinstance(metadata_value(0.5), dg.FloatMetadataValue)
    assert isinstance(metadata_value("x"), dg.TextMetadataValue)
    assert isinstance(metadata_value(None), dg.NullMetadataValue)
    assert metadata_value({"a": [1, ("b", 2)]}).value == {"a": [1, ["b", 2]]}


def test_examples_table():
    assert examples_markdown([]) == "_no invalid rows_"
    table = examples_markdown([{"row": 1, "key": "k", "error": "decode_error", "detail": "a\nb"}])
    assert table.splitlines()[-1] == "| 1 | `k` | decode_error | a b |"


def test_dataset_check_counts_shards_and_bytes_and_lists_missing(sample_build, tmp_path):
    main, outputs = sample_build  # main and its 512/1024 builds, no crop sidecar yet
    config = make_config(dataset_entry("sample", main, tmp_path / "out"))
    dataset = config.datasets[0]
    assert dataset.output("resized_512") == outputs[0].location

    passed, metadata, description = summarize_dataset(dataset)
    shards = main.list_shards()
    assert not passed and f"crop_bbox: {len(shards)} of {len(shards)} shards missing" in description
    assert metadata["main_shards"] == metadata["512_shards"] == metadata["1024_shards"] == len(shards)
    assert metadata["main_bytes"] == sum(main.size(rel) for rel in shards)
    assert metadata["1024_bytes"] == sum(outputs[1].location.size(rel) for rel in shards)
    assert metadata["crop_bbox_missing_shards"] == shards

    # Through Dagster: the dataset check job, on an instance; WARN, not blocking.
    defs = build_definitions(config)
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("sample__dataset_check").execute_in_process(instance=instance, run_config=QUIET)
        (evaluation,) = result.get_asset_check_evaluations()
        assert evaluation.asset_check_key == dg.AssetCheckKey(DatasetKeys("sample").main, DATASET_CHECK_NAME)
        assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
        assert evaluation.metadata["512_shards"].value == len(shards)

        for rel in shards:
            build_crop_bbox_shard(dataset.layout, rel)
        result = defs.resolve_job_def("sample__dataset_check").execute_in_process(instance=instance, run_config=QUIET)
        (evaluation,) = result.get_asset_check_evaluations()
        assert (
            evaluation.passed
            and evaluation.description == f"all {len(shards)} shards present in 512, 1024 and crop_bbox"
        )

    # A missing output shard and a main shard that cannot be a partition are both reported.
    outputs[0].location.write_bytes("x,y.parquet", b"")  # an output with no main shard
    main.write_bytes("x,y.parquet", b"")
    (tmp_path / "out" / "0_262mp_version_all_in_one" / "sample" / shards[0]).unlink()
    passed, metadata, description = summarize_dataset(dataset)
    assert not passed
    assert metadata["512_missing_shards"] == [shards[0]]
    assert metadata["unpartitionable_shards"] == ["x,y.parquet"]
    assert "cannot be partition keys" in description


def test_empty_main_fails_the_dataset_check(tmp_path):
    dataset = make_config(dataset_entry("empty", tmp_path / "main", tmp_path / "out")).datasets[0]
    passed, metadata, description = summarize_dataset(dataset)
    assert not passed and metadata["main_shards"] == 0 and description.startswith("no shards under")


def test_dataset_check_metadata_stays_small_and_lists_main_once(tmp_path, monkeypatch):
    """At 100,000 shards the hourly check must not store 100,000 names: counts plus the first few."""
    main = Location.parse(tmp_path / "main")
    rels = [f"d{i // 100:02d}/part-{i:05d}.parquet" for i in range(LISTED_MISSING * 3)]
    for rel in rels:
        main.write_bytes(rel, b"x")
    dataset = make_config(dataset_entry("big", main, tmp_path / "out")).datasets[0]
    built = dataset.output("resized_512")
    for rel in rels[:10]:
        built.write_bytes(rel, b"yy")
    built.write_bytes("orphan.parquet", b"z")

    listed = Counter()
    real = Location.shard_sizes

    def counting(self, *args, **kwargs):
        listed[self.uri] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Location, "shard_sizes", counting)
    passed, metadata, description = summarize_dataset(dataset)
    assert listed[main.uri] == 1 and set(listed.values()) == {1} and len(listed) == 4

    assert not passed and f"512: {len(rels) - 10} of {len(rels)} shards missing" in description
    assert (metadata["512_missing"], metadata["512_extra"], metadata["crop_bbox_missing"]) == (
        len(rels) - 10,
        1,
        len(rels),
    )
    assert metadata["512_missing_shards"] == rels[10 : 10 + LISTED_MISSING]
    assert metadata["crop_bbox_missing_shards"] == rels[:LISTED_MISSING]
    assert metadata["512_extra_shards"] == ["orphan.parquet"]
    assert (metadata["main_shards"], metadata["main_bytes"], metadata["512_bytes"]) == (len(rels), len(rels), 21)
    assert metadata["summary"]["outputs"]["1024"] == {
        "location": dataset.output("resized_1024").uri,
        "shards": 0,
        "total_bytes": 0,
        "missing": len(rels),
        "extra": 0,
    }
    # No list in the stored metadata is longer than LISTED_MISSING; the last shards are named nowhere.
    stored = json.dumps({k: v.value for k, v in to_metadata(metadata).items()})
    assert rels[-1] not in stored


def test_dataset_check_rides_out_injected_s3_errors(sample_build, faulty_s3, s3_bucket):
    """Listings (boto3, with its retries) answered 500/503 the first time: the same summary."""
    main, outputs = sample_build
    root = f"s3://{s3_bucket}/lake"
    copy_files(main, Location.parse(f"{root}/main"))
    copy_files(outputs[0].location, Location.parse(f"{root}/out/0_262mp_version_all_in_one/sample"))
    dataset = make_config(dataset_entry("sample", f"{root}/main", f"{root}/out")).datasets[0]
    clean = summarize_dataset(dataset)
    faulty_s3.inject(first_get_of_each_key)
    assert summarize_dataset(dataset) == clean
    assert [key for key, _ in faulty_s3.faults] == [s3_bucket]  # the listings of one bucket: the first one failed
    assert clean[1]["512_shards"] == 3 and clean[1]["1024_missing"] == 3
