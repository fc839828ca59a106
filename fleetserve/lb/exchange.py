"""One request's life: the replica it goes to, its body streamed there (and kept while small),
another replica when it was not sent, the read timeout, and the status it ends with.

A request goes to another replica only when it was not sent: the connection failed, or a
pooled connection turned out closed before the request got any answer (and its whole body can
be sent again). An `Upgrade` (WebSocket) becomes a raw two-way tunnel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetserve.lb.http import HIGH_WATER, Limits, error_response
from fleetserve.lb.metrics import LoadTracker, Metrics
from fleetserve.lb.priority import PriorityHints
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.lb.upstream import Pool, UpstreamConn
from fleetserve.policies.capabilities import TracksSends
from fleetserve.policies.lb import NO_KEY, RequestKey

SMALL_PIECE = 4096  # body pieces below this are gathered into one buffer while held
log = logging.getLogger("fleetserve.lb")
REPLAY_BYTES = 64 * 1024  # a body up to this size is kept until answered, to retry elsewhere
HELD_HEAD_BYTES = 64 * 1024  # move_waiting_requests: a head held past this size goes out
NO_HEADERS: dict[bytes, bytes] = {}  # a response the LB gives itself reads none (never written)


@dataclass(slots=True, eq=False)
class ExchangeContext:
    """What the exchanges of one load balancer process share, made once by the proxy
    (fleetserve.lb.proxy.Proxy) and handed to each client connection and exchange: the
    collaborators an exchange calls, and the few settings it reads."""

    service: str
    limits: Limits
    replicas: ReplicaSet  # the routable replicas, and the policy's capabilities (`caps`)
    pool: Pool
    metrics: Metrics
    load: LoadTracker
    monotonic: Callable[[], float]  # the load balancer's clock (fleetserve.core.clock)
    read_timeout: float  # load_balancer.read_timeout_seconds
    max_attempts: int  # load_balancer.max_attempts
    hold_when_empty: bool  # no ready replica: wait for one (a service that scales from zero)
    queue_size: int  # ... at most this many requests wait
    queue_timeout: float  # ... each at most this long
    wake: Callable[[], Coroutine[Any, Any, None]] | None = None  # asks the controller for one
    # load_balancer.engine_priority: writes the request's priority hint into its head
    # (fleetserve.lb.priority); None when off.
    priority: PriorityHints | None = None
    # The sweep's clock: monotonic seconds, at most one sweep old (the proxy's sweep sets it).
    clock: float = 0.0
    queued: int = 0  # requests waiting for a first replica
    wake_task: asyncio.Task[None] | None = None
    # move_waiting_requests (fleetserve.lb.mover): the requests sent and not yet answered, per
    # replica, oldest first; None when the option is off (nothing is listed or held).
    unanswered: dict[int, dict[Any, None]] | None = None
    # ... and when a moved request last found a target that did not answer it (replica id ->
    # monotonic seconds): the mover leaves that replica alone for a while.
    move_failed: dict[int, float] = field(default_factory=dict)

    async def hold(self) -> bytes | None:
        """No replica is ready and the service scales from zero: wait for one (bounded).
        Returns the refusal to send, or None once a replica is ready."""
        service = self.service
        if self.queued >= self.queue_size:
            return error_response(
                503,
                "queue_full",
                f"service {service!r} is starting from zero and {self.queued} requests are "
                "already waiting; retry later",
                extra={"Retry-After": "5"},
            )
        self.queued += 1
        self.metrics.set_queued(self.queued)
        try:
            if self.wake is not None:
                self.wake_task = asyncio.get_running_loop().create_task(self.wake())
            if await self.replicas.wait_ready(self.queue_timeout):
                return None
        finally:
            self.queued -= 1
            self.metrics.set_queued(self.queued)
        return error_response(
            503,
            "no_ready_replicas",
            f"service {service!r} had no READY replica within {self.queue_timeout:g} s",
            extra={"Retry-After": "5"},
        )


class ClientSide(Protocol):
    """The client connection an exchange answers (fleetserve.lb.client.ClientConn)."""

    closed: bool

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def tunnel_to(self, ex: Exchange) -> None: ...

    def exchange_done(self, ex: Exchange) -> None: ...

    def closing_after(self, ex: Exchange) -> bool:
        """The connection closes after `ex`'s answer (a stopping load balancer, nothing
        pipelined behind it): its head says `Connection: close`."""
        ...


class _NotSent(Exception):
    """The request did not reach a replica: another one may take it."""


class _BodyLate(Exception):
    """A policy waited for the body longer than a head may take (header_timeout_seconds)."""


class Body:
    """A request's body on its way to a replica: held until a replica is attached (small
    pieces gathered into one buffer), kept while small to send again (`replay`), and what a
    policy that reads the body (ReadsBody) waits for and keys on."""

    __slots__ = (
        "choose_at",
        "complete",
        "event",
        "held",
        "key",
        "key_later",
        "late",
        "replay",
        "replay_size",
        "seen",
        "size",
    )

    def __init__(self, complete: bool) -> None:
        # Buffered until a replica is attached (small pieces gathered into a bytearray).
        self.held: list[bytes | bytearray] = []
        self.size = 0  # bytes held
        self.complete = complete
        self.event: asyncio.Event | None = None  # made when a policy waits for the body
        # A policy that reads the body chooses when this much of the body (or all of it) is
        # here, without a task if it can (0: not waiting); a late body gets a task that
        # answers 408.
        self.choose_at = 0
        # When the last body bytes came (or the wait began), on the proxy's sweep clock: the
        # sweep gives a silent body a 408 (ClientConn.check_deadline), no timer per request.
        self.seen = 0.0
        self.late = False  # no body bytes for header_timeout_seconds: a 408
        self.replay: list[bytes | bytearray] | None = []  # what was sent, while it is small
        self.replay_size = 0
        self.key: RequestKey | None = None  # a body policy's key, made once
        # A body whose key the policy completes off the event loop, in the task
        # (CompletesKeyOffLoop: cache_aware's precise mode tokenizes a long prompt).
        self.key_later: bytes | None = None


class Exchange:
    """One request and its response.

    The common case runs without a task: the request is written to an idle pooled connection
    as soon as its head is parsed, and the response's end settles the exchange from the
    replica connection's callback. Anything that must wait (a new connection, a body to peek
    at, a long prompt to tokenize, holding for a first replica, a retry) continues in a task
    (`run`).
    """

    __slots__ = (
        "_charged",
        "_counted",
        "_listed",
        "_reported",
        "_sending",
        "_settled",
        "_timer",
        "_waiter",
        "activity",
        "body",
        "charge",
        "chosen",
        "chunked",
        "client",
        "conn",
        "ctx",
        "early",
        "failures",
        "first_byte",
        "has_body",
        "head",
        "headers",
        "held_head",
        "http10",
        "keep_alive",
        "local",
        "method",
        "moved",
        "priority",
        "priority_since",
        "replica",
        "sent_at",
        "sent_to_client",
        "started",
        "status",
        "task",
        "tried",
        "upgrade",
        "wants_upgrade",
    )

    def __init__(
        self,
        ctx: ExchangeContext,
        client: ClientSide,
        method: bytes,
        head: bytes,
        has_body: bool,
        headers: dict[bytes, bytes] = NO_HEADERS,
    ) -> None:
        self.ctx = ctx
        self.client = client
        self.method = method
        self.head = head  # request line and headers as they go to the replica
        self.has_body = has_body
        self.chunked = False
        self.http10 = False  # the client speaks HTTP/1.0: no chunked framing towards it
        self.wants_upgrade = False  # the client asked for a protocol upgrade (WebSocket)
        # What the client sent after an Upgrade request's head: the tunnel's first bytes,
        # held until the replica agrees (101). Sent earlier, a replica that declines would
        # read them as a request of their own and answer it on a pooled connection.
        self.early: list[bytes] = []
        self.headers = headers  # lower-case names
        self.body = Body(complete=not has_body)
        self.conn: UpstreamConn | None = None
        self.replica: Upstream | None = None
        self.status = 0
        self.sent_to_client = False
        self.started = self.ctx.monotonic()
        self.activity = self.started
        self.sent_at = self.started  # when the current attempt was sent to its replica
        self.first_byte: float | None = None  # seconds from sent_at to the answer's first byte
        self.keep_alive = True
        self.local: bytes | None = None  # a response the LB gives itself
        self.upgrade = False
        self.task: asyncio.Task[None] | None = None
        self.tried: set[int] = set()
        self.chosen: Upstream | None = None  # picked without a task, to connect to in one
        self.failures: list[str] | None = None  # why attempts were not sent (made on the first)
        self._counted: int | None = None  # the replica whose in-flight count holds this one
        # WeighsPrefill: the prompt blocks the pick's replica has to prefill for this request,
        # and the replica whose `prefilling` count holds them (from send to first byte)
        self.charge = 0
        self.priority: int | None = None  # engine_priority: the prompt blocks not cached there
        self.priority_since = 0  # ... and when it was first sent (ms since the epoch)
        self._charged: tuple[int, int] | None = None
        # TracksSends: whom this attempt was told to, and what to answer with
        self._sending: tuple[TracksSends, int, RequestKey, object] | None = None
        self._settled = True
        self._waiter: asyncio.Future[str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reported = False
        # move_waiting_requests: the replica this request is listed under while it has no
        # byte of its answer (ctx.unanswered), the response head held meanwhile (a streaming
        # server sends its head before its first token), and whether it moved once.
        self._listed: int | None = None
        self.held_head: list[bytes] | None = None
        self.moved = False

    # client -> replica ---------------------------------------------------------------------

    def _keep_for_replay(self, data: bytes | bytearray) -> None:
        body = self.body
        if body.replay is not None:
            body.replay_size += len(data)
            if body.replay_size > REPLAY_BYTES:
                body.replay = None  # too big to keep: this request cannot be retried once sent
            else:
                body.replay.append(data)

    def _frame(self, data: bytes | bytearray) -> bytes | bytearray:
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    def on_body(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.write(self._frame(data))
            self._keep_for_replay(data)
        else:
            body = self.body
            held = body.held
            if len(data) < SMALL_PIECE and held and isinstance(held[-1], bytearray):
                held[-1] += data  # tiny chunks cost one buffer, not an object each
            else:
                held.append(bytearray(data) if len(data) < SMALL_PIECE else data)
            body.size += len(data)
            if body.size >= HIGH_WATER:
                self.client.pause_reading()
            if body.event is not None:
                body.event.set()
            if body.choose_at:
                body.seen = self.ctx.clock
                if body.size >= body.choose_at:
                    self._to_task()  # a long body: its head is enough, the task reads it

    def on_body_complete(self) -> None:
        body = self.body
        body.complete = True
        if body.event is not None:
            body.event.set()
        if self.conn is not None and self.chunked:
            self.conn.write(b"0\r\n\r\n")
        elif body.choose_at:
            self._choose_with_body()  # (its send ends a chunked body itself)
        if (
            self.ctx.unanswered is not None  # (move_waiting_requests on: first, off is common)
            and self.conn is not None
            and self.replica is not None
            and self._listed is None
            and not self.sent_to_client
            and self.first_byte is None
            and self._may_move()
        ):
            self._list(self.replica.replica_id)  # sent before its body ended

    def tunnel_from_client(self, data: bytes) -> None:
        if self.upgrade and self.conn is not None:
            self.conn.write(data)
        else:
            self.early.append(data)  # (at most the rest of the read that held the head)

    # replica -> client ---------------------------------------------------------------------

    def to_client(self, data: bytes) -> None:
        held = self.held_head
        if held is not None:
            held.append(data)  # no body byte yet: the request may still move
            if len(held) > 1 and sum(map(len, held)) > HELD_HEAD_BYTES:
                self._release_head()  # (interim answers without end): it stays here
            return
        self.sent_to_client = True
        self.client.write(data)

    def pause_client(self) -> None:
        self.client.pause_reading()

    def resume_client(self) -> None:
        self.client.resume_reading()

    def response_complete(self, upstream_keep_alive: bool) -> None:
        conn, self.conn = self.conn, None
        if self.wants_upgrade:
            # The replica declined the upgrade: what the client sent after its head is
            # neither a tunnel nor a request the load balancer parsed. Neither connection
            # is used again (the client is told by the close).
            self.early.clear()
            self.keep_alive = False
            upstream_keep_alive = False
        if conn is not None:
            self.status = conn.status
            if upstream_keep_alive and self.body.complete:
                self.ctx.pool.release(conn)
            else:
                conn.exchange = None
                conn.close()
        self._settle("ok")

    def closes_client(self) -> bool:
        return self.client.closing_after(self)

    def upgraded(self) -> None:
        self.upgrade = True
        self.client.tunnel_to(self)
        if self.conn is not None:
            self.status = self.conn.status
            for data in self.early:
                self.conn.write(data)
        self.early.clear()

    def upstream_lost(self, got_bytes: bool, tunnel: bool) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not self.status:
            self.status = conn.status
        if tunnel:
            self.client.close()
            self._settle("tunnel closed")
            return
        self._settle("lost" if got_bytes else "unanswered")

    def upstream_failed(self, why: str) -> None:
        self.conn = None
        self._settle(f"failed: {why}")

    def client_gone(self) -> None:
        """The client disconnected: cancel the replica's request (close its connection)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()
        waiting = self.body.choose_at
        self._stop_waiting_for_body()
        if self.task is not None:
            self.task.cancel()
        elif waiting:
            self._report(499, "none")  # gone before its body came: no replica saw it
        elif not self._settled:
            self._settled = True
            self._cancel_timer()
            self._end_attempt()
            self._report(499, str(self.replica.replica_id) if self.replica else "none")

    # bookkeeping -------------------------------------------------------------------------------

    def _failed(self, why: str) -> None:
        """An attempt was not sent (another replica may take the request): why, for the 502."""
        if self.failures is None:
            self.failures = []
        self.failures.append(why)

    def _begin_attempt(self, upstream: Upstream) -> None:
        rid = upstream.replica_id
        inflight = self.ctx.replicas.inflight
        inflight[rid] = inflight.get(rid, 0) + 1
        self._counted = rid
        self.tried.add(rid)
        if not self.moved:  # (a moved request was counted when it came)
            self.ctx.load.record(str(rid))
        charge, self.charge = self.charge, 0
        if charge:
            prefilling = self.ctx.replicas.prefilling
            prefilling[rid] = prefilling.get(rid, 0) + charge
            self._charged = (rid, charge)
        tracks = self.ctx.replicas.caps.tracks_sends
        if tracks is not None:
            key = self.body.key
            if key is not None and key.blocks:
                token = tracks.sending(rid, key)
                if token is not None:
                    self._sending = (tracks, rid, key, token)
        self.ctx.replicas.on_count()

    def prefilled(self) -> None:
        """The replica answered its first body byte (or ended its answer, or upgraded): its
        prompt is no longer waiting to be prefilled there, and the request no longer moves
        (a head held until now goes to the client)."""
        if self._listed is not None:
            self._release_head()
        self._release_charge()
        if self._sending is not None:
            self._answered()

    def _answered(self) -> None:
        """TracksSends: this attempt got its first byte, or ended without one (told to the
        selector that heard of its send, even if another was installed since)."""
        sending, self._sending = self._sending, None
        if sending is not None:
            tracks, rid, key, token = sending
            tracks.answered(rid, key, token)
            self.ctx.replicas.on_count()  # (the LB's other processes hear of it)

    def _release_head(self) -> None:
        """The request stays at its replica: the head held so far goes to the client."""
        self._unlist()
        held, self.held_head = self.held_head, None
        if held:
            self.sent_to_client = True
            self.client.write(b"".join(held))

    def _may_move(self) -> bool:
        """Whether this attempt is to be listed (and its head held): the option is on, the
        request could be sent again whole, and it has not moved."""
        return (
            self.ctx.unanswered is not None
            and not self.moved
            and not self.wants_upgrade
            and self.body.replay is not None
            and len(self.tried) < self.ctx.max_attempts
            and not self._waits_for_continue()
        )

    def _list(self, rid: int) -> None:
        unanswered = self.ctx.unanswered
        assert unanswered is not None
        self._listed = rid
        self.held_head = []
        listed = unanswered.get(rid)
        if listed is None:
            listed = unanswered[rid] = {}
        listed[self] = None

    def _release_charge(self) -> None:
        charged, self._charged = self._charged, None
        if charged is None:
            return
        rid, charge = charged
        prefilling = self.ctx.replicas.prefilling
        left = prefilling.get(rid, 0) - charge
        if left > 0:
            prefilling[rid] = left
        else:
            prefilling.pop(rid, None)
        self.ctx.replicas.on_count()

    def _end_attempt(self) -> None:
        if self._charged is not None:
            self._release_charge()
        if self._sending is not None:
            self._answered()
        if self._listed is not None:
            self._unlist()
        self.held_head = None  # an attempt that ends unanswered: its head is not sent
        rid, self._counted = self._counted, None
        if rid is None:
            return
        inflight = self.ctx.replicas.inflight
        left = inflight.get(rid, 1) - 1
        if left > 0:
            inflight[rid] = left
        else:
            inflight.pop(rid, None)
        self.ctx.replicas.on_count()

    def _unlist(self) -> None:
        rid, self._listed = self._listed, None
        unanswered = self.ctx.unanswered
        if rid is None or unanswered is None:
            return
        listed = unanswered.get(rid)
        if listed is not None:
            listed.pop(self, None)
            if not listed:
                del unanswered[rid]

    def can_move(self) -> bool:
        """Whether the request can still move (fleetserve.lb.mover): sent, no byte of its
        answer yet (a held head is not sent), not moved before, its whole body kept to send
        again, and an attempt left."""
        return (
            self._listed is not None
            and not self.moved
            and not self.sent_to_client
            and self.first_byte is None
            and self.conn is not None
            and not self._settled
            and not self.upgrade
            and self.body.complete
            and self.body.replay is not None
            and len(self.tried) < self.ctx.max_attempts
        )

    def move_to(self, upstream: Upstream) -> bool:
        """Leave the replica (closing the connection cancels the request there) and go to
        `upstream` as a new attempt; False (nothing changed) when it cannot move. The replica
        it leaves may take it again if `upstream` does not answer it."""
        source = self._listed
        if not self.can_move() or upstream.replica_id == source:
            return False
        self.moved = True
        if source is not None:
            self.tried.discard(source)  # (a move is not a failed attempt)
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()
        self.held_head = None
        self.chosen = upstream
        self.priority = None  # (engine_priority: not known to lack less than all of it there)
        self._settle("moved")
        return True

    def _report(self, status: int, replica: str) -> None:
        if self._reported:
            return
        self._reported = True
        ctx = self.ctx
        ctx.metrics.done(replica, status, ctx.monotonic() - self.started, self.first_byte)
        self.client.exchange_done(self)

    # sending and settling ------------------------------------------------------------------------

    def _send(self, conn: UpstreamConn, upstream: Upstream) -> None:
        conn.start(self)
        self.conn, self.replica = conn, upstream
        self.status = 0
        self._settled = False
        body = self.body
        if body.replay:
            body.held = body.replay + body.held  # a retry: the body goes again, from its start
            body.replay, body.replay_size = [], 0
        head = self.head
        hints = self.ctx.priority
        if hints is not None:
            if not self.priority_since:  # (a retry or a move keeps its place in time)
                self.priority_since = hints.stamp()
            head = hints.head(head, self.priority, self._body_bytes(), self.priority_since)
        out = [head, *(self._frame(data) for data in body.held)]
        if body.complete and self.chunked:
            out.append(b"0\r\n\r\n")
        conn.write(b"".join(out))  # one send for the head and what came of the body so far
        if body.complete and self._may_move():
            # It may move while no byte of its answer came; the answer's head waits for its
            # first body byte. (A body still coming is listed when it ends: a client that
            # reads the head before it sends the rest is never held up.)
            self._list(upstream.replica_id)
        if not self.upgrade:
            for data in body.held:
                self._keep_for_replay(data)
            body.held = []
            body.size = 0
            self.client.resume_reading()
        self.activity = self.sent_at = self.ctx.monotonic()
        self._timer = asyncio.get_running_loop().call_later(
            self.ctx.read_timeout, self._check_timeout
        )

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        """No byte from the replica for read_timeout_seconds: give up (tunnels may idle)."""
        if self._settled:
            return
        limit = self.ctx.read_timeout
        idle = self.ctx.monotonic() - self.activity
        if self.upgrade or idle < limit:
            delay = limit if self.upgrade else limit - idle
            self._timer = asyncio.get_running_loop().call_later(delay, self._check_timeout)
            return
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()
        self._settle("timeout")

    def _settle(self, outcome: str) -> None:
        if self._settled:
            return
        self._settled = True
        self._cancel_timer()
        if self._waiter is not None:
            if not self._waiter.done():
                self._waiter.set_result(outcome)
            return
        # The task-less path: conclude here.
        rid = str(self.replica.replica_id) if self.replica else "none"
        try:
            status = self._conclude(outcome)
        except _NotSent as e:
            self._end_attempt()
            self._failed(f"replica {rid}: {e}")
            self.task = asyncio.get_running_loop().create_task(self.run())
            return
        self._end_attempt()
        self._report(status, rid)

    def _conclude(self, outcome: str) -> int:
        """The status this attempt ends with; raises _NotSent when another replica may try."""
        ctx = self.ctx
        rid = str(self.replica.replica_id) if self.replica else "none"
        if outcome in ("ok", "tunnel closed"):
            return self.status
        if outcome == "moved":
            raise _NotSent("left its queue for a replica with room")
        if outcome == "unanswered" and not self.sent_to_client:
            # The connection closed before any response byte: the replica did not answer
            # (a stale pooled connection, or it died), so another one may, if the whole body
            # can be sent again.
            ctx.metrics.error(rid, "disconnected")
            if self.moved and self.replica is not None:
                ctx.move_failed[self.replica.replica_id] = ctx.monotonic()
            if self.body.replay is not None and self.body.complete:
                raise _NotSent("closed the connection without answering")
        ctx.metrics.error(rid, "timeout" if outcome == "timeout" else "mid_response")
        if self.sent_to_client:
            self.client.close()  # a truncated response must not look complete
            return self.status or 502
        if outcome == "timeout":
            msg = error_response(
                504,
                "upstream_timeout",
                f"replica {rid} sent no response within {ctx.read_timeout:g} s",
                close=not self.keep_alive or self.closes_client(),
            )
        else:
            msg = error_response(
                502,
                "upstream_disconnected",
                f"replica {rid} failed mid-request ({outcome})",
                close=not self.keep_alive or self.closes_client(),
            )
        self.client.write(msg)
        return int(msg[9:12])

    def try_now(self) -> bool:
        """Start the exchange without a task if nothing has to be waited for."""
        ctx = self.ctx
        if self.local is not None:
            return False
        if self._reads_body():
            # Choose once the body is here (mostly in the same read as the head); a request
            # started after its body came (pipelined behind another) chooses at once.
            limit = self._body_limit()
            body = self.body
            if body.complete or body.size >= limit:
                key = self._key_of_body()
                return body.key_later is None and self._send_now(key)
            body.choose_at = limit
            body.seen = ctx.clock
            return True
        return self._send_now(self._header_key())

    def _choose_with_body(self) -> None:
        self._stop_waiting_for_body()
        key = self._key_of_body()
        if self.body.key_later is not None or not self._send_now(key):
            self.task = asyncio.get_running_loop().create_task(self.run())

    def body_stalled(self) -> None:
        """Called by the sweep: no byte of the body for header_timeout_seconds (counted from
        when this request's turn came, not from its head: it may have been pipelined)."""
        self.body.late = True
        self._to_task()

    def _to_task(self) -> None:
        """Stop waiting without a task: a long body, or a stalled one (the task answers 408)."""
        if self.body.choose_at:
            self._stop_waiting_for_body()
            self.task = asyncio.get_running_loop().create_task(self.run())

    def _stop_waiting_for_body(self) -> None:
        self.body.choose_at = 0

    def _send_now(self, key: RequestKey) -> bool:
        """Send to the chosen replica now if it has an idle pooled connection."""
        ctx = self.ctx
        if not ctx.replicas.upstreams:
            return False
        upstream = ctx.replicas.pick(frozenset(), key)
        if upstream is None:
            return False
        self._picked()
        conn = ctx.pool.idle_conn(upstream)
        if conn is None:
            self.chosen = upstream  # the task connects to it: a pick is not made twice
            return False
        self._begin_attempt(upstream)
        self._send(conn, upstream)
        return True

    def _body_bytes(self) -> int:
        """The body's length: its Content-Length, else what is about to go of it."""
        length = self.headers.get(b"content-length")
        if length:
            try:
                return int(length)
            except ValueError:
                pass
        return sum(map(len, self.body.held))

    def _picked(self) -> None:
        """What the policy said of the replica it just picked for this request: the blocks
        it has to prefill (`charge`) and the prompt blocks it lacks (`priority`)."""
        replicas = self.ctx.replicas
        self.charge, self.priority = replicas.last_charge, replicas.last_missing

    # the task path -------------------------------------------------------------------------------

    async def run(self) -> None:
        status, replica = 0, "none"
        try:
            status, replica = await self._run()
        except asyncio.CancelledError:
            status = 499  # the client went away
        finally:
            self._end_attempt()
            self._report(status, replica)

    async def _run(self) -> tuple[int, str]:
        ctx = self.ctx
        if self.local is not None:
            self.client.write(self.local)
            return int(self.local[9:12]), "none"
        try:
            key = await self._key()
        except _BodyLate:
            self.keep_alive = False
            timeout = ctx.limits.header_timeout
            self.client.write(
                error_response(
                    408,
                    "request_timeout",
                    f"the request's body stalled: no byte of it for {timeout:g} s",
                    close=True,
                )
            )
            return 408, "none"
        if not ctx.replicas.upstreams and ctx.hold_when_empty:
            refused = await ctx.hold()
            if refused is not None:
                self.client.write(refused)
                ctx.load.record("none")
                return int(refused[9:12]), "none"
        for _ in range(ctx.max_attempts - len(self.tried)):
            upstream, self.chosen = self.chosen, None
            if upstream is None or upstream.replica_id not in ctx.replicas.upstreams:
                upstream = ctx.replicas.pick(frozenset(self.tried), key)
                self._picked()
            if upstream is None:
                break
            rid = str(upstream.replica_id)
            self._begin_attempt(upstream)
            try:
                return await self._attempt(upstream), rid
            except _NotSent as e:
                self._failed(f"replica {rid}: {e}")
            finally:
                self._end_attempt()
        if not self.tried:
            ctx.load.record("none")
            msg = error_response(
                503,
                "no_ready_replicas",
                f"service {ctx.service!r} has no READY replica; "
                f"see `fleetserve status {ctx.service}`",
                close=not self.keep_alive or self.closes_client(),
            )
        else:
            msg = error_response(
                502,
                "upstream_unreachable",
                "no replica could be reached: " + "; ".join(self.failures or ()),
                close=not self.keep_alive or self.closes_client(),
            )
        self.client.write(msg)
        return int(msg[9:12]), "none"

    def _header_key(self) -> RequestKey:
        read = self.ctx.replicas.caps.header_key
        return NO_KEY if read is None else read(self.headers)

    def _body_limit(self) -> int:
        """How much of the body the policy reads (at most HIGH_WATER, where reading pauses)."""
        return min(self.ctx.replicas.caps.body_limit, HIGH_WATER)

    async def _read_body(self, limit: int) -> bytes:
        """The body, or its first `limit` bytes when it is longer (it is held, not sent, until
        a replica is chosen); raises _BodyLate past the head's time limit."""
        body = self.body
        if body.late:
            raise _BodyLate
        event = body.event = asyncio.Event()
        timeout = self.ctx.limits.header_timeout
        while not body.complete and body.size < limit:
            event.clear()
            try:  # each wait is for the next bytes: a slow but steady body is fine
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                raise _BodyLate from None
        return b"".join(body.held)[:limit]

    def _reads_body(self) -> bool:
        """Whether the policy reads this request's body before choosing: not a client that
        waits for `100 Continue` before sending it (the replica answers that; waiting for the
        body here would stall both until the client gives up waiting)."""
        return (
            self.ctx.replicas.caps.body_key is not None
            and self.has_body
            and not self._waits_for_continue()
        )

    def _waits_for_continue(self) -> bool:
        """The client sends its body only after the replica's `100 Continue`."""
        return self.headers.get(b"expect", b"").lower() == b"100-continue"

    async def _key(self) -> RequestKey:
        if self._reads_body():
            body = self.body
            if body.key is None:
                await self._read_body(self._body_limit())
            key = self._key_of_body()
            if body.key_later is not None:
                key = body.key = await self._complete_key(key, body.key_later)
            return key
        return self._header_key()

    async def _complete_key(self, key: RequestKey, body: bytes) -> RequestKey:
        """The key with its slow part, made off the event loop (a long prompt's tokens)."""
        self.body.key_later = None
        ctx = self.ctx
        off_loop = ctx.replicas.caps.off_loop
        if off_loop is None:
            return key
        try:
            return await off_loop.complete_key(key, body)
        except Exception:
            ctx.replicas.policy_failed("completing a request's key off the event loop failed")
            return key

    def _key_of_body(self) -> RequestKey:
        """The body policy's key, made once (a task that takes over reuses it)."""
        body = self.body
        if body.key is None:
            data, limit = b"".join(body.held), self._body_limit()
            whole = body.complete and len(data) <= limit
            body.key = self._body_key(data[:limit], whole)
        return body.key

    def _body_key(self, body: bytes, complete: bool) -> RequestKey:
        """What a body policy keys on (`complete`: `body` is the whole body); a body it cannot
        read (a bug some input reaches) has no key and goes by load, never fails the request
        (the replica set logs and counts)."""
        ctx = self.ctx
        caps = ctx.replicas.caps
        assert caps.body_key is not None  # (only asked when the policy reads the body)
        try:
            key = caps.body_key(body, complete)
            if caps.off_loop is not None and caps.off_loop.completes_later(key, body, complete):
                self.body.key_later = body  # the task completes it (`_key`)
        except Exception:
            ctx.replicas.policy_failed("reading a request's body for its key failed")
            return NO_KEY
        return key

    async def _attempt(self, upstream: Upstream) -> int:
        ctx = self.ctx
        rid = str(upstream.replica_id)
        try:
            conn = await ctx.pool.acquire(upstream)
        except (OSError, TimeoutError) as e:
            ctx.replicas.discard(upstream.replica_id)  # until the controller's next push
            ctx.metrics.error(rid, "connect")
            if self.moved:
                ctx.move_failed[upstream.replica_id] = ctx.monotonic()
            log.warning("replica %s refused a connection: %s", rid, e or type(e).__name__)
            raise _NotSent(str(e) or type(e).__name__) from None
        if self.client.closed:
            ctx.pool.release(conn)
            raise asyncio.CancelledError
        self._waiter = asyncio.get_running_loop().create_future()
        self._send(conn, upstream)
        try:
            outcome = await self._waiter
        finally:
            self._waiter = None
        return self._conclude(outcome)
