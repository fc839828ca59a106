"""High availability across hosts with the ray infra (docs/scaling.md): two controllers with
homes and host ids of their own on one PostgreSQL database, a service of two Ray replicas;
host A is lost (kill -9 of its controller and of its load balancer). Controller B takes over,
adopts the same two actors (none relaunched) and starts a load balancer of its own on the
service's port, and requests succeed again.

Like test_ray_infra.py, the scenario (tests/ray/ha_scenario.py: Ray cluster, PostgreSQL,
controllers, load balancers, requests) runs inside a network namespace this test makes, since
Ray will not run on loopback. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.ray.netns import run_scenario

pytestmark = [pytest.mark.slow]

if os.geteuid() != 0 or shutil.which("ip") is None:  # never skipped in CI, which runs as root
    pytest.fail("the Ray tests need root and iproute2 (a network namespace)", pytrace=False)


def test_a_controller_on_another_host_takes_over_ray_replicas(tmp_path: Path) -> None:
    started = time.monotonic()
    # The folder must be reachable by the postgres user (tests/pg.py runs the server as it).
    work = tmp_path / "work"
    work.mkdir()
    found = run_scenario("tests.ray.ha_scenario", work, "10.214.0.2", timeout=240)
    print(f"test took {time.monotonic() - started:.1f} s")
    assert found["b_role_before"] == "standby"
    assert len(found["home_ids"]) == 1 and found["b_joined"] is True  # B joined A's home id
    assert found["lb_host_before"] == "host-a"
    assert found["answer_before"] is not None and found["actors_before"] is True
    assert found["endpoint_down_after_kill"] is True  # A's LB really was gone
    assert found["b_active_after_s"] < 10.0
    # B's own LB on the service's port: 4.9 s after the kill when measured (the lease's TTL
    # of 4 s, a poll, the takeover, the LB's start), bounded with room for a loaded machine.
    assert found["endpoint_back_after_s"] < 12.0
    assert found["request_failures_after"] == 0 and found["requests_after"] == 60
    assert found["replicas_answering_after"] == ["1", "2"]
    # The same two actors serve: same replica ids and launch tokens, none relaunched.
    assert found["same_replicas"] is True and found["actors_same"] is True
    assert found["actors_alive_after"] is True
    assert found["statuses_after"] == ["READY", "READY"]
    assert found["replicas_created"] == 2 and found["adopted_events"] >= 2
    assert found["lb_port_same"] is True and found["lb_pid_changed"] is True
    assert found["lb_host_after"] == "host-b"
    assert found["lb_event"], "no event about the LB recorded on host-a"
    assert found["actors_left"] == []  # down (through B) removed both actors
