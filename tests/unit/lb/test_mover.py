"""move_waiting_requests: requests waiting in a replica's queue move to a replica with room
(fleetserve.lb.mover), planned from the replicas' metrics and made by the exchanges."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from fleetserve.lb.mover import Mover, plan_moves
from fleetserve.lb.replica_load import parse_queue
from fleetserve.lb.replica_set import Upstream
from fleetserve.spec.loader import InvalidSpec, parse_spec
from tests.unit.lb.test_proxy import Start, make_lb_proxy, start  # noqa: F401 (fixture)

# --- the plan ------------------------------------------------------------------------------


def test_a_new_replica_takes_half_of_a_queued_replicas_load() -> None:
    # 2 running + 6 waiting against an empty replica: 4 move (8/0 -> 4/4).
    assert plan_moves({1: (2, 6), 2: (0, 0)}, {1, 2}, limit=100) == [(1, 2)] * 4


def test_only_waiting_requests_move() -> None:
    # 6 running, 1 waiting: one may move, however unequal the loads.
    assert plan_moves({1: (6, 1), 2: (0, 0)}, {1, 2}, limit=100) == [(1, 2)]
    # Nothing waits: nothing moves.
    assert plan_moves({1: (8, 0), 2: (0, 0)}, {1, 2}, limit=100) == []


def test_a_move_needs_a_difference_of_two() -> None:
    # 1 waiting against an idle replica: moving would only swap the loads.
    assert plan_moves({1: (0, 1), 2: (0, 0)}, {1, 2}, limit=100) == []
    assert plan_moves({1: (1, 1), 2: (0, 0)}, {1, 2}, limit=100) == [(1, 2)]


def test_targets_are_ready_replicas_read_with_nothing_waiting() -> None:
    queues = {1: (2, 6), 2: (0, 1), 3: (0, 0), 4: (0, 0)}
    # 2 waits itself (not a target), 3 is not READY (draining, cold), 5 READY but not read.
    assert plan_moves(queues, {1, 2, 4, 5}, limit=100) == [(1, 4)] * 4
    # A source that is not READY keeps its requests.
    assert plan_moves(queues, {2, 4}, limit=100) == []


def test_the_busiest_source_and_the_least_loaded_target_go_first() -> None:
    queues = {1: (2, 4), 2: (2, 2), 3: (0, 0), 4: (1, 0)}
    moves = plan_moves(queues, {1, 2, 3, 4}, limit=100)
    assert moves[0] == (1, 3)
    # The loads end within 1 of each other where something waited.
    loads = {rid: r + w for rid, (r, w) in queues.items()}
    for src, dst in moves:
        loads[src] -= 1
        loads[dst] += 1
    assert max(loads.values()) - min(loads.values()) <= 1
    assert len(moves) == 4  # 6, 4, 0, 1 -> 3, 3, 3, 2


def test_a_replica_that_lies_costs_at_most_the_limit() -> None:
    began = time.monotonic()
    assert plan_moves({1: (0, 10**8), 2: (0, 0)}, {1, 2}, limit=5) == [(1, 2)] * 5
    assert time.monotonic() - began < 1.0


def test_parse_queue_splits_running_from_waiting() -> None:
    assert parse_queue("vllm:num_requests_running 3\nvllm:num_requests_waiting 2\n") == (3, 2)
    assert parse_queue("sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\n") == (4, 1)
    assert parse_queue("tgi_batch_current_size 2\ntgi_queue_size 7\n") == (2, 7)
    assert parse_queue("tgi_queue_size 7\n") == (0, 7)
    assert parse_queue("other 1\n") is None


# --- one process's share -------------------------------------------------------------------


class FakeRequest:
    def __init__(self, name: str, movable: bool = True) -> None:
        self.name = name
        self.movable = movable
        self.went: int | None = None

    def can_move(self) -> bool:
        return self.movable and self.went is None

    def move_to(self, upstream: Upstream) -> bool:
        if not self.can_move():
            return False
        self.went = upstream.replica_id
        return True


def _mover(
    queues: dict[int, tuple[int, int]],
    mine: dict[int, list[FakeRequest]],
    inflight: dict[int, int],
    chance: float = 0.5,
) -> tuple[Mover, list[tuple[int, int]]]:
    upstreams = {rid: Upstream(rid, f"http://127.0.0.1:{9000 + rid}", 1) for rid in (1, 2, 3)}
    unanswered: dict[int, dict[Any, None]] = {
        rid: dict.fromkeys(reqs) for rid, reqs in mine.items()
    }
    moved: list[tuple[int, int]] = []
    mover = Mover(
        queues,
        lambda: upstreams,
        inflight,
        unanswered,
        on_moved=lambda s, d: moved.append((s, d)),
        chance=lambda: chance,
    )
    return mover, moved


def test_the_newest_requests_move_and_the_unmovable_are_passed_over() -> None:
    reqs = [FakeRequest(f"r{i}") for i in range(6)]
    reqs[5].movable = False  # its answer began
    mover, moved = _mover({1: (2, 4), 2: (0, 0)}, {1: reqs}, {1: 6})
    assert mover.round() == 3  # 6/0 -> 3/3
    assert [r.name for r in reqs if r.went == 2] == ["r2", "r3", "r4"]
    assert moved == [(1, 2)] * 3
    # The next round, on the same (stale) reading, moves none of them again.
    assert all(r.went is None or not r.can_move() for r in reqs)


def test_a_process_moves_its_share_of_a_replicas_moves() -> None:
    # The replica holds 8 (2 running, 6 waiting); this process sent 4 of them: 4 moves are
    # planned, this process makes 4 x 4 / 8 = 2.
    reqs = [FakeRequest(f"r{i}") for i in range(4)]
    mover, _ = _mover({1: (2, 6), 2: (0, 0)}, {1: reqs}, {1: 4})
    assert mover.round() == 2
    assert [r.name for r in reqs if r.went] == ["r2", "r3"]


def test_a_fractional_share_is_rounded_at_random() -> None:
    # 1 move planned, this process holds a third of the load: it moves one when the draw
    # falls under 1/3, none otherwise.
    for chance, expected in ((0.2, 1), (0.5, 0)):
        reqs = [FakeRequest("a"), FakeRequest("b")]
        mover, _ = _mover({1: (2, 1), 2: (0, 0)}, {1: reqs}, {1: 1}, chance=chance)
        assert mover.round() == expected


def test_nothing_to_move_without_requests_of_this_process() -> None:
    mover, _ = _mover({1: (2, 6), 2: (0, 0)}, {}, {})
    assert mover.round() == 0


# --- on real sockets: a queued streaming server ---------------------------------------------


class Engine:
    """An LLM server's shape: one request runs at a time, the others wait in a queue; a
    streamed answer's head goes out at once, its tokens when the request runs. A request
    whose client leaves while it waits is aborted."""

    def __init__(self, name: str, seconds: float = 0.6) -> None:
        self.name = name
        self.seconds = seconds
        self.lock = asyncio.Lock()
        self.waiting = 0
        self.running = 0
        self.served: list[str] = []
        self.aborted: list[str] = []
        self.hints: dict[str, str | None] = {}  # X-Vllm-Priority by request id (engine_priority)

    def app(self) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.hints[body["id"]] = request.headers.get("X-Vllm-Priority")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)  # the head, before the first token
            self.waiting += 1
            queued = True
            try:
                async with self.lock:
                    self.waiting -= 1
                    queued = False
                    self.running += 1
                    try:
                        for i in range(3):
                            await asyncio.sleep(self.seconds / 3)
                            await resp.write(f"data: {self.name} {i}\n\n".encode())
                    finally:
                        self.running -= 1
            except asyncio.CancelledError:
                self.aborted.append(body["id"])
                raise
            finally:
                if queued:
                    self.waiting -= 1
            self.served.append(body["id"])
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(
                text=f"vllm:num_requests_running {self.running}\n"
                f"vllm:num_requests_waiting {self.waiting}\n"
            )

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/metrics", metrics)
        return app


async def _chat(session: aiohttp.ClientSession, lb: str, rid: str) -> tuple[int, str]:
    async with session.post(f"{lb}/v1/chat/completions", json={"id": rid}) as r:
        return r.status, (await r.read()).decode()


def _up(rid: int, port: int) -> Upstream:
    return Upstream(rid, f"http://127.0.0.1:{port}", 1)


async def _moving_lb(
    start: Start,  # noqa: F811
    upstreams: list[Upstream],
) -> tuple[str, Any, Any]:
    """A load balancer with move_waiting_requests, reading the replicas every 0.1 s."""
    return await make_lb_proxy(
        start, "least_load", upstreams, replica_metrics_seconds=0.1, move_waiting_requests=True
    )


async def _queue_four(
    session: aiohttp.ClientSession, lb: str, engine: Engine
) -> list[asyncio.Task[tuple[int, str]]]:
    """Four streamed requests, in order, until one runs at `engine` and three wait."""
    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(_chat(session, lb, f"q{i}")))
        await asyncio.sleep(0.05)  # arrive in order
    for _ in range(100):
        if engine.waiting == 3:
            break
        await asyncio.sleep(0.01)
    assert (engine.running, engine.waiting) == (1, 3)
    return tasks


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def _queued_then_scaled(
    start: Start,  # noqa: F811
    session: aiohttp.ClientSession,
    move: bool,
) -> tuple[Engine, Engine, list[tuple[int, str]], str]:
    """Four streamed requests queue at replica 1; then replica 2 becomes READY."""
    a, b = Engine("A"), Engine("B")
    port_a = await start(a.app())
    port_b = await start(b.app())
    up_a, up_b = _up(1, port_a), _up(2, port_b)
    options: dict[str, Any] = {"replica_metrics_seconds": 0.1}
    if move:
        options["move_waiting_requests"] = True
    lb, replicas, proxy = await make_lb_proxy(start, "least_load", [up_a], **options)
    tasks = await _queue_four(session, lb, a)
    replicas.replace([up_a, up_b])  # replica 2 is READY now
    results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
    text = generate_latest(proxy.metrics.registry).decode()
    return a, b, results, text


async def test_queued_requests_move_to_a_replica_made_ready(
    start: Start,  # noqa: F811
    session: aiohttp.ClientSession,
) -> None:
    a, b, results, metrics = await _queued_then_scaled(start, session, move=True)
    # 1 running + 3 waiting against an empty replica: the two newest move (4/0 -> 2/2).
    assert sorted(b.served) == ["q2", "q3"]
    assert sorted(a.served) == ["q0", "q1"]
    assert sorted(a.aborted) == ["q2", "q3"]  # their first connections closed: cancelled there
    for i, (status, text) in enumerate(results):
        replica = "B" if i >= 2 else "A"
        # One clean answer each, from the replica that served it: one head (the moved
        # requests' first heads were held, never sent), every token, the end.
        assert status == 200
        assert text == "".join(f"data: {replica} {t}\n\n" for t in range(3)) + "data: [DONE]\n\n"
    moved = 'fleetserve_lb_requests_moved_total{policy="least_load",replica="1",service="svc"}'
    assert f"{moved} 2.0" in metrics


async def test_a_moved_request_is_hinted_as_lacking_all_of_its_prompt(
    start: Start,  # noqa: F811
    session: aiohttp.ClientSession,
) -> None:
    """engine_priority: the hint a request carries is the one of the replica it is sent to;
    moved, it counts as lacking all of its body there (its bytes / cache_block_chars), not
    what it lacked where it waited."""
    a, b = Engine("A"), Engine("B")
    up_a, up_b = _up(1, await start(a.app())), _up(2, await start(b.app()))
    lb, replicas, _ = await make_lb_proxy(
        start,
        "cache_aware",
        [up_a],
        replica_metrics_seconds=0.1,
        move_waiting_requests=True,
        engine_priority="uncached",
    )
    system = "a system prompt that every conversation here shares " * 40  # ~2,100 characters
    bodies = {
        f"q{i}": {
            "id": f"q{i}",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {i}"},
            ],
        }
        for i in range(4)
    }

    async def send(body: dict[str, Any]) -> int:
        async with session.post(f"{lb}/v1/chat/completions", json=body) as r:
            await r.read()
            return r.status

    tasks = []
    for body in bodies.values():
        tasks.append(asyncio.create_task(send(body)))
        await asyncio.sleep(0.05)  # arrive in order
    for _ in range(100):
        if a.waiting == 3:
            break
        await asyncio.sleep(0.01)
    replicas.replace([up_a, up_b])
    assert await asyncio.wait_for(asyncio.gather(*tasks), 20) == [200] * 4
    assert sorted(b.served) == ["q2", "q3"]
    first = int(a.hints["q0"] or -1)
    assert first >= 8  # all of the shared prompt, at first
    assert all(0 <= int(a.hints[q] or -1) < first for q in ("q1", "q2", "q3"))  # held at A
    for q in ("q2", "q3"):  # at B: all of the body
        assert b.hints[q] == str(len(json.dumps(bodies[q])) // 256)


async def test_without_the_option_queued_requests_stay(
    start: Start,  # noqa: F811
    session: aiohttp.ClientSession,
) -> None:
    a, b, results, metrics = await _queued_then_scaled(start, session, move=False)
    assert sorted(a.served) == ["q0", "q1", "q2", "q3"]
    assert b.served == [] and a.aborted == []
    assert all(status == 200 for status, _ in results)
    assert "fleetserve_lb_requests_moved_total{" not in metrics


async def test_a_body_too_large_to_send_again_does_not_move(
    start: Start,  # noqa: F811
    session: aiohttp.ClientSession,
) -> None:
    a, b = Engine("A", seconds=1.5), Engine("B")
    port_a = await start(a.app())
    port_b = await start(b.app())
    up_a, up_b = _up(1, port_a), _up(2, port_b)
    lb, replicas, _ = await _moving_lb(start, [up_a])
    big = {"id": "big", "pad": "x" * 70_000}  # past the 64 KiB the LB keeps to send again

    async def post(body: dict[str, Any]) -> tuple[int, str]:
        async with session.post(f"{lb}/v1/chat/completions", data=json.dumps(body)) as r:
            return r.status, (await r.read()).decode()

    first = asyncio.create_task(post({"id": "first"}))
    for _ in range(200):
        if a.running:
            break
        await asyncio.sleep(0.01)
    second = asyncio.create_task(post({"id": "second"}))
    await asyncio.sleep(0.05)
    third = asyncio.create_task(post(big))  # the newest
    for _ in range(200):
        if a.waiting == 2:
            break
        await asyncio.sleep(0.01)
    assert (a.running, a.waiting) == (1, 2)
    # 1 running, 2 waiting: the plan moves one, the newest that can move: not the big one.
    replicas.replace([up_a, up_b])
    done = await asyncio.wait_for(asyncio.gather(first, second, third), 30)
    assert all(status == 200 for status, _ in done)
    assert b.served == ["second"]
    assert a.served == ["first", "big"]


def test_the_option_needs_the_python_data_plane() -> None:
    yaml = (
        "service:\n  readiness_probe: /\n  replicas: 1\n  load_balancer:\n"
        "    move_waiting_requests: true\n    data_plane: {plane}\n"
        "run: python -m http.server $PORT\n"
    )
    assert parse_spec(yaml.format(plane="python")).service.load_balancer.move_waiting_requests
    with pytest.raises(InvalidSpec, match="move_waiting_requests needs data_plane: python"):
        parse_spec(yaml.format(plane="nginx"))


async def test_a_first_token_in_the_heads_packet_is_not_held(
    start: Start,  # noqa: F811
) -> None:
    """A server that writes its head and first token at once, the next token much later:
    the held head goes out with the first token, not with the second."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"
        )
        await writer.drain()
        await asyncio.sleep(2.0)
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        lb, _, _ = await _moving_lb(start, [_up(1, port)])
        async with aiohttp.ClientSession() as session:
            began = time.monotonic()
            async with session.get(f"{lb}/stream") as r:
                first = await r.content.readuntil(b"\n\n")
                took = time.monotonic() - began
                rest = await r.read()
        assert first == b"data: 1\n\n"
        assert took < 1.5, took  # not held until the second token (2 s)
        assert rest == b"data: 2\n\n"
    finally:
        server.close()
        await server.wait_closed()


