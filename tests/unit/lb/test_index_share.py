"""One cache_aware index for all the processes of a load balancer: a conversation whose turns
arrive on new connections (so on different worker processes) stays on its replica; the relay
goes on past a dead worker, and a restarted one gets the index; other policies share nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp import web

from fleetserve.lb import index_share as share_module
from fleetserve.lb.config import LbConfig
from fleetserve.lb.index_share import (
    KEY_ENV,
    MAX_BATCH_KEYS,
    MAX_RECORD_KEYS,
    IndexShare,
)
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.cache_aware import CacheAware
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.helpers import start_lb_process, wait_workers, workers_of
from tests.unit.lb.test_proxy import Start, closed_port, start

__all__ = ["start"]


# -- one process's side, without sockets --------------------------------------------------------


def share_of(sent: list[bytes], source: int = 1) -> tuple[IndexShare, CacheAware, ReplicaSet]:
    sel = CacheAware(block_chars=8)
    replicas = ReplicaSet(sel)
    replicas.replace([Upstream(r, f"http://127.0.0.1:{r}", 1) for r in (1, 2)])
    return IndexShare(sel, replicas, source, sent.append), sel, replicas


async def test_batches_carry_choices_and_changed_counts_within_bounds() -> None:
    sent: list[bytes] = []
    share, sel, replicas = share_of(sent)
    assert sel.on_record == share.record
    share.record(1, (11, 12))
    share.record(2, tuple(range(MAX_RECORD_KEYS + 50)))  # a huge prompt: its first keys only
    replicas.inflight[1] = 3
    line = share.batch()
    assert line is not None and line.endswith(b"\n")
    msg = json.loads(line)
    assert msg["op"] == "share" and msg["from"] == 1
    assert msg["records"][0] == [1, [11, 12]]
    assert len(msg["records"][1][1]) == MAX_RECORD_KEYS
    assert msg["inflight"] == [[1, 3]]
    assert share.batch() is None  # nothing new: nothing sent
    # Past MAX_BATCH_KEYS in one batch, choices are not shared (the local index has them).
    for _ in range(MAX_BATCH_KEYS // MAX_RECORD_KEYS + 2):
        share.record(1, tuple(range(MAX_RECORD_KEYS)))
    msg = json.loads(share.batch() or b"{}")
    assert sum(len(keys) for _, keys in msg["records"]) == MAX_BATCH_KEYS
    assert share.dropped_keys == 2 * MAX_RECORD_KEYS
    assert "inflight" not in msg  # unchanged


async def test_the_loop_sends_while_busy_and_sleeps_when_idle() -> None:
    sent: list[bytes] = []
    share, _, replicas = share_of(sent)
    share.interval = 0.001
    task = asyncio.get_running_loop().create_task(share.run())
    try:
        replicas.inflight[2] = 1
        share.record(2, (5,))
        await asyncio.sleep(0.05)
        assert [json.loads(x).get("records") for x in sent] == [[[2, [5]]]]
        del replicas.inflight[2]  # the request ended: the counts go out without a choice
        replicas.on_count()  # (as exchange.py tells, after each change of the counts)
        await asyncio.sleep(0.05)
        assert json.loads(sent[-1])["inflight"] == []
        count = len(sent)
        await asyncio.sleep(0.05)
        assert len(sent) == count and not share._wake.is_set()  # idle: asleep
    finally:
        task.cancel()


async def test_requests_in_flight_with_no_change_do_not_wake_the_loop() -> None:
    """Long streams in flight and nothing new: no batch is even looked for (the loop used to
    wake every interval while any request was in flight)."""
    sent: list[bytes] = []
    share, _, replicas = share_of(sent)
    share.interval = 0.001
    looks = 0
    batch = share.batch

    def counted() -> bytes | None:
        nonlocal looks
        looks += 1
        return batch()

    share.batch = counted  # type: ignore[method-assign]
    task = asyncio.get_running_loop().create_task(share.run())
    try:
        replicas.inflight[1] = 4
        share.record(1, (7,))
        await asyncio.sleep(0.03)
        assert len(sent) == 1 and looks == 1
        await asyncio.sleep(0.1)  # ~100 intervals with 4 requests in flight, none changing
        assert looks == 1 and not share._wake.is_set()
        replicas.inflight[1] = 3
        replicas.on_count()
        await asyncio.sleep(0.03)
        assert looks == 2 and json.loads(sent[-1])["inflight"] == [[1, 3]]
    finally:
        task.cancel()


async def test_applying_others_batches() -> None:
    share, sel, replicas = share_of([], source=0)
    keys = sel.keys("abcdefgh" * 4)
    line = {"op": "share", "from": 2, "records": [[2, list(keys)], [9, [1, 2]]]}
    share.apply({**line, "inflight": [[2, 4], [1, 1]]})
    share.apply({"op": "share", "from": 1, "inflight": [[2, 1]]})
    assert sel.index.match(keys, [1, 2]) == (4, [2])
    assert 9 not in sel.index.replicas()  # not routable here: not recorded (it left)
    assert sel.peer_inflight == {2: 5, 1: 1}
    share.forget_peer(2)
    assert sel.peer_inflight == {2: 1}
    share.apply({"op": "share", "from": 1, "inflight": []})
    assert sel.peer_inflight == {}
    share.apply({"op": "share", "records": [[1, [1]]]})  # malformed: logged, ignored
    share.apply({"op": "share", "from": 1, "records": 5})
    # What a new process gets: the index and the counts, its own and the others'.
    replicas.inflight[1] = 2
    share.apply({"op": "share", "from": 3, "inflight": [[1, 7]]})
    lines = [json.loads(x) for x in share.snapshot_lines()]
    assert lines[0]["from"] == 0 and lines[0]["inflight"] == [[1, 2]]
    assert [rid for rid, _ in lines[0]["records"]] == [2]
    assert lines[1] == {
        "op": "share",
        "from": 3,
        "records": [],
        "inflight": [[1, 7]],
        "prefilling": [],
        "sent": [],
    }


async def test_blocks_to_prefill_are_shared_added_up_and_forgotten() -> None:
    """The cost choice weighs the other processes' prompt blocks not yet prefilled, per
    replica: they go out when they change, add up per replica, and leave with their process."""
    share, sel, replicas = share_of([], source=0)
    replicas.prefilling[1] = 12
    msg = json.loads(share.batch() or b"{}")
    assert msg["prefilling"] == [[1, 12]]
    assert "prefilling" not in json.loads(share.batch() or b'{"x": 1}')  # unchanged: not sent
    share.apply({"op": "share", "from": 2, "prefilling": [[1, 5], [2, 3]]})
    share.apply({"op": "share", "from": 3, "prefilling": [[2, 4]]})
    assert sel.peer_prefilling == {1: 5, 2: 7}
    share.apply({"op": "share", "from": 3, "prefilling": []})
    assert sel.peer_prefilling == {1: 5, 2: 3}
    lines = [json.loads(x) for x in share.snapshot_lines()]
    assert lines[0]["prefilling"] == [[1, 12]]
    assert {x["from"]: x["prefilling"] for x in lines[1:]} == {2: [[1, 5], [2, 3]]}
    share.forget_peer(2)
    assert sel.peer_prefilling == {}


async def test_prompts_sent_and_not_yet_answered_are_shared_whole_and_mended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cache_aware's precise mode credits a replica with the prompts sent to it and not yet
    answered by any process of the LB: each process sends its whole pending set per replica
    when it changed (a lost batch is mended by the next, none stands for good), bounded and
    checked; the others' sets are united, leave with their process and skip replicas that
    left."""
    monkeypatch.setattr(share_module, "SENT_INTERVAL_SECONDS", 0.0)  # (see the next test)
    from fleetserve.policies.cache_aware_precise import PreciseCacheAware
    from fleetserve.policies.kv_index import KvIndex
    from fleetserve.policies.lb import RequestKey
    from tests.unit.policies.test_cache_aware_precise import NoTokens

    sel = PreciseCacheAware(KvIndex(), NoTokens(), block_chars=8)
    replicas = ReplicaSet(sel)
    replicas.replace([Upstream(r, f"http://127.0.0.1:{r}", 1) for r in (1, 2)])
    sent: list[bytes] = []
    share = IndexShare(sel, replicas, 0, sent.append)
    assert "sent" not in json.loads(share.batch() or b"{}")  # nothing pending: nothing said
    streamed = RequestKey(prefix="p", blocks=(11, 12, 13), streams=True)
    shorter = RequestKey(prefix="p", blocks=(11, 12), streams=True)
    first = sel.sending(1, streamed)
    second = sel.sending(1, shorter)
    assert sel.sending(2, RequestKey(prefix="q", blocks=(21,), streams=False)) is None
    assert json.loads(share.batch() or b"{}")["sent"] == [[1, [11, 12, 13]]]
    assert share.batch() is None  # unchanged: not sent again
    sel.answered(1, streamed, first)
    assert json.loads(share.batch() or b"{}")["sent"] == [[1, [11, 12]]]
    sel.answered(1, shorter, second)
    assert json.loads(share.batch() or b"{}")["sent"] == []
    # The others' sets: each process's apart; a later set replaces its earlier one.
    blended = sel.blended
    share.apply({"op": "share", "from": 1, "sent": [[1, [5, 6]], [9, [7]]]})  # 9: not routable
    share.apply({"op": "share", "from": 2, "sent": [[1, [5, 8]]]})
    assert blended.pending((5, 6, 7), 1) == 2 and blended.pending((5, 8), 1) == 2
    assert blended.pending((7,), 9) == 0
    share.apply({"op": "share", "from": 1, "sent": []})
    assert blended.pending((5, 6), 1) == 1 and blended.pending((5, 8), 1) == 2
    # Bad sets are dropped whole (and logged), the process's earlier one stands.
    for bad in (
        5,
        [[1, 5]],
        [[1, [5, "x"]]],
        [["1", [5]]],
        [[1, list(range(share_module.MAX_SENT_KEYS + 1))]],
    ):
        share.apply({"op": "share", "from": 2, "sent": bad})
        assert blended.pending((5, 8), 1) == 2, bad
    # A new process gets the pending sets too; a process that is gone takes its set along.
    sel.sending(2, RequestKey(prefix="r", blocks=(31, 32), streams=True))
    lines = [json.loads(x) for x in share.snapshot_lines()]
    assert lines[0]["sent"] == [[2, [31, 32]]]
    assert [(x["from"], x["sent"][0][0], set(x["sent"][0][1])) for x in lines[1:]] == [
        (2, 1, {5, 8})
    ]
    share.forget_peer(2)
    assert blended.pending((5, 8), 1) == 0
    # A replica that leaves takes its credit along, ours and the others', and a set that a
    # process sends later does not bring it back while it is not routable.
    share.apply({"op": "share", "from": 1, "sent": [[2, [40]]]})
    assert blended.pending((40,), 2) == 1
    replicas.replace([Upstream(1, "http://127.0.0.1:1", 1)])
    assert blended.pending((31, 32), 2) == 0 and blended.pending((40,), 2) == 0
    share.apply({"op": "share", "from": 3, "sent": [[1, [50]]]})
    share.apply({"op": "share", "from": 1, "sent": [[2, [40]], [1, [60]]]})
    assert blended.pending((40,), 2) == 0 and blended.pending((60,), 1) == 1


