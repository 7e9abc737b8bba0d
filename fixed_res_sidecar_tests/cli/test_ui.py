"""`sidecar-ops ui` and what an auditor sees in it: a real `dagster dev`, a real Chromium.

The demo's data, then one batch run over both shards after one of them was damaged: its verifier
fails and its crop_bbox is refused, its neighbour is restated. In the browser the dataset audit's
check page shows the totals and the failing shard by name, the crop_bbox page shows an overlay
picture at least 600 px wide, a run launched from an asset page carries the dataset tag, and the
project's metadata raises no console errors. Per-shard truth: every "Failed" filter selects the
damaged shard alone, and after the repair every view is green.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from fixed_res_sidecar import demo
from fixed_res_sidecar.defs.config import load_config
from fixed_res_sidecar.defs.dagster_private import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from fixed_res_sidecar.defs.dataset_definitions import build_definitions
from fixed_res_sidecar.defs.names import DATASET_TAG, DatasetKeys
from fixed_res_sidecar_tests.defs.conftest import QUIET, swap_two_keys
from fixed_res_sidecar_tests.fixtures.dagster_deployment import automation_caught_up, wait_until
from fixed_res_sidecar_tests.fixtures.processes import describe, family
from fixed_res_sidecar_tests.fixtures.signals import sigint_ignored

KEYS = DatasetKeys("sample")
DAMAGED = "part-00001.parquet"
SCREENSHOTS = os.environ.get("SIDECAR_SCREENSHOTS")  # keep the screenshots here to look at them


def sidecar_ops(*args: str, cwd: Path, timeout: float = 180, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fixed_res_sidecar.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_batch(defs: dg.Definitions, instance) -> dg.ExecuteInProcessResult:
    """One run of the shard job over every shard, as a backfill's batch is."""
    order = instance.get_dynamic_partitions(KEYS.partitions)
    return defs.resolve_job_def(KEYS.shard_job).execute_in_process(
        instance=instance,
        raise_on_error=False,
        run_config=QUIET,
        tags={ASSET_PARTITION_RANGE_START_TAG: order[0], ASSET_PARTITION_RANGE_END_TAG: order[-1]},
    )


@contextmanager
def demo_environment(workdir: Path) -> Iterator[None]:
    """The demo run as a user would: no DAGSTER_HOME of the test's, its record of itself (XDG_STATE_HOME)
    beside `workdir`; both restored afterwards."""
    saved = {name: os.environ.pop(name, None) for name in ("DAGSTER_HOME", "XDG_STATE_HOME")}
    os.environ["XDG_STATE_HOME"] = str(workdir.parent / "state")
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@contextmanager
def detached_ui(workdir: Path) -> Iterator[str]:
    """`sidecar-ops ui --detach` on a demo work dir, yielding its URL; stopped at the end, with everything
    it started (webserver, daemon, code server), by the SIGINT of `--stop`. Started with SIGINT ignored,
    as a script's background job starts it: the UI must still stop at `--stop`'s SIGINT."""
    port = free_port()
    started = sidecar_ops(
        "ui", "--workdir", str(workdir), "--port", str(port), "--detach", cwd=workdir.parent, preexec_fn=sigint_ignored
    )
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"Browse http://127.0.0.1:{port}" in started.stdout and "sidecar-ops ui --stop" in started.stdout
    pid = int((workdir / "dagster_home" / "dagster-dev.pid").read_text())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stopped = sidecar_ops("ui", "--workdir", str(workdir), "--stop", cwd=workdir.parent)
        assert stopped.returncode == 0 and "killing it" not in stopped.stderr, stopped.stdout + stopped.stderr
        survivors = family(pid)  # zombies have exited
        assert not survivors, describe(survivors)