# --- what the outside review found (2026-12-05) ---------------------------------------------


def test_running_requests_of_this_process_are_kept() -> None:
    # Non-streaming requests: all four unanswered, three of them running. The newest (r3)
    # cannot move: the next newest (r2) runs, and must not be taken instead.
    reqs = [FakeRequest(f"r{i}") for i in range(4)]
    reqs[3].movable = False
    mover, _ = _mover({1: (3, 1), 2: (0, 0)}, {1: reqs}, {1: 4})
    assert mover.round() == 0
    assert all(r.went is None for r in reqs)


def test_no_moves_while_the_routing_splits_by_itself() -> None:
    reqs = [FakeRequest(f"r{i}") for i in range(6)]
    mover, _ = _mover({1: (2, 4), 2: (0, 0)}, {1: reqs}, {1: 6})
    mover.allowed = lambda: False  # a canary's percentage, replicas of different weights
    assert mover.round() == 0


def test_a_target_that_failed_a_moved_request_is_left_alone() -> None:
    now = [100.0]
    reqs = [FakeRequest(f"r{i}") for i in range(6)]
    mover, _ = _mover({1: (2, 4), 2: (0, 0), 3: (0, 0)}, {1: reqs}, {1: 6})
    mover.failed = {2: 90.0}
    mover.monotonic = lambda: now[0]
    assert mover.round() == 3
    assert {r.went for r in reqs if r.went} == {3}
    now[0] = 200.0  # long after: 2 is a target again
    more = [FakeRequest(f"s{i}") for i in range(6)]
    mover, _ = _mover({1: (2, 4), 2: (0, 0)}, {1: more}, {1: 6})
    mover.failed = {2: 90.0}
    mover.monotonic = lambda: now[0]
    assert mover.round() == 3
    assert mover.failed == {}  # (an old failure is forgotten)


