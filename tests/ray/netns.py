"""What the Ray tests share: Ray will not run on loopback, so each scenario (a module of this
folder that prints one JSON line of findings) runs inside a network namespace the test makes,
a test host of its own whose only non-loopback address is on one end of a veth pair. Needs root
and iproute2 (.ci/run has both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# The replicas' command: a tiny HTTP server that names its replica.
SERVER = """
import json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({
            "replica": os.environ["FLEETSERVE_REPLICA_ID"],
            **{k: os.environ.get(k) for k in (
                "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE",
                "SKYPILOT_NODE_RANK", "SKYPILOT_CLUSTER_INFO",
            )},
        }).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
print("replica", os.environ["FLEETSERVE_REPLICA_ID"], "serving on", os.environ["PORT"], flush=True)
ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
"""


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def run_scenario(module: str, work: Path, address: str, timeout: int) -> dict[str, Any]:
    """Run `python -m module work` in a namespace of its own with `address` (a /24) on its
    veth end; return the JSON of its last line. Whatever it leaves running there is killed,
    and the namespace and the veth pair are removed."""
    tag = uuid.uuid4().hex[:6]
    ns, outer, inner = f"fsns{tag}", f"fso{tag}", f"fsi{tag}"
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _sh("ip", "link", "set", inner, "netns", ns)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", inner)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        _sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "dev", inner)
        env = dict(
            os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        )
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-m", module, str(work)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        found: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        print("\n" + json.dumps(found, indent=1))
        return found
    finally:
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10
        ).stdout.split()
        for pid in pids:  # anything the scenario left in its namespace
            subprocess.run(["kill", "-9", pid], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
