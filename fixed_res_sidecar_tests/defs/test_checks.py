"""Verifier reports as Dagster check results."""

import dagster as dg

from fixed_res_sidecar.core.audit import ERROR_CODES
from fixed_res_sidecar.defs.checks import check_evaluations, examples_table, metadata_value
from fixed_res_sidecar.shards import verify

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
    results = {
        r.check_name: r
        for r in check_evaluations(resized_report(), KEY, verify.RESIZED_CHECKS, "a/part-0.parquet", None)
    }
    assert {r.partition for r in results.values()} == {"a/part-0.parquet"} and all(r.blocking for r in results.values())
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
    # Counts as plain numbers, one per error code, on every resized check; examples as a table.
    for result in results.values():
        counts = {code: result.metadata[f"invalid_{code}"].value for code in ERROR_CODES}
        assert counts == {code: {"decode_error": 1, "too_small": 1}.get(code, 0) for code in ERROR_CODES}
        assert (result.metadata["valid"].value, result.metadata["invalid"].value) == (8, 2)
    audit = results[verify.AUDIT_CONSISTENT].metadata
    assert [r.data["key"] for r in audit["invalid_examples"].records] == ["k3", "k7"]
    assert audit["invalid_examples"].records[0].data["detail"] == "cannot identify | image"


def test_metadata_values_keep_their_types():
    assert isinstance(metadata_value(3), dg.IntMetadataValue)
    assert isinstance(metadata_value(True), dg.BoolMetadataValue)
    assert isinstance(metadata_value(0.5), dg.FloatMetadataValue)
    assert isinstance(metadata_value("x"), dg.TextMetadataValue)
    assert isinstance(metadata_value(None), dg.NullMetadataValue)
    assert metadata_value({"a": [1, ("b", 2)]}).value == {"a": [1, ["b", 2]]}


def test_examples_table():
    assert examples_table([]).records == []
    table = examples_table([{"row": 1, "key": b"k", "error": "decode_error", "detail": "x" * 1000}])
    (record,) = table.records
    assert record.data == {"row": 1, "key": "b'k'", "error": "decode_error", "detail": "x" * 300}
    assert [c.name for c in table.schema.columns] == ["row", "key", "error", "detail"]
