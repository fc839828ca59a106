"""Spot replicas on the local infra's zones, through the real CLI: the placer's zones in
status, zone outages injected by hand, and a slice of the AWS3 spot trace replayed under load
with no failed request (docs/spot.md)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter

import httpx

from fleetserve.api.models import ReplicaInfo, ServiceInfo

from .conftest import Fleet, endpoint_of

ZONES = "zone-a,zone-b,zone-c"
SPOT_SERVICE = """\
name: spotty
service:
  readiness_probe: /health
  replica_policy:
    min_replicas: 2
    num_overprovision: 1
    base_ondemand_fallback_replicas: 1
    dynamic_ondemand_fallback: true
    spot_placer: {placer}
resources:
  use_spot: true
workdir: {workdir}
run: python3 oneshot.py
"""
# The replica answers each request with one send (headers and body together). A replica that
# is killed between two sends of one response cuts a response the load balancer has already
# started to forward: no retry can save that one, and the goal is about those a retry can.
ONESHOT = """\
import json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
RID = os.environ["FLEETSERVE_REPLICA_ID"]
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 1 << 16  # buffered: the whole response leaves in one send, at the flush
    def do_GET(self):
        body = json.dumps({"replica": RID}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""
# A slice of AWS3 (fleetserve/sim/traces/spot) where its first three zones (us-east-1a, -1c,
# -1d, mapped onto zone-a, -b, -c) lose spot capacity 8 times in 40 steps of 300 s, all three
# at once for a while: 12,000 s of trace, 20 s at --speed 600.
SLICE = ("--start", "2730000", "--duration", "12000", "--speed", "600")


def alive(svc: ServiceInfo) -> list[ReplicaInfo]:
    return [r for r in svc.replicas if "FAIL" not in r.status and r.status != "PREEMPTED"]


def ready(svc: ServiceInfo) -> list[ReplicaInfo]:
    return [r for r in svc.replicas if r.status == "READY"]


def start(fleet: Fleet, placer: str = "dynamic_fallback") -> str:
    fleet.env["FLEETSERVE_LOCAL_ZONES"] = ZONES
    (fleet.workdir / "oneshot.py").write_text(ONESHOT)
    path = fleet.write_service("spotty", SPOT_SERVICE.format(placer=placer, workdir=fleet.workdir))
    return endpoint_of(fleet.cli("up", str(path), timeout=120).stdout)


def test_zones_in_status_and_a_zone_outage_by_hand(fleet: Fleet) -> None:
    start(fleet)
    client = fleet.client()

    def split() -> tuple[list[ReplicaInfo], list[ReplicaInfo]]:
        up = ready(client.service("spotty"))
        return [r for r in up if r.spot], [r for r in up if not r.spot]

    # On the way there, a dynamic on-demand fallback stands in for a spot replica that is not
    # READY yet (1 spot + 2 on-demand), and is drained once the spot one is.
    fleet.wait_for("2 spot + 1 on-demand READY", lambda: [len(x) for x in split()] == [2, 1])
    spot, _ = split()
    assert len({r.zone for r in spot}) == 2  # spread: no two spot replicas share a zone
    shown = fleet.cli("status", "spotty").stdout
    assert "ZONE" in shown and "spot placer dynamic_fallback" in shown
    assert "zones marked PREEMPTED: none" in shown

    victim = spot[0]
    out = fleet.cli("chaos", "preempt", "spotty", "--zone", victim.zone or "").stdout
    assert f"spotty/{victim.replica_id}" in out
    # Out of rotation at the next reconcile round (the reconciler is woken at once; its
    # interval is 1 s): the bound leaves room for a loaded machine, the speed is not measured
    # here.
    fleet.wait_for(
        "the preempted replica out of READY",
        lambda: all(r.replica_id != victim.replica_id for r in ready(client.service("spotty"))),
        timeout=10.0,
    )
    fleet.wait_for(
        "a replacement READY",
        lambda: len([r for r in ready(client.service("spotty")) if r.spot]) == 2,
        timeout=30,
    )
    svc = client.service("spotty")
    rows = {r.replica_id: r for r in svc.replicas}
    assert rows[victim.replica_id].status == "PREEMPTED"
    replacement = max(r.replica_id for r in ready(svc) if r.spot)
    assert rows[replacement].zone != victim.zone  # the marked zone is avoided
    assert svc.spot_placer is not None
    assert victim.zone in str(svc.spot_placer["summary"])
    # The marks survive a controller restart.
    fleet.cli("server", "stop")
    fleet.cli("server", "start")
    assert client.service("spotty").spot_placer == svc.spot_placer
    # A zone with no spot capacity left preempts its spot replicas and takes no new one.
    others = [z for z in ("zone-a", "zone-b", "zone-c") if z != victim.zone]
    for z in others:
        fleet.cli("chaos", "capacity", z, "0")

    def only_where_capacity() -> bool:
        up = ready(client.service("spotty"))
        spot_zones = {r.zone for r in up if r.spot}
        # SkyServe's placer never stacks two spot replicas in one zone while another zone is
        # ACTIVE: on-demand fallback makes up the rest (docs/spot.md).
        return spot_zones == {victim.zone} and len(up) >= 3

    fleet.wait_for("spot only where capacity is left", only_where_capacity, timeout=60)
    events = [e.message for e in client.events("spotty", limit=500)]
    assert any("no spot capacity in zone" in m for m in events)
    assert "PREEMPTED" in fleet.cli("status", "spotty").stdout
    bad = fleet.cli("chaos", "preempt", "spotty", "--zone", "nowhere", check=False)
    assert bad.returncode != 0 and "nowhere" in bad.stderr


def test_a_replayed_trace_slice_preempts_and_the_endpoint_keeps_answering(fleet: Fleet) -> None:
    endpoint = start(fleet)
    client = fleet.client()
    fleet.wait_for("3 READY", lambda: len(ready(client.service("spotty"))) == 3, timeout=60)
    results: Counter[str] = Counter()
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as http:
            deadline = time.monotonic() + 90
            for _ in range(20_000):  # bounded in count and time
                if stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    code = http.get(f"{endpoint}/work").status_code
                    results[str(code)] += 1
                except httpx.HTTPError as e:
                    results[type(e).__name__] += 1
                time.sleep(0.01)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        replay = fleet.cli("chaos", "replay", "AWS3", *SLICE, timeout=120)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=20)
    assert "us-east-1a -> zone-a" in replay.stdout
    events = [e.message for e in client.events("spotty", limit=1000)]
    preempted = [m for m in events if "spot capacity fell" in m]
    assert len(preempted) >= 3, replay.stdout
    assert any("launching on the local infra" in m and "spot" not in m for m in events) or any(
        "on-demand" in m for m in events
    )
    print(f"\nreplay: {len(preempted)} preemptions, requests {dict(results)}")
    assert results["200"] > 200, results
    assert set(results) == {"200"}, f"failed requests during the replay: {results}"
    # Capacity is back after the replay: the fleet heals to its target.
    fleet.wait_for(
        "2 spot + 1 on-demand READY after the replay",
        lambda: len([r for r in ready(client.service("spotty")) if r.spot]) == 2,
        timeout=60,
    )


