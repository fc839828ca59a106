"""bench/autoscale: autoscaling policies on real vLLM replicas under a bursty chat load.

Each policy gets its own fleet, started from nothing through fleetserve itself (a private
controller home, `up`, the service's own load balancer, `down`): vLLM's OpenAI server on the
testbed's small model (scripts/llm/setup.sh), `least_load` routing, min 1 and max
`--max-replicas` replicas. The same load runs through each fleet:

1. calibration (once, on the first fleet while it has one idle replica): a few requests of
   each kind, one at a time: the unloaded time of a light request (a short prompt, 4 tokens
   out) and of a heavy one (a long prompt of its own, `--heavy-tokens` out).
2. light burst (`--light-seconds`): cheap requests at 2.5x the request-rate target.
3. a pause (`--gap-seconds`) with no traffic: the fleet may scale back.
4. heavy burst (`--heavy-seconds`): chats of `--turns` turns on long prompts, new turns at
   `--heavy-load` (1.5) times what one replica serves of first turns unloaded: more than one
   replica can take, at a rate well under the request-rate target.
5. a tail with no traffic (`--tail-seconds`): the fleet scales back to one.

The targets: request_rate `target_qps_per_replica` = `--qps-target` (1 req/s, an operator's
round figure); in_flight `target_ongoing_requests_per_replica` = `--inflight-target` (2);
engine_queue `target_queue_per_replica` = `--queue-target` (1 request waiting in vLLM);
ttft `target_ttft_ms` = the TTFT target (`--ttft-target-ms`). `--max-num-seqs N` caps vLLM's
running batch at N for every fleet (vLLM's own default otherwise): a CPU replica saturates on
compute long before vLLM's default batch of 256 fills, so without a cap its queue stays empty
and the engine-queue policy sees nothing (the README). The scenario is built to show
what a request rate cannot see (the size of the requests); it says nothing of a workload
whose requests are all alike.

Figures per policy: TTFT p50/p99 of each burst, requests over the TTFT target, failed
requests, replica-seconds (every replica row that is not terminal, from launch to its end,
polled each second) and the largest fleet. This is an illustration on 2 CPU cores, not a
capacity model: the README of this folder says how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "llm"))

from engines import testbed_model, testbed_python  # noqa: E402

import fleetserve  # noqa: E402
from fleetserve.client import stop_server  # noqa: E402
from fleetserve.controller.settings import Settings  # noqa: E402

SERVED = "tiny"
POLICIES = ("request_rate", "in_flight", "engine_queue", "ttft")
WORDS = (
    *("fleet", "replica", "engine", "token", "prompt", "cache", "batch", "queue", "latency"),
    *("stream", "model", "server", "load", "balance", "route", "scale", "policy", "target"),
    *("window", "signal", "metric", "decode", "prefill", "block"),
)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def service_yaml(policy: str, targets: dict[str, float], args: argparse.Namespace) -> str:
    base, move = split_policy(policy)
    scaling = "replicas: 1" if base == "fixed" else _policy_block(base, targets, args)
    return _yaml(policy, scaling, args.max_num_seqs, move)


def split_policy(policy: str) -> tuple[str, bool]:
    """`engine_queue+move`: the policy, with the LB's move_waiting_requests on."""
    base, plus, rest = policy.partition("+")
    return base, plus == "+" and rest == "move"


def fleet_name(policy: str) -> str:
    return "autoscale-" + policy.replace("_", "-").replace("+", "-")


def _policy_block(policy: str, targets: dict[str, float], args: argparse.Namespace) -> str:
    key = {
        "request_rate": f"target_qps_per_replica: {targets['qps']:.3f}",
        "in_flight": f"target_ongoing_requests_per_replica: {args.inflight_target}",
        "engine_queue": f"target_queue_per_replica: {args.queue_target}",
        "ttft": f"target_ttft_ms: {args.ttft_target_ms}\n    latency_percentile: 90",
    }[policy]
    scrape = "\n    metrics_scrape_seconds: 2" if policy == "engine_queue" else ""
    return f"""\
replica_policy:
    min_replicas: 1
    max_replicas: {args.max_replicas}
    {key}{scrape}
    upscale_delay_seconds: {args.upscale_delay}
    downscale_delay_seconds: {args.downscale_delay}"""