@pytest.fixture(scope="module")
def audited_demo(tmp_path_factory) -> Path:
    """A demo work dir whose shard DAMAGED failed its verifier; the audit ran afterwards."""
    workdir = tmp_path_factory.mktemp("ui") / "sidecar-demo"
    with demo_environment(workdir):
        summary = demo.run_demo(workdir, shards=2, rows_per_shard=6, say=lambda _: None)
        assert summary.ok, demo.format_summary(summary)
        dataset = load_config(summary.config_file).dataset("sample")
        defs = build_definitions(load_config(summary.config_file))
        swap_two_keys(dataset.output("resized_512"), DAMAGED)
        with dg.DagsterInstance.from_config(str(summary.dagster_home)) as instance:
            # One batch over both shards: the damaged one fails (verifier, then the crop is refused),
            # its up-to-date neighbour is restated.
            assert not run_batch(defs, instance).success
            defs.resolve_job_def(KEYS.audit_job).execute_in_process(instance=instance, run_config=QUIET)
    return workdir


@pytest.fixture(scope="module")
def ui(audited_demo):
    """`sidecar-ops ui --detach` on the demo; stopped (with everything it started) at the end."""
    with detached_ui(audited_demo) as url:
        yield url, audited_demo


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (scripts/setup.sh installs it)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        yield browser
        browser.close()


@pytest.fixture
def new_page(browser):
    """`new_page(base)`: a `Page` on the UI at `base`, closed when the test ends. A page left open keeps
    polling the webserver (and Chromium keeps rendering it) through the module's later tests."""
    pages: list[Page] = []

    def open_page(base: str) -> Page:
        pages.append(Page(browser, base))
        return pages[-1]

    yield open_page
    for page in pages:
        page.page.close()


