"""The REST API fuzzed from its own OpenAPI schema (schemathesis), and abused by hand: no
answer is a 5xx, the controller answers /health throughout, and its memory stays bounded.

The controller runs with FLEETSERVE_MAX_LAUNCHES=0: a fuzzed YAML that happens to be a valid
service never runs its command."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.e2e.conftest import Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES = 60  # per operation: 14 operations, well under a minute on 2 cores


@pytest.fixture
def controller(fleet: Fleet) -> Iterator[Fleet]:
    fleet.env["FLEETSERVE_MAX_LAUNCHES"] = "0"
    fleet.cli("server", "start")
    yield fleet


def rss_mb(fleet: Fleet) -> float:
    return psutil.Process(fleet.controller_pid()).memory_info().rss / 2**20


def fds(fleet: Fleet) -> int:
    return psutil.Process(fleet.controller_pid()).num_fds()


def healthy(fleet: Fleet, within: float = 2.0) -> bool:
    started = time.monotonic()
    with urllib.request.urlopen(f"{fleet.api}/health", timeout=within) as r:
        ok = r.status == 200
    return ok and time.monotonic() - started < within


def fuzz(
    op: Any, base: str, auth: dict[str, str], service: str | None = None
) -> list[tuple[int, str]]:
    """EXAMPLES generated requests to one operation: (status, start of the body) each. With
    `service`, a `{name}` in the path is that existing service (deeper than a 404)."""
    answers: list[tuple[int, str]] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy())
    def run(case: Any) -> None:
        if service is not None and case.path_parameters and "name" in case.path_parameters:
            case.path_parameters["name"] = service
        headers = {**auth, "Content-Type": "application/json"}
        resp = case.call(base_url=base, headers=headers, timeout=15)
        answers.append((resp.status_code, resp.text[:300]))

    run()
    return answers


def test_no_fuzzed_request_gets_a_5xx(controller: Fleet) -> None:
    fleet = controller
    auth = fleet.auth()
    req = urllib.request.Request(fleet.api.removesuffix("/api/v1") + "/openapi.json", headers=auth)
    schema = schemathesis.openapi.from_dict(json.loads(urllib.request.urlopen(req).read()))
    base = fleet.api.removesuffix("/api/v1")
    baseline, baseline_fds = rss_mb(fleet), fds(fleet)
    seen: dict[str, set[int]] = {}
    errors: list[str] = []
    spec = fleet.write_service(
        "fz", "service:\n  readiness_probe: /\n  replicas: 2\nrun: python3 -m http.server\n"
    )
    fleet.cli("up", "-d", str(spec), "-n", "fz")  # never launched: FLEETSERVE_MAX_LAUNCHES=0
    ops = [r.ok() for r in schema.get_all_operations()]
    ops.sort(key=lambda op: op.method.upper() == "DELETE")  # take "fz" down last
    for op in ops:
        name = f"{op.method.upper()} {op.path}"
        codes = fuzz(op, base, auth) + fuzz(op, base, auth, service="fz")
        seen[name] = {code for code, _ in codes}
        errors += [f"{name} -> {code}: {text}" for code, text in codes if code >= 500]
        assert healthy(fleet), f"/health slow or failing after fuzzing {name}"
    print("\nstatus codes per operation:", {k: sorted(v) for k, v in seen.items()})
    assert not errors, errors[:5]
    assert len(seen) >= 14
    grown = rss_mb(fleet) - baseline
    print(f"controller RSS: {baseline:.0f} MB before, +{grown:.0f} MB after fuzzing")
    assert grown < 80
    time.sleep(1)  # closed connections are gone
    assert fds(fleet) <= baseline_fds + 10, (baseline_fds, fds(fleet))


def post(fleet: Fleet, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(
        f"{fleet.api}/services",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **fleet.auth(), **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (ConnectionError, urllib.error.URLError) as e:
        return 0, repr(e)  # the server closed early: it refused the body without reading it


BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
service:
  readiness_probe:
    path: /
    post_data: *i
  replicas: 1
run: echo
"""


def test_hostile_bodies_get_clear_4xx_and_the_controller_carries_on(controller: Fleet) -> None:
    fleet = controller
    baseline, baseline_fds = rss_mb(fleet), fds(fleet)
    cases: list[tuple[str, bytes, tuple[int, ...], str]] = [
        ("100 MB body", b'{"yaml": "' + b"a" * (100 * 2**20) + b'"}', (413, 0), "exceeds"),
        ("alias bomb", json.dumps({"yaml": BOMB}).encode(), (422,), ""),
        ("20k nested [", json.dumps({"yaml": "a: " + "[" * 20000}).encode(), (422,), ""),
        (
            "a billion replicas",
            json.dumps(
                {"yaml": "service:\n  readiness_probe: /\n  replicas: 1000000000\nrun: echo\n"}
            ).encode(),
            (422,),
            "replicas",
        ),
        ("not JSON", b"{{{{", (422,), "invalid request"),
    ]
    for what, body, codes, words in cases:
        status, text = post(fleet, body)
        assert status in codes, (what, status, text[:300])
        assert status == 0 or words in text, (what, text[:300])
        assert healthy(fleet), f"/health slow or failing after {what}"
    # A declared size past the cap is answered 413 before any of the body is read.
    with socket.create_connection(("127.0.0.1", int(fleet.env["FLEETSERVE_API_PORT"]))) as s:
        token = fleet.auth()["Authorization"]
        s.sendall(
            b"POST /api/v1/services HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nAuthorization: " + token.encode() + b"\r\n"
            b"Content-Length: 104857600\r\n\r\n{"
        )
        s.settimeout(10)
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert rss_mb(fleet) - baseline < 50
    time.sleep(1)
    assert fds(fleet) <= baseline_fds + 10, (baseline_fds, fds(fleet))
    assert fleet.client().status() == []  # nothing was created