async def _raw_server(handler: Any) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_moved_request_goes_back_when_its_target_does_not_answer(
    start: Start,  # noqa: F811
    session: aiohttp.ClientSession,
) -> None:
    """Replica 2 reads as idle but drops every request: the moved requests go back to
    replica 1 and are answered there; replica 2 gets no more moves."""
    a = Engine("A")
    port_a = await start(a.app())
    dropped: list[bytes] = []

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /metrics"):
                text = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text))
                await writer.drain()
            else:
                dropped.append(head.split(b"\r\n", 1)[0])
        writer.close()

    server, port_b = await _raw_server(drop)
    try:
        up_a, up_b = _up(1, port_a), _up(2, port_b)
        lb, replicas, proxy = await _moving_lb(start, [up_a])
        tasks = await _queue_four(session, lb, a)
        replicas.replace([up_a, up_b])
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert [status for status, _ in results] == [200] * 4
        assert all("data: A 2" in text for _, text in results)
        assert sorted(a.served) == ["q0", "q1", "q2", "q3"]
        # Two moved, both dropped; none after (the target failed a move: left alone).
        assert len(dropped) == 2
        text = generate_latest(proxy.metrics.registry).decode()
        assert (
            'fleetserve_lb_requests_moved_total{policy="least_load",replica="1",service="svc"} 2.0'
            in text
        )
    finally:
        server.close()
        await server.wait_closed()