async def test_pending_sets_go_at_most_once_an_interval_and_the_last_one_always_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole set each time, so not on every change under a high request rate: a change
    within SENT_INTERVAL_SECONDS of the last set sent waits for the interval's end, and then
    goes by itself (no later change needed)."""
    from fleetserve.policies.cache_aware_precise import PreciseCacheAware
    from fleetserve.policies.kv_index import KvIndex
    from fleetserve.policies.lb import RequestKey
    from tests.unit.policies.test_cache_aware_precise import NoTokens

    sel = PreciseCacheAware(KvIndex(), NoTokens(), block_chars=8)
    replicas = ReplicaSet(sel)
    replicas.replace([Upstream(1, "http://127.0.0.1:1", 1)])
    monkeypatch.setattr(share_module, "SENT_INTERVAL_SECONDS", 0.5)
    lines: list[bytes] = []
    share = IndexShare(sel, replicas, 0, lines.append, interval=0.001)
    task = asyncio.ensure_future(share.run())
    try:
        key = RequestKey(prefix="p", blocks=(11, 12), streams=True)
        token = sel.sending(1, key)
        replicas.on_count()
        for _ in range(100):
            if lines:
                break
            await asyncio.sleep(0.005)
        sel.answered(1, key, token)
        replicas.on_count()
        await asyncio.sleep(0.05)
        sets = [json.loads(x).get("sent") for x in lines]
        assert sets == [[[1, [11, 12]]]]  # the change came too soon: not yet sent
        for _ in range(300):
            if len(lines) > 1:
                break
            await asyncio.sleep(0.01)
        assert [json.loads(x).get("sent") for x in lines] == [[[1, [11, 12]]], []]
        # A set deferred when the share stops: its wake is cancelled with it.
        token = sel.sending(1, key)
        replicas.on_count()
        for _ in range(300):
            if share._sent_due is not None:
                break
            await asyncio.sleep(0.005)
        due = share._sent_due
        assert due is not None
    finally:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert due.cancelled() and share._sent_due is None


# -- real load-balancer processes ---------------------------------------------------------------

Served = list[tuple[str, int]]  # (replica, the LB's local port of the connection it came on)


def named_upstream(name: str, served: Served) -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        served.append((name, int(peer[1]) if peer else 0))
        return web.json_response({"replica": name})

    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


def processes_that_served(proc: subprocess.Popen[bytes], served: Served) -> set[int]:
    """The LB processes (pids) whose pooled replica connections carried these requests."""
    ports: dict[int, int] = {}
    for p in [psutil.Process(proc.pid), *workers_of(proc)]:
        for c in p.net_connections(kind="tcp"):
            if c.laddr:
                ports[c.laddr.port] = p.pid
    return {ports[port] for _, port in served if port in ports}


def conversation(conv: int, turns: int) -> dict[str, object]:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"Shop {conv}: you answer its customers. " * 20}
    ]
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {conv}, turn {t}. " * 40})
        messages.append({"role": "assistant", "content": f"answer {t} to {conv}. " * 20})
    return {"model": "m", "messages": messages[:-1]}


async def post_fresh(port: int, body: dict[str, object]) -> str:
    """On a new connection: the kernel picks the LB process (SO_REUSEPORT)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        return str((await r.json())["replica"])


