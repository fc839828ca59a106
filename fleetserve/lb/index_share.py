"""One prefix index for all the processes of a load balancer (fleetserve.lb.workers), for a
policy that shares one (SharesIndex in fleetserve.policies.capabilities: cache_aware).

The kernel spreads connections over the processes, so a conversation's turns land on
processes that did not see its earlier turns. Each process therefore tells the others what it
chose: after a cache_aware choice it queues (replica, the prompt's block keys) and, `interval`
seconds after a choice or a change of its counts, sends one batch on its control channel,
with its in-flight counts per replica (and the prompt blocks they still wait to have
prefilled, for a policy that weighs them) when they changed. The primary applies each worker's
batch and passes the line on, unparsed again, to the other workers; it sends its own batches
to all of them. Each process records the others' choices in its own index
(`PrefixIndex.record`) and adds their in-flight counts to its own (`CacheAware.peer_inflight`),
so every process converges to the global index and load within milliseconds (a chat's next
turn comes seconds later), and the load bound holds across processes up to that staleness.
The keys agree because every process keys its block hashes with one secret of the load
balancer (`CacheAware.share_keys`; the primary makes it and hands it to the workers it starts).

Bounds (a client sending huge prompts must not flood the channels): at most
`MAX_RECORD_KEYS` keys of one prompt, at most `MAX_BATCH_KEYS` keys per batch (what does not
fit waits for no one: the other processes miss it), and nothing is written to a channel whose
unsent bytes pass `MAX_BUFFERED`. A process applies others' records at a fraction of what the
same prompts cost the process that parsed and hashed them.

A policy that also shares what it sent and still waits to have answered (SharesSends:
cache_aware's precise mode) sends, when that changed, its whole pending set per replica (at
most `MAX_SENT_KEYS` keys, at most once per `SENT_INTERVAL_SECONDS`), and each process
credits the others' as its own. A whole set each time: a set lost on the way (a full
channel: the primary relays without retrying) is mended by that process's next change; until
then the others keep the one before.

A worker that starts (or restarts) gets the primary's index and the in-flight counts it knows
(`snapshot_lines`). Only such a policy with several processes pays for any of this: the other
policies never queue, send or apply anything.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fleetserve.lb.replica_set import ReplicaSet
from fleetserve.policies.capabilities import SharesIndex, SharesSends

log = logging.getLogger("fleetserve.lb")

KEY_ENV = "FLEETSERVE_LB_INDEX_KEY"  # the secret, hex, from the primary to its workers
INTERVAL_SECONDS = 0.005
MAX_RECORD_KEYS = 512  # of one prompt: 128K characters at the default block size
MAX_BATCH_KEYS = 2048  # per batch (one per INTERVAL_SECONDS at most)
MAX_BUFFERED = 1 << 20  # unsent bytes on a channel past which batches are dropped
SNAPSHOT_KEYS = 1 << 18  # of the index, in all, sent to a new worker
CHANNEL_LIMIT = 1 << 24  # the longest line a control channel reads
MAX_COUNT = 1 << 31  # the largest count (requests, prompt blocks) of one replica a peer may say
MAX_SENT_KEYS = 4096  # of one process's pending prompt blocks, in one batch
# ... sent at most this often (a whole set each time: under a high request rate it changes
# every request; the credit weighs queues seconds long)
SENT_INTERVAL_SECONDS = 0.05
Send = Callable[[bytes], None]
_UNSENT = {-1: -1}  # differs from any table of counts: the next batch sends them


def is_share(msg: Mapping[str, Any]) -> bool:
    return msg.get("op") == "share"


class IndexShare:
    """One process's side: queues its own choices, sends them in batches, applies others'."""

    def __init__(
        self,
        selector: SharesIndex,
        replicas: ReplicaSet,
        source: int,
        send: Send,
        interval: float = INTERVAL_SECONDS,
    ) -> None:
        self.selector = selector
        self.replicas = replicas  # its in-flight counts are this process's own
        self.source = source  # this process's worker index (the primary: 0)
        self.send = send
        self.interval = interval
        self._records: list[tuple[int, tuple[int, ...]]] = []
        self._keys = 0
        self._sent_inflight: dict[int, int] = {}
        self._sent_prefilling: dict[int, int] = {}
        self._peers: dict[int, dict[int, int]] = {}  # other process -> its in-flight counts
        self._peer_prefilling: dict[int, dict[int, int]] = {}  # -> its blocks to prefill
        # SharesSends: the version of our pending set last sent, and the others' sets
        self.sends = selector if isinstance(selector, SharesSends) else None
        self._sent_version = 0
        self._sent_at = -SENT_INTERVAL_SECONDS
        self._sent_due: asyncio.TimerHandle | None = None  # a deferred set's wake
        self._peer_sent: dict[int, dict[int, set[int]]] = {}  # other process -> its sets
        self._wake = asyncio.Event()
        self.dropped_keys = 0  # over MAX_BATCH_KEYS
        self.dropped_batches = 0  # not written: a full channel
        self._warned = 0.0
        selector.on_record = self.record
        replicas.on_count = self._wake.set  # a count changed: send it with the next batch

    # this process's choices --------------------------------------------------------------------

    def record(self, replica: int, keys: tuple[int, ...]) -> None:
        """CacheAware.on_record: queue a choice for the next batch."""
        if keys:
            if len(keys) > MAX_RECORD_KEYS:
                keys = keys[:MAX_RECORD_KEYS]
            if self._keys + len(keys) <= MAX_BATCH_KEYS:
                self._records.append((replica, keys))
                self._keys += len(keys)
            else:
                self.dropped_keys += len(keys)
        if not self._wake.is_set():
            self._wake.set()

    def batch(self) -> bytes | None:
        """The next line to send (queued records, in-flight counts if they changed), or None."""
        msg: dict[str, Any] = {"op": "share", "from": self.source}
        if self._records:
            msg["records"] = self._records
            self._records, self._keys = [], 0
        inflight = self.replicas.inflight
        if inflight != self._sent_inflight:
            self._sent_inflight = dict(inflight)
            msg["inflight"] = list(self._sent_inflight.items())
        prefilling = self.replicas.prefilling
        if prefilling != self._sent_prefilling:
            self._sent_prefilling = dict(prefilling)
            msg["prefilling"] = list(self._sent_prefilling.items())
        sends = self.sends
        if sends is not None and sends.sent_version != self._sent_version:
            now = time.monotonic()
            wait = self._sent_at + SENT_INTERVAL_SECONDS - now
            if wait <= 0:
                self._sent_version = sends.sent_version
                self._sent_at = now
                msg["sent"] = sends.sent_keys(MAX_SENT_KEYS)
            elif self._sent_due is None:
                # (too soon after the last one: a batch when its interval is over)
                self._sent_due = asyncio.get_running_loop().call_later(wait, self._send_due)
        if len(msg) == 2:
            return None
        return json.dumps(msg, separators=(",", ":")).encode() + b"\n"

    def _send_due(self) -> None:
        self._sent_due = None
        self._wake.set()

    async def run(self) -> None:
        """Send a batch `interval` after a choice or a change of this process's counts (the
        changes of that interval go together); asleep otherwise, however many requests are in
        flight. (It used to wake every `interval` while any was in flight, to see whether
        their counts had changed: 200 wake-ups a second per process for nothing while long
        streams ran, CPU taken from replicas sharing the machine's cores.)"""
        try:
            await self._run()
        finally:
            if self._sent_due is not None:  # (stopped: no deferred set's wake after it)
                self._sent_due.cancel()
                self._sent_due = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.interval)
            self._wake.clear()  # what changes from here on wakes the next round
            line = self.batch()
            if line is not None:
                dropped = self.dropped_batches
                self.send(line)
                if self.dropped_batches != dropped:
                    # Not written (a full channel): the counts go again in the next batch,
                    # or the others would keep this line's predecessor's for good.
                    self._sent_inflight = self._sent_prefilling = _UNSENT
                    self._sent_version = -1
                    self._wake.set()  # (and not only at the next change)
                    continue
            dropped = self.dropped_keys or self.dropped_batches
            if dropped and time.monotonic() - self._warned > 60:
                self._warned = time.monotonic()
                log.warning(
                    "cache_aware: not shared with the other LB processes so far: %s block keys "
                    "(over %s keys per %g s), %s batches (a full channel)",
                    self.dropped_keys,
                    MAX_BATCH_KEYS,
                    self.interval,
                    self.dropped_batches,
                )

    # the other processes' ----------------------------------------------------------------------

    def apply(self, msg: Mapping[str, Any]) -> None:
        """Another process's batch: its choices into the index, its in-flight counts."""
        try:
            source = int(msg["from"])
            record = self.selector.index.record
            routable = self.replicas.upstreams
            for rid, keys in msg.get("records", ()):
                if rid in routable:  # (a replica that left since must not come back)
                    record(rid, keys)
            if _take(self._peers, source, msg.get("inflight")):
                self._add_up()
            if _take(self._peer_prefilling, source, msg.get("prefilling")):
                self.selector.peer_prefilling = _sum(self._peer_prefilling.values())
            sent = msg.get("sent")
            if sent is not None and self.sends is not None:
                table = _sent_sets(sent, routable)
                if table:
                    self._peer_sent[source] = table
                else:
                    self._peer_sent.pop(source, None)
                self.sends.take_peer_sent(source, table)
        except (KeyError, TypeError, ValueError, ArithmeticError) as e:
            log.warning("cache_aware: a malformed share message: %s", e)

    def forget_peer(self, source: int) -> None:
        """A process is gone: its requests are no longer in flight."""
        if self._peers.pop(source, None) is not None:
            self._add_up()
        if self._peer_prefilling.pop(source, None) is not None:
            self.selector.peer_prefilling = _sum(self._peer_prefilling.values())
        if self._peer_sent.pop(source, None) is not None and self.sends is not None:
            self.sends.take_peer_sent(source, {})

    def _add_up(self) -> None:
        self.selector.peer_inflight = _sum(self._peers.values())

    def snapshot_lines(self) -> Iterable[bytes]:
        """What a new process needs: this one's index and in-flight counts, and those it
        knows of the others."""
        index = self.selector.index
        most = SNAPSHOT_KEYS // max(1, len(index.replicas()))
        records = list(index.snapshot(most).items())
        replicas = self.replicas
        sends = self.sends
        yield _line(
            self.source,
            records,
            list(replicas.inflight.items()),
            list(replicas.prefilling.items()),
            sends.sent_keys(MAX_SENT_KEYS) if sends is not None else [],
        )
        for source in self._peers.keys() | self._peer_prefilling.keys() | self._peer_sent.keys():
            counts = self._peers.get(source, {})
            blocks = self._peer_prefilling.get(source, {})
            sent = [(rid, list(keys)) for rid, keys in self._peer_sent.get(source, {}).items()]
            yield _line(source, [], list(counts.items()), list(blocks.items()), sent)


