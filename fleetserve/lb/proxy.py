"""The data plane: a lean streaming HTTP/1.1 reverse proxy on raw asyncio protocols.

httptools (llhttp) parses both sides only to find where each message ends; the bytes of a
response pass through to the client as they arrive (SSE and token streams stay streams) and
request bodies are streamed to the replica with back-pressure both ways, never buffered whole.
Why not a framework: a request through aiohttp's server and client costs about ten times what
this path costs (bench/lb), and the load balancer is the one component every request crosses.

`Proxy` listens, holds what every connection shares (limits, replicas, pool, metrics) and
sweeps the connections for timeouts. Its parts: `client` (a client connection), `exchange`
(one request), `upstream` (replica connections) and `http` (pure HTTP helpers).
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import ssl
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from fleetserve.core.clock import Monotonic, SystemClock
from fleetserve.lb.client import ClientConn
from fleetserve.lb.config import LbConfig
from fleetserve.lb.exchange import ExchangeContext
from fleetserve.lb.http import Limits, error_response
from fleetserve.lb.kv_events import KvEventsFollower
from fleetserve.lb.metrics import LoadTracker, Metrics
from fleetserve.lb.mover import Mover
from fleetserve.lb.priority import priority_hints
from fleetserve.lb.replica_load import ReplicaLoadPoller
from fleetserve.lb.replica_set import ReplicaSet
from fleetserve.lb.upstream import Pool

DEFAULT_MAX_CONNECTIONS = 10_000
# move_waiting_requests without replica_metrics_seconds: read the replicas' queues this often.
MOVE_READ_SECONDS = 2.0
# At a stop, how long a connection accepted before it may take to send its first request.
FIRST_REQUEST_GRACE = 1.0


def listen_addresses(host: str, port: int) -> list[tuple[int, int, tuple[Any, ...]]]:
    """(family, protocol, address) of each socket a load balancer listens on for host:port
    (one per address `host` resolves to, each once)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[tuple[int, int, tuple[Any, ...]]] = []
    for family, _, proto, _, address in infos:
        if all((family, address) != (f, a) for f, _, a in out):
            out.append((family, proto, address))
    return out


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on host:port (`listen_addresses`), with SO_REUSEPORT: what `serve`
    binds, made ahead so that another process can hold them too (a worker's queue outlives
    the worker: fleetserve.lb.workers)."""
    made: list[socket.socket] = []
    try:
        for family, proto, address in listen_addresses(host, port):
            sock = socket.socket(family, socket.SOCK_STREAM, proto)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
            sock.setblocking(False)
    except OSError:
        for sock in made:
            sock.close()
        raise
    return made


class Proxy:
    def __init__(
        self,
        config: LbConfig,
        replicas: ReplicaSet,
        metrics: Metrics | None = None,
        load: LoadTracker | None = None,
        wake: Callable[[], Coroutine[Any, Any, None]] | None = None,
        max_connections: int | None = None,
        clock: Monotonic | None = None,
    ) -> None:
        # Durations and deadlines read this (fleetserve.core.clock; a fake one in tests); the
        # event loop's timers run on real time.
        self.monotonic = (clock or SystemClock()).monotonic
        self.config = config
        self.opts = config.options
        self.limits = Limits.of(self.opts)
        # build.connection_limit derives it from the file-descriptor limit when unset.
        self.max_connections = (
            max_connections or self.opts.max_connections or DEFAULT_MAX_CONNECTIONS
        )
        self.busy = error_response(
            503,
            "too_many_connections",
            f"this load balancer holds its {self.max_connections} connections; retry shortly",
            close=True,
            extra={"Retry-After": "1"},
        )
        self.per_client_limit = self.opts.max_connections_per_client
        self.per_client: dict[bytes, int] = {}  # open connections by client address
        self.busy_client = error_response(
            503,
            "too_many_connections_from_client",
            f"this client address holds {self.per_client_limit} connections to this load "
            "balancer; close some, or retry shortly",
            close=True,
            extra={"Retry-After": "1"},
        )
        self.replicas = replicas
        self.metrics = metrics or Metrics(config.service, config.policy)
        self.load = load or LoadTracker()
        self.keys = [k.encode() for k in self.opts.api_keys]
        self.draining = False  # stopping (`close`): no connection is kept alive
        self.drain_until: float | None = None  # `close`'s deadline (loop time)
        self.drain_cap: float | None = None  # `shorten_drain` before `close` began
        # TLS connections accepted whose handshake may not be done (weak: one that failed
        # its handshake never becomes a client and goes with its transport).
        self.handshaking: weakref.WeakSet[ClientConn] = weakref.WeakSet()
        self.pool = Pool(self.opts.connect_timeout_seconds, self.monotonic)
        # What every connection's exchanges share: made once, handed to each ClientConn.
        self.shared = ExchangeContext(
            service=config.service,
            limits=self.limits,
            replicas=replicas,
            pool=self.pool,
            metrics=self.metrics,
            load=self.load,
            monotonic=self.monotonic,
            read_timeout=self.opts.read_timeout_seconds,
            max_attempts=self.opts.max_attempts,
            hold_when_empty=config.hold_when_empty,
            queue_size=self.opts.queue_size,
            queue_timeout=self.opts.queue_timeout_seconds,
            wake=wake,
            priority=priority_hints(
                self.opts.engine_priority,
                self.opts.engine_priority_ms_per_block,
                self.opts.cache_block_chars,
            ),
        )
        if self.opts.move_waiting_requests:
            self.shared.unanswered = {}
        self.mover: Mover | None = None  # move_waiting_requests
        self._server: asyncio.Server | None = None
        # More listening sockets served by this process: a worker's second address family,
        # or another worker's sockets while that worker is down (fleetserve.lb.workers).
        self._more: list[asyncio.Server] = []
        self.clients: set[ClientConn] = set()  # open client connections (drained on close)
        self._sweeper: asyncio.TimerHandle | None = None
        self._load_poller: ReplicaLoadPoller | None = None  # ReadsReportedLoad's
        self.kv_events: KvEventsFollower | None = None  # the engines' KV cache events
        self._kv_events_started = False
        # Timeouts are checked by one sweep over the connections, not a timer per request,
        # and connections stamp their times with the clock the sweep reads (no clock read
        # per request): a stamp is at most one sweep old, so a timeout is given one sweep
        # more, never less.
        shortest = min(self.limits.header_timeout, self.limits.idle_timeout)
        self.sweep_seconds = min(1.0, max(0.05, shortest / 4))
        self.shared.clock = self.monotonic()

    @property
    def clock(self) -> float:
        """The sweep's clock: monotonic seconds, at most one sweep old."""
        return self.shared.clock

    @property
    def queued(self) -> int:
        """Requests waiting for a first replica (ExchangeContext.hold)."""
        return self.shared.queued

    def _sweep(self) -> None:
        now = self.shared.clock = self.monotonic()
        head_since = now - self.sweep_seconds - self.limits.header_timeout
        idle_since = now - self.sweep_seconds - self.limits.idle_timeout
        for client in list(self.clients):
            client.check_deadline(head_since, idle_since)
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(self.sweep_seconds, self._sweep)

    def authorized(self, header: bytes | None) -> bool:
        if not self.keys:
            return True
        scheme, _, token = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        given = token.strip()
        return any(hmac.compare_digest(given, key) for key in self.keys)

    async def serve(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
        sockets: list[socket.socket] | None = None,
    ) -> asyncio.Server:
        """Listen; with `reuse_port` several worker processes share the port (SO_REUSEPORT)
        and the kernel spreads connections over them. `sockets`: listen on these (made by
        `listening_sockets`, owned from now on) instead of binding new ones."""
        loop = asyncio.get_running_loop()
        if sockets:
            servers = await self.listen_on(sockets, ssl_context)
            self._server = servers[0]
            self._more.remove(servers[0])
        else:
            self._server = await loop.create_server(
                self._factory(ssl_context),
                host,
                port,
                backlog=2048,
                reuse_address=True,
                reuse_port=reuse_port or None,
                ssl=ssl_context,
                # A TLS handshake is part of reading the first head (and not yet a counted
                # connection): it gets the same time.
                ssl_handshake_timeout=self.limits.header_timeout if ssl_context else None,
            )
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.sweep_seconds, self._sweep)
        if self.kv_events is not None and not self._kv_events_started:
            self._kv_events_started = True
            self.kv_events.start()
        reported = self.replicas.caps.reported  # a policy that reads the replicas' load
        unanswered = self.shared.unanswered  # move_waiting_requests
        every = self.opts.replica_metrics_seconds
        if every is None and unanswered is not None:
            every = MOVE_READ_SECONDS
        # The policy counts the replicas' reported load only when asked to
        # (replica_metrics_seconds set), not because the mover reads the metrics.
        counted = reported if self.opts.replica_metrics_seconds else None
        if (counted is not None or unanswered is not None) and every and not self._load_poller:
            replicas = self.replicas  # its set is replaced by each push: read it each round
            poller = self._load_poller = ReplicaLoadPoller(
                every,
                self.opts.replica_metrics_path,
                lambda: [(rid, u.url) for rid, u in replicas.upstreams.items()],
                counted if counted is not None else {},
            )
            if unanswered is not None:
                self.mover = Mover(
                    poller.queues,
                    lambda: replicas.upstreams,
                    replicas.inflight,
                    unanswered,
                    on_moved=self.metrics.moved,
                    failed=self.shared.move_failed,
                    # A canary's percentage and replicas of different weights are the
                    # routing's own split: moves would break it.
                    allowed=lambda: (
                        replicas.canary is None and len(set(replicas.weights.values())) <= 1
                    ),
                    monotonic=self.monotonic,
                )
                poller.on_round = self.mover.round
            poller.start()
            if counted is not None:
                self.metrics.watch_reported(counted)
        if self.replicas.caps.weighs_prefill is not None:
            self.metrics.watch_queued_blocks(self.replicas.prefilling)
        return self._server

    async def listen_on(
        self, sockets: list[socket.socket], ssl_context: ssl.SSLContext | None, copy: bool = False
    ) -> list[asyncio.Server]:
        """Accept connections on `sockets` too; with `copy`, on duplicates of them, so that
        stopping (`stop_listening`) leaves the sockets, and their queues, open."""
        loop = asyncio.get_running_loop()
        servers = []
        for sock in sockets:
            server = await loop.create_server(
                self._factory(ssl_context),
                sock=sock.dup() if copy else sock,
                backlog=2048,
                ssl=ssl_context,
                ssl_handshake_timeout=self.limits.header_timeout if ssl_context else None,
            )
            servers.append(server)
        self._more.extend(servers)
        return servers

    def _factory(self, ssl_context: ssl.SSLContext | None) -> Callable[[], ClientConn]:
        """The protocol factory: called at accept. A TLS connection is a client (its
        `connection_made`) only once its handshake is done: until then `handshaking` holds
        it, so that a stop gives it the first request's grace too."""
        if ssl_context is None:
            return lambda: ClientConn(self, self.shared)

        def accepted() -> ClientConn:
            conn = ClientConn(self, self.shared)
            self.handshaking.add(conn)
            return conn

        return accepted

    def stop_listening(self, servers: list[asyncio.Server]) -> None:
        for server in servers:
            server.close()
            if server in self._more:
                self._more.remove(server)

    def shorten_drain(self, seconds: float) -> None:
        """Let the requests in progress have at most `seconds` more (a retirement's long
        drain cut to a stop's)."""
        self.drain_cap = seconds if self.drain_cap is None else min(self.drain_cap, seconds)
        if self.drain_until is not None:
            self.drain_until = min(self.drain_until, asyncio.get_running_loop().time() + seconds)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self, drain_seconds: float = 5.0) -> None:
        """Stop listening at once; let requests in progress finish (up to `drain_seconds`),
        then close every connection. (Python 3.11's Server.wait_closed does not wait for
        connections, so the proxy tracks them itself.)"""
        if self._server is not None:
            self._server.close()
        self.stop_listening(list(self._more))
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._load_poller is not None:
            await self._load_poller.stop()
            self._load_poller = None
        if self.kv_events is not None and self._kv_events_started:
            self._kv_events_started = False
            await self.kv_events.stop()
        loop = asyncio.get_running_loop()  # (real time: this waits for real)
        now = loop.time()
        if self.drain_cap is not None:
            drain_seconds = min(drain_seconds, self.drain_cap)
        self.drain_until = now + drain_seconds
        # From now on a connection closes once its requests are answered, and one idle between
        # requests closes at once. One accepted before the stop whose first request is not read
        # yet (its client sent it, or is sending it) gets a moment for it: closing it unread
        # would fail a request the client had every reason to think accepted.
        self.draining = True
        first_by = now + min(FIRST_REQUEST_GRACE, drain_seconds)
        for client in list(self.clients):
            if client.idle():
                client.close()
        while (now := loop.time()) < self.drain_until and (
            any(c.busy(now < first_by) for c in self.clients)
            or (now < first_by and any(c.transport is None for c in self.handshaking))
        ):
            await asyncio.sleep(0.05)
        for client in list(self.clients):
            client.close()
        self.pool.close()
