"""shards/verify/report.py: report documents, where they go, and the deterministic sample."""

import json
from pathlib import Path

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.verify import RESIZED_CHECKS, report_rel, write_report
from fixed_res_sidecar.shards.verify.report import sample_rows
from fixed_res_sidecar_tests.fixtures.datasets import DAMAGED_REL as REL


def test_report_json_and_write_report(sidecar_build, tmp_path):
    report = sidecar_build.verify("512")
    document = json.loads(report.to_json())
    assert document["passed"] is True and document["rel"] == REL
    assert [c["name"] for c in document["checks"]] == list(RESIZED_CHECKS)
    reports = Location.parse(tmp_path / "reports")
    written = write_report(reports, REL, report)
    assert written == report_rel(REL) == "nested/a/part-00001.verify.json"
    assert json.loads(Path(reports.child(written)).read_text()) == document


def test_sample_is_deterministic_per_shard_path():
    rows = list(range(1000))
    first = sample_rows(rows, 32, "a/part-1.parquet")
    assert first == sample_rows(rows, 32, "a/part-1.parquet") and len(first) == 32 and first == sorted(first)
    assert first != sample_rows(rows, 32, "a/part-2.parquet")
    assert sample_rows(rows[:5], 32, "x.parquet") == rows[:5]
