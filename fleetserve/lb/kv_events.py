"""Following each replica's KV cache events (vLLM's ZMQ publisher) into cache_aware's precise
index (fleetserve.policies.kv_index).

Where: a replica at http://HOST:PORT publishes on tcp://HOST:PORT+1 and answers replay requests
on tcp://HOST:PORT+2 (the infra exports both as FLEETSERVE_KV_EVENTS_PORT and
FLEETSERVE_KV_EVENTS_REPLAY_PORT; docs/load-balancer.md). The wire is vLLM's ZmqEventPublisher:
multipart [topic, seq (8 bytes, big-endian), msgpack KVEventBatch]; a replay request is
[b"", start seq] to its ROUTER, answered by the buffered batches from that seq, then
[b"", b"", -1, b""].

How (one task per replica, per LB process): subscribe, then replay from seq 0 so that the
history is complete (vLLM sends no snapshot: a block stored before we listened could not be
chained), apply batches in sequence. A gap is filled by a replay; one the replay cannot fill
(its buffer moved on) leaves the replica INCOMPLETE until its engine clears its cache. An
engine sends nothing while idle, so silence is probed with a replay request (the publisher's
thread answers it); no answer within the timeout: SILENT, reconnect with backoff. A publisher
that restarts (its seq goes back) is followed afresh. Any state but LIVE sends the policy to
the approximate index for that replica (`fleetserve_lb_kv_events_replicas{state}` says so).

Bounded: frames of at most `max_message_bytes` (ZMQ drops a peer that sends more), msgpack
decoding with length limits, at most `max_blocks_per_second` blocks applied per replica and
BYTES_PER_BLOCK times that in bytes received, replays included (past either: OVERFLOW,
reconnect later), at most `max_blocks` keys per replica (the index), replays of at most
MAX_REPLAY_BATCHES batches, ZMQ's queue of at most RCVHWM_BYTES per socket. Garbage is
counted and skipped, never raised.

Optional dependencies (the `llm` extra): pyzmq and msgpack.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fleetserve.core.sockets import held_by_me, loopback_port
from fleetserve.policies.kv_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
    KvIndex,
    Trust,
)

if TYPE_CHECKING:
    from fleetserve.lb.prompt_tokens import LoopTokenizer

log = logging.getLogger("fleetserve.lb.kv_events")

# As fleetserve.infra.kv_ports exports them (lb and infra are independent layers).
EVENTS_PORT_OFFSET = 1  # the replica's port + 1: its events (FLEETSERVE_KV_EVENTS_PORT)
REPLAY_PORT_OFFSET = 2  # + 2: its replay endpoint (FLEETSERVE_KV_EVENTS_REPLAY_PORT)
END_SEQ = -1
MAX_REPLAY_BATCHES = 20_000
MAX_EVENTS_PER_BATCH = 100_000
MAX_BLOCKS_PER_EVENT = 8_192
MAX_TOKENS_PER_EVENT = 1 << 20
MAX_HASH_BYTES = 64
# Bytes received per second allowed per block of max_blocks_per_second (~40 tokens of msgpack):
# garbage, unknown kinds and events that name few blocks but carry many bytes cost decoding
# time on the LB's event loop too.
BYTES_PER_BLOCK = 128
RCVHWM_BYTES = 128 * 1024 * 1024  # what ZMQ may queue per socket, in max_message_bytes messages


class BadBatch(ValueError):
    """A payload that is not a KVEventBatch this module can vouch for."""


@dataclass(frozen=True)
class KvEventsSettings:
    topic: str = "kv-events"
    silence_seconds: float = 10.0  # idle this long: probe the publisher with a replay request
    timeout_seconds: float = 3.0  # a replay's answer (or the probe's) within this
    max_message_bytes: int = 4 * 1024 * 1024
    max_blocks_per_second: int = 50_000
    backoff_seconds: float = 0.5  # first wait before resubscribing; doubles up to 30 s


def endpoints(url: str) -> tuple[str, str] | None:
    """The events and replay endpoints of a replica at `url` (None: no port to derive from)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if ":" in host:
        host = f"[{host}]"
    return (
        f"tcp://{host}:{port + EVENTS_PORT_OFFSET}",
        f"tcp://{host}:{port + REPLAY_PORT_OFFSET}",
    )


