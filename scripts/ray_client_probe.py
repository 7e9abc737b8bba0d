"""Probe: N Ray Client (ray://) connections, one after the other, to a fresh single-node head on this
host; counts the connections that fail and shows the logs of the per-client servers that died.

usage: PYTHONPATH=. python3 scripts/ray_client_probe.py N [--burn K] [ENV=VALUE ...]
  --burn K    keep K busy processes of its own running meanwhile (a loaded machine)
  ENV=VALUE   given to the head node, hence to its Ray Client server and per-client servers

The head runs in a cgroup v2 group of its own (needs root), killed with cgroup.kill at the end;
nothing is left. Findings and advice: docs/ray.md, "Ray Client".
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fixed_res_sidecar_tests.fixtures.ray_cluster import cgroup_pids, cgroup_root, free_ports

CLIENT = (
    "import ray; ray.init('ray://127.0.0.1:{port}'); print(ray.get(ray.remote(lambda: 1).remote())); ray.shutdown()"
)


def read(path: str) -> str:
    return Path(path).read_text(errors="replace")


def main(argv: list[str]) -> dict:
    connections, args, burn = int(argv[0]), argv[1:], 0
    if args[:1] == ["--burn"]:
        burn, args = int(args[1]), args[2:]
    extra = dict(a.split("=", 1) for a in args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)
    root = tempfile.mkdtemp(prefix="rcx-", dir="/tmp")
    group = cgroup_root() / Path(root).name
    group.mkdir()
    gcs, client = free_ports(2)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burn)]
    results = []
    try:
        start = ["ray", "start", "--head", f"--port={gcs}", f"--ray-client-server-port={client}", "--num-cpus=1",
                 "--include-dashboard=false", f"--temp-dir={root}", "--node-ip-address=127.0.0.1",
                 "--disable-usage-stats"]  # fmt: skip
        wrapper = ["/bin/sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "head"]
        subprocess.run(wrapper + start, env=env, check=True, capture_output=True, start_new_session=True)
        for _ in range(connections):
            began = time.monotonic()
            done = subprocess.run([sys.executable, "-c", CLIENT.format(port=client)], env=env, capture_output=True,
                                  text=True, timeout=180)  # fmt: skip
            last = done.stderr.strip().splitlines()[-1:] if done.returncode else []
            results.append({"rc": done.returncode, "seconds": round(time.monotonic() - began, 1), "error": last})
        logs = glob.glob(f"{root}/session_*/logs/ray_client_server_*")
        died = {Path(p).name: read(p)[-1500:] for p in logs if read(p).strip() and p.endswith(".err")}
        segfaults = [name for name, text in died.items() if "SIGSEGV" in text or "Segmentation fault" in text]
        return {"env": extra, "burn": burn, "connections": connections,
                "failed": sum(1 for r in results if r["rc"]), "results": results,
                "server_logs_with_segfault": segfaults, "server_error_logs": died}  # fmt: skip
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        (group / "cgroup.kill").write_text("1")
        while cgroup_pids(group):
            time.sleep(0.1)
        group.rmdir()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
