"""The operator's loop in a real Chromium on `sidecar-ops ui` (dagster dev: webserver, daemon, sensors):
a backfill launched from the job page fails one shard; within a minute, without a click, the audit says
so, leading with its verdict and linking the shard and its repair; every view says one thing about the
shard; the repair takes three clicks and nothing typed, and the audit passes again within a minute.

The demo's three shards, damaged before the UI starts: `part-00001` has two wrong pictures in its 512
output (fidelity fails), `2026/12/part-00002` a truncated 1024 output, verified alone once (its check
must say the shard could not be read, never "rows 0"), which the backfill rebuilds.
"""

import os
import re
import time
from pathlib import Path

import dagster as dg
import pytest

from fixed_res_sidecar import demo
from fixed_res_sidecar.defs.audit_triggers import AUDIT_AFTER_TAG
from fixed_res_sidecar.defs.config import load_config
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.names import DatasetKeys
from fixed_res_sidecar_tests.cli.test_ui import (  # noqa: F401 (browser, new_page: fixtures)
    Page,
    answer_to,
    browser,
    check_partitions,
    demo_environment,
    detached_ui,
    new_page,
    shards_with_status,
)
from fixed_res_sidecar_tests.defs.conftest import QUIET
from fixed_res_sidecar_tests.fixtures.datasets import damage_resized_images, valid_rows

KEYS = DatasetKeys("sample")
WRONG = "part-00001.parquet"  # two wrong pictures in its 512 output
TRUNCATED = "2026/12/part-00002.parquet"  # its 1024 output cut in half
SHARDS = [TRUNCATED, "part-00000.parquet", WRONG]
MINUTE = 60.0


@pytest.fixture(scope="module")
def damaged_demo(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("operator") / "sidecar-demo"
    with demo_environment(workdir):
        summary = demo.run_demo(workdir, shards=3, rows_per_shard=8, say=lambda _: None)
        assert summary.ok, demo.format_summary(summary)
        config = load_config(summary.config_file)
        dataset = config.dataset("sample")
        r512, r1024 = dataset.output("resized_512"), dataset.output("resized_1024")
        prefix = dataset.layout.resized["512"].audit_prefix
        rows = valid_rows(r512, WRONG, prefix)
        damage_resized_images(r512, r1024, prefix, {rows[0]: "rotated_180", rows[-1]: "black"}, WRONG)
        truncated = Path(r1024.child(TRUNCATED))
        truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
        with dg.DagsterInstance.from_config(str(summary.dagster_home)) as instance:
            verified = (
                build_definitions(config)
                .resolve_job_def(KEYS.shard_job)
                .execute_in_process(
                    partition_key=TRUNCATED,
                    instance=instance,
                    raise_on_error=False,
                    run_config=QUIET,
                    asset_selection=[KEYS.verify("1024")],
                )
            )
            assert not verified.success
    return workdir


@pytest.fixture(scope="module")
def live_ui(damaged_demo):
    with detached_ui(damaged_demo) as url:
        yield url, damaged_demo


def instance_of(workdir: Path) -> dg.DagsterInstance:
    return dg.DagsterInstance.from_config(str(workdir / "dagster_home"))


def wait_for(predicate, timeout: float, what: str, interval: float = 2.0):
    deadline = time.monotonic() + timeout
    while (result := predicate()) is None or result is False:
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(interval)
    return result


def ended_shard_runs(instance, after: float) -> list[dg.RunRecord]:
    records = instance.get_run_records(dg.RunsFilter(job_name=KEYS.shard_job, created_after=_utc(after)))
    return [r for r in records if r.dagster_run.is_finished]


def audits_after(instance, moment: float) -> list[dg.EventLogRecord]:
    """The audit's materializations recorded after `moment` (unix time)."""
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=KEYS.audit), limit=20).records
    return [r for r in records if r.timestamp > moment]


def assert_reads_run(audit_run: dg.RunRecord, run: dg.RunRecord) -> None:
    """The audit reads `run`: the after-runs sensor's names it. An audit the hourly schedule asked for as
    the run ended reads that run too, and the sensor then asks for none (as in defs/test_audit_triggers.py):
    it must start after the run's end."""
    if AUDIT_AFTER_TAG in audit_run.dagster_run.tags:
        assert run.dagster_run.run_id[:8] in audit_run.dagster_run.tags[AUDIT_AFTER_TAG]
    else:
        assert audit_run.start_time is not None and audit_run.start_time >= (run.end_time or 0)


