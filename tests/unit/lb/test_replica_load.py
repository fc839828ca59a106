"""cache_aware's optional reading of the replicas' own load from their /metrics."""

from __future__ import annotations

import asyncio

from aiohttp import web

from fleetserve.lb.replica_load import ReplicaLoadPoller, parse_load

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""


def test_parse_load_sums_running_and_waiting_of_each_server() -> None:
    assert parse_load(VLLM) == 5
    assert parse_load("sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\n") == 5
    assert parse_load("tgi_batch_current_size 2\ntgi_queue_size 7\n") == 9
    # Summed over label sets (two models on one server).
    assert parse_load('vllm:num_requests_running{a="1"} 1\nvllm:num_requests_running{a="2"} 2') == 3


def test_parse_load_ignores_what_it_cannot_trust() -> None:
    assert parse_load("") is None
    assert parse_load("other_metric 5\n# vllm:num_requests_running 9\n") is None
    assert parse_load("vllm:num_requests_running NaN\n") is None
    assert parse_load("vllm:num_requests_running -4\n") is None
    assert parse_load("vllm:num_requests_running 1e300\n") is None
    assert parse_load("vllm:num_requests_running {broken\n") is None


async def test_poller_reads_each_replica_and_drops_the_silent_ones() -> None:
    bodies = {"a": VLLM, "b": "nothing here 1\n", "c": VLLM}

    async def metrics(request: web.Request) -> web.StreamResponse:
        who = request.match_info["who"]
        if who != "c":
            return web.Response(text=bodies[who])
        # A long page written in pieces, a number split across two writes: read whole.
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"# padding\n" * 30_000)
        await resp.write(b"vllm:num_requests_waiting 1")
        await asyncio.sleep(0.05)
        await resp.write(b"234\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/{who}/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    replicas = [
        (1, f"http://127.0.0.1:{port}/a"),
        (2, f"http://127.0.0.1:{port}/b"),
        (3, "http://127.0.0.1:9"),  # nothing listens: not counted
        (4, f"http://127.0.0.1:{port}/c"),
    ]
    loads: dict[int, int] = {3: 99}
    poller = ReplicaLoadPoller(0.1, "/metrics", lambda: list(replicas), loads)
    poller.start()
    try:
        for _ in range(50):
            await asyncio.sleep(0.05)
            if loads == {1: 5, 4: 1234}:
                break
        assert loads == {1: 5, 4: 1234}
        bodies["a"] = "vllm:num_requests_waiting 11\n"
        del replicas[2]  # replica 3 left the set
        for _ in range(50):
            await asyncio.sleep(0.05)
            if loads.get(1) == 11:
                break
        assert loads == {1: 11, 4: 1234}
    finally:
        await poller.stop()
        await runner.cleanup()
