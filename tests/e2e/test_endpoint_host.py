"""`service.load_balancer.host`: an endpoint exposed beyond loopback, with a warning."""

from __future__ import annotations

import json
import socket
import textwrap
import urllib.request

import pytest

from tests.e2e.conftest import Fleet, endpoint_of
from tests.e2e.test_service_lifecycle import get

pytestmark = pytest.mark.e2e

EXPOSED = """\
    name: {name}
    service:
      readiness_probe: /health
      replicas: 1
      load_balancer:
        host: 0.0.0.0
    workdir: {workdir}
    run: python3 server.py
"""


def test_an_endpoint_bound_to_every_address_answers_on_each_and_warns(fleet: Fleet) -> None:
    path = fleet.write_service("wide", EXPOSED.format(name="wide", workdir=fleet.workdir))
    out = fleet.cli("up", str(path))
    assert "warning: the endpoint listens on 0.0.0.0" in out.stderr
    assert "no api_keys" in out.stderr
    endpoint = endpoint_of(out.stdout)
    port = int(endpoint.rsplit(":", 1)[1])
    assert endpoint == f"http://{socket.gethostname()}:{port}"  # reachable, not 127.0.0.1
    for address in ("127.0.0.1", "127.0.0.2"):  # 127.0.0.2: answered only by 0.0.0.0
        assert get(f"http://{address}:{port}/x")["replica"] == "1"
    events = fleet.cli("status", "wide", "-v").stdout
    assert "beyond this machine's loopback" in events
    fleet.cli("down", "wide", "--purge")


def test_the_default_endpoint_is_loopback_only_and_quiet(fleet: Fleet) -> None:
    body = EXPOSED.replace("      load_balancer:\n        host: 0.0.0.0\n", "")
    path = fleet.write_service("narrow", body.format(name="narrow", workdir=fleet.workdir))
    out = fleet.cli("up", str(path))
    assert "warning" not in out.stderr
    endpoint = endpoint_of(out.stdout)
    port = int(endpoint.rsplit(":", 1)[1])
    assert endpoint == f"http://127.0.0.1:{port}"
    assert get(f"{endpoint}/x")["replica"] == "1"
    with pytest.raises(OSError):
        get(f"http://127.0.0.2:{port}/x", timeout=2)
    fleet.cli("down", "narrow", "--purge")


def test_the_api_returns_one_warning_per_cloud_only_field_and_none_otherwise(
    fleet: Fleet,
) -> None:
    """POST /api/v1/services answers with `warnings`: the cloud-only fields it accepted with no
    effect here, one line each (what `up` prints), and an empty list for a plain YAML."""
    fleet.cli("server", "start")
    body = EXPOSED.replace("      load_balancer:\n        host: 0.0.0.0\n", "")
    cloudy = body + "    resources:\n      cloud: aws\n      instance_type: m5.large\n"

    def create(name: str, text: str) -> dict[str, object]:
        payload = {"yaml": textwrap.dedent(text.format(name=name, workdir=fleet.workdir))}
        req = urllib.request.Request(
            f"{fleet.api}/services",
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json", **fleet.auth()},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 201
            return dict(json.loads(r.read()))

    got = create("cloudy", cloudy)
    warnings = got["warnings"]
    assert isinstance(warnings, list)
    assert [w.split(":")[0] for w in warnings] == ["resources.cloud", "resources.instance_type"]
    assert all("no effect on the local infra" in w for w in warnings), warnings
    assert create("plain", body)["warnings"] == []
    fleet.cli("down", "cloudy", "--purge")
    fleet.cli("down", "plain", "--purge")