def _yaml(policy: str, scaling: str, max_num_seqs: int | None = None, move: bool = False) -> str:
    # vLLM's batch cap: its default (256 on this build) never fills on 2 CPU cores, so its
    # queue stays empty while TTFT grows; a CPU deployment would cap it for latency.
    cap = f" --max-num-seqs {max_num_seqs}" if max_num_seqs else ""
    # +move: requests waiting in a replica's queue move to a replica with room (a new one).
    lb = "\n  load_balancer:\n    move_waiting_requests: true" if move else ""
    return f"""\
name: {fleet_name(policy)}
service:
  readiness_probe:
    path: /v1/models
    initial_delay_seconds: 900
    timeout_seconds: 10
  load_balancing_policy: least_load{lb}
  {scaling}
envs:
  MODEL: {testbed_model()}
  VLLM_PYTHON: {testbed_python()}
  VLLM_CPU_KVCACHE_SPACE: "1"
  VLLM_CPU_OMP_THREADS_BIND: nobind
  OMP_NUM_THREADS: "1"
  VLLM_ENABLE_V1_MULTIPROCESSING: "0"
run: |
  exec "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \\
    --model "$MODEL" --served-model-name {SERVED} --host 127.0.0.1 --port "$PORT" \\
    --max-model-len 4096 --enable-prefix-caching --enforce-eager --disable-uvicorn-access-log{cap}
"""


@dataclass
class Result:
    phase: str
    sent_at: float
    ttft: float | None = None
    ok: bool = False
    error: str = ""


@dataclass
class Run:
    policy: str
    results: list[Result] = field(default_factory=list)
    fleet: list[tuple[float, int, int]] = field(default_factory=list)  # (monotonic, alive, ready)
    events: list[str] = field(default_factory=list)


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    rec: Result,
    limit_s: float,
) -> str:
    body = {
        "model": SERVED,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    t0 = time.monotonic()
    reply: list[str] = []
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=limit_s)
        ) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}"
                return ""
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if rec.ttft is None:
                            rec.ttft = time.monotonic() - t0
                        reply.append(piece)
        rec.ok = True  # answered in full (a random-weight model may answer only tokens
        # that decode to nothing: no TTFT then, counted apart as `empty`)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        rec.error = type(e).__name__
    return "".join(reply)


class Load:
    """Open-loop arrivals (Poisson, seeded): light requests, or turns of heavy chats."""

    def __init__(self, url: str, args: argparse.Namespace, run: Run) -> None:
        self.url = url
        self.args = args
        self.run = run
        self.rng = random.Random(args.seed)
        self.tasks: set[asyncio.Task[Any]] = set()

    async def phase(
        self, session: aiohttp.ClientSession, name: str, seconds: float, rate: float
    ) -> None:
        end = time.monotonic() + seconds
        while True:
            wait = self.rng.expovariate(rate) if rate > 0 else seconds
            if time.monotonic() + wait >= end:
                await asyncio.sleep(max(0.0, end - time.monotonic()))
                return
            await asyncio.sleep(wait)
            if len(self.tasks) >= self.args.max_outstanding:
                self.run.results.append(Result(name, time.monotonic(), error="not sent"))
                continue
            coro = self.light(session) if name == "light" else self.chat(session)
            task = asyncio.create_task(coro)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def light(self, session: aiohttp.ClientSession) -> None:
        rec = Result("light", time.monotonic())
        self.run.results.append(rec)
        prompt = [{"role": "user", "content": _text(self.rng, 12)}]
        await one_request(session, self.url, prompt, 4, rec, self.args.request_timeout)

    async def chat(self, session: aiohttp.ClientSession) -> None:
        """A conversation of `--turns` turns on a long prompt of its own."""
        system = _text(self.rng, self.args.heavy_words)
        messages = [{"role": "system", "content": system}]
        for _ in range(self.args.turns):
            messages.append({"role": "user", "content": _text(self.rng, 20)})
            rec = Result("heavy", time.monotonic())
            self.run.results.append(rec)
            answer = await one_request(
                session, self.url, messages, self.args.heavy_tokens, rec, self.args.request_timeout
            )
            if not rec.ok:
                return
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(self.rng.uniform(1, 3))  # the user reads and types

    async def drain(self, seconds: float) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=seconds)
        for t in list(self.tasks):
            t.cancel()


