"""The optional nginx data plane, with a real nginx: same admin API, pushes reload nginx,
the fallback answers or holds when nothing is ready, API keys, access-log load reports."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from fleetserve.lb.config import LbConfig
from fleetserve.lb.nginx import render
from fleetserve.spec.models import LoadBalancerOptions
from tests.unit.lb.helpers import start_lb_process
from tests.unit.lb.test_proxy import Start, closed_port, start, upstream_app

__all__ = ["start"]

if shutil.which("nginx") is None:  # scripts/test.sh and .ci/run install it: never skipped there
    pytest.fail("these tests need nginx: apt-get install nginx-light", pytrace=False)


def test_render_maps_policies_keys_and_replicas(tmp_path: Path) -> None:
    cfg = LbConfig(
        service="s",
        port=8080,
        admin_port=8081,
        policy="sticky",
        options=LoadBalancerOptions(api_keys=["k" * 20], session_header="X-User"),
    )
    text = render(
        cfg, [{"replica_id": 1, "url": "http://127.0.0.1:9001", "weight": 3}], 7000, tmp_path
    )
    assert "hash $http_x_user consistent;" in text
    assert "server 127.0.0.1:9001 weight=3" in text
    assert "server 127.0.0.1:7000 backup;" in text
    assert f'"Bearer {"k" * 20}" 1;' in text
    empty = render(LbConfig(service="s", port=1, admin_port=2), [], 7000, tmp_path)
    assert "server 127.0.0.1:7000;" in empty and "backup" not in empty
    assert "least_conn;" in empty  # least_load, the default
    assert "zone fleetserve_replicas 1m;" in empty  # one state for all the workers


@pytest.fixture
async def nginx_lb(tmp_path: Path) -> AsyncIterator[LbConfig]:
    config = LbConfig(
        service="n",
        port=closed_port(),
        admin_port=closed_port(),
        policy="round_robin",
        options=LoadBalancerOptions(data_plane="nginx", workers=1, api_keys=["t" * 24]),
    )
    proc = await start_lb_process(config, tmp_path, "fleetserve.lb.nginx")
    path = tmp_path / "lb.json"
    yield config
    proc.send_signal(signal.SIGTERM)
    proc.wait(15)
    pid_file = path.with_suffix(".nginx") / "nginx.pid"
    assert not pid_file.exists() or not Path(f"/proc/{pid_file.read_text().strip()}").exists()


async def test_nginx_data_plane_end_to_end(start: Start, nginx_lb: LbConfig) -> None:
    config = nginx_lb
    auth = {"Authorization": "Bearer " + "t" * 24}
    url = f"http://127.0.0.1:{config.port}"
    admin = f"http://127.0.0.1:{config.admin_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/x", headers=auth) as r:  # nothing ready: the fallback's 503
            assert r.status == 503 and (await r.json())["error"] == "no_ready_replicas"
        a = await start(upstream_app("a"))
        b = await start(upstream_app("b"))
        push = {
            "replicas": [
                {"replica_id": 1, "url": f"http://127.0.0.1:{a}"},
                {"replica_id": 2, "url": f"http://127.0.0.1:{b}"},
            ]
        }
        async with s.put(f"{admin}/-/replicas", json=push) as r:
            assert r.status == 200
        await asyncio.sleep(0.5)  # the graceful reload
        seen = Counter()
        for _ in range(10):
            async with s.post(f"{url}/y", data=b"abc", headers=auth) as r:
                assert r.status == 200
                body = await r.json()
                assert body["bytes"] == 3
                seen[body["replica"]] += 1
        assert seen == {"a": 5, "b": 5}
        async with s.get(f"{url}/y") as r:
            assert r.status == 401
        await asyncio.sleep(0.5)  # the access log is tailed
        async with s.get(f"{admin}/-/load") as r:
            load = await r.json()
        assert load["replicas"]["1"]["requests_per_second"] == pytest.approx(5 / 60)
        # nginx's $upstream_header_time: each answer's time to first byte
        assert load["totals"]["1"]["first_byte"][-1] == 5
        assert load["totals"]["2"]["first_byte"][-1] == 5


async def test_nginx_round_robin_takes_turns_across_its_workers(
    start: Start, tmp_path: Path
) -> None:
    """Two nginx workers: each replica in turn for the endpoint as a whole (the upstream's
    state in a shared zone), whichever worker takes a new connection."""
    config = LbConfig(
        service="nrr",
        port=closed_port(),
        admin_port=closed_port(),
        policy="round_robin",
        options=LoadBalancerOptions(data_plane="nginx", workers=2),
    )
    proc = await start_lb_process(config, tmp_path, "fleetserve.lb.nginx")
    try:
        a = await start(upstream_app("a"))
        b = await start(upstream_app("b"))
        push = {
            "replicas": [
                {"replica_id": 1, "url": f"http://127.0.0.1:{a}"},
                {"replica_id": 2, "url": f"http://127.0.0.1:{b}"},
            ]
        }
        admin = f"http://127.0.0.1:{config.admin_port}"
        async with aiohttp.ClientSession() as s, s.put(f"{admin}/-/replicas", json=push) as r:
            assert r.status == 200
        await asyncio.sleep(1.0)  # the graceful reload: both new workers up
        names = []
        for _ in range(30):  # a new connection each time: the kernel spreads them
            async with (
                aiohttp.ClientSession() as fresh,
                fresh.get(f"http://127.0.0.1:{config.port}/x") as r,
            ):
                names.append((await r.json())["replica"])
        assert all(n != m for n, m in itertools.pairwise(names)), names
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