async def push(config: LbConfig, ports: dict[str, int], ids: dict[str, int]) -> None:
    body = {
        "replicas": [
            {"replica_id": ids[name], "url": f"http://127.0.0.1:{port}"}
            for name, port in ports.items()
        ]
    }
    async with (
        aiohttp.ClientSession() as s,
        s.put(f"http://127.0.0.1:{config.admin_port}/-/replicas", json=body) as r,
    ):
        assert r.status == 200
    await asyncio.sleep(0.2)  # relayed to the workers


@pytest.fixture
async def lb_processes(tmp_path: Path) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        workers = workers_of(proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, "a worker outlived its primary's stop"


async def start_lb(
    tmp_path: Path, started: list[subprocess.Popen[bytes]], policy: str, workers: int
) -> tuple[LbConfig, subprocess.Popen[bytes]]:
    config = LbConfig(
        service="share",
        port=closed_port(),
        admin_port=closed_port(),
        policy=policy,  # type: ignore[arg-type]
        options=LoadBalancerOptions(workers=workers),
    )
    proc = await start_lb_process(config, tmp_path)
    started.append(proc)
    assert await all_listening(proc, config, workers)
    return config, proc


def listening(p: psutil.Process, port: int) -> bool:
    try:
        conns = p.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


async def all_listening(proc: subprocess.Popen[bytes], config: LbConfig, count: int) -> bool:
    """Wait (30 s at most: a loaded machine starts a worker slowly) until `count` processes
    of the load balancer take connections on its port, each on its own socket (a worker's
    sockets are open in it from its start, and served by the primary until it is ready)."""
    admin = f"http://127.0.0.1:{config.admin_port}/-/replicas"
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            procs = [psutil.Process(proc.pid), *workers_of(proc)]
            if sum(listening(p, config.port) for p in procs) == count:
                async with s.get(admin) as r:
                    if (await r.json())["covered_workers"] == []:
                        return True
            await asyncio.sleep(0.1)
    return False


async def place_then_widen(
    start: Start, config: LbConfig, conversations: int
) -> tuple[Served, dict[str, int], dict[str, int]]:
    """Every conversation's first turn while only replica a is routable (each on a new
    connection, so on any process), then b joins. Only a process that knows where a
    conversation went sends its next turn to a: any other picks by load and the hash of the
    prompt's first block, which sends about half of the conversations to b."""
    served: Served = []
    a = await start(named_upstream("a", served))
    b = await start(named_upstream("b", served))
    ids = {"a": 1, "b": 2}
    await push(config, {"a": a}, ids)
    for conv in range(conversations):
        assert await post_fresh(config.port, conversation(conv, 1)) == "a"
    await asyncio.sleep(0.5)  # the batches go out every 5 ms (a loaded machine: more)
    await push(config, {"a": a, "b": b}, ids)
    return served, {"a": a, "b": b}, ids


async def test_turns_on_other_processes_stay_on_the_conversations_replica(
    start: Start, tmp_path: Path, lb_processes: list[subprocess.Popen[bytes]]
) -> None:
    config, proc = await start_lb(tmp_path, lb_processes, "cache_aware", workers=2)
    served, _, _ = await place_then_widen(start, config, conversations=12)
    later = [await post_fresh(config.port, conversation(c, 2)) for c in range(12)]
    assert later == ["a"] * 12
    assert len(processes_that_served(proc, served)) == 2  # both processes took turns
    # New conversations still spread over both replicas.
    fresh = {await post_fresh(config.port, conversation(100 + c, 1)) for c in range(16)}
    assert fresh == {"a", "b"}
    worker = workers_of(proc)[0]
    assert KEY_ENV in worker.environ()  # one secret for all the processes' keys


async def test_the_relay_survives_a_dead_worker_and_the_new_one_gets_the_index(
    start: Start, tmp_path: Path, lb_processes: list[subprocess.Popen[bytes]]
) -> None:
    config, proc = await start_lb(tmp_path, lb_processes, "cache_aware", workers=3)
    served, _, _ = await place_then_widen(start, config, conversations=12)
    dead = workers_of(proc)[0]
    os.kill(dead.pid, signal.SIGKILL)
    assert await wait_workers(proc, exclude=dead.pid)
    await asyncio.sleep(1.5)  # the primary restarts it within a second
    # The replacement got the set and the index at its start.
    assert await all_listening(proc, config, 3)
    served.clear()
    later = [await post_fresh(config.port, conversation(c % 12, 2)) for c in range(36)]
    assert later == ["a"] * 36
    assert len(processes_that_served(proc, served)) == 3  # the new worker among them


@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
async def test_other_policies_share_nothing(
    start: Start, tmp_path: Path, lb_processes: list[subprocess.Popen[bytes]], policy: str
) -> None:
    config, proc = await start_lb(tmp_path, lb_processes, policy, workers=2)
    assert KEY_ENV not in workers_of(proc)[0].environ()
    served: Served = []
    a = await start(named_upstream("a", served))
    b = await start(named_upstream("b", served))
    await push(config, {"a": a, "b": b}, {"a": 1, "b": 2})
    got = [await post_fresh(config.port, conversation(c, 1)) for c in range(8)]
    assert set(got) == {"a", "b"}


async def test_malformed_counts_are_dropped_whole_and_never_crash() -> None:
    """Counts steer every choice: a table that is not a list of [replica, count] pairs of
    integers in bounds is logged and dropped whole (the last good one stays)."""
    share, sel, _ = share_of([], source=0)
    share.apply({"op": "share", "from": 2, "prefilling": [[1, 5]], "inflight": [[1, 2]]})
    bad_tables = [
        json.loads(b"[[1, Infinity]]"),
        [[1, 10**400]],
        [[1, -1000]],
        [[1, True]],
        [[1, 2.5]],
        {"12": "3"},
        [[1, 2, 3]],
        "12",
    ]
    for bad in bad_tables:
        share.apply({"op": "share", "from": 2, "prefilling": bad})
        share.apply({"op": "share", "from": 2, "inflight": bad})
        assert sel.peer_prefilling == {1: 5} and sel.peer_inflight == {1: 2}, bad
    share.apply(json.loads(b'{"op": "share", "from": Infinity, "prefilling": []}'))
    assert sel.peer_prefilling == {1: 5}


async def test_counts_not_written_go_again() -> None:
    """A batch dropped on a full channel must not leave the others with stale counts: the
    next batch carries them again, even when they are now empty."""
    sent: list[bytes] = []
    full = True
    share: IndexShare | None = None

    def send(line: bytes) -> None:
        assert share is not None
        if full:
            share.dropped_batches += 1
        else:
            sent.append(line)

    share, _, replicas = share_of([], source=1)
    share.send = send
    share.interval = 0.001
    task = asyncio.get_running_loop().create_task(share.run())
    try:
        replicas.inflight[2] = 1
        replicas.prefilling[2] = 9
        share.record(2, (5,))
        await asyncio.sleep(0.02)
        del replicas.inflight[2], replicas.prefilling[2]  # ended while the channel was full
        replicas.on_count()
        await asyncio.sleep(0.02)
        assert not sent and share.dropped_batches >= 2
        full = False
        await asyncio.sleep(0.05)
        last = json.loads(sent[-1])
        assert last["inflight"] == [] and last["prefilling"] == []
    finally:
        task.cancel()