def _hash(value: object) -> EngineHash:
    if isinstance(value, bytes) and len(value) <= MAX_HASH_BYTES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 128) < value < 1 << 128:
        return value
    raise BadBatch("a block hash is neither bytes nor an int")


def _hashes(value: object) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS_PER_EVENT:
        raise BadBatch("block_hashes is not a list of at most 8,192 hashes")
    return tuple(_hash(v) for v in value)


def _plain(event: dict[Any, Any]) -> bool:
    """Whether a request without LoRA, media or a cache salt can match these blocks, in the
    main KV cache group and tier."""
    extra = event.get("extra_keys")
    return (
        event.get("lora_id") is None
        and event.get("lora_name") is None
        and (extra is None or (isinstance(extra, list) and all(x is None for x in extra)))
        and event.get("group_idx") in (None, 0)
        and event.get("medium") in (None, "GPU")
    )


def _event(raw: object) -> KvEvent | None:
    """One event (msgspec's tagged struct: a map with `type`); None for a kind we skip."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        raise BadBatch("events encoded as arrays are not supported")
    if not isinstance(raw, dict):
        raise BadBatch("an event is not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        tokens = raw.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS_PER_EVENT:
            raise BadBatch("token_ids is not a list")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadBatch("a token id is not an int")
        size = raw.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool):
            raise BadBatch("block_size is not an int")
        parent = raw.get("parent_block_hash")
        return BlockStored(
            block_hashes=_hashes(raw.get("block_hashes")),
            parent=None if parent is None else _hash(parent),
            token_ids=tuple(tokens),
            block_size=size,
            plain=_plain(raw),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(raw.get("block_hashes")), plain=_plain(raw))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a newer kind: not ours to follow


def decode_batch(payload: bytes) -> list[KvEvent]:
    """A KVEventBatch ([ts, events, dp rank]) into events; raises BadBatch."""
    import msgpack

    try:
        doc = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            max_str_len=64 * 1024,
            max_bin_len=MAX_HASH_BYTES,
            max_array_len=MAX_TOKENS_PER_EVENT,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many kinds on garbage; all mean the same here
        raise BadBatch(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(doc, list) or len(doc) < 2 or not isinstance(doc[1], list):
        raise BadBatch("not a [ts, events, ...] batch")
    if len(doc[1]) > MAX_EVENTS_PER_BATCH:
        raise BadBatch("too many events in one batch")
    return [e for e in (_event(raw) for raw in doc[1]) if e is not None]


def blocks_in(events: Iterable[KvEvent]) -> int:
    return sum(1 if isinstance(e, AllBlocksCleared) else len(e.block_hashes) for e in events)


class Counts:
    """What the follower tells the LB's metrics (fleetserve_lb_kv_events_*)."""

    def __init__(self) -> None:
        self.batches = 0
        self.bad = 0  # frames or payloads refused
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.ignored = 0
        self.duplicates = 0  # batches the subscription delivered after a replay applied them
        self.fallbacks: dict[str, int] = {}  # by Trust

    def fallback(self, trust: Trust) -> None:
        self.fallbacks[trust.value] = self.fallbacks.get(trust.value, 0) + 1


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


REPLAYED_KEPT = 4096  # batches remembered as applied by replays, newest first


def _kept(replayed: dict[int, bytes], more: dict[int, bytes]) -> dict[int, bytes]:
    """The batches replays applied that the subscription has not delivered yet: the earlier
    ones and `more`, at most REPLAYED_KEPT (the newest)."""
    replayed.update(more)
    if len(replayed) > REPLAYED_KEPT:
        replayed = dict(sorted(replayed.items())[-REPLAYED_KEPT:])
    return replayed


class _Rate:
    """A token bucket of blocks per second (one second's worth of burst)."""

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self.tokens = float(per_second)
        self.at = time.monotonic()

    def take(self, n: int) -> bool:
        now = time.monotonic()
        self.tokens = min(float(self.per_second), self.tokens + (now - self.at) * self.per_second)
        self.at = now
        if n > self.tokens:
            return False
        self.tokens -= n
        return True


