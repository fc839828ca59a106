"""Readiness probes, run in the background so a slow replica never stalls a reconcile round."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx

from fleetserve.controller.metrics import ControllerMetrics, ProbeOutcome
from fleetserve.controller.probe_client import (
    ForeignListener,
    HttpxProbes,
    ProbeClient,
    ProbeConnectError,
    ProbeError,
    ProbeProtocolError,
    ProbeReadError,
    ProbeTimeout,
    ProbeTransport,
    foreign_listener,
)
from fleetserve.core.types import ReplicaKey
from fleetserve.home.settings import is_loopback
from fleetserve.policies.fleet import ProbeResult
from fleetserve.spec.models import ReadinessProbe

__all__ = ["Prober", "foreign_listener", "probe_once", "probe_with_outcome"]


async def probe_once(
    client: httpx.AsyncClient | ProbeTransport, endpoint: str, probe: ReadinessProbe
) -> ProbeResult:
    """One probe: success is exactly HTTP 200 (SkyServe's rule), from a listener of this user
    when the replica is on this machine (another local user who took the replica's port
    first must not pass its probe and get its traffic)."""
    return (await probe_with_outcome(client, endpoint, probe))[0]


async def probe_with_outcome(
    client: httpx.AsyncClient | ProbeTransport, endpoint: str, probe: ReadinessProbe
) -> tuple[ProbeResult, ProbeOutcome]:
    """`probe_once`, with how it ended for the metrics (a bounded outcome, never the text)."""
    transport = HttpxProbes(client) if isinstance(client, httpx.AsyncClient) else client
    url = endpoint.rstrip("/") + probe.path
    body = None if probe.post_data is None else json.dumps(probe.post_data).encode()
    headers = (
        probe.headers if body is None else {"Content-Type": "application/json", **probe.headers}
    )
    try:
        status = await transport.status(probe.method, url, headers, body, probe.timeout_seconds)
    except ForeignListener as e:
        return ProbeResult(False, str(e)), ProbeOutcome.FOREIGN_LISTENER
    except ProbeTimeout:
        return ProbeResult(
            False, f"{probe.method} {probe.path} timed out after {probe.timeout_seconds:g} s"
        ), ProbeOutcome.TIMEOUT
    except Exception as e:
        outcome = (
            ProbeOutcome.CONNECT_ERROR
            if isinstance(e, ProbeConnectError | httpx.ConnectError)
            else ProbeOutcome.ERROR
        )
        return ProbeResult(False, f"{probe.method} {probe.path}: {_explain(e, url)}"), outcome
    if status == 200:
        return ProbeResult(True, f"{probe.method} {probe.path} -> 200"), ProbeOutcome.OK
    return ProbeResult(
        False, f"{probe.method} {probe.path} -> HTTP {status}"
    ), ProbeOutcome.HTTP_STATUS


def _explain(e: Exception, url: str) -> str:
    """The probe's failure in words: the exception, plus what it usually means."""
    label = e.label if isinstance(e, ProbeError) else type(e).__name__
    text = f"{label}: {e}"
    parsed = httpx.URL(url)
    host, port = parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80)
    refused = isinstance(e, ProbeConnectError | httpx.ConnectError)
    if refused and host:
        where = f"[{host}]" if ":" in host else host
        also = "" if is_loopback(host) else " on 0.0.0.0 (every address, not only 127.0.0.1)"
        return (
            f"{text} (nothing accepts connections at {where}:{port}, the address probed: "
            f"the server must listen there, on $PORT{also})"
        )
    closed = isinstance(
        e, ProbeReadError | ProbeProtocolError | httpx.ReadError | httpx.RemoteProtocolError
    )
    if closed and not str(e):
        return f"{label}: the connection was closed before any answer (see the log)"
    return text


class Prober:
    """Starts a probe per replica when it is due; a round collects the results that are in.

    Keyed by `ReplicaKey` (service and replica id): each reconciler has its own prober, and
    even a shared one could not hand one service's result to another's replica."""

    def __init__(self, client: httpx.AsyncClient | ProbeTransport) -> None:
        """`client`: the controller's `ProbeClient` (shared by every service's prober), or
        an httpx client to send the probes through (`HttpxProbes`)."""
        self.client = client
        self.transport: ProbeTransport = (
            HttpxProbes(client) if isinstance(client, httpx.AsyncClient) else client
        )
        self._tasks: dict[ReplicaKey, asyncio.Task[ProbeResult]] = {}
        self._last_start: dict[ReplicaKey, float] = {}
        self._endpoints: dict[ReplicaKey, str] = {}
        self.metrics: ControllerMetrics | None = None  # probe latency and outcomes

    def maybe_start(
        self,
        replica_id: ReplicaKey,
        endpoint: str,
        probe: ReadinessProbe,
        now: float,
        interval: float,
        on_done: Callable[[], None] | None = None,
        quiet_if_ok: bool = False,
    ) -> None:
        """Start a probe if none runs and the last one started `interval` seconds ago or more;
        `on_done` is called when it finishes (the reconciler wakes to act on the result),
        unless it passed and `quiet_if_ok` (a READY replica that still answers: nothing to
        act on, the next round takes the result). With a thousand replicas a wake-up per
        probe meant a round after every probe, back to back."""
        if replica_id in self._tasks:
            return
        if now - self._last_start.get(replica_id, float("-inf")) < interval:
            return
        self._last_start[replica_id] = now
        self._endpoints[replica_id] = endpoint
        task = asyncio.create_task(self._probe(replica_id.service, endpoint, probe))
        if on_done is not None:
            wake = on_done

            def done(t: asyncio.Task[ProbeResult]) -> None:
                if quiet_if_ok and not t.cancelled() and t.exception() is None and t.result().ok:
                    return
                wake()

            task.add_done_callback(done)
        self._tasks[replica_id] = task

    async def _probe(self, service: str, endpoint: str, probe: ReadinessProbe) -> ProbeResult:
        metrics = self.metrics
        if metrics is None:
            return await probe_once(self.transport, endpoint, probe)
        started = metrics.timer()
        result, outcome = await probe_with_outcome(self.transport, endpoint, probe)
        metrics.service(service).probe(metrics.timer() - started, outcome)
        return result

    def take(self, replica_id: ReplicaKey) -> ProbeResult | None:
        task = self._tasks.get(replica_id)
        if task is None or not task.done():
            return None
        del self._tasks[replica_id]
        return task.result()

    def forget(self, replica_id: ReplicaKey) -> None:
        task = self._tasks.pop(replica_id, None)
        if task is not None:
            task.cancel()
        self._last_start.pop(replica_id, None)
        endpoint = self._endpoints.pop(replica_id, None)
        if endpoint is not None and isinstance(self.transport, ProbeClient):
            self.transport.forget(endpoint)  # its kept-alive connection

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._last_start.clear()
        self._endpoints.clear()
