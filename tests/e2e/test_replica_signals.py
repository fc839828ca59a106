"""Autoscaling on what the replicas say, end to end: two services of small replica servers
that export gauges in Prometheus text. One scales on a gauge of its own (target_metrics,
with a label match): set above target through an endpoint it grows 1 -> 2, lowered it shrinks
back. The other scales on the engine queue (vLLM's name); once grown, its replicas' /metrics
break: one never answers, the other lies (NaN, negative, 10 MB of junk that ends in a
zero, a zero sent a byte a second). The controller neither stalls (the first service's
status answers promptly, and it still scales) nor reads them as idle (the fleet stays)."""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, endpoint_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GAUGE_SERVER = textwrap.dedent(
    """
    import os, time, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit, parse_qsl
    RID = int(os.environ["FLEETSERVE_REPLICA_ID"])
    STATE = os.environ["GAUGE_STATE"]  # a folder every replica of the service shares
    calls = [0]
    def read(name, default):
        try:
            with open(os.path.join(STATE, name)) as f:
                return f.read().strip()
        except OSError:
            return default
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def answer(self, body, status=200, length=None):
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)
        def do_POST(self):
            for key, value in parse_qsl(urlsplit(self.path).query):
                tmp = os.path.join(STATE, key + ".tmp")
                with open(tmp, "w") as f:
                    f.write(value)
                os.replace(tmp, os.path.join(STATE, key))
            self.answer(b"ok")
        def do_GET(self):
            if not self.path.startswith("/metrics"):
                return self.answer(b"ok")
            value = read("value", "0")
            mode = read("mode", "ok")
            if mode == "broken" and RID % 2 == 1:
                time.sleep(3600)  # never answers
                return
            if mode == "broken":
                calls[0] += 1
                lie = calls[0] % 4
                if lie == 0:
                    return self.answer(b"vllm:num_requests_waiting NaN\\napp_queue_depth 1\\n")
                if lie == 1:
                    return self.answer(b"vllm:num_requests_waiting -5\\n")
                if lie == 2:  # 10 MB of junk, then a zero a reader of it all would take
                    junk = b"\\xff\\x00 junk {{{ not prometheus " * 300_000
                    tail = b"\\nvllm:num_requests_waiting 0\\n"
                    try:
                        self.answer(junk + tail)
                    except OSError:
                        pass
                    return
                body = b"vllm:num_requests_waiting 0\\n"  # a byte a second
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    for i in range(len(body)):
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                        time.sleep(1)
                except OSError:
                    pass
                return
            self.answer(
                (
                    "# TYPE app_queue_depth gauge\\n"
                    f'app_queue_depth{{kind="work",replica="{RID}"}} {value}\\n'
                    'app_queue_depth{kind="other"} 1000\\n'
                    f'vllm:num_requests_waiting{{engine="0"}} {value}\\n'
                ).encode()
            )
        def log_message(self, *a):
            pass
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
    """
)

SERVICE = """\
    name: {name}
    envs:
      GAUGE_STATE: {state}
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
      replica_policy:
        min_replicas: 1
        max_replicas: 2
{policy}
        metrics_scrape_seconds: 1
        upscale_delay_seconds: 2
        downscale_delay_seconds: 6
    workdir: {workdir}
    run: python3 gauge_server.py
"""

GAUGED = """\
        target_metrics:
          - name: app_queue_depth
            labels: {kind: work}
            target: 10"""
QUEUED = """\
        target_queue_per_replica: 1"""


def test_scales_on_replica_gauges_and_survives_replicas_that_hang_or_lie(
    fleet: Fleet, tmp_path: Path
) -> None:
    (fleet.workdir / "gauge_server.py").write_text(GAUGE_SERVER)
    endpoints = {}
    for name, policy in (("gauged", GAUGED), ("broken", QUEUED)):
        state = tmp_path / f"state-{name}"
        state.mkdir()
        body = SERVICE.format(name=name, state=state, policy=policy, workdir=fleet.workdir)
        endpoints[name] = endpoint_of(fleet.cli("up", str(fleet.write_service(name, body))).stdout)

    def set_(name: str, **values: object) -> None:
        import httpx

        query = "&".join(f"{k}={v}" for k, v in values.items())
        assert httpx.post(f"{endpoints[name]}/set?{query}", timeout=10).status_code == 200

    slowest = [0.0]

    def alive(name: str) -> int:
        started = time.monotonic()
        with fleet.client() as c:
            replicas = c.service(name).replicas
        slowest[0] = max(slowest[0], time.monotonic() - started)
        return sum(r.status not in ("SHUTTING_DOWN", "FAILED") for r in replicas)

    def ready(name: str) -> int:
        with fleet.client() as c:
            return sum(r.status == "READY" for r in c.service(name).replicas)

    fleet.wait_for("both services READY", lambda: ready("gauged") == ready("broken") == 1, 60)
    # Below target (the decoy label set at 1000 does not count): nothing moves.
    time.sleep(4)
    assert alive("gauged") == 1 and alive("broken") == 1
    set_("gauged", value=25)  # 25 per replica, target 10: 2 (max_replicas)
    set_("broken", value=3)  # 3 waiting, 1 per replica wanted: 2
    fleet.wait_for("gauged at 2 READY", lambda: ready("gauged") == 2, 40)
    fleet.wait_for("broken at 2 READY", lambda: ready("broken") == 2, 40)

    # Break the second service's metrics, lower the first one's gauge.
    set_("broken", mode="broken", value=0)
    set_("gauged", value=2)
    slowest[0] = 0.0
    started = time.monotonic()
    fleet.wait_for("gauged back at 1", lambda: alive("gauged") == 1, 40)
    shrunk_after = time.monotonic() - started
    # The broken service keeps its 2 replicas through 3 downscale delays and more.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert alive("broken") == 2
        time.sleep(0.5)
    assert slowest[0] < 2.0, f"a status call took {slowest[0]:.1f} s"
    with fleet.client() as c:
        gauged = [e.message for e in c.events("gauged", 200)]
        broken = [e.message for e in c.events("broken", 200)]
    print(
        f"\ngauged shrank {shrunk_after:.1f} s after its gauge fell; slowest status call "
        f"{slowest[0] * 1000:.0f} ms"
    )
    up = [e for e in gauged if "autoscaler: target 1 -> 2" in e]
    assert up and 'app_queue_depth{kind="work"} (mean) 25' in up[0], gauged
    down = [e for e in gauged if "autoscaler: target 2 -> 1" in e]
    assert down and 'app_queue_depth{kind="work"} (mean) 2, target 10' in down[0], gauged
    # 3 waiting, read over ~10 s (autoscaler.QUEUE_SMOOTH_SECONDS): above the target of 1
    # and at most 3 when it scaled
    grew = [e for e in broken if "autoscaler: target 1 -> 2" in e]
    read = [re.search(r"engine queue ([0-9.]+)/replica, target 1", e) for e in grew]
    assert read and read[0] is not None and 1 < float(read[0].group(1)) <= 3, grew
    assert not any("autoscaler: target 2 -> 1" in e for e in broken), broken
    log = (fleet.home / "logs" / "controller.log").read_text()
    lies = [line for line in log.splitlines() if "counted as missing" in line]
    assert lies and all("service broken: replica 2" in line for line in lies), lies
    assert len(lies) == 1  # said once per replica and signal, however many scrapes lied