class _SessionEnd(Exception):
    def __init__(self, trust: Trust, why: str) -> None:
        super().__init__(why)
        self.trust = trust


class ReplicaFollower:
    """One replica's events into the index (see the module's docstring)."""

    def __init__(
        self,
        replica: int,
        events_endpoint: str,
        replay_endpoint: str,
        index: KvIndex,
        settings: KvEventsSettings,
        counts: Counts,
        ctx: Any,
    ) -> None:
        self.replica = replica
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.settings = settings
        self.counts = counts
        self.ctx = ctx
        self.last = -1  # the last applied seq; -1: none
        self.rate = _Rate(settings.max_blocks_per_second)
        self.bytes = _Rate(
            max(settings.max_blocks_per_second * BYTES_PER_BLOCK, settings.max_message_bytes)
        )

    def _received(self, frames: list[bytes]) -> list[bytes]:
        """Frames as received, charged to the byte budget (any frame: garbage costs too)."""
        if not self.bytes.take(sum(len(f) for f in frames)):
            self.index.clear(self.replica)
            raise _SessionEnd(Trust.OVERFLOW, "more bytes per second than max_blocks_per_second")
        return frames

    def _set(self, trust: Trust) -> None:
        if self.index.trust(self.replica) is Trust.LIVE and trust is not Trust.LIVE:
            self.counts.fallback(trust)
            log.warning("replica %s: KV events %s: approximate index", self.replica, trust.value)
        self.index.set_trust(self.replica, trust)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except BadBatch as e:
            self.counts.bad += 1
            # A batch we cannot read is a batch lost: what it stored or removed is unknown,
            # until the engine clears its cache.
            log.info("replica %s: KV events batch %s refused: %s", self.replica, seq, e)
            self.index.clear(self.replica)
            self._set(Trust.INCOMPLETE)
            self.last = seq
            return
        if not self.rate.take(blocks_in(events)):
            self.index.clear(self.replica)
            raise _SessionEnd(Trust.OVERFLOW, "more blocks per second than max_blocks_per_second")
        done = self.index.apply(self.replica, events)
        self.last = seq
        self.counts.batches += 1
        self.counts.stored += done.stored
        self.counts.removed += done.removed
        self.counts.cleared += done.cleared
        self.counts.ignored += done.ignored
        if done.overflow:
            raise _SessionEnd(Trust.OVERFLOW, "more blocks than max_blocks")
        if done.cleared and self.index.trust(self.replica) is Trust.INCOMPLETE:
            self._set(Trust.LIVE)  # the engine holds nothing we missed any more

    def _frames(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        """(seq, payload) of a published message; None (counted) if malformed."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts.bad += 1
            return None
        if frames[0] != self.settings.topic.encode():
            return None
        return int.from_bytes(frames[1], "big", signed=True), frames[2]

    async def _replay(self, replay: Any, start: int) -> tuple[int | None, list[tuple[int, bytes]]]:
        """The publisher's buffered batches from `start`: (first seq or None, batches)."""
        import zmq

        await replay.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.settings.timeout_seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await replay.poll(left * 1000, zmq.POLLIN):
                raise _SessionEnd(Trust.SILENT, "no answer to a replay request")
            frames = self._received(await replay.recv_multipart())
            if len(frames) != 4 or len(frames[2]) != 8:
                self.counts.bad += 1
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return (got[0][0] if got else None), got
            if len(got) >= MAX_REPLAY_BATCHES:
                raise _SessionEnd(Trust.OVERFLOW, "replay longer than MAX_REPLAY_BATCHES")
            if seq >= start and (not got or seq > got[-1][0]):
                got.append((seq, frames[3]))

    async def _catch_up(self, replay: Any, fresh: bool) -> dict[int, bytes]:
        """Apply what the publisher buffered after `self.last`; on a fresh start, from 0.
        Returns the digest of each batch it applied, by seq: the subscription may still
        deliver them (published while the replay was under way)."""
        start = 0 if fresh else self.last + 1
        first, batches = await self._replay(replay, start)
        if first is not None and first > start:
            # The buffer moved on: what happened in between is lost.
            self.index.clear(self.replica)
            self._set(Trust.INCOMPLETE)
        applied = {}
        for seq, payload in batches:
            if seq > self.last:
                self._apply(seq, payload)
                applied[seq] = _digest(payload)
        return applied

    async def session(self) -> None:
        """Subscribe, catch up and follow until trouble (raised as _SessionEnd)."""
        import zmq
        import zmq.asyncio

        for endpoint in (self.events_endpoint, self.replay_endpoint):
            # On this machine, only a publisher of this user is trusted: another user who
            # took the port first could steer routing and bloat the index.
            port = loopback_port(endpoint)
            if port is not None and not held_by_me(port):
                raise _SessionEnd(Trust.SILENT, f"{endpoint}: no listener of this user (yet)")
        sub = self.ctx.socket(zmq.SUB)
        replay = self.ctx.socket(zmq.DEALER)
        try:
            for s in (sub, replay):
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
                # (in messages: at most RCVHWM_BYTES of them queued, not 10,000 x 4 MiB)
                s.setsockopt(zmq.RCVHWM, max(16, RCVHWM_BYTES // self.settings.max_message_bytes))
            sub.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
            sub.connect(self.events_endpoint)
            replay.connect(self.replay_endpoint)
            fresh = self.last < 0 or self.index.trust(self.replica) is not Trust.SILENT
            if fresh:
                self.index.clear(self.replica)
                self.last = -1
                self.index.set_trust(self.replica, Trust.CONNECTING)
            await asyncio.sleep(0.05)  # (the subscription reaches the publisher first)
            # The batches a catch-up applied, which the subscription may deliver again: the
            # same seq and bytes are skipped, not taken for a restarted publisher's (whose
            # seqs start again at 0, its batches stamped with another time).
            replayed = await self._catch_up(replay, fresh)
            if self.index.trust(self.replica) is not Trust.INCOMPLETE:
                self._set(Trust.LIVE)
            silence = self.settings.silence_seconds * 1000
            while True:
                if not await sub.poll(silence, zmq.POLLIN):
                    # The liveness probe. What earlier probes applied may still be on its way
                    # through the subscription: kept, not replaced by this probe's batches.
                    replayed = _kept(replayed, await self._catch_up(replay, fresh=False))
                    continue
                msg = self._frames(self._received(await sub.recv_multipart()))
                if msg is None:
                    continue
                seq, payload = msg
                if replayed:
                    if replayed.get(seq) == _digest(payload):
                        self.counts.duplicates += 1
                        continue  # applied already, from the replay buffer
                    replayed = {}  # the subscription is past what the replay applied
                if seq <= self.last:  # the publisher restarted: its engine's cache is new
                    log.warning(
                        "replica %s: KV events batch %s after %s: the engine restarted, its "
                        "index starts again",
                        self.replica,
                        seq,
                        self.last,
                    )
                    self.index.clear(self.replica)
                    self.last = -1
                    self._set(Trust.LIVE if seq == 0 else Trust.INCOMPLETE)
                elif seq > self.last + 1:
                    # The gap, from the buffer (what it applies joins the record above).
                    replayed = _kept(replayed, await self._catch_up(replay, fresh=False))
                if seq > self.last:
                    self._apply(seq, payload)
        finally:
            sub.close(linger=0)
            replay.close(linger=0)

    async def run(self) -> None:
        backoff = self.settings.backoff_seconds
        while True:
            started = time.monotonic()
            try:
                await self.session()
            except _SessionEnd as e:
                self._set(e.trust)
                log.info("replica %s: KV events: %s", self.replica, e)
            except Exception:  # never let one publisher stop the follower
                log.exception("replica %s: following KV events failed", self.replica)
                self._set(Trust.SILENT)
            if time.monotonic() - started > 60:
                backoff = self.settings.backoff_seconds  # it had been working
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, 30.0)


class KvEventsFollower:
    """A ReplicaFollower per routable replica, started and stopped as the set changes (read
    every second, as ReplicaLoadPoller reads it)."""

    def __init__(
        self,
        index: KvIndex,
        settings: KvEventsSettings,
        replicas: Callable[[], Iterable[tuple[int, str]]],
    ) -> None:
        self.index = index
        self.settings = settings
        self.replicas = replicas
        self.counts = Counts()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._main: asyncio.Task[None] | None = None
        self._ctx: Any = None

    def start(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._main = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        if self._main is not None:
            tasks.append(self._main)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _sync(self) -> None:
        current = dict(self.replicas())
        for rid in set(self._tasks) - set(current):
            self._tasks.pop(rid).cancel()
            self.index.forget(rid)
        for rid, url in current.items():
            if rid in self._tasks:
                continue
            ends = endpoints(url)
            if ends is None:
                continue
            follower = ReplicaFollower(
                rid, ends[0], ends[1], self.index, self.settings, self.counts, self._ctx
            )
            self._tasks[rid] = asyncio.get_running_loop().create_task(follower.run())

    async def _run(self) -> None:
        while True:
            try:
                self._sync()
            except Exception:
                log.exception("following the replicas' KV events failed")
            await asyncio.sleep(1.0)


class KvEventsCollector:
    """The follower's state as Prometheus metrics, read at each scrape."""

    def __init__(self, follower: KvEventsFollower, service: str) -> None:
        self.follower = follower
        self.service = service

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        f = self.follower
        states = GaugeMetricFamily(
            "fleetserve_lb_kv_events_replicas",
            "cache_aware's precise mode: replicas by how their KV events are followed (live: "
            "the precise index; any other state: the approximate index for that replica).",
            labels=["service", "state"],
        )
        trusts = f.index.trusts()
        for trust in Trust:
            n = sum(1 for t in trusts.values() if t is trust)
            states.add_metric([self.service, trust.value], n)
        yield states
        blocks = GaugeMetricFamily(
            "fleetserve_lb_kv_events_blocks",
            "cache_aware's precise mode: the blocks each replica's engine holds, by its events.",
            labels=["service", "replica"],
        )
        for rid in trusts:
            blocks.add_metric([self.service, str(rid)], f.index.blocks(rid))
        yield blocks
        c = f.counts
        events = CounterMetricFamily(
            "fleetserve_lb_kv_events",
            "cache_aware's precise mode: KV events applied (blocks stored, removed, caches "
            "cleared), blocks not indexed (ignored), refused frames or batches (bad), and "
            "batches delivered again after a replay had applied them (duplicates).",
            labels=["service", "kind"],
        )
        for kind in ("stored", "removed", "cleared", "ignored", "bad", "batches", "duplicates"):
            events.add_metric([self.service, kind], getattr(c, kind))
        yield events
        falls = CounterMetricFamily(
            "fleetserve_lb_kv_events_fallbacks",
            "cache_aware's precise mode: times a live replica fell back to the approximate "
            "index, by why (silent, incomplete, overflow).",
            labels=["service", "reason"],
        )
        for reason, n in c.fallbacks.items():
            falls.add_metric([self.service, reason], n)
        yield falls


def precise_mode(
    options: Any, service: str
) -> tuple[KvIndex, KvEventsSettings, LoopTokenizer] | None:
    """What cache_aware's precise mode needs, from `service.load_balancer` (its kv_events and
    tokenizer); None, with an error logged that says why, when it cannot run here (the LB then
    runs cache_aware on its approximate index)."""
    from fleetserve.lb.prompt_tokens import (
        MISSING,
        LoopTokenizer,
        PromptTokenizer,
        TokenizerError,
    )

    kv = options.kv_events
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        log.error(
            "service %s: %s; running cache_aware on its approximate index",
            service,
            MISSING.format(missing=e.name),
        )
        return None
    try:
        tokenizer = PromptTokenizer.load(options.tokenizer)
    except (TokenizerError, OSError, ValueError) as e:
        log.error(
            "service %s: cache_aware's precise mode: %s; running cache_aware on its "
            "approximate index",
            service,
            e,
        )
        return None
    settings = KvEventsSettings(
        topic=kv.topic,
        silence_seconds=kv.silence_seconds,
        timeout_seconds=kv.timeout_seconds,
        max_message_bytes=kv.max_message_bytes,
        max_blocks_per_second=kv.max_blocks_per_second,
    )
    return KvIndex(kv.max_blocks), settings, LoopTokenizer(tokenizer)