def _utc(timestamp: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(timestamp, UTC)


def without_pop_up(page) -> None:
    """Close the UI's community pop-up of a first visit if it is open: on a busy machine it can open long
    after its page (a Playwright page, not counted as the operator's click: it is no part of the work)."""
    skip = page.get_by_role("button", name="Skip")
    if skip.count():
        skip.first.click()


class Clicks:
    """Every click of the operator, counted."""

    def __init__(self):
        self.count = 0

    def click(self, locator) -> None:
        without_pop_up(locator.page)
        self.count += 1
        locator.click()


def reload_until(page: Page, path: str, ready: str, expected: list[str], timeout: float) -> str:
    """The page's text once it holds every `expected` string, opening it again while it does not (what an
    operator coming back to it sees; nobody clicks anything)."""
    deadline = time.monotonic() + timeout
    while True:
        page.open(path, ready)
        text = page.text_when(expected, timeout=10)
        if all(line in text for line in expected) or time.monotonic() > deadline:
            return text


def test_a_failed_backfill_shows_in_the_audit_within_a_minute_and_every_view_agrees(live_ui, new_page):  # noqa: F811
    base, workdir = live_ui
    page = new_page(base)

    # Before anything runs: the truncated shard's check says its shard could not be read, not "rows 0".
    page.open(check_partitions("shard_complete", "verify_1024"), "Latest execution")
    text = page.text_when(["unknown: the shard could not be read"], timeout=30)
    assert "unknown: the shard could not be read" in text and not re.search(r"\brows\n0\n", text)
    page.shot("operator-0-truncated-check")

    # A backfill of every shard from the job page: Materialize all…, All, Launch backfill.
    launched_at = time.time()
    page.open("/guess/sample__build_shards", "Materialize all")
    described = "each run takes a batch of up to 8 shards"  # the job's description says what its runs do
    assert described in page.text_when([described], timeout=30)
    for target in (
        page.page.get_by_text("Materialize all").first,
        page.page.get_by_role("button", name="All", exact=True),
    ):
        without_pop_up(page.page)
        target.click()
    without_pop_up(page.page)
    with page.page.expect_response(answer_to("LaunchPartitionBackfill"), timeout=300_000):
        page.page.get_by_role("button", name="Launch backfill").click()
    page.leave()
    with instance_of(workdir) as instance:
        (run,) = wait_for(lambda: ended_shard_runs(instance, launched_at) or None, 600, "the backfill's run")
        assert run.dagster_run.status is dg.DagsterRunStatus.FAILURE and run.end_time is not None
        # Nobody clicks: the run-status sensor requests an audit for that run within a minute of its end (the
        # sensor ticks every 15 s); the audit then takes as long as a run's start does here.
        audit = wait_for(lambda: next(iter(audits_after(instance, run.end_time)), None), 3 * MINUTE, "the audit")
        (audit_run,) = instance.get_run_records(dg.RunsFilter(run_ids=[audit.run_id]))
        assert audit_run.dagster_run.job_name == KEYS.audit_job
        assert_reads_run(audit_run, run)
        assert audit_run.create_timestamp.timestamp() - run.end_time <= MINUTE
        print(f"audit requested {audit_run.create_timestamp.timestamp() - run.end_time:.1f} s and recorded "
              f"{audit.timestamp - run.end_time:.1f} s after the failed run ended")  # fmt: skip

    # The audit leads with its verdict, then the failing shard (its page) and its repair, totals with units.
    verdict = "sample FAILED: 1 of 3 shard(s) failed a check"
    text = reload_until(page, "/assets/sample/audit", "Metadata", [verdict], timeout=30)
    assert verdict in text
    table = text[text.index("Metadata") :]
    order = ["verdict", "repair the failed shards", f"failed: {WRONG} (verify_512:fidelity)", "totals", "fidelity"]
    positions = [table.index(f"\n{name}\n") for name in order]
    assert positions == sorted(positions), positions
    assert f"/assets/sample/verify_512?view=partitions&partition={WRONG}" in table
    assert re.search(r"main 3 shards, 24 rows, [\d.]+ MB", table)
    page.shot("operator-1-audit-verdict-first")
    without_pop_up(page.page)
    page.page.get_by_text("Plots", exact=True).first.click()
    page.page.get_by_text("1. failed shards").first.wait_for(timeout=30_000)
    labels = re.findall(r"^\d\. [^\n]+$", page.page.inner_text("body"), flags=re.MULTILINE)
    assert labels[0] == "1. failed shards" and labels == sorted(labels), labels[:8]
    page.shot("operator-2-audit-plots-failures-first")

    # Every view says one thing about the shard: its verifier and its crop_bbox read Failed, alone; its
    # check Failed; the crop_bbox's status says it was not rebuilt; the run failed with one message.
    assert shards_with_status(page, "/assets/sample/verify_512?view=partitions", "asset", "Failed", SHARDS) == [WRONG]
    assert shards_with_status(page, "/assets/sample/crop_bbox?view=partitions", "asset", "Failed", SHARDS) == [WRONG]
    assert shards_with_status(page, check_partitions("fidelity"), "check", "Failed", SHARDS) == [WRONG]
    assert shards_with_status(page, check_partitions("shard_complete", "verify_1024"), "check", "Failed", SHARDS) == []
    page.open(f"/assets/sample/crop_bbox?view=partitions&partition={WRONG}", "Metadata")
    text = page.text_when(["refused by the gate: not rebuilt; the sidecar on disk is from run "], timeout=30)
    assert "refused by the gate: not rebuilt; the sidecar on disk is from run " in text
    page.shot("operator-3-crop-partition")
    page.open(f"/runs/{run.dagster_run.run_id}", "RUN_FAILURE")
    text = page.text_when([f"1 of 3 shard(s) failed: {WRONG}: verify_512 failed fidelity"], timeout=30)
    assert f"1 of 3 shard(s) failed: {WRONG}: verify_512 failed fidelity" in text
    assert "Stack Trace" not in text and "dagster._core" not in text
    page.shot("operator-4-run-one-message")

    # The failed verification's own page says so (observed, not materialised: passed false).
    page.open(f"/assets/sample/verify_512?view=partitions&partition={WRONG}", "Metadata")
    text = page.text_when(["verification_failed"], timeout=30)
    assert re.search(r"verification_failed\s+true", text) and re.search(r"\npassed\s+false", text)
    page.shot("operator-5-verifier-partition")
    # Every failing fidelity row's picture is in the UI: that shard's fidelity result shows each inline.
    page.open(check_partitions("fidelity"), "Execution history")
    without_pop_up(page.page)
    page.page.get_by_role("tab", name="Partitions").last.click()
    page.page.locator(f"text={WRONG} >> visible=true").last.click()  # its row in the list of shards
    page.page.get_by_text("[Show Markdown]").first.wait_for(timeout=30_000)
    page.page.get_by_text("[Show Markdown]").last.click()
    pictures = page.page.locator("img[src^='data:image/webp']")
    pictures.first.wait_for(timeout=30_000)
    assert pictures.count() == 2, pictures.count()
    page.shot("operator-6-fidelity-pictures")
    project_errors = [e for e in page.errors if "Failed to load resource" not in e]
    assert project_errors == [], project_errors


def test_the_repair_takes_three_clicks_and_the_audit_passes_within_a_minute(live_ui, new_page):  # noqa: F811
    base, workdir = live_ui
    page, clicks = new_page(base), Clicks()
    page.open("/assets/sample/audit", "repair the failed shards")
    # Playwright writes a pattern into its selector as /.../: the slashes of the path escaped.
    link = page.page.get_by_role("link", name=re.compile(r"^\/guess\/sample__build_shards\?partition="))
    with page.page.context.expect_page() as opened:  # the UI opens metadata links in a new tab
        clicks.click(link.first)
    job = opened.value
    job.get_by_text("Materialize all").first.wait_for(timeout=60_000)
    clicks.click(job.get_by_text("Materialize all").first)
    job.get_by_text("Partition selection").first.wait_for(timeout=60_000)
    # The dialog opens on "0 partitions" and takes the link's selection once the job's partitions load.
    job.get_by_text("1 partition", exact=True).first.wait_for(timeout=30_000)  # the failed shard, nothing typed
    launch = job.get_by_role("button", name="Launch 1 run")
    launch.wait_for(timeout=30_000)
    launched_at = time.time()
    with job.expect_response(answer_to("LaunchPipelineExecution"), timeout=300_000):
        clicks.click(launch)
    assert clicks.count == 3
    if screenshots := os.environ.get("SIDECAR_SCREENSHOTS"):
        job.wait_for_timeout(1000)
        job.screenshot(path=str(Path(screenshots, "operator-5-repair-launched.png")))
    job.close()  # the tab the link opened (new_page closes only its own pages)
    page.leave()
    with instance_of(workdir) as instance:
        (run,) = wait_for(lambda: ended_shard_runs(instance, launched_at) or None, 600, "the repair run")
        assert run.dagster_run.status is dg.DagsterRunStatus.SUCCESS, run.dagster_run.status
        assert run.dagster_run.job_name == KEYS.shard_job  # a named job, not __ASSET_JOB
        assert run.dagster_run.tags["dagster/partition"] == WRONG
        logs = [e.user_message for e in instance.all_logs(run.dagster_run.run_id)]
        assert any(line.startswith(f"{WRONG}: to build again: its 512 output failed fidelity") for line in logs), logs
        audit = wait_for(lambda: next(iter(audits_after(instance, run.end_time)), None), 3 * MINUTE, "the audit")
        (audit_run,) = instance.get_run_records(dg.RunsFilter(run_ids=[audit.run_id]))
        assert_reads_run(audit_run, run)
        assert audit_run.create_timestamp.timestamp() - (run.end_time or 0) <= MINUTE
    verdict = "sample passed: 3 of 3 shard(s) verified and cropped"
    text = reload_until(page, "/assets/sample/audit", "Metadata", [verdict], timeout=30)
    assert verdict in text
    page.shot("operator-8-audit-passed")
    assert shards_with_status(page, "/assets/sample/verify_512?view=partitions", "asset", "Failed", SHARDS) == []
