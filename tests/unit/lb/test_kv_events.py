"""Following KV cache events (fleetserve.lb.kv_events) from a fake publisher on loopback that
speaks vLLM's ZmqEventPublisher wire: PUB [topic, seq, msgpack batch] and a ROUTER that
replays its buffer. Gaps, garbage, silence, restarts and floods."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from fleetserve.lb.kv_events import (
    BadBatch,
    Counts,
    KvEventsSettings,
    ReplicaFollower,
    decode_batch,
    endpoints,
)
from fleetserve.policies.kv_index import KvIndex, Trust, token_block_keys

TOPIC = b"kv-events"
PROMPT = list(range(1000, 1064))  # 4 blocks of 16


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(*events: dict[str, Any]) -> bytes:
    return msgpack.packb([time.time(), list(events), 0])


class FakePublisher:
    """vLLM's publisher in miniature: every batch is buffered; `drop` ones are not sent live."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.answers = True
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def send(self, payload: bytes, live: bool = True, buffered: bool = True) -> None:
        seq, self.seq = self.seq, self.seq + 1
        if buffered:
            self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            if not self.answers:
                continue
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        [client, b"", TOPIC, seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.term()


@pytest.fixture
async def pub(ctx: zmq.asyncio.Context) -> AsyncIterator[FakePublisher]:
    p = FakePublisher(ctx)
    yield p
    p.close()


async def until(cond: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def follower(
    pub: FakePublisher, ctx: zmq.asyncio.Context, **settings: Any
) -> tuple[ReplicaFollower, KvIndex]:
    index = KvIndex()
    s = KvEventsSettings(backoff_seconds=0.05, **settings)
    f = ReplicaFollower(
        7,
        f"tcp://127.0.0.1:{pub.port}",
        f"tcp://127.0.0.1:{pub.replay_port}",
        index,
        s,
        Counts(),
        ctx,
    )
    return f, index


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []
    yield tasks
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_history_is_replayed_then_followed(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    await pub.send(batch(stored([1, 2], PROMPT[:32])), live=False)  # before the LB listened
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    assert index.match(PROMPT, [7]) == {7: 32}
    await pub.send(batch(stored([3, 4], PROMPT[32:64], parent=2)))  # chained to the replayed
    await until(lambda: index.match(PROMPT, [7]) == {7: 64})
    await pub.send(batch(removed([2])))  # evicted: the match stops at block 1
    await until(lambda: index.match(PROMPT, [7]) == {7: 16})
    assert index.keys_of(7) == {token_block_keys(PROMPT, 16)[i] for i in (0, 2, 3)}


async def test_a_gap_is_filled_from_the_replay_buffer(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    await pub.send(batch(stored([1], PROMPT[:16])), live=False)  # lost on the way
    await pub.send(batch(stored([2], PROMPT[16:32], parent=1)))
    await until(lambda: index.match(PROMPT, [7]) == {7: 32})
    assert index.trust(7) is Trust.LIVE


async def test_batches_a_replay_applied_are_not_taken_for_a_restart(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    """A gap makes the follower replay the buffer, which by then holds the batches published
    right after it too; the subscription then delivers those again. They are skipped, not
    read as a restarted publisher's (whose seq would be lower than the last applied one),
    which would drop the replica to the approximate index until its engine cleared."""
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    await pub.send(batch(stored([1], PROMPT[:16])), live=False)  # lost on the way
    for i in range(1, 4):  # published at once: buffered before the replay is answered
        await pub.send(batch(stored([i + 1], PROMPT[16 * i : 16 * (i + 1)], parent=i)))
    await until(lambda: f.counts.duplicates >= 1)
    await pub.send(batch(removed([4])))  # followed live after them
    await until(lambda: index.match(PROMPT, [7]) == {7: 48})
    assert index.trust(7) is Trust.LIVE and f.counts.fallbacks == {}
    assert f.counts.batches == 5


async def test_a_batch_an_earlier_probe_applied_is_still_a_duplicate_after_a_later_one(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    """On a loaded machine a batch can reach the subscription after two silence probes: the
    first replayed it, the second found nothing new. It is still the same batch (seen in
    the full suite: a replica's index cleared and marked incomplete)."""
    f, index = follower(pub, ctx, silence_seconds=0.2, timeout_seconds=0.5)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    await pub.send(batch(stored([1], PROMPT[:16])))  # seq 0, live
    await until(lambda: index.match(PROMPT, [7]) == {7: 16})
    late = batch(stored([2], PROMPT[16:32], parent=1))
    await pub.send(late, live=False)  # seq 1: only in the buffer for now
    await until(lambda: index.match(PROMPT, [7]) == {7: 32})  # a probe replayed it
    probes = f.counts.batches
    await asyncio.sleep(0.7)  # more probes, finding nothing new
    assert f.counts.batches == probes
    await pub.pub.send_multipart([TOPIC, (1).to_bytes(8, "big"), late])  # now it arrives
    await until(lambda: f.counts.duplicates >= 1)
    assert index.trust(7) is Trust.LIVE and f.counts.fallbacks == {}
    assert index.match(PROMPT, [7]) == {7: 32}


async def test_a_restart_inside_what_a_replay_applied_is_still_followed_afresh(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    """Right after a replay, a batch whose seq the replay applied but whose bytes differ is a
    restarted engine's (its seqs start again at 0), not a duplicate."""
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    await pub.send(batch(stored([1], PROMPT[:16])), live=False)  # seq 0, lost: a gap
    for i in range(1, 4):
        await pub.send(batch(stored([i + 1], PROMPT[16 * i : 16 * (i + 1)], parent=i)))
    await until(lambda: f.counts.duplicates >= 1)  # the replay applied seqs 0-3
    await until(lambda: index.match(PROMPT, [7]) == {7: 64})
    pub.seq, pub.buffer = 0, []  # a new engine process: seq 0 again, other bytes
    await pub.send(batch(stored([9], [5] * 16)))
    await until(lambda: index.match(PROMPT, [7]) == {7: 0})
    assert index.trust(7) is Trust.LIVE and index.blocks(7) == 1


async def test_a_lost_batch_falls_back_until_the_engine_clears(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await pub.send(batch(stored([1], PROMPT[:16])))
    await until(lambda: index.match(PROMPT, [7]) == {7: 16})
    await pub.send(batch(removed([1])), live=False, buffered=False)  # gone for good
    await pub.send(batch(stored([5], PROMPT[16:32], parent=1)))
    await until(lambda: index.trust(7) is Trust.INCOMPLETE)
    assert f.counts.fallbacks == {"incomplete": 1}
    assert index.match(PROMPT, [7]) == {}  # the approximate index answers for it
    await pub.send(batch({"type": "AllBlocksCleared"}, stored([1], PROMPT[:16])))
    await until(lambda: index.trust(7) is Trust.LIVE)
    assert index.match(PROMPT, [7]) == {7: 16}


async def test_garbage_is_counted_not_raised(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    await pub.pub.send_multipart([TOPIC, b"short"])  # not three frames: skipped
    await pub.send(b"\xc1 not msgpack")
    await until(lambda: f.counts.bad >= 2)
    # The unreadable batch may have stored or removed anything: not trusted until a clear.
    await until(lambda: index.trust(7) is Trust.INCOMPLETE)
    await pub.send(batch({"type": "AllBlocksCleared"}))
    await until(lambda: index.trust(7) is Trust.LIVE)


def test_decode_refuses_what_it_cannot_vouch_for() -> None:
    assert len(decode_batch(batch(stored([1], PROMPT[:16]), {"type": "Future"}))) == 1
    bad = [
        b"",
        msgpack.packb({"not": "a batch"}),
        msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
        msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"]}]]),
        msgpack.packb([0.0, [{**stored([1], PROMPT[:16]), "block_hashes": [b"x" * 65]}]]),
        msgpack.packb([0.0, [["BlockStored", [1]]]]),
        msgpack.packb([0.0, list(range(10))]),
    ]
    for payload in bad:
        with pytest.raises(BadBatch):
            decode_batch(payload)
    lora = decode_batch(batch({**stored([1], PROMPT[:16]), "lora_name": "x"}))
    assert not lora[0].plain  # type: ignore[union-attr]


async def test_silence_without_an_answer_falls_back_and_resubscribes(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    f, index = follower(pub, ctx, silence_seconds=0.2, timeout_seconds=0.2)
    running.append(asyncio.create_task(f.run()))
    await pub.send(batch(stored([1], PROMPT[:16])))
    await until(lambda: index.match(PROMPT, [7]) == {7: 16})
    await asyncio.sleep(0.5)
    assert index.trust(7) is Trust.LIVE  # idle, but the publisher answers its probes
    pub.answers = False
    await until(lambda: index.trust(7) is Trust.SILENT)
    assert f.counts.fallbacks == {"silent": 1}
    pub.answers = True  # back: the same history continues
    await until(lambda: index.trust(7) is Trust.LIVE)
    assert index.match(PROMPT, [7]) == {7: 16}


async def test_a_restarted_publisher_is_followed_afresh(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await pub.send(batch(stored([1], PROMPT[:16])))
    await pub.send(batch(stored([2], PROMPT[16:32], parent=1)))
    await until(lambda: index.match(PROMPT, [7]) == {7: 32})
    pub.seq, pub.buffer = 0, []  # a new engine process: its seq starts again
    await pub.send(batch(stored([9], [5] * 16)))
    await until(lambda: index.match(PROMPT, [7]) == {7: 0})
    assert index.trust(7) is Trust.LIVE and index.blocks(7) == 1


async def test_a_flood_is_cut_off(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    f, index = follower(pub, ctx, max_blocks_per_second=100)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    many = [stored([i], [i] * 16) for i in range(1, 151)]
    await pub.send(batch(*many))
    await until(lambda: f.counts.fallbacks.get("overflow") == 1)
    assert index.blocks(7) <= 100


async def test_a_flood_of_bytes_without_blocks_is_cut_off(
    pub: FakePublisher, ctx: zmq.asyncio.Context, running: list[asyncio.Task[None]]
) -> None:
    # Events of kinds it skips, and garbage, name no blocks but cost decoding all the same.
    f, index = follower(pub, ctx, max_blocks_per_second=100, max_message_bytes=64 * 1024)
    running.append(asyncio.create_task(f.run()))
    await until(lambda: index.trust(7) is Trust.LIVE)
    future = batch(*[{"type": "Future", "pad": "x" * 100}] * 400)  # ~45 KB, no blocks
    for _ in range(8):
        await pub.send(future)
        await pub.send(b"\xc1" * 40_000)
    await until(lambda: f.counts.fallbacks.get("overflow") == 1)


async def test_a_publisher_of_another_user_is_not_followed(
    pub: FakePublisher,
    ctx: zmq.asyncio.Context,
    running: list[asyncio.Task[None]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another local user bound the replica's port + 1 and + 2 before its engine did.
    monkeypatch.setattr("fleetserve.lb.kv_events.held_by_me", lambda port: False)
    f, index = follower(pub, ctx)
    running.append(asyncio.create_task(f.run()))
    await pub.send(batch(stored([1], PROMPT[:16])))
    await until(lambda: index.trust(7) is Trust.SILENT)
    await asyncio.sleep(0.3)
    assert index.trust(7) is Trust.SILENT and index.blocks(7) == 0
    monkeypatch.setattr("fleetserve.lb.kv_events.held_by_me", lambda port: True)
    await until(lambda: index.match(PROMPT, [7]) == {7: 16})


def test_endpoints_follow_the_replica_port() -> None:
    assert endpoints("http://10.0.0.5:8000") == ("tcp://10.0.0.5:8001", "tcp://10.0.0.5:8002")
    assert endpoints("http://[::1]:9000/") == ("tcp://[::1]:9001", "tcp://[::1]:9002")
    assert endpoints("http:///nohost") is None
