"""What each router adds to an unloaded request: TTFT of one short chat request at a time
(2 tokens, a cached 200-word system prompt), straight to a vLLM replica and through
fleetserve's LB (least_load and cache_aware, 2 workers; least_load, 1 worker) and
sglang-router, the targets interleaved request by request. Run from the repository root:

    PYTHONPATH=. FLEETSERVE_VLLM_VENV=$PWD/.venv-vllm .venv/bin/python \\
        bench/llm/results-2026-12-05e/overhead.py 40
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import run
from engines import VllmFleet, start_router, testbed_model
from workloads import WORDS


async def ttft(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> float | None:
    t0 = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"choices":[{' in line:
                took = time.perf_counter() - t0
                await resp.read()
                return took
    return None


async def main(count: int) -> None:
    procs = run.Procs(Path(tempfile.mkdtemp(prefix="fleetserve-overhead-")))
    try:
        fleet = VllmFleet(procs, 2, testbed_model(), kv_blocks=64)
        fleet.start(print)
        targets = {"direct": fleet.urls[0]}
        for policy, workers in (("least_load", 2), ("cache_aware", 2), ("least_load", 1)):
            label = f"{policy}-{workers}"
            lb = run.start_lb(procs, policy, {"workers": workers}, fleet.ports, label)
            if isinstance(lb, str):
                sys.exit(lb)
            targets[f"{policy}, {workers} workers"] = f"http://127.0.0.1:{lb.port}"
        router = start_router(procs, "sglang-router", "cache_aware", fleet.urls)
        if isinstance(router, str):
            sys.exit(router)
        targets["sglang-router"] = f"http://127.0.0.1:{router.port}"
        system = " ".join(random.Random(1).choices(WORDS, k=200))
        got: dict[str, list[float]] = {name: [] for name in targets}
        async with aiohttp.ClientSession() as http:
            for i in range(count):
                for name, url in targets.items():
                    body = {
                        "model": "fake",
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"q {i % 3}"},
                        ],
                        "max_tokens": 2,
                        "stream": True,
                        "ignore_eos": True,
                    }
                    took = await ttft(http, url, body)
                    if took is not None and i >= 3:  # (the first ones fill the caches)
                        got[name].append(took * 1e3)
        for name, xs in got.items():
            xs.sort()
            print(
                f"{name:<24} n={len(xs)} p50 {statistics.median(xs):5.1f} ms, "
                f"p10 {xs[len(xs) // 10]:5.1f}, p90 {xs[int(len(xs) * 0.9)]:5.1f}"
            )
    finally:
        procs.stop_all()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 30))