def test_chaos_refuses_bad_input(fleet: Fleet) -> None:
    start(fleet)
    for args, words in (
        (("chaos", "preempt", "spotty"), "--replica"),
        (("chaos", "preempt", "nope", "--replica", "1"), "nope"),
        (("chaos", "capacity", "zone-a", "-1"), "capacity"),
        (("chaos", "capacity", "zone-z", "1"), "zone-z"),
        (("chaos", "replay", "AWS3", "--speed", "0"), "--speed"),
        (("chaos", "replay", "AWS3", "--speed", "1e9"), "--speed"),
        (("chaos", "replay", "/nonexistent"), "nonexistent"),
    ):
        proc = fleet.cli(*args, check=False)
        assert proc.returncode != 0, args
        assert words in proc.stderr + proc.stdout, (args, proc.stderr)
    r = httpx.post(
        f"{fleet.api}/chaos/capacity",
        json={"capacity": {"zone-a": 10**9}},
        headers=fleet.auth(),
    )
    assert r.status_code == 422
    r = httpx.post(f"{fleet.api}/chaos/capacity", json={"capacity": {"zone-a": 0}})
    assert r.status_code == 401  # authenticated like every other call


def test_bad_zone_declarations_refuse_to_start_the_controller(fleet: Fleet) -> None:
    for value, words in (
        ("zone-a,zone-a", "twice"),
        ("Zone A", "zone name"),
        ("zone-a:spot=-1", "0..10000"),
        ("zone-a:spot", "key=value"),
        ("zone-a:gpus=2", "unknown key"),
        ("/nonexistent/zones.yaml", "not a file"),
    ):
        fleet.env["FLEETSERVE_LOCAL_ZONES"] = value
        proc = subprocess.run(
            [*fleet_cmd(), "server", "start"],
            env=fleet.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0, value
        assert words in proc.stderr + proc.stdout, (value, proc.stderr)


def fleet_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "fleetserve"]