async def test_a_head_answered_before_the_body_ends_is_not_held(
    start: Start,  # noqa: F811
) -> None:
    """A client that reads the answer's head before it sends the rest of its body."""

    async def early(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)  # the head, before the body is read
        body = await request.read()
        await resp.write(b"got %d" % len(body))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/up", early)
    port = await start(app)
    lb, _, _ = await _moving_lb(start, [_up(1, port)])
    host, _, lb_port = lb.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(lb_port))
    try:
        writer.write(
            b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(b"6\r\n world\r\n0\r\n\r\n")
        await writer.drain()
        rest = await asyncio.wait_for(reader.readuntil(b"got 11"), 3)
        assert rest.endswith(b"got 11")
    finally:
        writer.close()


async def test_the_option_leaves_cache_awares_count_alone(
    start: Start,  # noqa: F811
) -> None:
    """Without replica_metrics_seconds, cache_aware counts the LB's own in-flight requests,
    with or without move_waiting_requests (which reads the metrics for itself)."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 5\nvllm:num_requests_waiting 2\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    port = await start(app)
    _, replicas, proxy = await make_lb_proxy(
        start,
        "cache_aware",
        [_up(1, port)],
        move_waiting_requests=True,
    )
    assert proxy._load_poller is not None
    for _ in range(60):
        if proxy._load_poller.queues:
            break
        await asyncio.sleep(0.1)
    assert proxy._load_poller.queues == {1: (5, 2)}
    assert replicas.caps.reported == {}


def test_the_option_needs_a_second_attempt() -> None:
    yaml = (
        "service:\n  readiness_probe: /\n  replicas: 1\n  load_balancer:\n"
        "    move_waiting_requests: true\n    max_attempts: 1\n"
        "run: python -m http.server $PORT\n"
    )
    with pytest.raises(InvalidSpec, match="move_waiting_requests needs max_attempts >= 2"):
        parse_spec(yaml)
