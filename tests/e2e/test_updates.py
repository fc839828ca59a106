"""Updates end to end, under continuous bounded load with every response checked: rolling,
blue-green, a service-only update, a broken update and a canary. Each shows 0 failed requests
and how many requests each version served."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.e2e.conftest import Fleet
from tests.e2e.test_service_lifecycle import TWO_REPLICAS, Load, up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def new_version(fleet: Fleet, name: str, body: str = TWO_REPLICAS, greeting: str = "v2") -> str:
    """The same service with a task-level change (an env var): its replicas must be replaced."""
    text = body.format(name=name, workdir=fleet.workdir) + f"    envs: {{GREETING: {greeting}}}\n"
    return str(fleet.write_service(f"{name}-{greeting}", text))


def report(load: Load) -> Counter[str]:
    served = Counter(load.versions)
    print(
        f"\nrequests {len(load.versions) + len(load.failures)}, failed {len(load.failures)}, "
        f"per version {dict(served)}"
    )
    return served


def test_rolling_update_within_the_surge(fleet: Fleet) -> None:
    endpoint = up(fleet, "roll")
    path = new_version(fleet, "roll")
    most = 0
    with Load(f"{endpoint}/r", pause=0.01) as load:
        time.sleep(0.5)
        fleet.cli("update", "roll", path, "--detach")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with fleet.client() as c:
                svc = c.service("roll")
            alive = [r for r in svc.replicas if r.status not in ("SHUTTING_DOWN", "FAILED")]
            most = max(most, len(alive))
            if svc.serving_version == 2 and all(r.version == 2 for r in alive):
                break
            time.sleep(0.2)
        time.sleep(1)
    served = report(load)
    assert load.failures == []
    assert served["1"] > 0 and served["2"] > 0
    assert most <= 3  # 2 replicas + a surge of 1, never more
    assert load.versions[-1] == "2"
    with fleet.client() as c:
        assert c.service("roll").serving_version == 2
    assert "rolling back to version 1" in fleet.cli("rollback", "roll").stdout

    def back_on_v1() -> bool:
        with fleet.client() as c:
            svc = c.service("roll")
        alive = [r for r in svc.replicas if r.status not in ("SHUTTING_DOWN", "FAILED")]
        return svc.serving_version == 1 and len(alive) == 2 and all(r.version == 1 for r in alive)

    fleet.wait_for("the rollback to version 1", back_on_v1, timeout=60)


def test_blue_green_moves_traffic_in_one_step(fleet: Fleet) -> None:
    endpoint = up(fleet, "bg")
    path = new_version(fleet, "bg")
    with Load(f"{endpoint}/b", pause=0.01) as load:
        time.sleep(0.5)
        fleet.cli("update", "bg", path, "--mode", "blue_green")
        time.sleep(1)
    served = report(load)
    assert load.failures == []
    first_new = load.versions.index("2")
    stragglers = load.versions[first_new:].count("1")
    assert stragglers <= 3  # requests in flight at the switch (each LB worker takes the push)
    assert served["1"] > 0 and served["2"] > 0


def test_service_only_update_keeps_the_same_processes(fleet: Fleet) -> None:
    # No workdir (SkyServe's rule: a workdir may have changed, so replicas are replaced).
    body = TWO_REPLICAS.replace("    workdir: {workdir}\n", "").replace(
        "run: python3 server.py", "run: python3 {workdir}/server.py"
    )
    endpoint = up(fleet, "inplace", body)
    with fleet.client() as c:
        before = {r.replica_id: r.pid for r in c.service("inplace").replicas}
    changed = body.replace("initial_delay_seconds: 30", "initial_delay_seconds: 45")
    path = fleet.write_service("inplace-v2", changed.format(name="inplace", workdir=fleet.workdir))
    with Load(f"{endpoint}/i", pause=0.01) as load:
        time.sleep(0.3)
        out = fleet.cli("update", "inplace", str(path)).stdout
        time.sleep(1)
    report(load)
    assert "in place" in out
    assert load.failures == []
    with fleet.client() as c:
        svc = c.service("inplace")
    assert svc.serving_version == 2 and {r.version for r in svc.replicas} == {2}
    assert {r.replica_id: r.pid for r in svc.replicas} == before


def test_a_broken_update_leaves_the_old_version_serving(fleet: Fleet) -> None:
    endpoint = up(fleet, "stable")
    broken = TWO_REPLICAS.replace("run: python3 server.py", "run: echo crashing; exit 3")
    path = fleet.write_service("stable-broken", broken.format(name="stable", workdir=fleet.workdir))
    with Load(f"{endpoint}/s", pause=0.01) as load:
        time.sleep(0.3)
        proc = fleet.cli("update", "stable", str(path), check=False)
        time.sleep(0.5)
    served = report(load)
    assert proc.returncode == 1
    assert "version 1 keeps serving" in proc.stderr and "exited with code 3" in proc.stderr
    assert load.failures == [] and set(served) == {"1"}
    with fleet.client() as c:
        svc = c.service("stable")
    assert svc.status == "READY" and svc.serving_version == 1
    assert sum(r.status == "READY" and r.version == 1 for r in svc.replicas) == 2
    # The cause and the next commands, in the error and in `status`.
    assert "last log lines: crashing" in proc.stderr
    assert "`fleetserve rollback stable` drops version 2" in proc.stderr
    shown = fleet.cli("status", "stable").stdout
    assert "1 -> 2 (failed)" in shown and "(rolling)" not in shown
    back = fleet.cli("rollback", "stable", "--wait")
    assert "Version 1 serves." in back.stdout
    with fleet.client() as c:
        assert c.service("stable").active_version == 1


def test_canary_split_then_promote(fleet: Fleet) -> None:
    body = TWO_REPLICAS.replace("replicas: 2", "replicas: 4")
    endpoint = up(fleet, "canary", body, ready=4)
    path = new_version(fleet, "canary", body)
    out = fleet.cli("update", "canary", path, "--traffic-percent", "25").stdout
    assert "takes 25% of requests" in out
    time.sleep(0.5)
    with Load(f"{endpoint}/c", pause=0.002, limit=1200) as load:
        deadline = time.monotonic() + 60
        while load.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
    served = report(load)
    assert load.failures == []
    share = served["2"] / sum(served.values())
    assert 0.19 < share < 0.31, share  # within a few percent of 25
    fleet.cli("promote", "canary")

    def promoted() -> bool:
        with fleet.client() as c:
            svc = c.service("canary")
        alive = [r for r in svc.replicas if r.status not in ("SHUTTING_DOWN", "FAILED")]
        return svc.serving_version == 2 and all(r.version == 2 for r in alive)

    fleet.wait_for("the canary promoted to the whole fleet", promoted, timeout=60)


def test_an_update_that_changes_the_lb_settings_replaces_it_without_a_failed_request(
    fleet: Fleet,
) -> None:
    endpoint = up(fleet, "lbset")
    changed = TWO_REPLICAS.replace(
        "load_balancing_policy: round_robin", "load_balancing_policy: least_load"
    )
    path = new_version(fleet, "lbset", changed)
    with Load(f"{endpoint}/l", pause=0.01) as load:
        time.sleep(0.3)
        fleet.cli("update", "lbset", path)
        time.sleep(2)
    report(load)
    assert load.failures == []
    log = fleet.cli("logs", "--no-follow", "lbset", "--load-balancer").stdout
    assert "policy least_load" in log
    # The new one listens on the old one's sockets (fleetserve.lb.handover): same queues.
    assert "sockets of the load balancer it replaces" in log
    with fleet.client() as c:
        events = [e.message for e in c.events("lbset", 200)]
    assert "load balancer settings changed: replacing it" in events


def test_update_errors_are_clear_and_change_nothing(fleet: Fleet) -> None:
    up(fleet, "firm")
    path = new_version(fleet, "firm")
    cases = [
        (["update", "nope", path], 3, "does not exist"),
        (["update", "firm", path, "--mode", "sideways"], 2, "rolling or blue_green"),
        (["update", "firm", path, "--traffic-percent", "150"], 2, "--traffic-percent 150: a"),
        (["rollback", "firm"], 4, "no earlier version"),
        (["promote", "firm"], 4, "no canary"),
    ]
    for args, code, words in cases:
        proc = fleet.cli(*args, check=False)
        assert proc.returncode == code, (args, proc.stderr)
        assert words in proc.stderr, (args, proc.stderr)
    bad = fleet.write_service("firm-bad", "service:\n  readiness_probe: nope\n")
    proc = fleet.cli("update", "firm", str(bad), check=False)
    assert proc.returncode == 2 and "must start with '/'" in proc.stderr
    with fleet.client() as c:
        svc = c.service("firm")
    assert svc.active_version == 1 and svc.serving_version == 1  # no version row was added
    # A rollout that is surely still under way when the next update comes (its replicas
    # stay STARTING for their 30 s initial delay), whatever the machine's load.
    slow = new_version(
        fleet, "firm", TWO_REPLICAS.replace("python3 server.py", "sleep 600"), greeting="v3"
    )
    fleet.cli("update", "firm", slow, "--detach")
    proc = fleet.cli("update", "firm", path, check=False)
    assert proc.returncode == 4 and "still rolling out" in proc.stderr
