"""cache_aware's approximate index against its precise mode (KV events) on real vLLM replicas
under cache pressure: 2 replicas of the testbed model with a small KV cache (evictions), one
fleetserve LB in this process, multi-turn chat whose conversations share system prompts.
Both modes run against the same replicas, their prefix caches reset between runs
(VLLM_SERVER_DEV_MODE's /reset_prefix_cache). Reports TTFT p50/p99 and vLLM's own prefix-cache
hit rate (vllm:prefix_cache_hits_total / queries_total over the run).

    .venv/bin/python bench/kv_events/run.py [--blocks 96] [--rate 0.7] [--seconds 90]

Bounded: at most --max-inflight requests at once; replicas are stopped (by pid) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fleetserve.lb.build import make_proxy  # noqa: E402
from fleetserve.lb.config import LbConfig  # noqa: E402
from fleetserve.lb.messages import RoutableReplica  # noqa: E402
from fleetserve.oshelpers.ports import free_port, port_free  # noqa: E402
from fleetserve.spec.models import LoadBalancerOptions  # noqa: E402

WORDS = ("the of and to in is you that it was for on are as with his they at be this have").split()  # noqa: SIM905


def start_vllm(
    python: str, model: str, blocks: int, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    while not all(port_free(p) for p in (port + 1, port + 2)):
        port = free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port + 1}",
        "replay_endpoint": f"tcp://*:{port + 2}",
        "topic": "kv-events",
    }
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # no worker spinning between steps
        "VLLM_SERVER_DEV_MODE": "1",
    }
    proc = subprocess.Popen(
        [
            *(python, "-m", "vllm.entrypoints.openai.api_server", "--model", model),
            *("--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)),
            # (vLLM wants one block more than its longest request)
            *("--max-model-len", str((blocks - 1) * 128), "--num-gpu-blocks-override", str(blocks)),
            *("--kv-events-config", json.dumps(events)),
        ],
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    return proc, port


def wait_up(port: int, proc: subprocess.Popen[bytes]) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM on {port} exited")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(1)


def cache_counts(port: int) -> tuple[float, float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {}
    for line in text.splitlines():
        for name in (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
            "vllm:request_success_total",
        ):
            if line.startswith(name):
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return (
        got["vllm:prefix_cache_hits_total"],
        got["vllm:prefix_cache_queries_total"],
        got.get("vllm:request_success_total", 0.0),
    )


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def drive(
    lb: str,
    seed: int,
    rate: float,
    seconds: float,
    max_inflight: int,
    tenants: int,
    conversations: int,
) -> list[float]:
    rng = random.Random(seed)
    systems = [f"You are assistant {t}. " + words(rng, 220) for t in range(tenants)]
    convs = [[{"role": "system", "content": systems[c % tenants]}] for c in range(conversations)]
    busy = [False] * conversations
    ttfts: list[float] = []
    sem = asyncio.Semaphore(max_inflight)

    async def turn(session: aiohttp.ClientSession, c: int) -> None:
        conv = convs[c]
        conv.append({"role": "user", "content": words(rng, 30)})
        body = {
            "model": "tiny",
            "messages": conv,
            "max_tokens": 8,
            "stream": True,
            "ignore_eos": True,
        }
        async with sem:
            t0 = time.monotonic()
            first = None
            reply = []
            async with session.post(lb + "/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        if first is None:
                            first = time.monotonic() - t0
                        delta = json.loads(line[6:])["choices"][0].get("delta", {})
                        reply.append(delta.get("content") or "")
            if first is not None:
                ttfts.append(first)
        conv.append({"role": "assistant", "content": "".join(reply)})
        if len(conv) > 14:  # a conversation ends; a new one on the same tenant begins
            del conv[1:]
        busy[c] = False

    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(rate))
            free = [c for c in range(conversations) if not busy[c]]
            if not free:
                continue
            c = rng.choice(free)
            busy[c] = True
            tasks.append(asyncio.create_task(turn(session, c)))
        await asyncio.gather(*tasks, return_exceptions=True)
    return ttfts


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def run_mode(
    mode: str, model: str, ports: list[int], args: argparse.Namespace
) -> dict[str, object]:
    for p in ports:
        urllib.request.urlopen(  # noqa: ASYNC210 - between runs, nothing else waits
            urllib.request.Request(
                f"http://127.0.0.1:{p}/reset_prefix_cache", data=b"", method="POST"
            ),
            timeout=30,
        )
    # The approximate index sized as the engines' caches (256-character blocks, ~64 tokens).
    opts: dict[str, object] = {"workers": 1, "cache_blocks": max(16, args.blocks * 128 // 64)}
    if mode == "precise":
        opts |= {"kv_events": {}, "tokenizer": model}
    lb_port = free_port()
    config = LbConfig(
        service="bench",
        port=lb_port,
        admin_port=free_port(),
        policy="cache_aware",
        options=LoadBalancerOptions.model_validate(opts),
        replicas=[
            RoutableReplica(replica_id=i + 1, url=f"http://127.0.0.1:{p}")
            for i, p in enumerate(ports)
        ],
    )
    proxy = make_proxy(config)
    await proxy.serve("127.0.0.1", lb_port)
    await asyncio.sleep(3)  # (precise: subscribed and replayed)
    before = [cache_counts(p) for p in ports]
    ttfts = await drive(
        f"http://127.0.0.1:{lb_port}",
        args.seed,
        args.rate,
        args.seconds,
        args.max_inflight,
        args.tenants,
        args.conversations,
    )
    after = [cache_counts(p) for p in ports]
    states = {}
    if proxy.kv_events is not None:
        states = {str(k): v.value for k, v in proxy.kv_events.index.trusts().items()}
        counts = proxy.kv_events.counts
        states["removed_blocks"] = str(counts.removed)
    await proxy.close(1.0)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {
        "mode": mode,
        "requests": len(ttfts),
        "ttft_p50_ms": round(pct(ttfts, 0.5)),
        "ttft_p99_ms": round(pct(ttfts, 0.99)),
        "prefix_cache_hit_rate": round(hits / queries, 3) if queries else None,
        "requests_per_replica": [round(a[2] - b[2]) for a, b in zip(after, before, strict=True)],
        "kv_events": states,
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--model", default=None)
    # Per replica; vLLM CPU's blocks hold 128 tokens: 12 blocks are 1,536 tokens.
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--rate", type=float, default=0.7)
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--max-inflight", type=int, default=8)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="approximate,precise")
    args = ap.parse_args()
    model = (
        args.model
        or subprocess.run(  # noqa: ASYNC221 - before anything runs
            [args.vllm_python, str(REPO / "scripts" / "llm" / "make_model.py")],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    procs = [
        start_vllm(args.vllm_python, model, args.blocks, logs / f"kvbench-{i}.log")
        for i in range(2)
    ]
    try:
        for proc, port in procs:
            wait_up(port, proc)
        ports = [port for _, port in procs]
        results = []
        for mode in args.modes.split(","):
            results.append(await run_mode(mode, model, ports, args))
            print(json.dumps(results[-1]), flush=True)
    finally:
        for proc, _ in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    asyncio.run(main())
