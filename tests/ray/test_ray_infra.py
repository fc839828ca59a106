"""The ray infra against a real Ray cluster (a head and three workers in zones a, b and c).

Ray will not run on loopback, so the whole scenario (cluster, controller, load balancer,
requests) runs inside a network namespace this test makes: a test host of its own, whose only
non-loopback address is on one end of a veth pair. Needs root and iproute2 (.ci/run has both).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

if os.geteuid() != 0 or shutil.which("ip") is None:  # never skipped in CI, which runs as root
    pytest.fail("the Ray tests need root and iproute2 (a network namespace)", pytrace=False)

SCENARIO = Path(__file__).with_name("scenario.py")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def test_ray_replicas_zones_node_loss_and_adoption(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    ns, outer, inner = f"fsray{tag}", f"fsa{tag}", f"fsb{tag}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", "10.213.0.2/24", "dev", inner)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "dev", inner)
        env = dict(
            os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        )
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, str(SCENARIO), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=420,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        print("\n" + json.dumps(found, indent=1))
    finally:
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10
        ).stdout.split()
        for pid in pids:  # anything the scenario left in our namespace
            subprocess.run(["kill", "-9", pid], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    assert found["pair_statuses"] == ["READY", "READY"]  # concurrent first launches
    # Spot: one replica in each spot zone (a, c), on a node of that zone; never on b.
    assert found["spot_replicas"] == [["a", True, "a"], ["c", True, "c"]]
    assert found["spot_placer"]["placer"] == "dynamic_fallback"
    # A pool on Ray: 6 jobs on 2 workers, every rank once, logs read from the worker's node.
    assert found["pool_job_statuses"] == ["SUCCEEDED"]
    assert found["pool_ranks"] == list(range(6)) and found["pool_workers_used"] == 2
    assert "rank 0 on" in found["pool_job_log"]
    assert found["pinned_answer"]["replica"] == "1"
    assert found["pinned_node_is_b"] is True  # placed in the zone it asked for
    assert "replica 1 serving on" in found["pinned_log"]
    assert found["lost_detected_after_s"] is not None and found["lost_detected_after_s"] < 15
    assert found["replaced_after_s"] is not None
    assert found["roaming_first_node"] in ("a", "c")
    assert found["replacement_node_differs"] is True
    assert "replica" in found["roaming_answer_after_replacement"]
    assert found["adopted_same_replicas"] is True and found["adoption_event"] is True
    assert found["actors_left"] == []  # down removed every actor
