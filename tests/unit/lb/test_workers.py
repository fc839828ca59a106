"""The load balancer as real processes: several workers on one port, pushes relayed to all,
load reports and metrics added up, a dead worker restarted."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp import web

from fleetserve.controller.history import window_percentile_ms
from fleetserve.lb.config import LbConfig
from fleetserve.lb.messages import LoadReport
from fleetserve.lb.proxy import listening_sockets
from fleetserve.lb.workers import MergedMetrics, Supervisor, merge_load
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.helpers import start_lb_process, wait_workers, workers_of
from tests.unit.lb.test_proxy import Start, closed_port, start, upstream_app

__all__ = ["start"]


def two_workers(service: str, policy: str = "least_load") -> LbConfig:
    """A load balancer of two processes on ports of its own."""
    return LbConfig(
        service=service,
        port=closed_port(),
        admin_port=closed_port(),
        policy=policy,
        options=LoadBalancerOptions(workers=2),
    )


@pytest.fixture
async def lb_process(tmp_path: Path) -> AsyncIterator[tuple[LbConfig, subprocess.Popen[bytes]]]:
    config = two_workers("w")
    proc = await start_lb_process(config, tmp_path)
    yield config, proc
    workers = workers_of(proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, "a worker outlived its primary's stop"


async def test_two_workers_share_the_port_and_report_together(
    start: Start, lb_process: tuple[LbConfig, subprocess.Popen[bytes]]
) -> None:
    config, proc = lb_process
    assert len(await wait_workers(proc)) == 1  # the primary plus one more
    a = await start(upstream_app("a"))
    admin = f"http://127.0.0.1:{config.admin_port}"
    async with aiohttp.ClientSession() as s:
        push = {"replicas": [{"replica_id": 1, "url": f"http://127.0.0.1:{a}"}]}
        async with s.put(f"{admin}/-/replicas", json=push) as r:
            assert r.status == 200
        await asyncio.sleep(0.2)
        statuses = []
        for _ in range(40):  # a new connection each time: the kernel spreads them
            async with (
                aiohttp.ClientSession() as fresh,
                fresh.get(f"http://127.0.0.1:{config.port}/x") as r,
            ):
                statuses.append(r.status)
        assert statuses == [200] * 40  # every worker got the push
        async with s.get(f"{admin}/-/load") as r:
            load = await r.json()
        async with s.get(f"{admin}/metrics") as r:
            text = await r.text()
    assert load["total_requests"] == 40
    assert load["replicas"]["1"]["requests_per_second"] == pytest.approx(40 / 60)
    assert 'replica="1",service="w"} 40.0' in text


def slow_to_answer_app() -> web.Application:
    """A replica that sends its head after 0.3 s, then its body in 5 pieces over 1 s (an LLM
    server streaming tokens after its time to first token)."""

    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # sends the status line and headers
        for i in range(5):
            await asyncio.sleep(0.2)
            await resp.write(f"data: {i}\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", slow)
    return app


async def test_time_to_first_byte_is_the_heads_and_duration_the_whole_answers(
    start: Start, lb_process: tuple[LbConfig, subprocess.Popen[bytes]]
) -> None:
    """Two workers, each measuring: the load report and the metrics add both up."""
    config, proc = lb_process
    await wait_workers(proc)
    a = await start(slow_to_answer_app())
    admin = f"http://127.0.0.1:{config.admin_port}"

    async def one() -> bytes:
        async with (  # a new connection each: the kernel spreads them over the workers
            aiohttp.ClientSession() as fresh,
            fresh.post(f"http://127.0.0.1:{config.port}/v1/completions", json={}) as r,
        ):
            assert r.status == 200
            return await r.read()

    async with aiohttp.ClientSession() as s:
        push = {"replicas": [{"replica_id": 1, "url": f"http://127.0.0.1:{a}"}]}
        async with s.put(f"{admin}/-/replicas", json=push) as r:
            assert r.status == 200
        async with s.get(f"{admin}/-/load") as r:
            before = LoadReport.model_validate(await r.json())
        await asyncio.sleep(0.2)
        bodies = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(8))), 20)
        assert all(b.count(b"data:") == 5 for b in bodies)
        async with s.get(f"{admin}/-/load") as r:
            load = LoadReport.model_validate(await r.json())
        async with s.get(f"{admin}/metrics") as r:
            text = await r.text()
    bounds = load.latency_bounds
    totals = load.totals["1"]
    # Cumulative counts: none of the 8 first bytes within 0.25 s, all within 1 s (0.3 s,
    # with room for a loaded machine); no whole answer within 1 s (1.3 s), all within 2.5 s.
    assert totals.first_byte[bounds.index(0.25)] == 0
    assert totals.first_byte[bounds.index(1)] == 8 and totals.first_byte[-1] == 8
    assert totals.latency[bounds.index(1)] == 0 and totals.latency[bounds.index(2.5)] == 8
    ttft = window_percentile_ms(before, load, 0.5, first_byte=True)
    duration = window_percentile_ms(before, load, 0.5, first_byte=False)
    assert ttft is not None and 250 < ttft < 1000
    assert duration is not None and 1000 < duration < 2500
    ttft_bucket = (
        'fleetserve_lb_time_to_first_byte_seconds_bucket{{le="{}",policy="least_load",'
        'replica="1",service="w"}} {}'
    )
    assert ttft_bucket.format("0.25", "0.0") in text
    assert ttft_bucket.format("1.0", "8.0") in text


async def test_a_dead_worker_is_restarted_and_gets_the_set(
    start: Start, lb_process: tuple[LbConfig, subprocess.Popen[bytes]]
) -> None:
    config, proc = lb_process
    await wait_workers(proc)
    a = await start(upstream_app("a"))
    async with aiohttp.ClientSession() as s:
        push = {"replicas": [{"replica_id": 1, "url": f"http://127.0.0.1:{a}"}]}
        async with s.put(f"http://127.0.0.1:{config.admin_port}/-/replicas", json=push):
            pass
    old = workers_of(proc)[0]
    os.kill(old.pid, signal.SIGKILL)
    assert await wait_workers(proc, exclude=old.pid), "the worker was not restarted"
    await asyncio.sleep(0.5)
    for _ in range(20):
        async with (
            aiohttp.ClientSession() as fresh,
            fresh.get(f"http://127.0.0.1:{config.port}/") as r,
        ):
            assert r.status == 200


@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
async def test_round_robin_takes_turns_across_workers_and_metrics_keep_real_dates(
    start: Start, tmp_path: Path, policy: str
) -> None:
    """round_robin with two workers: each replica in turn for the load balancer as a whole
    (a rotation per worker gave `2 1 1 2`), whichever worker the kernel hands a connection;
    and so do least_load's ties (an idle fleet: every choice is a tie); and the merged
    /metrics of the two workers date each series when it began (summed `_created`
    timestamps gave the year 2083)."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    began = time.time()
    config = two_workers("rr", policy)
    proc = await start_lb_process(config, tmp_path)
    try:
        (worker,) = await wait_workers(proc)
        for _ in range(100):  # until the worker listens too (a Python start on a busy box)
            if any(c.laddr.port == config.port for c in worker.net_connections("tcp")):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the worker never listened")
        a = await start(upstream_app("a"))
        b = await start(upstream_app("b"))
        admin = f"http://127.0.0.1:{config.admin_port}"
        push = {
            "replicas": [
                {"replica_id": 1, "url": f"http://127.0.0.1:{a}"},
                {"replica_id": 2, "url": f"http://127.0.0.1:{b}"},
            ]
        }
        names = []
        async with aiohttp.ClientSession() as s:
            async with s.put(f"{admin}/-/replicas", json=push) as r:
                assert r.status == 200
            await asyncio.sleep(0.3)  # relayed to the worker
            for _ in range(40):  # a new connection each time: the kernel spreads them
                async with (
                    aiohttp.ClientSession() as fresh,
                    fresh.get(f"http://127.0.0.1:{config.port}/x") as r,
                ):
                    names.append((await r.json())["replica"])
            async with s.get(f"{admin}/metrics") as r:
                text = await r.text()
        assert all(n != m for n, m in itertools.pairwise(names)), names
        assert sorted(set(names)) == ["a", "b"]
        created = [
            (sample.name, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.endswith("_created")
        ]
        assert created, "no _created sample to check"
        now = time.time()
        late = [(n, v) for n, v in created if not began - 60 <= v <= now + 1]
        assert not late, late
    finally:
        workers = workers_of(proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        psutil.wait_procs(workers, timeout=5)


async def _ready(config: LbConfig) -> None:
    """Until every worker accepts on its own socket (the primary covers it until then)."""
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            async with s.get(f"http://127.0.0.1:{config.admin_port}/-/replicas") as r:
                if (await r.json())["covered_workers"] == []:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError("a worker never became ready")


async def _one_replica(start: Start, config: LbConfig) -> None:
    """One replica ("a") pushed to the load balancer, and relayed to its worker."""
    a = await start(upstream_app("a"))
    async with aiohttp.ClientSession() as s:
        push = {"replicas": [{"replica_id": 1, "url": f"http://127.0.0.1:{a}"}]}
        async with s.put(f"http://127.0.0.1:{config.admin_port}/-/replicas", json=push):
            pass
    await asyncio.sleep(0.3)  # relayed to the worker


def _queue_requests(port: int, count: int) -> list[socket.socket]:
    """`count` requests, each on a new connection (the kernel spreads them over the
    processes' sockets), sent whole, none answered yet."""
    socks = []
    for i in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(f"GET /q{i} HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n".encode())
        socks.append(s)
    return socks


def _answers(socks: list[socket.socket], seconds: float = 20) -> list[bytes]:
    """Each connection's whole answer (until the LB closes it), or what came before an error."""
    deadline = time.monotonic() + seconds
    out = []
    for s in socks:
        data = b""
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            while chunk := s.recv(65536):
                data += chunk
        except OSError as e:
            data += f" <{type(e).__name__}>".encode()
        s.close()
        out.append(data)
    return out


async def test_a_killed_worker_loses_no_connection_queued_on_its_socket(
    start: Start, lb_process: tuple[LbConfig, subprocess.Popen[bytes]]
) -> None:
    """A worker that dies (kill -9) while connections wait in its socket's queue: the
    primary serves them (the socket is the primary's too), and new ones, until the new
    worker is ready. Before, the kernel reset them with the socket (RemoteDisconnected)."""
    config, proc = lb_process
    worker = (await wait_workers(proc))[0]
    await _ready(config)
    a = await start(upstream_app("a"))
    async with aiohttp.ClientSession() as s:
        push = {"replicas": [{"replica_id": 1, "url": f"http://127.0.0.1:{a}"}]}
        async with s.put(f"http://127.0.0.1:{config.admin_port}/-/replicas", json=push):
            pass
    os.kill(worker.pid, signal.SIGSTOP)  # it accepts nothing: its share waits in its queue
    try:
        socks = await asyncio.to_thread(_queue_requests, config.port, 24)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
    answers = await asyncio.to_thread(_answers, socks)
    assert [x[:15] for x in answers] == [b"HTTP/1.1 200 OK"] * 24, answers
    assert await wait_workers(proc, exclude=worker.pid), "the worker was not restarted"
    await _ready(config)  # the new worker took its socket back from the primary


async def test_a_killed_primary_loses_no_connection_queued_on_its_socket(
    start: Start, tmp_path: Path
) -> None:
    """The primary killed (kill -9) with connections in its socket's queue: its workers,
    which hold that socket too, serve them while they linger."""
    config = two_workers("w")
    proc = await start_lb_process(config, tmp_path)
    workers = await wait_workers(proc)
    try:
        await _ready(config)
        await _one_replica(start, config)
        proc.send_signal(signal.SIGSTOP)
        try:
            socks = await asyncio.to_thread(_queue_requests, config.port, 24)
        finally:
            proc.kill()
        answers = await asyncio.to_thread(_answers, socks)
        assert [x[:15] for x in answers] == [b"HTTP/1.1 200 OK"] * 24, answers
    finally:
        proc.kill()
        proc.wait(10)
        _, alive = psutil.wait_procs(workers, timeout=15)  # they linger 5 s, then exit
        for w in alive:
            w.kill()
    assert not alive, "a worker outlived its killed primary's linger"


async def test_a_stopping_primary_closes_its_copies_of_the_workers_sockets(
    tmp_path: Path,
) -> None:
    """At its stop the primary lets go of the workers' sockets it kept: held open until it
    exits (it may drain requests for seconds), the kernel would go on queueing connections on
    them, and reset them at its exit, rather than send them to a load balancer beside it. Its
    own socket is its server's to close."""
    own = listening_sockets("127.0.0.1", 0)
    port = own[0].getsockname()[1]
    worker = listening_sockets("127.0.0.1", port)
    supervisor = Supervisor(tmp_path / "lb.json", 2, listeners={0: own, 1: worker})
    await supervisor.stop()
    assert [s.fileno() for s in worker] == [-1]
    assert own[0].fileno() != -1
    own[0].close()


def test_merge_load_adds_up() -> None:
    a = {
        "at": 1.0,
        "window_seconds": 60,
        "requests_per_second": 1.0,
        "total_requests": 60,
        "queued": 1,
        "replicas": {"1": {"inflight": 2, "requests_per_second": 1.0}},
    }
    b = {
        "at": 2.0,
        "window_seconds": 60,
        "requests_per_second": 0.5,
        "total_requests": 30,
        "queued": 0,
        "replicas": {
            "1": {"inflight": 1, "requests_per_second": 0.5},
            "2": {"inflight": 3, "requests_per_second": 0.0},
        },
    }
    m = merge_load([LoadReport.model_validate(a), LoadReport.model_validate(b)]).model_dump()
    assert m["total_requests"] == 90 and m["queued"] == 1 and m["at"] == 2.0
    assert m["replicas"] == {
        "1": {"inflight": 3, "requests_per_second": 1.5},
        "2": {"inflight": 3, "requests_per_second": 0.0},
    }


def test_merge_load_adds_up_the_histograms_and_keeps_an_older_workers_report() -> None:
    def report(latency: list[int], first_byte: list[int] | None) -> LoadReport:
        totals: dict[str, object] = {"requests": latency[-1], "latency": latency}
        if first_byte is not None:
            totals["first_byte"] = first_byte
        return LoadReport.model_validate(
            {"latency_bounds": [0.1, 1.0], "totals": {"1": totals, "2": totals}}
        )

    a = report([1, 2, 3], [2, 3, 3])
    b = report([0, 4, 4], [4, 4, 4])
    old = report([1, 1, 1], None)  # a report without first_byte: it parses, adds nothing
    assert old.totals["1"].first_byte == []
    for reports in ([a, b, old], [old, a, b]):
        m = merge_load(reports)
        assert m.totals["1"].latency == [2, 7, 8] and m.totals["2"].latency == [2, 7, 8]
        assert m.totals["1"].first_byte == [6, 7, 7] and m.totals["1"].requests == 8
    assert merge_load([old, old]).totals["1"].first_byte == []


def test_merged_metrics_sum_samples() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    text = (
        "# HELP x_total things\n# TYPE x_total counter\n"
        'x_total{replica="1"} 2.0\nx_total{replica="2"} 1.0\n'
    )
    reg = CollectorRegistry()
    reg.register(MergedMetrics([text, text]))
    out = generate_latest(reg).decode()
    assert 'x_total{replica="1"} 4.0' in out and 'x_total{replica="2"} 2.0' in out
    assert json.dumps(out)  # renders


def test_merged_metrics_take_the_earliest_created_and_the_max_of_max_gauges() -> None:
    """Summing `_created` timestamps of two workers gave dates in the 2080s, and summing the
    replicas' reported load (each worker reads the same /metrics) doubled it."""
    from prometheus_client import CollectorRegistry, generate_latest

    def text(created: float, extra: float, reported: float) -> str:
        return (
            "# HELP x_total things\n# TYPE x_total counter\n"
            f'x_total{{replica="1"}} 2.0\nx_created{{replica="1"}} {created}\n'
            "# HELP fleetserve_lb_choice_extra_load_max m\n"
            "# TYPE fleetserve_lb_choice_extra_load_max gauge\n"
            f'fleetserve_lb_choice_extra_load_max{{service="s"}} {extra}\n'
            "# HELP fleetserve_lb_replica_reported_load r\n"
            "# TYPE fleetserve_lb_replica_reported_load gauge\n"
            f'fleetserve_lb_replica_reported_load{{service="s",replica="1"}} {reported}\n'
        )

    reg = CollectorRegistry()
    reg.register(MergedMetrics([text(1.8e9, 3, 5), text(1.7e9, 6, 4)]))
    out = generate_latest(reg).decode()
    assert 'x_total{replica="1"} 4.0' in out
    assert 'x_created{replica="1"} 1.7e+09' in out
    assert 'fleetserve_lb_choice_extra_load_max{service="s"} 6.0' in out
    assert 'fleetserve_lb_replica_reported_load{replica="1",service="s"} 5.0' in out


def _chat_posts(port: int, count: int, tag: str, timeout: float = 10) -> list[int]:
    """`count` cache_aware requests (each its own prompt, so each worker has index batches to
    send), each on a new connection; their status codes (0: no answer)."""
    codes = []
    for i in range(count):
        body = json.dumps({"prompt": f"{tag} {i} " + "word " * 300}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: lb\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
                s.sendall(head + body)
                first = s.recv(64)
            codes.append(int(first.split()[1]) if first.startswith(b"HTTP/1.1 ") else 0)
        except OSError:
            codes.append(0)
    return codes


async def test_a_worker_outlives_a_killed_primary_that_left_its_batches_unread(
    start: Start, tmp_path: Path
) -> None:
    """cache_aware with two processes: the primary stopped (its channel unread: the worker's
    index batches pile up there), then killed with kill -9. The kernel resets the channel; the
    worker takes that as the primary's end, as a close, and serves its linger (before, an
    unhandled ConnectionResetError ended it at once, and the port refused connections)."""
    config = two_workers("ca", "cache_aware")
    proc = await start_lb_process(config, tmp_path)
    (worker,) = await wait_workers(proc)
    try:
        await _ready(config)
        await _one_replica(start, config)
        assert set(await asyncio.to_thread(_chat_posts, config.port, 10, "warm")) == {200}
        proc.send_signal(signal.SIGSTOP)
        try:
            # The worker serves these (the stopped primary serves none), and sends its index
            # batches into the channel nobody reads.
            # (A connection the kernel hands the stopped primary gets no answer: 0.3 s each.)
            # The kernel hashes each connection to one of the two sockets: of 40, fewer than
            # 8 reach the worker about once in 20,000 runs (30 and 10 failed about once in 50).
            served = await asyncio.to_thread(_chat_posts, config.port, 40, "unread", 0.3)
            assert served.count(200) >= 8, served
        finally:
            proc.kill()
        proc.wait(10)
        await asyncio.sleep(2.5)  # the reset came at once; the linger is 5 s
        assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        after = await asyncio.to_thread(_chat_posts, config.port, 10, "after")
        assert after == [200] * 10, after
    finally:
        proc.kill()
        proc.wait(10)
        _, alive = psutil.wait_procs([worker], timeout=15)
        for w in alive:
            w.kill()


def test_a_worker_told_to_stop_on_its_channel_does_not_linger_as_for_a_dead_primary(
    tmp_path: Path,
) -> None:
    """A worker whose control channel closes without a word takes its primary for dead and
    serves LINGER_SECONDS more (the controller is starting a new primary). A primary that
    stops or retires says so on the channel first: the worker then stops listening at once
    and, with nothing in progress, exits. (Told only by the signal, a worker that saw the
    channel close first lingered, and a retired load balancer's workers served the old
    settings beside the new load balancer for 5 s.)"""
    from fleetserve.lb.__main__ import LINGER_SECONDS

    listener = socket.create_server(("127.0.0.1", 0))
    config = LbConfig(service="svc", port=listener.getsockname()[1], admin_port=closed_port())
    path = tmp_path / "lb.json"
    config.write(path)
    exits = {}
    for told in (True, False):
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "fleetserve.lb", "--config", str(path), "--worker", "1"),
                *("--control-fd", str(theirs.fileno())),
                *("--listen-fds", str(listener.fileno())),
            ],
            pass_fds=[theirs.fileno(), listener.fileno()],
        )
        theirs.close()
        try:
            ours.sendall(b'{"op": "start"}\n')
            ours.settimeout(30)
            assert json.loads(ours.makefile("rb").readline()) == {"op": "ready"}
            if told:
                ours.sendall(b'{"op": "stop", "retire": true}\n')
            began = time.monotonic()
            ours.close()
            try:
                proc.wait(LINGER_SECONDS + 5)
            finally:
                exits[told] = time.monotonic() - began
        finally:
            proc.kill()
            proc.wait(10)
    assert exits[True] < LINGER_SECONDS / 2 < LINGER_SECONDS <= exits[False], exits
