"""Autoscaling end to end: bounded load grows the fleet, a controller restart under load
scales nothing down, the fleet shrinks back when the load stops, and no request fails."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.conftest import Fleet, endpoint_of
from tests.e2e.test_service_lifecycle import Load

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AUTOSCALED = """\
    name: elastic
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
      replica_policy:
        min_replicas: 1
        max_replicas: 3
        target_qps_per_replica: 5
        qps_window_seconds: 3
        upscale_delay_seconds: 2
        downscale_delay_seconds: 6
    workdir: {workdir}
    run: python3 server.py
"""


def test_the_fleet_grows_survives_a_restart_and_shrinks(fleet: Fleet) -> None:
    path = fleet.write_service("elastic", AUTOSCALED.format(workdir=fleet.workdir))
    endpoint = endpoint_of(fleet.cli("up", str(path)).stdout)

    def ready() -> int:
        with fleet.client() as c:
            return sum(r.status == "READY" for r in c.service("elastic").replicas)

    def alive() -> int:
        with fleet.client() as c:
            return sum(
                r.status not in ("SHUTTING_DOWN", "FAILED") for r in c.service("elastic").replicas
            )

    with Load(f"{endpoint}/load", seconds=120, pause=0.04) as load:  # about 20 req/s
        fleet.wait_for("3 READY replicas", lambda: ready() == 3, timeout=40)
        # Kill the controller under load: the restarted one reads the persisted window, target
        # and timers, and scales nothing down while the load goes on.
        os.kill(fleet.controller_pid(), signal.SIGKILL)
        time.sleep(1)
        fleet.cli("server", "start")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert alive() == 3
            time.sleep(0.5)
        with fleet.client() as c:
            events = [e.message for e in c.events("elastic", 200)]
        assert not any("scaled down" in e for e in events)
        assert any("autoscaler: target 1 -> " in e for e in events)
    fleet.wait_for("the fleet back at 1 replica", lambda: alive() == 1, timeout=45)
    served = sum(load.ok.values())
    print(
        f"\nrequests {served + len(load.failures)}, failed {len(load.failures)}, "
        f"per replica {dict(load.ok)}"
    )
    assert load.failures == []
    assert len(load.ok) >= 3  # the new replicas served traffic
