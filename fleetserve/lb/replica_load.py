"""The replicas' own account of their load, for cache_aware (`replica_metrics_seconds`) and
the mover (`move_waiting_requests`).

An LB process counts only its own requests in flight; a replica serving several LB processes
(workers, or a restarted LB) or other clients is busier than that. When asked, each LB process
reads every replica's Prometheus `/metrics` every few seconds and takes the requests it runs
plus the ones it queues, in the names vLLM, SGLang and TGI use; the policy then counts a
replica's load as the larger of that and its own in-flight count. A replica that does not
answer (or has no such metric) is simply not counted: the in-flight count stands.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable

import aiohttp

log = logging.getLogger(__name__)

# Running + waiting requests, by server. Sources: vLLM's metrics docs (vllm:num_requests_*),
# SGLang's (sglang:num_running_reqs, sglang:num_queue_reqs), TGI's (tgi_batch_current_size,
# tgi_queue_size).
LOAD_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "tgi_batch_current_size",
    "tgi_queue_size",
)
# Of those, the requests waiting (not yet admitted to the engine's batch).
WAITING_METRICS = frozenset(
    {"vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size"}
)
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")
MAX_METRICS_BYTES = 1024 * 1024


def parse_load(text: str) -> int | None:
    """Running + waiting requests in a Prometheus text exposition (summed over label sets);
    None when it names none of LOAD_METRICS."""
    both = _running_waiting(text)
    return None if both is None else round(both[0] + both[1])


def parse_queue(text: str) -> tuple[int, int] | None:
    """(running, waiting) requests in a Prometheus text exposition (each summed over label
    sets); None when it names none of LOAD_METRICS. A server that exports only a waiting
    count reads as 0 running."""
    both = _running_waiting(text)
    return None if both is None else (round(both[0]), round(both[1]))


def _running_waiting(text: str) -> tuple[float, float] | None:
    running = waiting = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None or m.group(1) not in LOAD_METRICS:
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if value == value and 0 <= value < 1e9:  # not NaN, not absurd
            if m.group(1) in WAITING_METRICS:
                waiting += value
            else:
                running += value
            seen = True
    return (running, waiting) if seen else None


class ReplicaLoadPoller:
    """Reads each replica's metrics every `every` seconds into `loads` (replica id -> running
    + waiting) and `queues` (replica id -> (running, waiting)); `on_round` runs after each
    round (fleetserve.lb.mover)."""

    def __init__(
        self,
        every: float,
        path: str,
        replicas: Callable[[], Iterable[tuple[int, str]]],
        loads: dict[int, int],
        on_round: Callable[[], object] | None = None,
    ) -> None:
        self.every = every
        self.path = path
        self.replicas = replicas
        self.loads = loads
        self.queues: dict[int, tuple[int, int]] = {}
        self.on_round = on_round
        self._task: asyncio.Task[None] | None = None

    def _forget(self, rid: int) -> None:
        self.loads.pop(rid, None)
        self.queues.pop(rid, None)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _one(self, session: aiohttp.ClientSession, rid: int, url: str) -> None:
        try:
            async with session.get(url.rstrip("/") + self.path) as r:
                if r.status != 200:
                    self._forget(rid)
                    return
                body = bytearray()
                async for chunk in r.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) >= MAX_METRICS_BYTES:
                        # Cut: only whole lines count (a number cut short would be wrong).
                        del body[body.rfind(b"\n") + 1 :]
                        break
        except (aiohttp.ClientError, OSError, TimeoutError):
            self._forget(rid)
            return
        both = _running_waiting(body.decode(errors="replace"))
        if both is None:
            self._forget(rid)
        else:
            self.queues[rid] = (round(both[0]), round(both[1]))
            self.loads[rid] = round(both[0] + both[1])

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(0.5, min(self.every, 5.0)))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                current = dict(self.replicas())
                for gone in (set(self.loads) | set(self.queues)) - set(current):
                    self._forget(gone)
                try:
                    await asyncio.gather(
                        *(self._one(session, rid, url) for rid, url in current.items())
                    )
                    if self.on_round is not None:
                        self.on_round()
                except Exception:  # never let a bad replica stop the polling
                    log.exception("reading the replicas' metrics failed")
                await asyncio.sleep(self.every)
