"""GET /api/v1/logs/controller?service=NAME (`fleetserve logs --controller NAME`) gives the
controller's lines that name that service, the last `tail` of them; a replica that has ended
gives its log and ends even when followed (`logs` follows by default)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fleetserve.controller.controller import Controller
from fleetserve.core.status import ReplicaStatus
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
