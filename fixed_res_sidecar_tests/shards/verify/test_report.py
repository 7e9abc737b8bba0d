"""shards/verify/report.py: report documents, where they go, and the deterministic sample."""

import json
from pathlib import Path

import pytest

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.verify import (
    RESIZED_CHECKS,
    ReportError,
    failed_outputs,
    load_report,
    report_rel,
    write_report,
)
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


GOOD_ENTRY = {"kind": "resized", "passed": False, "shard": "/out/512/a.parquet", "stats": {"output_fingerprint": "9:1"}}
MALFORMED = {
    "a list": ("[1]", "r.json: not a verifier report (a JSON object), got a list"),
    "no shards or kind": ('{"command": "verify-resized"}', "r.json: not a verifier report: it has neither 'shards'"),
    "shards an object": ('{"shards": {}}', "r.json: 'shards' must be a list of shard reports, got an object"),
    "an entry as text": ('{"shards": ["x"]}', "r.json: shards[0] must be a shard report (a JSON object), got text"),
    "no shard": ('{"shards":[{"kind":"resized","passed":false}]}', "r.json: shards[0]: 'shard' must be the checked shard's URI (text), got nothing"),
    "shard a list": ('{"shards":[{"kind":"resized","passed":false,"shard":["a"]}]}', "'shard' must be the checked shard's URI (text), got a list"),
    "stats text": ('{"shards":[{"kind":"resized","passed":false,"shard":"a","stats":"x"}]}', "r.json: shards[0]: 'stats' must be an object, got text"),
    "passed text": ('{"shards":[{"kind":"resized","passed":"no","shard":"a"}]}', "'passed' must be true or false, got \"no\""),
    "kind unknown": ('{"kind":"resize","passed":false,"shard":"a"}', "r.json: the shard report: 'kind' must be one of ['resized', 'crop_bbox'], got \"resize\""),
    "fingerprint a number": ('{"shards":[{"kind":"resized","passed":false,"shard":"a","stats":{"output_fingerprint":7}}]}', "'stats.output_fingerprint' must be text or null, got 7"),
    "200,000 nested [": ("[" * 200_000, "r.json: not a verifier report (its JSON is nested too deeply)"),
    "not JSON": ("{'shards': []}", "r.json: not a readable verifier report (not JSON"),
    "not UTF-8": (b"\xff\xfe{}", "r.json: not a readable verifier report (not JSON"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_report_is_refused_naming_the_problem(name):
    """Reported: malformed reports crashed `build-both --rebuild-failed` (KeyError, TypeError, AttributeError,
    RecursionError)."""
    text, message = MALFORMED[name]
    with pytest.raises(ReportError) as refused:
        failed_outputs(load_report(text.encode() if isinstance(text, str) else text, "r.json"), "r.json")
    assert message in str(refused.value)


def test_failed_outputs_of_both_shapes_of_report():
    passed = {**GOOD_ENTRY, "passed": True, "shard": "/out/512/b.parquet"}
    crop = {**GOOD_ENTRY, "kind": "crop_bbox", "shard": "/out/sidecar/a.parquet"}
    document = {"command": "verify-resized", "shards": [GOOD_ENTRY, passed, crop], "passed": False}
    assert failed_outputs(document) == {"/out/512/a.parquet": "9:1"}
    assert failed_outputs({**GOOD_ENTRY, "stats": None}) == {"/out/512/a.parquet": None}
    assert failed_outputs({"shards": []}) == {}