async def watch(client: fleetserve.Client, name: str, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):
            svc = await asyncio.to_thread(client.service, name)
            alive = sum(1 for r in svc.replicas if r.status not in TERMINAL)
            ready = sum(1 for r in svc.replicas if r.status == "READY")
            run.fleet.append((time.monotonic(), alive, ready))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


TERMINAL = {
    "FAILED",
    "FAILED_INITIAL_DELAY",
    "FAILED_PROBING",
    "FAILED_PROVISION",
    "FAILED_CLEANUP",
    "UNKNOWN",
    "PREEMPTED",
}


async def calibrate(url: str, args: argparse.Namespace) -> dict[str, float]:
    """Unloaded end-to-end seconds of a light and of a heavy request, one at a time."""
    rng = random.Random(args.seed + 1)
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for kind, words, tokens in (
            ("light", 12, 4),
            ("heavy", args.heavy_words, args.heavy_tokens),
        ):
            times = []
            for _ in range(3):
                msgs = [
                    {"role": "system", "content": _text(rng, words)},
                    {"role": "user", "content": "hi"},
                ]
                rec = Result("calibration", time.monotonic())
                t0 = time.monotonic()
                await one_request(session, url, msgs, tokens, rec, args.request_timeout)
                if not rec.ok:
                    sys.exit(f"calibration request failed: {rec.error}")
                times.append(time.monotonic() - t0)
            out[kind] = sorted(times)[1]
    return out


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def summary(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"policy": run.policy}
    for phase in ("light", "heavy"):
        rs = [r for r in run.results if r.phase == phase]
        ttft = [r.ttft for r in rs if r.ttft is not None]
        out[f"{phase}_requests"] = len(rs)
        out[f"{phase}_failed"] = sum(1 for r in rs if not r.ok)
        out[f"{phase}_empty"] = sum(1 for r in rs if r.ok and r.ttft is None)
        out[f"{phase}_ttft_p50_ms"] = pct(ttft, 50) * 1e3
        out[f"{phase}_ttft_p99_ms"] = pct(ttft, 99) * 1e3
        out[f"{phase}_over_target"] = sum(
            1 for r in rs if not r.ok or (r.ttft is not None and r.ttft * 1e3 > args.ttft_target_ms)
        )
    errors: dict[str, int] = {}
    for r in run.results:
        if not r.ok:
            errors[f"{r.phase}: {r.error}"] = errors.get(f"{r.phase}: {r.error}", 0) + 1
    out["errors"] = errors
    steps = run.fleet
    out["replica_seconds"] = sum(
        a * (steps[i + 1][0] - t) for i, (t, a, _r) in enumerate(steps[:-1])
    )
    out["max_replicas"] = max((a for _t, a, _r in steps), default=0)
    out["events"] = run.events
    # Every request and the fleet over time, relative to the first request sent: a TTFT
    # target other than --ttft-target-ms can be read from the JSON afterwards.
    t0 = min((r.sent_at for r in run.results), default=0.0)
    out["requests"] = [
        [r.phase, round(r.sent_at - t0, 3), None if r.ttft is None else round(r.ttft, 4), r.ok]
        for r in run.results
    ]
    out["fleet"] = [[round(t - t0, 1), a, r] for t, a, r in steps]
    return out


