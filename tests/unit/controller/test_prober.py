"""`Prober`: one shared prober keeps two services' replicas apart, even with the same ids."""

from __future__ import annotations

import httpx

from fleetserve.controller.prober import Prober
from fleetserve.core.types import ReplicaKey
from fleetserve.policies.fleet import ProbeResult
from fleetserve.spec.models import ReadinessProbe

from .fakes import settle

PROBE = ReadinessProbe(path="/health")


def answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200 if request.url.host == "good-1.test" else 404)


async def test_a_shared_prober_never_mixes_two_services_with_the_same_replica_id() -> None:
    good, bad = ReplicaKey("good", 1), ReplicaKey("bad", 1)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        prober = Prober(client)
        prober.maybe_start(good, "http://good-1.test:8000", PROBE, now=10.0, interval=1.0)
        prober.maybe_start(bad, "http://bad-1.test:8000", PROBE, now=10.0, interval=1.0)
        await settle()
        bad_result, good_result = prober.take(bad), prober.take(good)
        assert good_result is not None and bad_result is not None
        assert (good_result.ok, good_result.detail) == (True, "GET /health -> 200")
        assert (bad_result.ok, bad_result.detail) == (False, "GET /health -> HTTP 404")
        assert prober.take(good) is None and prober.take(bad) is None  # each taken once

        # The interval is each replica's own: forgetting "bad" leaves "good"'s timer alone.
        prober.forget(bad)
        prober.maybe_start(good, "http://good-1.test:8000", PROBE, now=10.5, interval=1.0)
        prober.maybe_start(bad, "http://bad-1.test:8000", PROBE, now=10.5, interval=1.0)
        await settle()
        assert prober.take(good) is None  # not due yet: no probe started
        result = prober.take(bad)
        assert result is not None and not result.ok
        prober.close()


def test_a_probe_failure_says_what_it_usually_means() -> None:
    from fleetserve.controller.prober import _explain

    refused = httpx.ConnectError("All connection attempts failed")
    away = _explain(refused, "http://10.231.0.2:8080/health")
    assert "at 10.231.0.2:8080, the address probed" in away
    assert "must listen there, on $PORT on 0.0.0.0" in away
    local = _explain(refused, "http://127.0.0.1:8081/health")
    assert "0.0.0.0" not in local and "at 127.0.0.1:8081, the address probed" in local
    closed = _explain(httpx.ReadError(""), "http://127.0.0.1:4000/")
    assert closed == "ReadError: the connection was closed before any answer (see the log)"
    assert _explain(httpx.ReadError("boom"), "http://127.0.0.1:4000/") == "ReadError: boom"


async def test_a_passing_probe_of_a_ready_replica_wakes_no_one() -> None:
    """quiet_if_ok: a READY replica that still answers is nothing to act on (with a thousand
    replicas a wake-up per probe meant back-to-back rounds); a failure still wakes."""
    healthy = [True]

    def answer(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if healthy[0] else 503)

    woken: list[float] = []
    url = "http://svc-1.test:8000"
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        prober = Prober(client)
        key = ReplicaKey("svc", 1)

        def probe(now: float, quiet: bool) -> None:
            wake = lambda: woken.append(now)  # noqa: E731
            prober.maybe_start(key, url, PROBE, now, 1.0, wake, quiet_if_ok=quiet)

        probe(10.0, quiet=True)
        await settle()
        assert woken == [] and prober.take(key) == ProbeResult(True, "GET /health -> 200")
        healthy[0] = False
        probe(11.0, quiet=True)
        await settle()
        assert woken == [11.0] and prober.take(key) == ProbeResult(False, "GET /health -> HTTP 503")
        healthy[0] = True
        probe(12.0, quiet=False)  # a STARTING replica: every result wakes
        await settle()
        assert woken == [11.0, 12.0]
        prober.close()
