"""Readiness probes, run in the background so a slow replica never stalls a reconcile round."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx

from fleetserve.core.types import ReplicaKey
from fleetserve.policies.fleet import ProbeResult
from fleetserve.spec.models import ReadinessProbe


async def probe_once(
    client: httpx.AsyncClient, endpoint: str, probe: ReadinessProbe
) -> ProbeResult:
    """One probe: success is exactly HTTP 200 (SkyServe's rule)."""
    url = endpoint.rstrip("/") + probe.path
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
        )
    except Exception as e:
        return ProbeResult(False, f"{probe.method} {probe.path}: {type(e).__name__}: {e}")
    if resp.status_code == 200:
        return ProbeResult(True, f"{probe.method} {probe.path} -> 200")
    return ProbeResult(False, f"{probe.method} {probe.path} -> HTTP {resp.status_code}")


class Prober:
    """Starts a probe per replica when it is due; a round collects the results that are in.

    Keyed by `ReplicaKey` (service and replica id): each reconciler has its own prober, and
    even a shared one could not hand one service's result to another's replica."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._tasks: dict[ReplicaKey, asyncio.Task[ProbeResult]] = {}
        self._last_start: dict[ReplicaKey, float] = {}

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
        task = asyncio.create_task(probe_once(self.client, endpoint, probe))
        if on_done is not None:
            task.add_done_callback(lambda _t: on_done())
        self._tasks[replica_id] = task

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
