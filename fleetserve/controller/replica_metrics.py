"""What the replicas say about their own load, for the autoscaler (docs/autoscaling.md).

For a service whose `replica_policy` sets `target_queue_per_replica` (the engine's waiting
requests, and its running ones with them), `target_kv_cache_usage` or `target_metrics`, the
controller reads `metrics_path` (Prometheus text) of each READY
replica every `metrics_scrape_seconds`, in the background: a scrape round never holds a
reconcile round. Each request goes through the probes' client (`ProbeClient.get`: the same
kept-alive connections, the same bounded concurrency, the same check that a loopback port is
held by this user's process), with the readiness probe's headers (a replica that wants a key
for its probe wants it for its metrics too), a timeout of min(2 s, interval) for the whole
answer, the body's last byte included (a replica that drips its answer, or never ends it,
holds a request no longer), and a body read up to 1 MiB.

The parser is this module's own, not prometheus_client's: it looks only at the lines of the
few names wanted (a vLLM exposition is hundreds of histogram lines), takes each line on its
own (prometheus_client's parser gives up on the whole text at the first malformed line, and
builds an object for every sample of every family), and is run off the event loop when the
body is large.

A replica that does not answer, answers something other than 200, or exports none of the
names, is missing for that signal; so is one whose value is not a number a load can be (NaN,
infinite, negative, absurdly large, a KV cache use above 1): it lies, and the log says so once.
The autoscaler counts a missing replica as the mean of those that answered, never as an idle
one, and with no answer at all it holds the fleet's size.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fleetserve.core.types import ReplicaId, ReplicaKey
from fleetserve.policies.autoscaler import KV_CACHE, QUEUE, RUNNING, SignalReading, metric_key
from fleetserve.spec.models import MetricTarget, ReplicaPolicy

log = logging.getLogger("fleetserve.controller")

# Requests waiting in the engine, by server: vLLM (docs: metrics), SGLang, TGI. The first
# name a replica exports is read.
QUEUE_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size")
# Requests running in the engine's batch, read from the same scrape as the queue: the
# autoscaler shrinks on the queue only when the running ones would fit in fewer replicas.
RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size")
# KV cache use as a fraction: vLLM >= 0.10's name, vLLM's older one, SGLang's.
KV_CACHE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
MAX_METRICS_BYTES = 1024 * 1024
MAX_TIMEOUT_SECONDS = 2.0
MAX_CONCURRENT = 16  # metrics requests in flight at once, all services (of the probes' 64)
PARSE_INLINE_BYTES = 64 * 1024  # larger bodies are parsed in a thread
# A value past these is no load a replica can carry: a lie, counted as missing.
MAX_COUNT = 1e9
MAX_GAUGE = 1e15

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(,)?')
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, list[tuple[Labels, float]]]


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), value)


def parse_samples(text: str, names: Iterable[str]) -> Samples:
    """The samples of `names` in a Prometheus (or OpenMetrics) text exposition: per name, each
    sample's labels and value. Lines of other names, comments and malformed lines are
    skipped; a value that is no float is kept as NaN (the caller decides it is a lie)."""
    wanted = set(names)
    out: Samples = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _NAME.match(line)
        if m is None or m.group(0) not in wanted:
            continue
        name, rest = m.group(0), line[m.end() :]
        labels: list[tuple[str, str]] = []
        if rest.startswith("{"):
            pos = 1
            while True:
                lm = _LABEL.match(rest, pos)
                if lm is None:
                    break
                labels.append((lm.group(1), _unescape(lm.group(2))))
                pos = lm.end()
                if lm.group(3) is None:
                    break
            close = rest.find("}", pos)
            if close < 0 or rest[pos:close].strip():
                continue  # malformed labels
            rest = rest[close + 1 :]
        parts = rest.split()
        if not parts or not rest[:1].isspace():
            continue
        try:
            value = float(parts[0])
        except ValueError:
            value = math.nan
        out.setdefault(name, []).append((tuple(labels), value))
    return out


def _sane(value: float, limit: float) -> bool:
    return math.isfinite(value) and 0 <= value <= limit


@dataclass(frozen=True)
class Wanted:
    """What one service reads from its replicas: signal key -> how."""

    queue: bool = False
    kv_cache: bool = False
    metrics: tuple[MetricTarget, ...] = ()

    @classmethod
    def of(cls, policy: ReplicaPolicy) -> Wanted:
        return cls(
            queue=policy.target_queue_per_replica is not None,
            kv_cache=policy.target_kv_cache_usage is not None,
            metrics=tuple(policy.target_metrics or ()),
        )

    def names(self) -> set[str]:
        out = {m.name for m in self.metrics}
        if self.queue:
            out.update(QUEUE_METRICS)
            out.update(RUNNING_METRICS)
        if self.kv_cache:
            out.update(KV_CACHE_METRICS)
        return out

    def signals(self) -> list[str]:
        keys = [QUEUE, RUNNING] if self.queue else []
        if self.kv_cache:
            keys.append(KV_CACHE)
        keys.extend(metric_key(i) for i in range(len(self.metrics)))
        return keys


def signal_values(samples: Samples, wanted: Wanted) -> tuple[dict[str, float], dict[str, str]]:
    """Per signal key, one replica's value; and per key, why a value was refused (a lie).
    A key in neither: the replica does not export it."""
    values: dict[str, float] = {}
    lies: dict[str, str] = {}

    def first(names: Sequence[str]) -> tuple[str, list[tuple[Labels, float]]] | None:
        for name in names:
            if samples.get(name):
                return name, samples[name]
        return None

    def take(key: str, name: str, got: list[float], limit: float, mean: bool) -> None:
        bad = [v for v in got if not _sane(v, limit)]
        if bad:
            lies[key] = f"{name} = {bad[0]!r}"
        elif got:
            values[key] = sum(got) / len(got) if mean else sum(got)

    if wanted.queue:
        found = first(QUEUE_METRICS)
        if found:
            take(QUEUE, found[0], [v for _, v in found[1]], MAX_COUNT, mean=False)
        found = first(RUNNING_METRICS)
        if found:
            take(RUNNING, found[0], [v for _, v in found[1]], MAX_COUNT, mean=False)
    if wanted.kv_cache:
        found = first(KV_CACHE_METRICS)
        if found:  # a fraction: the mean over engines (data-parallel ranks), never a sum
            take(KV_CACHE, found[0], [v for _, v in found[1]], 1.0, mean=True)
    for i, m in enumerate(wanted.metrics):
        want = m.labels.items()
        got = [v for labels, v in samples.get(m.name, ()) if want <= dict(labels).items()]
        take(metric_key(i), m.name, got, MAX_GAUGE, mean=False)
    return values, lies


class MetricsTransport(Protocol):
    async def get(
        self, url: str, headers: Mapping[str, str], timeout_seconds: float, max_bytes: int = ...
    ) -> tuple[int, bytes, bool]: ...


@dataclass
class _Latest:
    at: float  # when the scrape round that read it started
    values: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why nothing was read


class MetricsClient:
    """The controller's metrics requests, every service's: at most `max_concurrent` at once
    (a replica that hangs holds one slot for a timeout, never the probes' all)."""

    def __init__(self, transport: MetricsTransport, max_concurrent: int = MAX_CONCURRENT) -> None:
        self.transport = transport
        self._slots = asyncio.Semaphore(max_concurrent)

    async def get(
        self, url: str, headers: Mapping[str, str], timeout_seconds: float
    ) -> tuple[int, bytes, bool]:
        async with self._slots:
            return await self.transport.get(url, headers, timeout_seconds, MAX_METRICS_BYTES)


class ReplicaMetrics:
    """One service's scrapes of its READY replicas, keyed by (service, replica id)."""

    def __init__(self, service: str, client: MetricsClient) -> None:
        self.service = service
        self.client = client
        self.latest: dict[ReplicaKey, _Latest] = {}
        self._task: asyncio.Task[None] | None = None
        self._started = float("-inf")
        self._told: set[tuple[ReplicaKey, str]] = set()  # lies and failures logged once
        self.rounds = 0  # scrape rounds finished

    def maybe_start(
        self,
        ready: Sequence[tuple[ReplicaId, str]],
        policy: ReplicaPolicy,
        headers: Mapping[str, str],
        now: float,
    ) -> None:
        """Start a scrape round of the READY replicas `(id, endpoint)` if none runs and the
        last one started `metrics_scrape_seconds` ago or more."""
        if self._task is not None and not self._task.done():
            return
        if now - self._started < policy.metrics_scrape_seconds:
            return
        self._started = now
        keep = {ReplicaKey(self.service, rid) for rid, _ in ready}
        for gone in set(self.latest) - keep:
            self.forget(gone.replica_id)
        if not ready:
            return
        timeout = min(MAX_TIMEOUT_SECONDS, policy.metrics_scrape_seconds)
        url_path = policy.metrics_path
        self._task = asyncio.create_task(
            self._round(list(ready), Wanted.of(policy), url_path, dict(headers), timeout, now)
        )

    async def _round(
        self,
        ready: list[tuple[ReplicaId, str]],
        wanted: Wanted,
        path: str,
        headers: dict[str, str],
        limit_s: float,
        now: float,
    ) -> None:
        try:
            await asyncio.gather(
                *(self._one(rid, ep, wanted, path, headers, limit_s, now) for rid, ep in ready)
            )
        except Exception:  # never let one replica's answer stop the scrapes
            log.exception("service %s: reading the replicas' metrics failed", self.service)
        self.rounds += 1

    async def _one(
        self,
        rid: ReplicaId,
        endpoint: str,
        wanted: Wanted,
        path: str,
        headers: dict[str, str],
        limit_s: float,
        now: float,
    ) -> None:
        key = ReplicaKey(self.service, rid)
        url = endpoint.rstrip("/") + path
        try:
            status, body, cut = await self.client.get(url, headers, limit_s)
        except Exception as e:  # ProbeError and its kin: no answer
            self._set(key, _Latest(now, error=f"{type(e).__name__}: {e}"))
            return
        if status != 200:
            self._set(key, _Latest(now, error=f"HTTP {status}"))
            return
        # A body cut at the limit: only its whole lines count (a number cut short is wrong).
        if cut:
            body = body[: body.rfind(b"\n") + 1]
        names = wanted.names()
        if len(body) > PARSE_INLINE_BYTES:
            samples = await asyncio.to_thread(_parse, body, names)
        else:
            samples = _parse(body, names)
        values, lies = signal_values(samples, wanted)
        for signal, why in lies.items():
            if (key, signal) not in self._told:
                self._told.add((key, signal))
                log.warning(
                    "service %s: replica %d reports %s: not a load, counted as missing "
                    "(said once per replica and signal)",
                    self.service,
                    rid,
                    why,
                )
        self._set(key, _Latest(now, values))

    def _set(self, key: ReplicaKey, latest: _Latest) -> None:
        self.latest[key] = latest

    def readings(
        self, ready_ids: Iterable[ReplicaId], policy: ReplicaPolicy, now: float
    ) -> dict[str, SignalReading]:
        """Per signal, what the READY replicas said in their latest scrape (older than three
        intervals and a timeout: missing)."""
        ids = list(ready_ids)
        stale = now - 3 * policy.metrics_scrape_seconds - MAX_TIMEOUT_SECONDS
        out: dict[str, SignalReading] = {}
        for signal in Wanted.of(policy).signals():
            got = []
            for rid in ids:
                latest = self.latest.get(ReplicaKey(self.service, rid))
                if latest is not None and latest.at >= stale and signal in latest.values:
                    got.append(latest.values[signal])
            out[signal] = SignalReading(
                mean=sum(got) / len(got) if got else None,
                peak=max(got) if got else None,
                answered=len(got),
                ready=len(ids),
                pairs=self._pairs(ids, stale) if signal == RUNNING else (),
            )
        return out

    def _pairs(self, ids: list[ReplicaId], stale: float) -> tuple[tuple[float, float], ...]:
        """(running, waiting) of each replica whose latest scrape reported both."""
        out = []
        for rid in ids:
            latest = self.latest.get(ReplicaKey(self.service, rid))
            if latest is not None and latest.at >= stale:
                values = latest.values
                if RUNNING in values and QUEUE in values:
                    out.append((values[RUNNING], values[QUEUE]))
        return tuple(out)

    def forget(self, replica_id: ReplicaId) -> None:
        key = ReplicaKey(self.service, replica_id)
        self.latest.pop(key, None)
        self._told = {t for t in self._told if t[0] != key}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.latest.clear()


def _parse(body: bytes, names: set[str]) -> Samples:
    return parse_samples(body.decode("utf-8", errors="replace"), names)