class Page:
    """A browser page on the UI that records console errors and load times."""

    def __init__(self, browser, base: str):
        self.page = browser.new_page(viewport={"width": 1500, "height": 1100})
        self.base, self.errors, self.load_seconds = base, [], {}
        self.pop_up_closed = False
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)

    def open(self, path: str, ready: str) -> None:
        started = time.monotonic()
        self.page.goto(self.base + path)
        self.page.get_by_text(ready).first.wait_for(timeout=60_000)  # the UI polls: wait for content, not idle
        self.load_seconds[path] = round(time.monotonic() - started, 2)
        # The community pop-up of a first visit: it can open a moment after the page (later on a busy machine).
        skip = self.page.get_by_role("button", name="Skip")
        try:
            skip.first.wait_for(timeout=500 if self.pop_up_closed else 5000)
            skip.first.click()
            self.pop_up_closed = True
        except PlaywrightTimeout:  # no pop-up this time
            pass

    def leave(self) -> None:
        """Leave the UI while the test waits on the backend: an open page keeps polling the webserver and
        Chromium keeps rendering it (an eighth of a core between them, measured on a job page)."""
        self.page.goto("about:blank")

    def text_when(self, expected: list[str], timeout: float) -> str:
        """The page's text once it holds every `expected` string, or as it is after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not all(line in (text := self.page.inner_text("body")) for line in expected):
            if time.monotonic() > deadline:
                break
            self.page.wait_for_timeout(250)
        return text

    def shot(self, name: str) -> None:
        if SCREENSHOTS:
            self.page.wait_for_timeout(1000)  # let dialogs finish opening
            Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(SCREENSHOTS, f"{name}.png")), full_page=True)


def test_an_auditor_sees_the_truth_in_the_ui(ui, new_page):
    base, workdir = ui
    page = new_page(base)

    page.open("/assets/sample/audit?view=checks", "dataset_audit")
    expected = [
        "sample FAILED: 1 of 2 shard(s) failed a check",  # the verdict first
        f"{DAMAGED}: verify_512:keys_match",  # the failing shard, by name (a link to its page)
        "512: 2 built, 1 verified, 10 valid + 2 invalid rows",  # the totals
    ]
    text = page.text_when(expected, timeout=30)  # the page fills in as its queries answer
    for line in expected:
        assert line in text
    page.shot("audit-check")

    page.open("/assets/sample/crop_bbox", "Overlay pictures")
    page.page.get_by_text("[Show Markdown]").first.click()
    picture = page.page.locator("img[src^='data:image/webp']").first
    picture.wait_for(timeout=30_000)
    width = picture.evaluate("image => image.complete ? image.naturalWidth : 0")
    assert width >= 600
    page.shot("crop-bbox-overlay")

    # Launched from an asset page: the run carries the dataset tag (DatasetRunCoordinator). (An audit run does
    # not: it is not work on the shards, and must not wait behind the dataset's run limit.)
    page.open("/assets/sample/crop_bbox?partition=part-00000.parquet", "Materialize")
    page.page.get_by_role("button", name="Materialize").first.click()
    # Waits for the launch's own answer, not a fixed time: the webserver creates and submits the run within
    # that request (one CI, with an image built beside it, took over 60 s to answer).
    with page.page.expect_response(answer_to("LaunchPipelineExecution"), timeout=300_000) as answer:
        page.page.get_by_role("button", name="Launch 1 run").click()
    launched = answer.value.json()["data"]["launchPipelineExecution"]
    assert launched["__typename"] == "LaunchRunSuccess", f"no run was launched from the asset page: {launched}"
    with dg.DagsterInstance.from_config(str(workdir / "dagster_home")) as instance:
        run = instance.get_run_by_id(launched["run"]["id"])
        assert run is not None and run.job_name == "__ASSET_JOB"
        # The coordinator tags a run as it submits it (the run exists, NOT_STARTED, a moment before).
        assert run.status != dg.DagsterRunStatus.NOT_STARTED
        assert run.tags.get(DATASET_TAG) == "sample"

    project_errors = [e for e in page.errors if "Failed to load resource" not in e]
    assert project_errors == [], project_errors
    print("page load seconds:", page.load_seconds)


def answer_to(mutation: str) -> Callable[[Any], bool]:
    """Whether a response is the webserver's answer to the UI's GraphQL `mutation` (LaunchPipelineExecution:
    a run launched; LaunchPartitionBackfill: a backfill)."""

    def answers(response) -> bool:
        return "graphql" in response.url and mutation in (response.request.post_data or "")

    return answers


STATUSES = {
    "check": ["Execution Failed", "Failed", "In Progress", "Missing", "Skipped", "Passed"],
    "asset": ["Failed", "Materialized", "Materializing", "Missing"],
}


def shards_with_status(page: Page, path: str, kind: str, status: str, shards: list[str]) -> list[str]:
    """The shards a Partitions tab lists with only the `status` filter ticked (the UI's status preset)."""
    if kind == "check":
        page.open(path, "Execution history")
        page.page.get_by_role("tab", name="Partitions").last.click()  # the check's tab, not the asset's
    else:
        page.open(path, "Partitions Selected")
    page.page.get_by_text("Partitions Selected").first.wait_for(timeout=30_000)
    count = 0
    for other in STATUSES[kind]:
        box = page.page.get_by_text(re.compile(rf"^{re.escape(other)} \(\d+\)$"))
        box.first.wait_for(timeout=30_000)
        if other == status:
            count = int(re.findall(r"\d+", box.first.text_content() or "")[-1])
        else:
            box.first.click()
    # The list is the union of the ticked statuses: once it holds as many rows as `status` counts, every
    # other status is filtered out (the clicks apply asynchronously, so wait for that, not for a time).
    # (The check page's list of checks is a table too: count the partitions' rows alone.)
    rows = page.page.locator("[class*='VirtualizedTable_row'] [class*='MiddleTruncate_measure']")
    partition_rows = rows.filter(has_text=re.compile(r"\.parquet$"))
    wait_until(lambda: partition_rows.count() == count, 30, f"{path}: {count} shard(s) listed as {status}",
               interval=0.25, detail=lambda: partition_rows.all_text_contents())  # fmt: skip
    listed = partition_rows.all_text_contents()
    return [rel for rel in shards if rel in listed]


def settled(instance: dg.DagsterInstance, limit_s: float = 300) -> None:
    """Return once the running automation sensor has answered the last run (`automation_caught_up`)."""
    wait_until(lambda: automation_caught_up(instance, KEYS.automation_sensor), limit_s,
               "the automation sensor to answer the last run", interval=1)  # fmt: skip


def around(text: str, word: str) -> str:
    """The part of a page's text where `word` first appears (the whole text is too long to read)."""
    at = max(text.find(word), 0)
    return text[max(at - 200, 0) : at + 400]


def check_partitions(name: str, asset: str = "verify_512") -> str:
    return f"/assets/sample/{asset}?view=checks&checkDetail={name}"


def test_each_shard_of_a_batch_shows_its_own_truth_and_a_repair_clears_it(ui, new_page):
    base, workdir = ui
    page = new_page(base)
    shards = ["part-00000.parquet", DAMAGED]
    # The damaged shard alone: its verifier check failed, its crop_bbox failed (refused, in a failed run)
    # and its sidecar checks did not run in that run; the restated neighbour is green everywhere.
    assert shards_with_status(page, check_partitions("keys_match"), "check", "Failed", shards) == [DAMAGED]
    assert shards_with_status(page, check_partitions("keys_match"), "check", "Passed", shards) == [shards[0]]
    assert shards_with_status(page, "/assets/sample/crop_bbox?view=partitions", "asset", "Failed", shards) == [DAMAGED]
    # Its verification failed: not materialised, so its verifier reads Failed too (one thing about the shard).
    assert shards_with_status(page, "/assets/sample/verify_512?view=partitions", "asset", "Failed", shards) == [DAMAGED]
    assert shards_with_status(
        page, check_partitions("boxes_valid", "crop_bbox"), "check", "Execution Failed", shards
    ) == [DAMAGED]
    page.shot("batch-failed-preset")
    page.open("/assets/sample/audit?view=checks", "dataset_complete")
    # The check list shows the names before their statuses: wait for the status itself.
    text = page.text_when(["dataset_audit\nFailed"], timeout=30)
    assert "dataset_audit\nFailed" in text, around(text, "dataset_audit")
    page.shot("batch-audit-before-repair")

    # The repair: the damaged resized shard is rebuilt by a batch over both, then the audit runs.
    page.leave()
    config = load_config(workdir / "datasets.yaml")
    defs = build_definitions(config)
    Path(config.dataset("sample").output("resized_512").child(DAMAGED)).unlink()
    with dg.DagsterInstance.from_config(str(workdir / "dagster_home")) as instance:
        assert run_batch(defs, instance).success
        # The running automation sensor may answer the repair with runs of its own: the audit is read
        # once the deployment is idle (else it rightly says "under way" and "not verified yet").
        settled(instance)
        defs.resolve_job_def(KEYS.audit_job).execute_in_process(instance=instance, run_config=QUIET)
    for path, kind in [
        (check_partitions("keys_match"), "check"),
        (check_partitions("boxes_valid", "crop_bbox"), "check"),
        ("/assets/sample/crop_bbox?view=partitions", "asset"),
        ("/assets/sample/verify_512?view=partitions", "asset"),
    ]:
        failed = [status for status in ("Failed", "Execution Failed") if status in STATUSES[kind]]
        for status in failed:
            assert shards_with_status(page, path, kind, status, shards) == [], (path, status)
    assert shards_with_status(page, check_partitions("keys_match"), "check", "Passed", shards) == shards
    page.open("/assets/sample/audit?view=checks", "dataset_complete")
    text = page.text_when(["dataset_audit\nSucceeded", "dataset_complete\nSucceeded"], timeout=30)
    assert "dataset_audit\nSucceeded" in text and "dataset_complete\nSucceeded" in text, around(text, "dataset_audit")
    page.shot("batch-after-repair")


def test_ui_finds_the_demo_run_from_this_folder_into_another_workdir(tmp_path, monkeypatch):
    """The README: `sidecar-ops demo --workdir D`, then `sidecar-ops ui` from the same folder browses D."""
    import argparse

    from fixed_res_sidecar.cli import ui as ui_command

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    workdir = elsewhere / "my-demo"
    workdir.mkdir(parents=True)
    here.mkdir()
    (workdir / "datasets.yaml").write_text("datasets: []\n")
    monkeypatch.chdir(here)
    args = argparse.Namespace(datasets=None, workdir=None, dagster_home=None)
    with pytest.raises(ValueError, match="no datasets file"):
        ui_command.where(args)

    demo.remember_demo(here, workdir, workdir / "dagster_home")
    assert ui_command.where(args) == (workdir / "datasets.yaml", workdir / "dagster_home")
    monkeypatch.chdir(elsewhere)  # another folder: not that demo
    with pytest.raises(ValueError, match="no datasets file"):
        ui_command.where(args)
