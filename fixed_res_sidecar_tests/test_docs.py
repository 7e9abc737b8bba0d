"""Every shell command the README and docs/*.md show runs in a test, in CI or in the benchmark.

`RUN_BY` maps each command, as the docs write it (comment removed, blanks collapsed, split at `&&`), to
where it runs: a test (`path::function`), or a script that holds the line as written (`.ci/run`). A
block that a test reads from the docs and runs as written (`fixtures/docs.documented_block`) is in
`BLOCKS_RUN_BY`. A new or changed command that neither names fails here; so does an entry naming a test
that does not exist, or a command the docs no longer show. `NOT_RUN_HERE` holds the few that cannot run
on this machine, each with why.
"""

import ast
import json
import os
import re
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from fixed_res_sidecar.io.s3 import s3_client
from fixed_res_sidecar_tests.conftest import work_order
from fixed_res_sidecar_tests.fixtures.docs import FENCE, REPO, documented_block, documented_blocks
from fixed_res_sidecar_tests.fixtures.signals import sigint_ignored

TEST_BUILD = "fixed_res_sidecar_tests/cli/test_build.py"
BUILD_CMD = (
    "sidecar-ops build-0-262mp --main-prefix s3://bucket/main/ds/ --output-prefix s3://bucket/0_262mp_version_all_in_one/ds/"
    " --key-column image_key --audit-prefix 0_26mp_process --patch-size 32 --use-ray --skip-existing --max-inflight 32"
    " --task-cpus 4 --task-memory-gb 12 --threads-per-shard 4 --output-format webp --quality 95"
)
RUN_BY = {
    # README.md, docs/testing.md
    "bash scripts/setup.sh": ".ci/run",
    "python3 -m pytest -q fixed_res_sidecar_tests": ".ci/run",
    "sidecar-ops demo": "fixed_res_sidecar_tests/test_demo.py::test_demo_builds_every_shard_then_skips_finished_work",
    'python3 -m pytest -q -m "not slow" fixed_res_sidecar_tests': (
        "fixed_res_sidecar_tests/test_docs.py::test_the_documented_test_commands_select_their_tests"
    ),
    "python3 -m pytest -q fixed_res_sidecar_tests/defs/test_ledger.py": (
        "fixed_res_sidecar_tests/test_docs.py::test_the_documented_test_commands_select_their_tests"
    ),
    "sidecar-ops ui --detach": "fixed_res_sidecar_tests/cli/test_ui.py::ui",
    "sidecar-ops ui --detach ... / sidecar-ops ui --stop ...": "fixed_res_sidecar_tests/cli/test_ui.py::ui",
    # The command data teams run: test_build runs it on local folders without --use-ray, and the Ray
    # tests run it with --use-ray on a cluster (test_deploy_ray_cluster.py).
    BUILD_CMD: f"{TEST_BUILD}::test_the_documented_command_builds_every_shard",
    # docs/cli.md's synopses (M, O, A, B, S stand for prefixes)
    "sidecar-ops build-0-262mp --main-prefix M --output-prefix O [options]": (
        f"{TEST_BUILD}::test_the_documented_command_builds_every_shard"
    ),
    "sidecar-ops build-both --main-prefix M --output-prefix-512 A --output-prefix-1024 B [options]": (
        f"{TEST_BUILD}::test_fused_command_builds_both_resolutions"
    ),
    "sidecar-ops build-crop-bbox --main-prefix M --resized-512-prefix A --resized-1024-prefix B --output-prefix S"
    " --key-column image_key [options]": (
        "fixed_res_sidecar_tests/cli/test_crop_bbox.py::test_through_the_sidecar_ops_dispatcher"
    ),
    "sidecar-ops verify-resized --main-prefix M --output-prefix O --key-column image_key --audit-prefix 0_26mp_process"
    " --report verify-512.json": (
        "fixed_res_sidecar_tests/cli/test_verify.py::test_verify_resized_passes_and_writes_the_full_report"
    ),
    "sidecar-ops verify-crop-bbox --main-prefix M --resized-512-prefix A --resized-1024-prefix B --sidecar-prefix S"
    " --key-column image_key --overlay-dir overlays/": (
        "fixed_res_sidecar_tests/cli/test_verify.py::test_verify_crop_bbox_passes_with_overlays"
    ),
    # docs/dagster.md
    "dagster job backfill -w workspace.yaml -j sample__build_shards --partitions"
    " 'part-00000.parquet,2026/12/part-00002.parquet' --noprompt": (
        "fixed_res_sidecar_tests/test_deploy_instance.py::test_the_documented_dagster_commands_build_their_shards"
    ),
    "dagster asset materialize -m fixed_res_sidecar.defs.definitions --select 'sample/resized_512,sample/resized_1024'"
    " --partition part-00000.parquet": (
        "fixed_res_sidecar_tests/test_deploy_instance.py::test_the_documented_dagster_commands_build_their_shards"
    ),
    # docs/image.md
    "bash scripts/build_image.sh": "fixed_res_sidecar_tests/test_image.py::image",
    'podman run --rm --network none -v "$PWD/data:/data" localhost/fixed-res-sidecar sidecar-ops build-both'
    " --main-prefix /data/main --output-prefix-512 /data/512 --output-prefix-1024 /data/1024": (
        "fixed_res_sidecar_tests/test_image.py::test_build_both_runs_inside_the_image_on_a_local_dataset"
    ),
    'podman run --rm --network none -v "$PWD/demo:/data" localhost/fixed-res-sidecar sidecar-ops demo'
    " --workdir /data/demo": "fixed_res_sidecar_tests/test_image.py::test_the_demo_runs_inside_the_image",
    # docs/operations.md: the command submitted to a cluster's job server
    "ray job submit --address http://ray-head.example:8265 -- sidecar-ops build-both --main-prefix"
    " s3://bucket/main/my_dataset/ --output-prefix-512 s3://bucket/0_262mp_version_all_in_one/my_dataset/"
    " --output-prefix-1024 s3://bucket/1_05mp_version_all_in_one/my_dataset/ --use-ray --skip-existing"
    " --max-inflight 256 --task-cpus 4 --threads-per-shard 4 --task-memory-gb 8": (
        "fixed_res_sidecar_tests/test_deploy_ray_cluster.py::test_the_cli_submitted_as_a_ray_job_builds_every_shard"
    ),
}
# (doc, the block's first command) -> the test that reads the block from the doc and runs it as written.
BLOCKS_RUN_BY = {
    ("docs/operations.md", "cat > lifecycle.json <<'JSON'"): (
        "fixed_res_sidecar_tests/test_docs.py::test_the_documented_lifecycle_rule_is_set_by_the_aws_cli"
    ),
}
NOT_RUN_HERE = {
    # A foreground `dagster dev`: the tests run the same server detached (`--detach`, then `--stop`).
    "sidecar-ops ui": "foreground until Ctrl-C; the tests run it with --detach and --stop (test_ui.py::ui)",
    "sidecar-ops ui --datasets /path/to/datasets.yaml": "the tests give the demo's folder (--workdir), not a file",
    "BASE_IMAGE=python:3.11-slim bash scripts/build_image.sh": "needs an image registry, which CI cannot reach",
    "CONTAINER_ENGINE=docker BASE_IMAGE=python:3.11-slim SIDECAR_IMAGE=registry.example.com/sidecar bash"
    " scripts/build_image.sh": "needs docker and an image registry",
    "docker push registry.example.com/sidecar:latest": "needs docker and an image registry",
    "podman run -d --network host --shm-size 8g localhost/fixed-res-sidecar ray start --head --block --port 6379"
    " --dashboard-host 0.0.0.0": "a Ray head on fixed host ports; the Ray tests start nodes with `ray start` outside it",
    "podman run -d --network host --shm-size 8g localhost/fixed-res-sidecar ray start --block --address HEAD:6379": (
        "a Ray worker node joining a head on another machine"
    ),
    # docs/dagster.md's manual PostgreSQL steps: fixed ports (5432, 3030, 3000), as a user other than root;
    # the deployment fixture runs the same servers with the same arguments on free ports.
    **dict.fromkeys(
        [
            "PG=$(ls -d /usr/lib/postgresql/*/bin | tail -1); mkdir -p /tmp/sidecar-pg",
            "$PG/initdb -D /tmp/sidecar-pg/data -U postgres --auth=trust",
            "$PG/postgres -D /tmp/sidecar-pg/data -h 127.0.0.1 -p 5432 -k /tmp/sidecar-pg &",
            "$PG/createdb -h 127.0.0.1 -U postgres dagster",
            "export DAGSTER_PG_HOST=127.0.0.1 DAGSTER_PG_USERNAME=postgres DAGSTER_PG_PASSWORD=unused DAGSTER_PG_DB=dagster",
            "export DAGSTER_HOME=~/sidecar-prod SIDECAR_DATASETS=$PWD/datasets.yaml",
            "mkdir -p $DAGSTER_HOME",
            'python3 -c \'import sys, yaml; c = yaml.safe_load(open("deploy/dagster.yaml")); [c.pop(k) for k in'
            ' ("run_launcher", "compute_logs")]; c["run_monitoring"]["max_runtime_seconds"] = 3600;'
            " yaml.safe_dump(c, sys.stdout)' > $DAGSTER_HOME/dagster.yaml",
            "sed 's/host: fixed-res-sidecar-code/host: 127.0.0.1/' deploy/workspace.yaml > $DAGSTER_HOME/workspace.yaml",
            "dagster api grpc --module-name fixed_res_sidecar.defs.definitions --host 127.0.0.1 --port 3030 &",
            "dagster-daemon run -w $DAGSTER_HOME/workspace.yaml &",
            "dagster-webserver -w $DAGSTER_HOME/workspace.yaml -p 3000",
        ],
        "fixed ports and a non-root user; fixtures/postgres.py and fixtures/dagster_deployment.py run these servers",
    ),
}


