"""GET /api/v1/logs/controller?service=NAME (`fleetserve logs --controller NAME`) gives the
controller's lines that name that service, the last `tail` of them; a replica that has ended
gives its log and ends even when followed (`logs` follows by default)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from fleetserve.controller.controller import Controller
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaId
from fleetserve.oshelpers.files import read_lines, while_alive
from fleetserve.spec.loader import parse_spec

YAML = "service:\n  readiness_probe: /health\n  replicas: 1\nrun: python3 server.py\n"

LOG = [
    "10:00:01 INFO fleetserve.controller: service web: version 1 serves\n",
    "10:00:02 INFO fleetserve.controller: service web2: version 1 serves\n",
    "10:00:03 INFO fleetserve.controller: api listening\n",
    "10:00:04 ERROR fleetserve.controller: launch of replica web/3 failed\n",
    "10:00:05 INFO fleetserve.controller: service web-b: scaled down\n",
]


def add(ctl: Controller, name: str) -> None:
    ctl.store.create_service(name, YAML, parse_spec(YAML).model_dump_json(), 1.0)


def test_controller_lines_of_one_service(api: tuple[TestClient, Controller]) -> None:
    client, ctl = api
    for name in ("web", "web2", "web-b"):
        add(ctl, name)
    ctl.settings.controller_log.parent.mkdir(parents=True, exist_ok=True)
    ctl.settings.controller_log.write_text("".join(LOG))

    every = client.get("/api/v1/logs/controller")
    assert every.text == "".join(LOG)
    web = client.get("/api/v1/logs/controller", params={"service": "web"})
    assert web.status_code == 200 and web.text == LOG[0] + LOG[3]
    last = client.get("/api/v1/logs/controller", params={"service": "web", "tail": 1})
    assert last.text == LOG[3]
    tail2 = client.get("/api/v1/logs/controller", params={"tail": 2})
    assert tail2.text == LOG[3] + LOG[4]
    missing = client.get("/api/v1/logs/controller", params={"service": "nosuch"})
    assert missing.status_code == 404 and "nosuch" in missing.text


@pytest.mark.timeout(30)
def test_following_an_ended_replica_returns_its_log(api: tuple[TestClient, Controller]) -> None:
    client, ctl = api
    add(ctl, "web")
    rec = ctl.store.allocate_replica("web", 1, "local", "tok", 2.0)
    ctl.store.update_replica(rec, 3.0, status=ReplicaStatus.FAILED, reason="exited with code 2")
    log = ctl.settings.logs_dir / "web" / "replica-1.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("python3: can't open file 'server.py'\n")
    got = client.get("/api/v1/services/web/replicas/1/logs", params={"follow": True})
    assert got.status_code == 200 and got.text == "python3: can't open file 'server.py'\n"


@pytest.mark.timeout(30)
async def test_a_follow_ends_once_its_replica_or_service_is_gone(
    api: tuple[TestClient, Controller],
) -> None:
    """`logs NAME ID` and `logs --load-balancer NAME` follow by default: once the replica is
    terminated (or the service taken down) the follow ends, the lines written before that
    included, instead of holding the client and the controller's generator forever."""
    _, ctl = api
    add(ctl, "web")
    rec = ctl.store.allocate_replica("web", 1, "local", "tok", 2.0)
    ctl.store.update_replica(rec, 3.0, status=ReplicaStatus.READY)
    log = ctl.settings.logs_dir / "web" / "replica-1.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("serving\n")
    lines = ctl.replica_logs("web", ReplicaId(1), True)
    assert await anext(lines) == "serving\n"
    ctl.store.update_replica(rec, 4.0, status=ReplicaStatus.SHUTTING_DOWN)  # (it may log on)
    with log.open("a") as f:
        f.write("shutting down\n")
    assert await anext(lines) == "shutting down\n"
    rest = asyncio.ensure_future(anext(lines))
    await asyncio.sleep(2.5)
    assert not rest.done()  # still followed while it shuts down
    ctl.store.delete_replica("web", ReplicaId(1), 5.0, "terminated")
    t0 = time.monotonic()
    with pytest.raises(StopAsyncIteration):
        await rest
    assert time.monotonic() - t0 < 5
    # A service's load-balancer log, followed: ends when the service is gone.
    lb_log = ctl.settings.logs_dir / "web" / "load-balancer.log"
    lb_log.write_text("listening\n")
    follow = while_alive(read_lines(lb_log, True), ctl.service_alive("web"))
    assert await anext(follow) == "listening\n"
    ctl.store.delete_service("web")
    assert [line async for line in follow] == []
