"""Several load-balancer processes on one port.

The process the controller starts (the primary) serves traffic, runs the admin API and starts
`workers - 1` more processes that serve traffic too; all of them listen on the service's port
with SO_REUSEPORT, so the kernel spreads connections over them. Each extra worker holds a
control channel (a socket pair) to the primary: replica-set pushes are relayed down it at once,
and the primary asks each worker for its load report and metrics when it is asked for them,
adding them up. With cache_aware the processes share one prefix index over the same
channels (fleetserve.lb.index_share): the primary relays each worker's batches to the others.
With round_robin they take turns from one counter in shared memory (fleetserve.lb.rotation).
A worker exits when its channel closes (the primary is gone); the primary restarts a worker
that died.

The primary makes every process's listening sockets itself and keeps them: a worker gets its
own (and the primary's) by descriptor. So a worker that dies does not take its socket, and the
connections queued on it, along: the primary serves that socket itself from the moment the
worker's channel closes (or, at start, until the worker says it is ready) until the worker
that replaces it is ready. What a dead worker loses is only the connections it had accepted.
Likewise a worker whose primary was killed serves the primary's socket while it lingers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from fleetserve.lb.config import PARENT_ENV
from fleetserve.lb.index_share import (
    CHANNEL_LIMIT,
    KEY_ENV,
    IndexShare,
    channel_full,
    gone_line,
    is_share,
)
from fleetserve.lb.messages import LoadReport, ReplicaLoad, ReplicaPush, ReplicaTotals
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.rotation import FD_ENV as ROTATION_FD_ENV

log = logging.getLogger("fleetserve.lb")
# A stop (SIGTERM: `down`, a controller's orphan sweep): the requests in progress get this long.
# A retirement (SIGQUIT: replaced by a load balancer with new settings) gets the config's
# drain_seconds instead (fleetserve.lb.config).
STOP_DRAIN_SECONDS = 5.0
WORKER_EXIT_MARGIN = 3.0  # past its drain, a worker that has not exited is killed


@dataclass
class _Link:
    index: int
    proc: subprocess.Popen[bytes]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Lines on the channel that are not share batches: answers to "report".
    answers: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    reading: asyncio.Task[None] | None = None


def _replicas_message(push: ReplicaPush) -> dict[str, Any]:
    """A push as the control channel carries it to a worker (which reads it back with
    `ReplicaPush`): {"op": "replicas", "replicas": [...], "canary": {...} or null}."""
    return {"op": "replicas", **push.model_dump(mode="json")}


class Supervisor:
    def __init__(
        self,
        config_path: Path,
        count: int,
        index_key: bytes | None = None,
        rotation_fd: int | None = None,
        listeners: dict[int, list[socket.socket]] | None = None,
        proxy: Proxy | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.config_path = config_path
        self.count = count
        self.links: dict[int, _Link] = {}
        # Each process's listening sockets, made and kept by the primary (index 0: its own).
        self.listeners = listeners or {}
        self.proxy = proxy  # the primary's: it serves a worker's sockets while it is down
        self.tls = tls
        self.covering: dict[int, list[asyncio.Server]] = {}
        self._stopping = False
        self._restarting: set[int] = set()
        self.pushed: ReplicaPush | None = None  # the last push, for a worker (re)started later
        self._watch: asyncio.Task[None] | None = None
        self.index_key = index_key  # cache_aware's shared secret, handed to each worker
        self.share: IndexShare | None = None  # the primary's side of the shared index
        self.rotation_fd = rotation_fd  # round_robin's shared counter (fleetserve.lb.rotation)

    def share_index(self, share: IndexShare) -> None:
        """Relay the workers' index batches to each other and apply them here (this
        process's own batches go to every worker: `broadcast`)."""
        self.share = share

    async def start(self) -> None:
        for index in range(1, self.count):
            await self.cover(index)  # the kernel sends it connections before it is ready
            await self._spawn(index)
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def cover(self, index: int) -> None:
        """Serve worker `index`'s sockets here (their queue, and what the kernel sends them)
        until it says it is ready."""
        socks = self.listeners.get(index)
        if self.proxy is None or not socks or index in self.covering:
            return
        self.covering[index] = await self.proxy.listen_on(socks, self.tls, copy=True)

    def uncover(self, index: int) -> None:
        servers = self.covering.pop(index, None)
        if servers and self.proxy is not None:
            self.proxy.stop_listening(servers)

    async def _spawn(self, index: int) -> None:
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ)
        env[PARENT_ENV] = str(os.getpid())
        if self.index_key is not None:
            env[KEY_ENV] = self.index_key.hex()
        fds = [child_end.fileno()]
        if self.rotation_fd is not None:
            env[ROTATION_FD_ENV] = str(self.rotation_fd)
            fds.append(self.rotation_fd)
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
        own = [s.fileno() for s in self.listeners.get(index, [])]
        primary = [s.fileno() for s in self.listeners.get(0, [])]
        if own:
            cmd += ["--listen-fds", ",".join(map(str, own))]
        if primary:
            cmd += ["--primary-fds", ",".join(map(str, primary))]
        proc = subprocess.Popen(cmd, pass_fds=[*fds, *own, *primary], env=env)
        child_end.close()
        reader, writer = await asyncio.open_connection(sock=parent_end, limit=CHANNEL_LIMIT)
        if self._stopping:  # stopped meanwhile: this one never serves
            proc.kill()
            writer.close()
            await asyncio.to_thread(proc.wait)
            return
        link = _Link(index, proc, reader, writer)
        self.links[index] = link
        link.reading = asyncio.get_running_loop().create_task(self._read_loop(link))
        if self.pushed is not None and self.pushed.replicas:
            await self._send(link, _replicas_message(self.pushed))
        if self.share is not None:  # the index so far: the new worker starts where we are
            for line in self.share.snapshot_lines():
                writer.write(line)
        writer.write(b'{"op": "start"}\n')  # all it needs is there: it may listen
        log.info("worker %s started (pid %s)", index, proc.pid)

    async def _read_loop(self, link: _Link) -> None:
        """A worker's lines: its index batches (applied here, passed on to the others) and
        its answers to "report"."""
        while True:
            try:
                line = await link.reader.readline()
            except (ValueError, ConnectionError) as e:  # (ValueError: a line over the limit)
                log.warning("worker %s: control channel: %s", link.index, e)
                break
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if is_share(msg):
                if self.share is not None:
                    self.share.apply(msg)
                    self.broadcast(line, but=link.index)
            elif msg.get("op") == "ready":  # it accepts on its sockets: no need to cover it
                self.uncover(link.index)
            else:
                link.answers.put_nowait(msg)
        # The channel closed: the worker is gone (or going). Take over its sockets now, not
        # at the next watch round, and start another one.
        if not self._stopping:
            asyncio.get_running_loop().create_task(self._lost(link))

    async def _lost(self, link: _Link) -> None:
        index = link.index
        if self._stopping or index in self._restarting or self.links.get(index) is not link:
            return
        self._restarting.add(index)
        try:
            await self.cover(index)
            for _ in range(50):  # its channel is closed: it is exiting
                if link.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            else:
                link.proc.kill()
                await asyncio.to_thread(link.proc.wait, 5)
            log.warning("worker %s exited with %s: restarting it", index, link.proc.returncode)
            link.writer.close()
            if link.reading is not None and link.reading is not asyncio.current_task():
                link.reading.cancel()
            if self.share is not None:  # its requests are no longer in flight
                self.share.forget_peer(index)
                self.broadcast(gone_line(index), but=index)
            if not self._stopping:
                await self._spawn(index)
        finally:
            self._restarting.discard(index)

    def broadcast(self, line: bytes, but: int | None = None) -> None:
        """An index batch to every worker (but the one it came from); dropped for a worker
        whose channel is full (it misses those records, nothing waits)."""
        for index, link in self.links.items():
            if index == but:
                continue
            if channel_full(link.writer):
                if self.share is not None:
                    self.share.dropped_batches += 1
                continue
            link.writer.write(line)

    async def _watch_loop(self) -> None:
        """A worker that exited without its channel closing first (or one that fails
        again and again at start) is restarted here, once a second at most."""
        while True:
            await asyncio.sleep(1.0)
            for link in list(self.links.values()):
                if link.proc.poll() is not None:
                    await self._lost(link)

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
                while not link.answers.empty():  # a late answer to an earlier question
                    link.answers.get_nowait()
                try:
                    await self._send(link, {"op": "report"})
                    return await asyncio.wait_for(link.answers.get(), 2)
                except (TimeoutError, ConnectionError):
                    return None

        answers = await asyncio.gather(*(ask(link) for link in list(self.links.values())))
        return [a for a in answers if a is not None]

    def hurry(self) -> None:
        """Retiring, then told to stop: the workers' drains cut to a stop's (SIGTERM)."""
        for link in self.links.values():
            if link.proc.poll() is None:
                link.proc.send_signal(signal.SIGTERM)

    async def stop(self, drain_seconds: float = STOP_DRAIN_SECONDS, retire: bool = False) -> None:
        """Stop the workers: SIGTERM (they drain up to STOP_DRAIN_SECONDS), or with `retire`
        SIGQUIT (up to the config's drain_seconds, as this process); killed past
        `drain_seconds` and a margin."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        # A worker not ready yet may not handle SIGQUIT yet (Python's default: dump core): it
        # serves nothing, so a stop (SIGTERM) is all it needs.
        unready = set(self.covering)
        for index in list(self.covering):
            self.uncover(index)
        # The workers' sockets leave with the workers: kept open here while this process
        # drains, the kernel would go on queueing connections on them. (A load balancer that
        # replaces this one holds the same sockets (fleetserve.lb.handover) and takes what
        # queues there; one that could not take them over never would.)
        for index, socks in self.listeners.items():
            if index != 0:
                for sock in socks:
                    sock.close()
        for link in self.links.values():
            if link.reading is not None:
                link.reading.cancel()
            if link.proc.poll() is None:  # a stop, not a crash: the worker drains and goes
                quit_ = retire and link.index not in unready
                # Said on the channel first: a worker that saw the channel close before its
                # signal took it for its primary's death and went on serving the old settings
                # (for LINGER_SECONDS, on the primary's sockets too) beside the new load balancer.
                link.writer.write(json.dumps({"op": "stop", "retire": quit_}).encode() + b"\n")
                link.proc.send_signal(signal.SIGQUIT if quit_ else signal.SIGTERM)
            # A half-close: the worker reads what was sent, then the end. (Closed with bytes of
            # the worker's still unread, the channel would be reset, and a worker busy at that
            # instant would get the reset before the lines waiting in its buffer.)
            if link.writer.can_write_eof():
                with contextlib.suppress(OSError):
                    link.writer.write_eof()
            else:
                link.writer.close()

        async def reap(proc: subprocess.Popen[bytes]) -> None:
            try:
                await asyncio.to_thread(proc.wait, drain_seconds + WORKER_EXIT_MARGIN)
            except subprocess.TimeoutExpired:
                proc.kill()

        await asyncio.gather(*(reap(link.proc) for link in self.links.values()))
        for link in self.links.values():
            link.writer.close()


def _add_counts(a: list[int], b: list[int]) -> list[int]:
    """Two histograms' cumulative counts added up; an empty one (none kept) adds nothing."""
    if not a or not b:
        return list(a or b)
    return [x + y for x, y in zip(a, b, strict=False)]


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
            into.latency = _add_counts(into.latency, t.latency)
            into.first_byte = _add_counts(into.first_byte, t.first_byte)
    return (merged or LoadReport()).model_copy(update={"replicas": replicas, "totals": totals})


class MergedMetrics(Collector):
    """Prometheus families from several workers' expositions, samples with the same name and
    labels added up (counters, histogram buckets and in-flight gauges are all sums), but for
    what is not a sum: a `_created` timestamp is the earliest one, and the gauges in
    `MAX_FAMILIES` (a maximum, or the same reading taken by each worker) the largest."""

    MAX_FAMILIES = frozenset(
        {"fleetserve_lb_choice_extra_load_max", "fleetserve_lb_replica_reported_load"}
    )

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
                    was = slot.get(key)
                    if was is None:
                        slot[key] = s.value
                    elif s.name.endswith("_created"):
                        slot[key] = min(was, s.value)
                    elif fam.name in self.MAX_FAMILIES:
                        slot[key] = max(was, s.value)
                    else:
                        slot[key] = was + s.value
        for name, metric in families.items():
            for (sample, labels), value in sums[name].items():
                metric.add_sample(sample, dict(labels), value)
            yield metric