@cache
def definitions_in(path: str) -> set[str]:
    """Names of the functions a module defines (tests and fixtures)."""
    tree = ast.parse((REPO / path).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def runs_it(target: str, command: str) -> str | None:
    """Why `target` does not run `command` (None: it does)."""
    path, _, name = target.partition("::")
    if not (REPO / path).is_file():
        return f"{path} does not exist"
    if not name:  # a script: it holds the line as written
        return None if command in (REPO / path).read_text() else f"{path} does not hold the line"
    return None if name in definitions_in(path) else f"{path} defines no {name}"


def test_every_documented_command_runs_somewhere():
    in_blocks = {(path, first) for path, first in BLOCKS_RUN_BY}
    problems = []
    for block in documented_blocks():
        commands = block.commands
        if any(block.path == path and commands[0].startswith(first) for path, first in in_blocks):
            continue
        for command in commands:
            if command in NOT_RUN_HERE:
                continue
            target = RUN_BY.get(command)
            why = runs_it(target, command) if target else "no test runs it: add one, and name it in RUN_BY"
            if why:
                problems.append(f"{block.path}:{block.line}: {command}\n    {why}")
    assert not problems, "\n".join(problems)


def test_every_entry_names_a_command_the_docs_show_and_a_test_that_exists():
    shown = {command for block in documented_blocks() for command in block.commands}
    assert not (set(RUN_BY) | set(NOT_RUN_HERE)) - shown, "commands the docs no longer show"
    for (path, first), target in BLOCKS_RUN_BY.items():
        block = documented_block(path, first)
        assert runs_it(target, first) is None, target
        test_path = target.split("::")[0]
        assert f'documented_block("{path}", "{first}")' in (REPO / test_path).read_text(), (
            f"{target} does not read {path}'s block from the doc"
        )
        assert block.commands


@pytest.mark.slow  # two collections of the whole suite in new processes: kept out of the developer loop
def test_the_documented_test_commands_select_their_tests():
    """The fast tier's command selects tests and none of the slow tier; the one-module command selects that
    module. Collected, not run (this suite runs inside the full command, which `.ci/run` runs)."""
    # Collected without assertion rewriting, which only a run needs (half a collection's CPU).
    env = {**os.environ, "PYTEST_ADDOPTS": "--collect-only -n 0 --assert=plain"}
    fast = subprocess.run(
        ["python3", "-m", "pytest", "-q", "-m", "not slow", "fixed_res_sidecar_tests"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    collected = [line for line in fast.stdout.splitlines() if "::" in line]
    assert fast.returncode == 0 and collected, fast.stdout[-2000:] + fast.stderr[-2000:]
    assert "fixed_res_sidecar_tests/test_docs.py::test_commands_are_read_as_the_docs_write_them" in collected
    assert "fixed_res_sidecar_tests/test_docs.py::test_the_documented_test_commands_select_their_tests" not in collected
    slow_modules = ("test_deploy_instance.py", "test_deploy_ray_cluster.py", "test_image.py", "cli/test_ui_operator.py")
    assert not [line for line in collected if line.split("::")[0].endswith(slow_modules)]
    assert (
        "fixed_res_sidecar_tests/cli/test_ui.py::test_an_auditor_sees_the_truth_in_the_ui" not in collected
    )  # a browser
    assert any(
        line.startswith("fixed_res_sidecar_tests/cli/test_ui.py::") for line in collected
    )  # `sidecar-ops ui` alone
    one = subprocess.run(
        ["python3", "-m", "pytest", "-q", "fixed_res_sidecar_tests/defs/test_ledger.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    modules = {line.split("::")[0] for line in one.stdout.splitlines() if "::" in line}
    assert one.returncode == 0 and modules == {"fixed_res_sidecar_tests/defs/test_ledger.py"}, one.stdout[-2000:]


def test_the_documented_lifecycle_rule_is_set_by_the_aws_cli(s3_env, s3_bucket, tmp_path):
    """docs/operations.md's block as written (BUCKET named), with the real `aws` command line (awscli, pinned
    in the test extra) on the test's S3 server: the rule is set, and the open upload is listed."""
    block = documented_block("docs/operations.md", "cat > lifecycle.json <<'JSON'")
    open_key = "1_05mp_version_all_in_one/sample/part-0.parquet"
    s3_client().create_multipart_upload(Bucket=s3_bucket, Key=open_key)
    script = block.text.replace("BUCKET", s3_bucket)

    first = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    # No rule before: the get says so (and the block goes on); then the put sets it.
    assert "NoSuchLifecycleConfiguration" in first.stderr, first.stderr
    (rule,) = s3_client().get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]
    assert rule["ID"] == "abort-incomplete-multipart-uploads" and rule["Status"] == "Enabled"
    assert rule["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
    listed = json.loads(first.stdout[first.stdout.index("{") :])
    assert [upload["Key"] for upload in listed["Uploads"]] == [open_key]

    again = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr  # now the get shows the rule the put replaces
    assert again.stdout.count('"abort-incomplete-multipart-uploads"') == 1


def test_commands_are_read_as_the_docs_write_them(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n```bash\nsetup && run --a 'x # not a comment' \\\n  --b 2   # a comment\ncat > f <<'END'\n"
        "body && not a command\nEND\n```\n  ```yaml\nkey: value\n  ```\n- item\n  ```sh\n  one\n  ```\n"
    )
    blocks = documented_blocks([doc])
    assert [b.commands for b in blocks] == [["setup", "run --a 'x # not a comment' --b 2", "cat > f <<'END'"], ["one"]]
    assert Path(blocks[1].path).name == "doc.md" and blocks[0].line == 3


MARKDOWN = [
    REPO / "README.md",
    REPO / "ARCHITECTURE.md",
    REPO / "benchmarks" / "README.md",
    *(REPO / "docs").glob("*.md"),
]
SECTION_LINK = re.compile(r"\]\((?P<file>[^)#\s]*)#(?P<anchor>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t]*$", re.MULTILINE)


def prose(path: Path) -> str:
    """A Markdown file without its fenced blocks (a shell comment there is no heading)."""
    return FENCE.sub("", path.read_text())


def github_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_every_link_to_a_section_names_a_heading_that_exists():
    anchors = {path: {github_anchor(m["title"]) for m in HEADING.finditer(prose(path))} for path in MARKDOWN}
    assert "10000-100000-shards-on-ray-or-kubernetes" in anchors[REPO / "docs" / "operations.md"]
    broken = []
    for path in MARKDOWN:
        for link in SECTION_LINK.finditer(prose(path)):
            target = (path.parent / link["file"]).resolve() if link["file"] else path
            if target.suffix == ".md" and link["anchor"] not in anchors.get(target, set()):
                broken.append(f"{path.relative_to(REPO)}: ({link['file']}#{link['anchor']})")
    assert not broken, broken


@pytest.mark.slow  # a pytest run in a new process
def test_the_suite_reports_each_tests_cpu_when_asked(tmp_path):
    """docs/testing.md: SIDECAR_TEST_CPU=FILE appends one line per test: CPU seconds, wall seconds, test id."""
    report = tmp_path / "cpu.tsv"
    env = {**os.environ, "SIDECAR_TEST_CPU": str(report), "PYTEST_ADDOPTS": "-n 0"}
    done = subprocess.run(
        ["python3", "-m", "pytest", "-q", "fixed_res_sidecar_tests/defs/test_ledger.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split("\t") for line in report.read_text().splitlines()]
    passed = int(re.search(r"(\d+) passed", done.stdout)[1])
    assert len(rows) == passed > 0
    assert all(float(cpu) >= 0 and float(wall) >= 0 for cpu, wall, _ in rows)
    assert {test.split("::")[0] for _, _, test in rows} == {"fixed_res_sidecar_tests/defs/test_ledger.py"}


# Stops at SIGTERM as Dagster's servers do: their SIGTERM handler is whatever SIGINT's is.
LIKE_A_DAGSTER_SERVER = "import signal, time; signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT)); print(flush=True); time.sleep(600)"


def test_a_command_the_tests_start_stops_at_sigterm_as_dagsters_servers_do():
    """docs/testing.md: the tests' commands get SIGINT as from a terminal (fixtures/signals.py), so a Dagster
    server they start stops at SIGTERM instead of ignoring it until SIGKILL."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    child = subprocess.Popen([sys.executable, "-c", LIKE_A_DAGSTER_SERVER], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"\n"  # its handler is set
        child.terminate()
        assert child.wait(timeout=60) == -signal.SIGINT  # KeyboardInterrupt: Python ends by SIGINT
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow  # a pytest run in a new process
def test_a_run_started_with_sigint_ignored_gives_its_commands_sigint_as_from_a_terminal():
    """As a script's background job (`pytest ... &`, many CI runners) starts pytest: SIGINT ignored."""
    done = subprocess.run(
        ["python3", "-m", "pytest", "-q", "-n", "0",
         "fixed_res_sidecar_tests/test_docs.py::test_a_command_the_tests_start_stops_at_sigterm_as_dagsters_servers_do"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        preexec_fn=sigint_ignored,
    )  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_slow_single_tests_are_collected_before_the_quick_ones(request):
    """conftest.py: among the tests of no xdist group, the slow ones come first in the collection (so in
    `work_order`), those of the package's top-level modules first among them; the quick ones after. In
    the fast tier there are none to move."""
    singles = [item for item in request.session.items if not item.get_closest_marker("xdist_group")]
    slow = [item.get_closest_marker("slow") is not None for item in singles]
    assert slow == sorted(slow, reverse=True)
    deep = [item.nodeid.count("/") > 1 for item, is_slow in zip(singles, slow) if is_slow]
    assert deep == sorted(deep)  # fixed_res_sidecar_tests/test_x.py::... first


def test_the_workers_get_the_lanes_first_then_single_tests_with_the_other_groups_spread_among_them():
    """docs/testing.md: the order in which pytest-xdist's workers get their work (conftest.py)."""
    singles = [f"fixed_res_sidecar_tests/cli/test_build.py::test_{i}" for i in range(40)]
    groups = ["fixed_res_sidecar_tests.cli.test_ui", "fixed_res_sidecar_tests.test_image"]
    order = work_order(["deployments-2", groups[0], *singles[:10], "deployments-1", groups[1], *singles[10:]])
    assert order[:2] == ["deployments-2", "deployments-1"]
    assert [scope for scope in order if "::" in scope] == singles  # in their order (the collection's)
    assert order.index(groups[0]) == 2 and order.index(groups[1]) == 2 + 1 + 10  # the second after a quarter
    assert sorted(order) == sorted(["deployments-1", "deployments-2", *groups, *singles])
