"""The ray infra against a real Ray cluster (a head and three workers in zones a, b and c).

Ray will not run on loopback, so the whole scenario (tests/ray/scenario.py: cluster,
controller, load balancer, requests) runs inside a network namespace this test makes
(tests/ray/netns.py). Needs root and iproute2 (.ci/run has both).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.ray.netns import run_scenario

pytestmark = [pytest.mark.slow]

if os.geteuid() != 0 or shutil.which("ip") is None:  # never skipped in CI, which runs as root
    pytest.fail("the Ray tests need root and iproute2 (a network namespace)", pytrace=False)


def test_ray_replicas_zones_node_loss_and_adoption(tmp_path: Path) -> None:
    found = run_scenario("tests.ray.scenario", tmp_path, "10.213.0.2", timeout=420)
    assert found["pair_statuses"] == ["READY", "READY"]  # concurrent first launches
    # Spot: one replica in each spot zone (a, c), on a node of that zone; never on b.
    assert found["spot_replicas"] == [["a", True, "a"], ["c", True, "c"]]
    assert found["spot_placer"]["placer"] == "dynamic_fallback"
    # A pool on Ray: 6 jobs on 2 workers, every rank once, logs read from the worker's node.
    assert found["pool_job_statuses"] == ["SUCCEEDED"]
    assert found["pool_ranks"] == list(range(6)) and found["pool_workers_used"] == 2
    assert "rank 0 on" in found["pool_job_log"]
    # SkyPilot's task variables: a job on its worker's node, no GPU asked for.
    assert " ips 10.213." in found["pool_job_log"] and " gpus 0" in found["pool_job_log"]
    answer = found["pinned_answer"]
    assert answer["SKYPILOT_NODE_IPS"] == found["pinned_replica_host"]  # its node's address
    assert answer["SKYPILOT_NUM_NODES"] == "1" and answer["SKYPILOT_NODE_RANK"] == "0"
    assert answer["SKYPILOT_NUM_GPUS_PER_NODE"] == "0"
    assert '"cloud": "ray"' in answer["SKYPILOT_CLUSTER_INFO"]
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