def _counts(table: Any) -> dict[int, int]:
    """A table of counts per replica as sent: a list of [replica id, count] pairs of
    integers, each count in 0..MAX_COUNT; anything else raises ValueError (the whole table is
    dropped: a wrong count would steer every choice)."""
    if not isinstance(table, list):
        raise ValueError(f"a table of counts must be a list, not {type(table).__name__}")
    out: dict[int, int] = {}
    for pair in table:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"a count must be a [replica, count] pair, not {pair!r:.60}")
        rid, n = pair
        if type(rid) is not int or type(n) is not int or not 0 <= n <= MAX_COUNT:
            raise ValueError(f"a count out of bounds or not an integer: {pair!r:.60}")
        out[rid] = n
    return out


def _take(tables: dict[int, dict[int, int]], source: int, table: Any) -> bool:
    """A process's table of counts (None: not in this message, nothing changes; empty: it
    has none) into `tables`; whether they changed."""
    if table is None:
        return False
    if table:
        tables[source] = _counts(table)
    else:
        tables.pop(source, None)
    return True


def _sum(tables: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """Per replica, the sum of the tables' counts (zeros left out)."""
    total: dict[int, int] = {}
    for table in tables:
        for rid, n in table.items():
            total[rid] = total.get(rid, 0) + n
    return {rid: n for rid, n in total.items() if n}


def _sent_sets(table: Any, routable: Mapping[int, Any]) -> dict[int, set[int]]:
    """A process's pending prompt blocks as sent: a list of [replica id, [key, ...]] pairs of
    integers, at most MAX_SENT_KEYS keys in all; replicas no longer routable are left out.
    Anything else raises ValueError (the whole set is dropped)."""
    if not isinstance(table, list):
        raise ValueError(f"pending prompt blocks must be a list, not {type(table).__name__}")
    out: dict[int, set[int]] = {}
    total = 0
    for pair in table:
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[1], list):
            raise ValueError(f"pending blocks must be a [replica, [keys]] pair, not {pair!r:.60}")
        rid, keys = pair
        total += len(keys)
        if type(rid) is not int or total > MAX_SENT_KEYS:
            raise ValueError(f"pending blocks out of bounds: {pair!r:.60}")
        if any(type(k) is not int for k in keys):
            raise ValueError(f"a pending block key is not an integer: {pair!r:.60}")
        if rid in routable and keys:
            out[rid] = set(keys)
    return out


def _line(
    source: int,
    records: list[Any],
    inflight: list[tuple[int, int]],
    prefilling: list[tuple[int, int]] | None = None,
    sent: list[tuple[int, list[int]]] | None = None,
) -> bytes:
    msg = {"op": "share", "from": source, "records": records, "inflight": inflight}
    msg["prefilling"] = prefilling or []
    msg["sent"] = sent or []
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def gone_line(source: int) -> bytes:
    """Told to the others when a worker died: nothing of it is in flight any more."""
    return _line(source, [], [])


def channel_full(writer: asyncio.StreamWriter) -> bool:
    transport = writer.transport
    return transport.is_closing() or transport.get_write_buffer_size() > MAX_BUFFERED
