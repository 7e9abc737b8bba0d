"""shards/pipeline.py: the job a process pool runs per shard (the stages themselves are tested through
the Dagster layer, defs/test_assets.py, and the CLI)."""

import pickle
import subprocess
import sys

from fixed_res_sidecar.io.locations import Location
from fixed_res_sidecar.shards.pipeline import PipelineOptions, Stages, StagesJob
from fixed_res_sidecar_tests.fixtures.datasets import layout_of, resized_outputs

# Runs a pickled job on one shard in a fresh interpreter, as a spawned pool worker does, and says what it
# built and whether anything of Dagster was imported on the way.
IN_A_WORKER = """
import pickle, sys
job = pickle.loads(sys.stdin.buffer.read())
outcome = job(sys.argv[1])
print(outcome.resized.rows, outcome.reports["512"].passed, outcome.problems())
print(sorted(m for m in sys.modules if m == "dagster" or m.startswith(("dagster.", "fixed_res_sidecar.defs"))))
"""


def test_a_pickled_job_builds_and_verifies_its_shard_in_a_fresh_process_without_dagster(sample_main, tmp_path):
    layout = layout_of(sample_main, resized_outputs(tmp_path / "out"), reports=Location.parse(tmp_path / "reports"))
    job = StagesJob(layout, Stages(resize=("512",), verify=("512",)), PipelineOptions(), gates={}, rebuilds={})
    rel = sample_main.list_shards()[0]
    done = subprocess.run(
        [sys.executable, "-c", IN_A_WORKER, rel], input=pickle.dumps(job), capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()
    built, imported = done.stdout.decode().splitlines()
    assert built == "10 True []"
    assert imported == "[]"  # a pool worker of a Dagster run imports Dagster only for its fence's instance