async def run_policy(policy: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix=f"fleetserve-autoscale-{policy}-"))
    os.environ["FLEETSERVE_HOME"] = str(home)
    os.environ["FLEETSERVE_API_PORT"] = str(args.api_port)
    settings = Settings.from_env()
    run = Run(policy)
    try:
        with fleetserve.Client(settings=settings) as client:
            targets: dict[str, float] = {"qps": args.qps_target}
            spec = home / "service.yaml"
            spec.write_text(service_yaml(policy, targets, args))
            name = fleet_name(policy)
            log(f"[{policy}] starting the fleet (a vLLM start takes minutes) ...")
            svc = client.up_file(spec, name=name, wait=True, timeout=1200)
            if not args.calibration:  # the first fleet, still at one idle replica
                args.calibration = await calibrate(svc.endpoint or "", args)
            cal = args.calibration
            url = svc.endpoint or ""
            light_rate = 2.5 * targets["qps"]
            heavy_rate = args.heavy_load / cal["heavy"] / args.turns
            log(
                f"[{policy}] unloaded light {cal['light']:.2f} s, heavy {cal['heavy']:.2f} s; "
                f"request-rate target {targets['qps']:.2f} req/s/replica; light burst "
                f"{light_rate:.2f} req/s, heavy burst {heavy_rate * args.turns:.2f} req/s "
                f"({heavy_rate:.3f} chats/s of {args.turns} turns)"
            )
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(client, name, run, stop))
            load = Load(url, args, run)
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as session:
                await load.phase(session, "light", args.light_seconds, light_rate)
                await load.drain(30)
                await asyncio.sleep(args.gap_seconds)
                await load.phase(session, "heavy", args.heavy_seconds, heavy_rate)
                await load.drain(args.request_timeout)
            await asyncio.sleep(args.tail_seconds)
            stop.set()
            await watcher
            run.events = [
                f"{e.at:.0f} {e.message}"
                for e in client.events(name, limit=200)
                if e.kind == "autoscaler"
            ]
            keep = Path(args.keep_logs) / policy if args.keep_logs else None
            if keep is not None:  # `down` removes the service's logs: copied before
                shutil.copytree(settings.logs_dir / name, keep, dirs_exist_ok=True)
            client.down(name)
            client.wait_gone(name, timeout=300)
    finally:
        stop_server(settings)
    out = summary(run, args)
    out["calibration"] = args.calibration
    out["request_rate_target"] = targets["qps"]
    log(json.dumps({k: v for k, v in out.items() if k != "events"}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policies",
        default="request_rate,engine_queue",
        help="comma-separated; POLICY+move turns on the LB's move_waiting_requests",
    )
    p.add_argument("--qps-target", type=float, default=1.0, help="request_rate's target")
    p.add_argument(
        "--heavy-load",
        type=float,
        default=1.5,
        help="the heavy burst's new chats x turns per second, in units of one replica's "
        "unloaded heavy-request rate",
    )
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--ttft-target-ms", type=float, default=2000)
    p.add_argument("--queue-target", type=float, default=1)
    p.add_argument("--inflight-target", type=float, default=2)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="cap vLLM's running batch (its --max-num-seqs; e.g. 4 on 2 CPU cores): past it "
        "requests wait in vLLM's queue, which the engine_queue policy reads; default: vLLM's",
    )
    p.add_argument("--upscale-delay", type=float, default=10)
    p.add_argument("--downscale-delay", type=float, default=40)
    p.add_argument("--light-seconds", type=float, default=120)
    p.add_argument("--gap-seconds", type=float, default=60)
    p.add_argument("--heavy-seconds", type=float, default=240)
    p.add_argument("--tail-seconds", type=float, default=90)
    p.add_argument("--heavy-words", type=int, default=900)
    p.add_argument("--heavy-tokens", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-outstanding", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--api-port", type=int, default=46990)
    p.add_argument("--seed", type=int, default=26)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--keep-logs", help="copy each fleet's logs (LB, replicas) into this folder")
    args = p.parse_args()
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        p.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    args.calibration = {}
    policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in policies if split_policy(x)[0] not in POLICIES or x.count("+") > 1]
    bad += [x for x in policies if "+" in x and not split_policy(x)[1]]
    if bad:
        p.error(
            f"unknown policies {bad}: choose from {', '.join(POLICIES)}, each optionally "
            "with +move (the LB's move_waiting_requests)"
        )
    if "request_rate" in policies:  # the base of the ratios
        policies.remove("request_rate")
        policies.insert(0, "request_rate")

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    results = [asyncio.run(run_policy(x, args, log)) for x in policies]
    print()
    head = (
        f"{'policy':<13}{'light p99':>10}{'heavy p50':>10}{'heavy p99':>10}"
        f"{'over tgt':>9}{'failed':>7}{'rep-s':>8}{'max':>4}"
    )
    print(head)
    base = results[0]
    for r in results:
        over = r["light_over_target"] + r["heavy_over_target"]
        failed = r["light_failed"] + r["heavy_failed"]
        print(
            f"{r['policy']:<13}{r['light_ttft_p99_ms']:>10.0f}{r['heavy_ttft_p50_ms']:>10.0f}"
            f"{r['heavy_ttft_p99_ms']:>10.0f}{over:>9}{failed:>7}{r['replica_seconds']:>8.0f}"
            f"{r['max_replicas']:>4}"
            f"   ({r['replica_seconds'] / max(base['replica_seconds'], 1e-9):.2f}x rep-s, "
            f"{r['heavy_ttft_p99_ms'] / base['heavy_ttft_p99_ms']:.2f}x heavy p99 of request_rate)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
