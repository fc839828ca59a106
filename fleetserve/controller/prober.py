"""Readiness probes, run in the background so a slow replica never stalls a reconcile round."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from fleetserve.controller.metrics import ControllerMetrics, ProbeOutcome
from fleetserve.controller.settings import is_loopback
from fleetserve.core.sockets import listener_uids
from fleetserve.core.types import ReplicaKey
from fleetserve.policies.fleet import ProbeResult
from fleetserve.spec.models import ReadinessProbe


async def probe_once(
    client: httpx.AsyncClient, endpoint: str, probe: ReadinessProbe
) -> ProbeResult:
    """One probe: success is exactly HTTP 200 (SkyServe's rule), from a listener of this user
    when the replica is on this machine (another local user who took the replica's port
    first must not pass its probe and get its traffic)."""
    return (await probe_with_outcome(client, endpoint, probe))[0]


async def probe_with_outcome(
    client: httpx.AsyncClient, endpoint: str, probe: ReadinessProbe
) -> tuple[ProbeResult, ProbeOutcome]:
    """`probe_once`, with how it ended for the metrics (a bounded outcome, never the text)."""
    url = endpoint.rstrip("/") + probe.path
    squatter = foreign_listener(endpoint)
    if squatter is not None:
        return ProbeResult(False, squatter), ProbeOutcome.FOREIGN_LISTENER
    try:
        if probe.post_data is None:
            resp = await client.get(url, headers=probe.headers, timeout=probe.timeout_seconds)
        else:
            resp = await client.post(
                url,
                content=json.dumps(probe.post_data),
                headers={"Content-Type": "application/json", **probe.headers},
                timeout=probe.timeout_seconds,
            )
    except httpx.TimeoutException:
        return ProbeResult(
            False, f"{probe.method} {probe.path} timed out after {probe.timeout_seconds:g} s"
        ), ProbeOutcome.TIMEOUT
    except Exception as e:
        outcome = (
            ProbeOutcome.CONNECT_ERROR if isinstance(e, httpx.ConnectError) else ProbeOutcome.ERROR
        )
        return ProbeResult(False, f"{probe.method} {probe.path}: {_explain(e, url)}"), outcome
    if resp.status_code == 200:
        return ProbeResult(True, f"{probe.method} {probe.path} -> 200"), ProbeOutcome.OK
    return ProbeResult(
        False, f"{probe.method} {probe.path} -> HTTP {resp.status_code}"
    ), ProbeOutcome.HTTP_STATUS


def _explain(e: Exception, url: str) -> str:
    """The probe's failure in words: the exception, plus what it usually means."""
    text = f"{type(e).__name__}: {e}"
    host = httpx.URL(url).host
    if isinstance(e, httpx.ConnectError) and host and not is_loopback(host):
        return (
            f"{text} (nothing accepts connections at {host}: the server must listen on "
            "0.0.0.0, every address, not only 127.0.0.1)"
        )
    if isinstance(e, httpx.ReadError | httpx.RemoteProtocolError) and not str(e):
        return f"{type(e).__name__}: the connection was closed before any answer (see the log)"
    return text


def foreign_listener(endpoint: str) -> str | None:
    """Why a loopback endpoint's port is not the replica's: held by another user's process."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    if parts.port is None or not (host.startswith("127.") or host in ("localhost", "::1")):
        return None
    uids = listener_uids(parts.port)
    others = uids - {os.getuid()}
    if others:
        who = ", ".join(str(u) for u in sorted(others))
        return f"port {parts.port} is held by another user's process (uid {who}), not the replica"
    return None


class Prober:
    """Starts a probe per replica when it is due; a round collects the results that are in.

    Keyed by `ReplicaKey` (service and replica id): each reconciler has its own prober, and
    even a shared one could not hand one service's result to another's replica."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._tasks: dict[ReplicaKey, asyncio.Task[ProbeResult]] = {}
        self._last_start: dict[ReplicaKey, float] = {}
        self.metrics: ControllerMetrics | None = None  # probe latency and outcomes

    def maybe_start(
        self,
        replica_id: ReplicaKey,
        endpoint: str,
        probe: ReadinessProbe,
        now: float,
        interval: float,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Start a probe if none runs and the last one started `interval` seconds ago or more;
        `on_done` is called when it finishes (the reconciler wakes to act on the result)."""
        if replica_id in self._tasks:
            return
        if now - self._last_start.get(replica_id, float("-inf")) < interval:
            return
        self._last_start[replica_id] = now
        task = asyncio.create_task(self._probe(replica_id.service, endpoint, probe))
        if on_done is not None:
            task.add_done_callback(lambda _t: on_done())
        self._tasks[replica_id] = task

    async def _probe(self, service: str, endpoint: str, probe: ReadinessProbe) -> ProbeResult:
        metrics = self.metrics
        if metrics is None:
            return await probe_once(self.client, endpoint, probe)
        started = metrics.timer()
        result, outcome = await probe_with_outcome(self.client, endpoint, probe)
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

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._last_start.clear()
