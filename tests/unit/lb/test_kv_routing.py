"""The load balancer in precise mode, end to end on loopback: two fake replicas, each with a
fake KV-events publisher on its port + 1 and + 2; the LB routes a prompt to the replica whose
engine says it holds it, and back to the approximate index when the mode cannot run."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from fleetserve.lb.build import make_proxy
from fleetserve.lb.config import LbConfig
from fleetserve.lb.messages import RoutableReplica
from fleetserve.lb.prompt_tokens import LoopTokenizer, PromptTokenizer
from fleetserve.oshelpers.ports import free_port, port_free
from fleetserve.policies.cache_aware_precise import PreciseCacheAware
from fleetserve.policies.kv_index import Trust
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.test_kv_events import FakePublisher, batch, stored, until
from tests.unit.lb.test_prompt_tokens import make_tokenizer


def triple() -> int:
    while True:
        port = free_port()
        if port < 65000 and port_free(port + 1) and port_free(port + 2):
            return port


async def fake_replica(rid: int, seen: list[int]) -> tuple[web.AppRunner, int]:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        seen.append(rid)
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = triple()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


class PortPublisher(FakePublisher):
    def __init__(self, ctx: zmq.asyncio.Context, port: int) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.pub.bind(f"tcp://127.0.0.1:{port + 1}")
        self.router.bind(f"tcp://127.0.0.1:{port + 2}")
        self.port, self.replay_port = port + 1, port + 2
        self.buffer = []
        self.seq = 0
        self.answers = True
        self._task = asyncio.get_running_loop().create_task(self._serve())


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[list[int], list[int], list[PortPublisher]]]:
    seen: list[int] = []
    ctx = zmq.asyncio.Context()
    runners, ports, pubs = [], [], []
    for rid in (1, 2):
        runner, port = await fake_replica(rid, seen)
        runners.append(runner)
        ports.append(port)
        pubs.append(PortPublisher(ctx, port))
    yield ports, seen, pubs
    for p in pubs:
        p.close()
    for r in runners:
        await r.cleanup()
    ctx.term()


def config(ports: list[int], tokenizer: Path) -> LbConfig:
    return LbConfig(
        service="svc",
        port=free_port(),
        admin_port=free_port(),
        policy="cache_aware",
        options=LoadBalancerOptions.model_validate(
            {"workers": 1, "kv_events": {}, "tokenizer": str(tokenizer)}
        ),
        replicas=[
            RoutableReplica(replica_id=i + 1, url=f"http://127.0.0.1:{p}")
            for i, p in enumerate(ports)
        ],
    )


async def test_the_lb_routes_to_the_engine_that_holds_the_prompt(
    fleet: tuple[list[int], list[int], list[PortPublisher]], tmp_path: Path
) -> None:
    ports, seen, pubs = fleet
    folder = make_tokenizer(tmp_path)
    proxy = make_proxy(config(ports, folder))
    assert isinstance(proxy.replicas.selector, PreciseCacheAware)
    await proxy.serve("127.0.0.1", proxy.config.port)
    try:
        assert proxy.kv_events is not None
        index = proxy.kv_events.index
        await until(lambda: index.trusts() == {1: Trust.LIVE, 2: Trust.LIVE})
        body = {"messages": [{"role": "user", "content": "hello world " * 40}]}
        tokens = PromptTokenizer.load(folder).tokens(json.dumps(body).encode())
        full = len(tokens) // 16 * 16
        # Replica 2's engine reports holding the prompt (the LB never sent it there).
        await pubs[1].send(batch(stored(list(range(full // 16)), list(tokens[:full]))))
        await until(lambda: index.match(tokens, [2]) == {2: full})
        url = f"http://127.0.0.1:{proxy.config.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(url, json=body) as r:
                    assert r.status == 200
        assert seen == [2, 2, 2]
        names = {m.name for m in proxy.metrics.registry.collect()}
        assert "fleetserve_lb_kv_events_replicas" in names
        # What the events promised: 3 requests of len(tokens), each with `full` held.
        reg = proxy.metrics.registry
        for kind, want in (("prompt", 3 * len(tokens)), ("matched", 3 * full)):
            got = reg.get_sample_value(
                "fleetserve_lb_precise_prompt_tokens_total", {"service": "svc", "kind": kind}
            )
            assert got == want, (kind, got, want)
    finally:
        await proxy.close(0.1)


async def test_a_long_prompt_is_tokenized_off_the_event_loop_and_routed_the_same(
    fleet: tuple[list[int], list[int], list[PortPublisher]], tmp_path: Path
) -> None:
    """While a 240 KB prompt is tokenized (slowed to 1.5 s here), the LB proxies another
    request at once; the long one then goes where the engine holds it, as it would have."""
    ports, seen, pubs = fleet
    folder = make_tokenizer(tmp_path)
    proxy = make_proxy(config(ports, folder))
    selector = proxy.replicas.selector
    assert isinstance(selector, PreciseCacheAware)
    tokenizer = selector.tokenizer
    assert isinstance(tokenizer, LoopTokenizer)
    engine = tokenizer.tokenizer
    fast, fast_unlocked = engine._encode, engine._encode_unlocked

    def slow(text: str, add_special: bool) -> list[int]:
        if len(text) > 1000:
            time.sleep(1.5)  # a loaded machine's tokenizer, on a long prompt
        return fast(text, add_special)

    def slow_unlocked(text: str, add_special: bool) -> list[int]:
        if len(text) > 1000:
            time.sleep(1.5)  # (it leaves the GIL to the event loop, as encode_batch does)
        return fast_unlocked(text, add_special)

    engine._encode, engine._encode_unlocked = slow, slow_unlocked
    await proxy.serve("127.0.0.1", proxy.config.port)
    try:
        assert proxy.kv_events is not None
        index = proxy.kv_events.index
        await until(lambda: index.trusts() == {1: Trust.LIVE, 2: Trust.LIVE})
        long = {"messages": [{"role": "user", "content": "hello world " * 20_000}]}
        tokens = PromptTokenizer.load(folder).tokens(json.dumps(long).encode())
        held = tokens[: 64 * 16]  # replica 2's engine holds its first 64 blocks
        await pubs[1].send(batch(stored(list(range(64)), list(held))))
        await until(lambda: index.match(tokens, [2]) == {2: len(held)})
        url = f"http://127.0.0.1:{proxy.config.port}/v1/chat/completions"
        short = {"messages": [{"role": "user", "content": "a short one"}]}
        async with aiohttp.ClientSession() as s:

            async def post(doc: dict[str, object]) -> int:
                async with s.post(url, json=doc) as r:
                    return r.status

            slow_one = asyncio.ensure_future(post(long))
            await asyncio.sleep(0.3)  # sent, and being tokenized
            start = time.monotonic()
            assert await asyncio.wait_for(post(short), 5) == 200
            took = time.monotonic() - start
            assert not slow_one.done(), "the short one waited for the long one"
            assert took < 0.5
            assert await asyncio.wait_for(slow_one, 10) == 200
        assert seen[-1] == 2  # the long prompt: where the engine holds it
        assert len(seen) == 2
    finally:
        await proxy.close(0.1)


def test_without_a_tokenizer_the_lb_says_so_and_runs_approximate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    proxy = make_proxy(config([8000, 8010], tmp_path / "nowhere"))
    assert not isinstance(proxy.replicas.selector, PreciseCacheAware)
    assert proxy.kv_events is None
    assert "no tokenizer.json" in caplog.text and "approximate index" in caplog.text


def test_a_corrupt_tokenizer_folder_runs_approximate_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # tokenizers raises a bare Exception on a corrupt tokenizer.json, jinja2 a
    # TemplateSyntaxError on a broken template: the LB must still start.
    caplog.set_level(logging.ERROR)
    (tmp_path / "tokenizer.json").write_text("not json")
    proxy = make_proxy(config([8000, 8010], tmp_path))
    assert not isinstance(proxy.replicas.selector, PreciseCacheAware)
    assert "tokenizer.json" in caplog.text and "approximate index" in caplog.text
