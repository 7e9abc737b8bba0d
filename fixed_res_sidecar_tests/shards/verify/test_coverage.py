"""shards/verify/coverage.py: each verification of the same bytes compares rows not compared before;
every comparable row is compared after ceil(rows / window) verifications, so a damaged row anywhere is
found within them (a fixed sample never finds one outside it)."""

import json
import math

import pytest

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.sample_data import write_sample_dataset
from fixed_res_sidecar.shards.pipeline import PipelineOptions, Stages, run_stages
from fixed_res_sidecar.shards.verify import FIDELITY, VerifyOptions
from fixed_res_sidecar.shards.verify.coverage import COVERAGE_STAT, plan, previous_coverage, row_order, window_rows
from fixed_res_sidecar_tests.fixtures.datasets import (
    build_all,
    damage_resized_images,
    layout_of,
    resized_outputs,
    valid_rows,
)


@pytest.mark.parametrize(("comparable", "size"), [(200, 8), (203, 8), (9, 8), (16, 8), (5, 1)])
def test_every_row_is_compared_after_ceil_rows_over_window_verifications(comparable, size):
    order = row_order("2026/12/part-00002.parquet", list(range(comparable)))
    previous, compared, first = None, [], 1000.0
    needed = math.ceil(comparable / size)
    for n in range(1, needed + 1):
        coverage = plan(previous, comparable, size, "fingerprint-1", first + n)
        rows = window_rows(order, coverage.size, coverage.window)
        assert rows and not set(rows) & set(compared)  # only rows not compared before
        compared += rows
        assert coverage.compared_ever == len(compared) and coverage.windows == needed
        assert coverage.since == first + 1  # when these bytes were first verified
        assert coverage.complete == (n == needed)
        previous = coverage.to_json()
    assert sorted(compared) == list(range(comparable))
    # Then the rotation starts over, and the coverage of these bytes stays full.
    again = plan(previous, comparable, size, "fingerprint-1", first + 99)
    assert again.window == 0 and again.complete and again.since == first + 1


def test_new_bytes_start_over_and_a_window_as_large_as_the_shard_compares_all():
    first = plan(None, 40, 8, "old", 10.0)
    second = plan(first.to_json(), 40, 8, "old", 20.0)
    assert (second.window, second.compared_ever) == (1, 16)
    rebuilt = plan(second.to_json(), 40, 8, "new", 30.0)  # another object: nothing of it was compared
    assert (rebuilt.window, rebuilt.windows_done, rebuilt.compared_ever, rebuilt.since) == (0, 1, 8, 30.0)
    everything = plan(None, 40, None, "new", 30.0)  # `--sample all`
    assert everything.complete and window_rows(row_order("x", list(range(40))), everything.size, 0) == list(range(40))
    assert plan(None, 0, 8, None, 1.0).complete  # no valid row: nothing to compare


def test_the_order_is_the_shards_own_and_the_same_every_time():
    rows = list(range(100))
    assert row_order("a.parquet", rows) == row_order("a.parquet", rows)
    assert row_order("a.parquet", rows) != row_order("b.parquet", rows)
    assert sorted(row_order("a.parquet", rows)) == rows


def test_successive_verifications_walk_the_shard_and_find_a_damaged_row_wherever_it_is(tmp_path):
    """The issue's case: one wrong picture outside the first sample. Verifications through the shard step
    (each reads what the previous report recorded) compare new rows each time; the damaged row fails the
    verification whose window holds it, and after ceil(valid / window) verifications every valid row was
    compared."""
    main = Location.parse(tmp_path / "main")
    rel = "part-00000.parquet"
    write_sample_dataset(main, shards=(rel,), rows_per_shard=24, row_group_size=8, sizes=((160, 120), (120, 160)))
    outputs = resized_outputs(tmp_path / "out")
    build_all(main, outputs)
    layout = layout_of(main, outputs, reports=Location.parse(tmp_path / "reports"))
    r512 = outputs[0]
    valid = valid_rows(r512.location, rel, r512.audit_prefix)
    window = 4
    order = row_order(rel, valid)
    damaged = order[-1]  # in the last window: a fixed sample of the first rows would never see it
    damage_resized_images(r512.location, outputs[1].location, r512.audit_prefix, {damaged: "rotated_180"}, rel)

    options = PipelineOptions(verify=VerifyOptions(sample=8, fidelity_sample=window))
    needed = math.ceil(len(valid) / window)
    compared: list[int] = []
    found_at = None
    for n in range(1, needed + 1):
        outcome = run_stages(layout, rel, Stages(verify=("512",)), options)
        report = outcome.reports["512"]
        coverage = report.stats[COVERAGE_STAT]
        rows = window_rows(order, coverage["size"], coverage["window"])
        assert not set(rows) & set(compared)
        compared += rows
        assert coverage["compared_ever"] == len(compared) and coverage["comparable"] == len(valid)
        fidelity = report.check(FIDELITY)
        assert fidelity.metadata["checked"] == len(rows)
        if not fidelity.passed:
            assert [f["row"] for f in fidelity.metadata["failing"]] == [damaged]
            found_at = found_at or n
    assert sorted(compared) == sorted(valid) and found_at == needed
    # The record the next verification continues from is the one written with the report.
    written = json.loads(layout.report_location("resized_512").read_bytes("part-00000.verify.json"))
    assert previous_coverage(written) == coverage and coverage["windows_done"] == needed
