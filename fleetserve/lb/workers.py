"""Several load-balancer processes on one port.

The process the controller starts (the primary) serves traffic, runs the admin API and starts
`workers - 1` more processes that serve traffic too; all of them listen on the service's port
with SO_REUSEPORT, so the kernel spreads connections over them. Each extra worker holds a
control channel (a socket pair) to the primary: replica-set pushes are relayed down it at once,
and the primary asks each worker for its load report and metrics when it is asked for them,
adding them up. A worker exits when its channel closes (the primary is gone); the primary
restarts a worker that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from fleetserve.lb.messages import LoadReport, ReplicaLoad, ReplicaPush, ReplicaTotals

log = logging.getLogger("fleetserve.lb")
PARENT_ENV = "FLEETSERVE_LB_PARENT"


@dataclass
class _Link:
    index: int
    proc: subprocess.Popen[bytes]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _replicas_message(push: ReplicaPush) -> dict[str, Any]:
    """A push as the control channel carries it to a worker (which reads it back with
    `ReplicaPush`): {"op": "replicas", "replicas": [...], "canary": {...} or null}."""
    return {"op": "replicas", **push.model_dump(mode="json")}


class Supervisor:
    def __init__(self, config_path: Path, count: int) -> None:
        self.config_path = config_path
        self.count = count
        self.links: dict[int, _Link] = {}
        self.pushed: ReplicaPush | None = None  # the last push, for a worker (re)started later
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for index in range(1, self.count):
            await self._spawn(index)
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _spawn(self, index: int) -> None:
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ)
        env[PARENT_ENV] = str(os.getpid())
        cmd = [
            sys.executable,
            "-m",
            "fleetserve.lb",
            "--config",
            str(self.config_path),
            "--worker",
            str(index),
            "--control-fd",
            str(child_end.fileno()),
        ]
        proc = subprocess.Popen(cmd, pass_fds=[child_end.fileno()], env=env)
        child_end.close()
        reader, writer = await asyncio.open_connection(sock=parent_end)
        link = _Link(index, proc, reader, writer)
        self.links[index] = link
        if self.pushed is not None and self.pushed.replicas:
            await self._send(link, _replicas_message(self.pushed))
        log.info("worker %s started (pid %s)", index, proc.pid)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for index, link in list(self.links.items()):
                if link.proc.poll() is not None:
                    log.warning(
                        "worker %s exited with %s: restarting it", index, link.proc.returncode
                    )
                    link.writer.close()
                    await self._spawn(index)

    async def _send(self, link: _Link, msg: dict[str, Any]) -> None:
        link.writer.write(json.dumps(msg).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await link.writer.drain()

    async def push(self, push: ReplicaPush) -> None:
        self.pushed = push
        msg = _replicas_message(push)
        for link in list(self.links.values()):
            await self._send(link, msg)

    async def reports(self) -> list[dict[str, Any]]:
        """Each live worker's {"load": ..., "metrics": "<prometheus text>"}."""

        async def ask(link: _Link) -> dict[str, Any] | None:
            async with link.lock:
                try:
                    await self._send(link, {"op": "report"})
                    line = await asyncio.wait_for(link.reader.readline(), 2)
                    return dict(json.loads(line)) if line else None
                except (TimeoutError, ValueError, ConnectionError):
                    return None

        answers = await asyncio.gather(*(ask(link) for link in list(self.links.values())))
        return [a for a in answers if a is not None]

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for link in self.links.values():
            if link.proc.poll() is None:
                link.proc.terminate()  # a stop, not a crash: the worker goes at once
            link.writer.close()
        for link in self.links.values():
            try:
                await asyncio.to_thread(link.proc.wait, 5)
            except subprocess.TimeoutExpired:
                link.proc.kill()


def merge_load(reports: Iterable[LoadReport]) -> LoadReport:
    """Add up the load reports of several workers (rates, totals, in-flight, queued); the
    rest (window, latency bounds) is the first one's."""
    merged: LoadReport | None = None
    replicas: dict[str, ReplicaLoad] = {}
    totals: dict[str, ReplicaTotals] = {}  # counters: sums (fleetserve.lb.metrics.totals)
    for r in reports:
        if merged is None:
            merged = r.model_copy()
        else:
            merged.requests_per_second += r.requests_per_second
            merged.total_requests += r.total_requests
            merged.queued += r.queued
            merged.at = max(merged.at, r.at)
        for rid, v in r.replicas.items():
            slot = replicas.setdefault(rid, ReplicaLoad())
            slot.inflight += v.inflight
            slot.requests_per_second += v.requests_per_second
        for key, t in r.totals.items():
            into = totals.setdefault(key, ReplicaTotals())
            into.requests += t.requests
            into.errors += t.errors
            counts = t.latency
            into.latency = [
                a + b for a, b in zip(into.latency or [0] * len(counts), counts, strict=False)
            ]
    return (merged or LoadReport()).model_copy(update={"replicas": replicas, "totals": totals})


class MergedMetrics(Collector):
    """Prometheus families from several workers' expositions, samples with the same name and
    labels added up (counters, histogram buckets and in-flight gauges are all sums)."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = list(texts)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for text in self.texts:
            for fam in text_string_to_metric_families(text):
                if fam.name not in families:
                    families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    sums[fam.name] = {}
                slot = sums[fam.name]
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    slot[key] = slot.get(key, 0.0) + s.value
        for name, metric in families.items():
            for (sample, labels), value in sums[name].items():
                metric.add_sample(sample, dict(labels), value)
            yield metric
