"""bench/llm: fleetserve's load-balancing policies in front of fake LLM replicas that model a KV
cache (bench/llm/replica.py, bench/llm/model.py), in one run.

Starts one process of K fake replicas (default 4), then for each policy a fresh fleetserve load
balancer (`python -m fleetserve.lb --config X.json`, that policy, --lb-option settings) with the
replicas pushed to its admin port; for each workload (bench/llm/workloads.py) the replicas are
reset, then the workload runs at each load in turn, open loop (Poisson arrivals), through the
load balancer, streaming:

  TTFT        time to the first SSE event carrying content, p50 / p99 / mean (far past the
              knee TTFT is bimodal, admitted at once or queued for seconds, and the p50 can
              fall on either side of the gap: read the mean too)
  e2e         time to the end of the stream, p50 / p99
  req/s tok/s completed requests and output tokens per second
  hit         prefix-cache hit rate: delta of the replicas' vllm:prefix_cache_hits/queries
  share       the busiest replica's share of the requests (1/K is even)
  diff        in-flight (running + waiting) of the busiest replica minus the least busy one,
              sampled every 50 ms: mean / max
  x LL        ratios to least_load at the same workload and load

Each run: `--warmup` seconds of arrivals that load the fleet but are not measured, then
`--seconds` measured; nothing is sent after that, and what is still in flight gets at most
`--drain` seconds. First, the unloaded TTFT of each workload (its first requests one at a time,
max_tokens 1): the report says from which load least_load's TTFT p50 is 3x that.

    .venv/bin/python bench/llm/run.py [--quick] [--policies round_robin,least_load,...]
        (a policy@option=value entry: a variant of a policy, e.g. cache_aware@cache_choice=match)
        [--workloads chat,shared,skewed,unique] [--loads 8,16,24 | --loads chat:4,8]
        [--lb-option key=value | --lb-option policy:key=value] [--lb-workers 1]
        [--json out.json] [--plot out.png] [model options: see replica.py --help]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import psutil
from replica import config_of, model_options
from workloads import UNITS, WORKLOADS, Session, Turn, request_body

HERE = Path(__file__).resolve().parent
POLICIES = ["round_robin", "least_load", "power_of_two", "prefix_affinity", "cache_aware"]
# Highest load: least_load queues (its TTFT p50 >= 3x unloaded) with the default model.
LOADS = {
    "chat": [8.0, 16.0, 24.0],
    "shared": [10.0, 20.0, 40.0],
    "skewed": [16.0, 32.0, 48.0],
    "unique": [6.0, 12.0, 18.0],
}
QUICK_WORKLOADS = ["shared"]
PRECISE = "cache_aware_precise"  # --engine vllm: cache_aware on the engines' KV cache events
QUEUEING = 3.0  # "queueing": least_load's TTFT p50 at least this many times the unloaded one


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Procs:
    """Every process this benchmark starts, stopped by pid."""

    workdir: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self, cmd: list[str], log: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        out = open(self.workdir / log, "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.started.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop_all(self) -> None:
        for p in self.started:
            self.stop(p)

    def tail(self, log: str, lines: int = 6) -> str:
        """The last non-empty lines of a child's log, joined."""
        try:
            text = (self.workdir / log).read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join([line for line in text.splitlines() if line.strip()][-lines:])


def start_replicas(procs: Procs, args: argparse.Namespace) -> tuple[list[int], int]:
    ready = procs.workdir / "replicas.json"
    cmd = [sys.executable, str(HERE / "replica.py"), "--replicas", str(args.replicas)]
    cmd += ["--ready-file", str(ready)]
    for name, value in asdict(config_of(args)).items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    proc = procs.start(cmd, "replicas.log")
    deadline = time.monotonic() + 20
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the replicas did not start:\n{procs.tail('replicas.log')}")
        time.sleep(0.05)
    return [int(p) for p in json.loads(ready.read_text())["ports"]], proc.pid


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


T = TypeVar("T")


def round_order(targets: list[T], round_no: int, order: str) -> list[T]:
    """The targets in the order round `round_no` runs them (see --order)."""
    if order == "rotate":
        k = round_no % len(targets) if targets else 0
        return targets[k:] + targets[:k]
    return targets if round_no % 2 == 0 else targets[::-1]


def split_target(target: str) -> tuple[str, dict[str, Any]]:
    """A --policies entry: a policy, or a variant of one with its own options
    (`cache_aware@cache_choice=match@max_extra_load=4`: the label is the whole entry)."""
    policy, *rest = target.split("@")
    overrides: dict[str, Any] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or not key:
            sys.exit(f"--policies: {target!r}: expected policy@option=value, got {item!r}")
        overrides[key] = parse_value(value)
    return policy, overrides


def lb_options(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """The `options` of `policy`'s LbConfig: workers, then every --lb-option that applies."""
    opts: dict[str, Any] = {"workers": args.lb_workers}
    # No cache geometry is passed on, on either engine: a cache-aware policy runs at its
    # defaults, as a user runs it. (Until 2026-12-05 the fake engine's runs sized cache_aware's
    # index to the replicas' caches; under eviction that made it forget conversations the
    # engines still partly held: results-2026-12-05c.md.)
    for item in args.lb_option:
        key, _, value = item.partition("=")
        scope, _, name = key.rpartition(":")
        if scope in ("", policy):
            opts[name] = parse_value(value)
    return opts


@dataclass
class Lb:
    policy: str
    port: int
    pid: int
    proc: subprocess.Popen[bytes]
    options: dict[str, Any]
    admin: int = 0


def start_lb(
    procs: Procs, policy: str, options: dict[str, Any], ports: list[int], label: str = ""
) -> Lb | str:
    """A fresh load balancer with `policy`, serving `ports`; or why it refused. Its ports are
    found free just before it binds them; another process may take one in between (a
    client's ephemeral port): it is then started again on new ones (3 attempts in all)."""
    for attempt in range(3):
        got = _start_lb(procs, policy, options, ports, label)
        if not (isinstance(got, str) and "address already in use" in got.lower()):
            break
        if attempt < 2:
            print(f"{label or policy}: a port was taken before the LB bound it; on new ports")
    return got


def _start_lb(
    procs: Procs, policy: str, options: dict[str, Any], ports: list[int], label: str = ""
) -> Lb | str:
    from pydantic import ValidationError

    from fleetserve.lb.config import LbConfig
    from fleetserve.spec.models import LoadBalancerOptions

    port, admin = free_port(), free_port()
    try:
        config = LbConfig(
            service="bench-llm",
            port=port,
            admin_port=admin,
            policy=policy,
            options=LoadBalancerOptions(**options),
        )
    except ValidationError as e:
        errors = (f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        return "the load balancer's config refuses it: " + "; ".join(errors)
    path = procs.workdir / f"lb-{label or policy}.json"
    config.write(path)
    log = f"lb-{label or policy}.log"
    proc = procs.start([sys.executable, "-m", "fleetserve.lb", "--config", str(path)], log)
    deadline = time.monotonic() + 20
    while not listening(admin):
        if proc.poll() is not None or time.monotonic() > deadline:
            procs.stop(proc)
            return f"the load balancer exited: {procs.tail(log, 3) or 'no output'}"
        time.sleep(0.05)
    push_replicas(admin, ports)
    while not listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            procs.stop(proc)
            return f"the load balancer exited: {procs.tail(log, 3) or 'no output'}"
        time.sleep(0.05)
    time.sleep(0.2)  # with several workers, the push reaches the others
    return Lb(policy, port, proc.pid, proc, options, admin)


def push_replicas(admin: int, ports: list[int]) -> None:
    """The LB's replica set, as the controller pushes it: replica i + 1 at ports[i]."""
    import urllib.request

    body = {
        "replicas": [
            {"replica_id": i + 1, "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(ports)
        ]
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{admin}/-/replicas", data=json.dumps(body).encode(), method="PUT"
    )
    urllib.request.urlopen(req, timeout=10).read()


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children (the LB's other workers)."""
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for q in procs:
        with contextlib.suppress(psutil.Error):
            t = q.cpu_times()
            total += t.user + t.system
    return total


# ---------------------------------------------------------------- one run


@dataclass
class Record:
    sent: float  # from the start of the run
    measured: bool
    max_tokens: int
    late: float = 0.0  # sent this long after it was due (the driver's own lag)
    turn: int = 0  # its place in its session (0: a conversation's first turn)
    session: int = -1  # which session (its index in the run's list), for --json
    prompt_chars: int = 0  # the request body's prompt text, in characters
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    replica: str | None = None
    error: str | None = None
    done: bool = False


class Engine(Protocol):
    """The replicas behind a target: their figures, and a way to empty their caches."""

    async def stats(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]: ...

    async def reset(self, http: aiohttp.ClientSession) -> None: ...


@dataclass
class FakeEngine:
    """The fake replicas (replica.py): one stats page for all, a reset each."""

    stats_url: str
    reset_urls: list[str]

    async def stats(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        async with http.get(self.stats_url) as r:
            return list((await r.json())["replicas"])

    async def reset(self, http: aiohttp.ClientSession) -> None:
        for url in self.reset_urls:
            async with http.post(url) as r:
                await r.read()


@dataclass
class Fleet:
    lb_url: str
    engine: Engine
    # Real engines: ask for exactly max_tokens (no end of sequence) and count the tokens from
    # the stream's usage (a token of a random-weight model may decode to no text).
    real: bool = False


# A request the model cannot serve whole, whatever routes it: a prompt longer than its
# context (vLLM's 400 says "maximum context length"), or an answer cut where the context is
# full. Nearly the same requests in every target of a round (the same sessions; a later
# prompt holds the model's earlier answers, and a session ends at its first error): counted
# apart from the failures, which a router could cause or save.
CONTEXT = "context: "
CONTEXT_REFUSAL = b"maximum context length"


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile; nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


async def stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: Record, real: bool = False
) -> str | None:
    """Send one request, read its SSE stream into `rec`; the reply's text, or None."""
    loop = asyncio.get_running_loop()
    chat = "messages" in body
    if real:
        body = {**body, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = loop.time()
    parts: list[str] = []
    usage: int | None = None
    try:
        async with http.post(url, json=body) as resp:
            rec.replica = resp.headers.get("X-Replica")
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                if CONTEXT_REFUSAL in await resp.read() and resp.status == 400:
                    rec.error = f"{CONTEXT}prompt too long (HTTP 400)"
                return None
            finished = False
            reason = None
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                doc = json.loads(data)
                if real:
                    if doc.get("usage"):
                        usage = int(doc["usage"].get("completion_tokens") or 0)
                    if not doc.get("choices"):
                        continue
                    if rec.ttft is None:  # vLLM's first chunk comes with the first token
                        rec.ttft = loop.time() - t0
                choice = doc["choices"][0]
                reason = choice.get("finish_reason") or reason
                piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if piece:
                    if rec.ttft is None:
                        rec.ttft = loop.time() - t0
                    parts.append(piece)
                    rec.tokens += 1
            rec.e2e = loop.time() - t0
            if real and usage is not None:
                rec.tokens = usage
            if not finished or rec.tokens != rec.max_tokens:
                # Stopped by its length short of max_tokens (the bench ignores EOS): the
                # model's context filled up, whichever replica answered.
                # (vLLM's count: `usage`; counting chunks, one that held back a partial
                # character would make a whole answer look cut.)
                counted = usage is not None or not real
                full = finished and counted and reason == "length" and rec.tokens < rec.max_tokens
                why = f"{CONTEXT}full after" if full else "short stream:"
                rec.error = f"{why} {rec.tokens} of {rec.max_tokens} tokens"
                return None
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        rec.error = type(e).__name__
        return None
    rec.done = True
    return "".join(parts)


@dataclass
class Plan:
    warmup: float
    seconds: float
    drain: float
    max_requests: int


async def run_sessions(
    http: aiohttp.ClientSession, fleet: Fleet, sessions: list[Session], plan: Plan
) -> tuple[list[Record], list[tuple[float, list[dict[str, Any]]]], dict[str, Any], float]:
    """Play `sessions` (start times from now); sample the replicas every 50 ms. Returns the
    records, the samples, the replicas' stats at the end of the warm-up, and the run's span."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    window_end = plan.warmup + plan.seconds
    records: list[Record] = []
    samples: list[tuple[float, list[dict[str, Any]]]] = []
    at_warmup: dict[str, Any] = {}

    async def stats() -> list[dict[str, Any]]:
        return await fleet.engine.stats(http)

    id_of = {id(s): i for i, s in enumerate(sessions)}

    async def session(s: Session) -> None:
        history: list[dict[str, str]] = []
        due = s.start_s  # when the next request is to be sent, from t0 (open loop: a late
        # start, under CPU contention, is recorded, not dropped)
        for k, turn in enumerate(s.turns):
            if k:
                due = loop.time() - t0 + turn.think_s
            if due >= window_end or len(records) >= plan.max_requests:
                return
            await asyncio.sleep(max(0.0, t0 + due - loop.time()))
            now = loop.time() - t0
            rec = Record(sent=now, measured=due >= plan.warmup, max_tokens=turn.max_tokens, turn=k)
            rec.late = now - due
            records.append(rec)
            path, body = request_body(s, history, turn)
            rec.session = id_of[id(s)]
            rec.prompt_chars = sum(len(m["content"]) for m in body.get("messages", ())) + len(
                body.get("prompt", "")
            )
            reply = await stream(http, fleet.lb_url + path, body, rec, fleet.real)
            if reply is None:
                return
            history += [
                {"role": "user", "content": turn.user},
                {"role": "assistant", "content": reply},
            ]

    async def sampler() -> None:
        while True:
            t = loop.time() - t0
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                got = await stats()
                samples.append((t, got))
                if not at_warmup and t >= plan.warmup:
                    at_warmup["replicas"] = got
            await asyncio.sleep(0.05)

    sampling = asyncio.create_task(sampler())
    tasks = [asyncio.create_task(session(s)) for s in sessions]
    if tasks:
        await asyncio.wait(tasks, timeout=window_end + plan.drain)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    span = loop.time() - t0
    sampling.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampling
    end = await stats()
    samples.append((span, end))
    if not at_warmup:
        at_warmup["replicas"] = samples[0][1] if samples else end
    for rec in records:
        if not rec.done and rec.error is None:
            rec.error = "unfinished at the deadline"
    return records, samples, at_warmup, span


def summarize(
    records: list[Record],
    samples: list[tuple[float, list[dict[str, Any]]]],
    at_warmup: dict[str, Any],
    plan: Plan,
) -> dict[str, Any]:
    measured = [r for r in records if r.measured]
    ok = [r for r in measured if r.done]
    ttft = [r.ttft for r in measured if r.ttft is not None]
    first = [r.ttft for r in measured if r.ttft is not None and r.turn == 0]
    later = [r.ttft for r in measured if r.ttft is not None and r.turn > 0]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    if ok:
        last = max(r.sent + (r.e2e or 0.0) for r in ok)
        span = max(last - plan.warmup, plan.seconds)
    else:
        span = plan.seconds
    before = {r["replica"]: r for r in at_warmup["replicas"]}
    end = samples[-1][1]

    def delta(key: str) -> list[float]:
        return [r[key] - before.get(r["replica"], {}).get(key, 0) for r in end]

    queries, hits = sum(delta("prefix_cache_queries")), sum(delta("prefix_cache_hits"))
    requests = delta("requests")
    preempted = sum(delta("preemptions")) if all("preemptions" in r for r in end) else None
    shares = [n / sum(requests) for n in requests] if sum(requests) else []
    diffs = []
    for t, reps in samples:
        if t >= plan.warmup:
            inflight = [r["running"] + r["waiting"] for r in reps]
            diffs.append(max(inflight) - min(inflight))
    errors: dict[str, int] = {}
    for r in measured:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    past_context = sum(1 for r in measured if r.error and r.error.startswith(CONTEXT))
    return {
        "requests": len(measured),
        "completed": len(ok),
        "failed": len(measured) - len(ok) - past_context,
        "past_context": past_context,  # not failures: no router can serve them (CONTEXT)
        "errors": errors,
        "warmup_requests": len(records) - len(measured),
        "ttft_p50_ms": pct(ttft, 50) * 1e3,
        "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "ttft_mean_ms": sum(ttft) / len(ttft) * 1e3 if ttft else math.nan,
        # First turns (a new conversation: where it lands) apart from later ones (where its
        # history is cached, or not).
        "ttft_first_turn_p50_ms": pct(first, 50) * 1e3,
        "ttft_later_turns_p50_ms": pct(later, 50) * 1e3,
        "first_turns": len(first),
        "preemptions": preempted,  # vLLM's, all replicas (None: the fake model has none)
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "throughput_rps": len(ok) / span,
        "tokens_per_s": sum(r.tokens for r in ok) / span,
        "hit_rate": hits / queries if queries else math.nan,
        "prompt_tokens_queried": queries,
        "replica_requests": requests,
        "shares": shares,
        "max_share": max(shares) if shares else math.nan,
        "inflight_diff_mean": sum(diffs) / len(diffs) if diffs else math.nan,
        "inflight_diff_max": max(diffs) if diffs else math.nan,
        "samples": len(diffs),
        "driver_late_max_ms": max((r.late for r in records), default=0.0) * 1e3,
        "timeline": timeline(records, plan),
        # Each measured request: sent (s), session, turn, prompt characters, TTFT (ms), e2e
        # (s), error, the replica that answered (the fake replicas' X-Replica; None on vLLM);
        # for reading a tail (which requests make the p99) after the run.
        "per_request": [
            [
                round(r.sent, 3),
                r.session,
                r.turn,
                r.prompt_chars,
                None if r.ttft is None else round(r.ttft * 1e3, 1),
                None if r.e2e is None else round(r.e2e, 3),
                r.error,
                r.replica,
            ]
            for r in measured
        ],
    }


TIMELINE_S = 10.0


def timeline(records: list[Record], plan: Plan, step: float = TIMELINE_S) -> list[list[Any]]:
    """The measured window in slices of `step` seconds of sending: [slice start (s from the
    run's start), requests sent, new prompt characters sent (each request's prompt less its
    conversation's previous prompt: what the replicas had not seen of it), TTFT p50 and p90
    (ms)]: where in the window a run's slow requests were sent, and how much new prompt text
    came then."""
    out: list[list[Any]] = []
    previous: dict[int, int] = {}
    slices: dict[int, list[Record]] = {}
    new_chars: dict[int, int] = {}
    for r in sorted(records, key=lambda r: r.sent):
        new = r.prompt_chars - previous.get(r.session, 0)
        previous[r.session] = r.prompt_chars
        if not r.measured:
            continue
        k = int((r.sent - plan.warmup) // step)
        slices.setdefault(k, []).append(r)
        new_chars[k] = new_chars.get(k, 0) + max(0, new)
    for k in sorted(slices):
        ttfts = [r.ttft for r in slices[k] if r.ttft is not None]
        out.append(
            [
                round(plan.warmup + k * step, 1),
                len(slices[k]),
                new_chars[k],
                round(pct(ttfts, 50) * 1e3, 1) if ttfts else None,
                round(pct(ttfts, 90) * 1e3, 1) if ttfts else None,
            ]
        )
    return out


async def reset(http: aiohttp.ClientSession, fleet: Fleet) -> None:
    await fleet.engine.reset(http)


async def wait_idle(http: aiohttp.ClientSession, fleet: Fleet, seconds: float) -> bool:
    """Until no replica runs or queues anything (True), or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reps = await fleet.engine.stats(http)
        if all(x["running"] + x["waiting"] == 0 for x in reps):
            return True
        await asyncio.sleep(0.05)
    return False


async def unloaded_ttft(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    workload: str,
    seed: int,
    count: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The workload's first `count` requests one at a time (max_tokens 1), from a reset
    cache: TTFT p50 / max in ms."""
    await reset(http, fleet)
    ttfts: list[float] = []
    deadline = time.monotonic() + (30 if not fleet.real else 120)
    for s in WORKLOADS[workload](1.0, seed, 1e9, count, 1000, scale=args.prompt_scale):
        history: list[dict[str, str]] = []
        for turn in s.turns:
            if len(ttfts) >= count or time.monotonic() > deadline:
                break
            path, body = request_body(s, history, Turn(turn.user, 1))
            rec = Record(0.0, True, 1)
            reply = await stream(http, fleet.lb_url + path, body, rec, fleet.real)
            if reply is None or rec.ttft is None:
                break
            ttfts.append(rec.ttft)
            history += [
                {"role": "user", "content": turn.user},
                {"role": "assistant", "content": reply},
            ]
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": pct(ttfts, 50) * 1e3,
        "ttft_max_ms": max(ttfts) * 1e3 if ttfts else math.nan,
    }


# ---------------------------------------------------------------- report


def base_label(label: str) -> str:
    """A target's label without its round (`cache_aware #2`: `cache_aware`)."""
    return label.split(" #")[0]


def fmt(v: float, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def ratio(a: float, b: float) -> str:
    if any(isinstance(x, float) and math.isnan(x) for x in (a, b)) or not b:
        return "-"
    return f"{a / b:.2f}"


HEADER = (
    f"{'policy':<24}{'TTFT p50':>9}{'p99':>7}{'mean':>7}{'e2e p50':>9}{'p99':>6}{'req/s':>7}"
    f"{'tok/s':>7}{'hit':>6}{'fail':>5}{'share':>7}{'diff':>9}"
    "   x LL: TTFT p50    p99 e2e p50  req/s"
)


def table(runs: list[dict[str, Any]], unloaded: dict[str, dict[str, Any]]) -> list[str]:
    out: list[str] = []
    keys: list[tuple[str, float]] = []
    for r in runs:
        if (r["workload"], r["load"]) not in keys:
            keys.append((r["workload"], r["load"]))
    for wl, load in sorted(keys, key=lambda k: (list(WORKLOADS).index(k[0]), k[1])):
        rows = [r for r in runs if r["workload"] == wl and r["load"] == load]
        bases = {r.get("round", 0): r for r in rows if base_label(r["policy"]) == "least_load"}
        u = unloaded.get(wl, {}).get("ttft_p50_ms", math.nan)
        out.append("")
        out.append(
            f"{wl}, {load:g} {UNITS[wl]} (unloaded TTFT p50 {fmt(u, '.0f')} ms; "
            "TTFT in ms, e2e in s)"
        )
        out.append(HEADER)
        for r in rows:
            base = bases.get(r.get("round", 0))
            cells = [
                (fmt(r["ttft_p50_ms"], ".0f"), 9),
                (fmt(r["ttft_p99_ms"], ".0f"), 7),
                (fmt(r.get("ttft_mean_ms", math.nan), ".0f"), 7),
                (fmt(r["e2e_p50_s"], ".2f"), 9),
                (fmt(r["e2e_p99_s"], ".2f"), 6),
                (fmt(r["throughput_rps"], ".1f"), 7),
                (fmt(r["tokens_per_s"], ".0f"), 7),
                (fmt(r["hit_rate"] * 100, ".0f") + "%", 6),
                (str(r["failed"]), 5),
                (fmt(r["max_share"], ".2f"), 7),
                (fmt(r["inflight_diff_mean"], ".1f") + "/" + fmt(r["inflight_diff_max"], ".0f"), 9),
            ]
            line = f"{r['policy']:<24}" + "".join(f"{text:>{width}}" for text, width in cells)
            if base is not None:
                line += (
                    f"{'':>13}{ratio(r['ttft_p50_ms'], base['ttft_p50_ms']):>7}"
                    f"{ratio(r['ttft_p99_ms'], base['ttft_p99_ms']):>7}"
                    f"{ratio(r['e2e_p50_s'], base['e2e_p50_s']):>8}"
                    f"{ratio(r['throughput_rps'], base['throughput_rps']):>7}"
                )
            out.append(line)
    return out


def queueing_from(
    runs: list[dict[str, Any]],
    unloaded: dict[str, dict[str, Any]],
    unloaded_rounds: list[dict[str, dict[str, Any]]] | None = None,
) -> dict[str, float | None]:
    """Per workload: the lowest load at which least_load's TTFT p50 >= 3x unloaded (with
    rounds: in every round, against that round's unloaded TTFT)."""
    out: dict[str, float | None] = {}
    for wl, u in unloaded.items():
        ll = [r for r in runs if r["workload"] == wl and base_label(r["policy"]) == "least_load"]
        if not ll:
            continue

        def base(r: dict[str, Any], wl: str = wl, u: dict[str, Any] = u) -> float:
            got = u
            if unloaded_rounds and r.get("round", 0) < len(unloaded_rounds):
                got = unloaded_rounds[r.get("round", 0)].get(wl, u)
            return float(got["ttft_p50_ms"])

        loads = sorted({r["load"] for r in ll})
        out[wl] = next(
            (
                x
                for x in loads
                if all(r["ttft_p50_ms"] >= QUEUEING * base(r) for r in ll if r["load"] == x)
            ),
            None,
        )
    return out


# (figure, whether lower is better) compared round by round.
PAIRED = (
    ("ttft_p50_ms", True),
    ("ttft_p99_ms", True),
    ("ttft_mean_ms", True),
    ("throughput_rps", False),
)


def paired(
    runs: list[dict[str, Any]],
    unloaded_rounds: list[dict[str, dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """Each target against each reference (least_load, the other routers, and cache_aware
    for its variants: `cache_aware_precise`, `cache_aware@option=value`), over the
    rounds in which both ran the same workload and load (the same traffic): per figure, in
    how many rounds the target did as well or better, and the geometric mean, lowest and
    highest of its ratio to the reference. `queueing`: only the rounds in which least_load's
    TTFT p50 was >= 3x that round's unloaded one (None without least_load)."""
    out: list[dict[str, Any]] = []
    keys = sorted({(r["workload"], r["load"]) for r in runs}, key=lambda k: (k[0], k[1]))
    for wl, load in keys:
        by: dict[str, dict[int, dict[str, Any]]] = {}
        for r in runs:
            if r["workload"] == wl and r["load"] == load:
                by.setdefault(base_label(r["policy"]), {})[r.get("round", 0)] = r
        ll = by.get("least_load", {})
        queueing: set[int] | None = None
        if ll and unloaded_rounds:
            queueing = {
                n
                for n, r in ll.items()
                if n < len(unloaded_rounds)
                and wl in unloaded_rounds[n]
                and r["ttft_p50_ms"] >= QUEUEING * unloaded_rounds[n][wl]["ttft_p50_ms"]
            }
        references = [t for t in by if t in ("least_load", "cache_aware") or ":" in t]
        for target in by:
            if target == "least_load":
                continue  # (its ratios to a router: that router's against it, inverted)
            for ref in references:
                if ref == target or (ref == "cache_aware" and not target.startswith(ref)):
                    continue  # (cache_aware: the reference of its own variants only)
                rounds = sorted(set(by[target]) & set(by[ref]))
                subsets = [("all", rounds)] if rounds else []
                if queueing is not None and not set(rounds) <= queueing:
                    queued = [n for n in rounds if n in queueing]
                    subsets += [("queueing", queued)] if queued else []
                for name, subset in subsets:
                    out.append(
                        {
                            "workload": wl,
                            "load": load,
                            "target": target,
                            "reference": ref,
                            "rounds": name,
                            "count": len(subset),
                            "figures": _ratios(by[target], by[ref], subset),
                        }
                    )
    return out


def _ratios(
    target: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]], rounds: list[int]
) -> dict[str, dict[str, float]]:
    """Per PAIRED figure, over `rounds`: in how many the target did as well or better, and
    the geometric mean, lowest and highest of its ratio to the reference."""
    figures = {}
    for key, lower in PAIRED:
        ratios = [
            target[n][key] / ref[n][key]
            for n in rounds
            if _positive(target[n].get(key)) and _positive(ref[n].get(key))
        ]
        if ratios:
            figures[key] = {
                "better": sum(1 for x in ratios if (x <= 1 if lower else x >= 1)),
                "geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
                "low": min(ratios),
                "high": max(ratios),
            }
    return figures


def _positive(value: Any) -> bool:
    """A figure a ratio can be taken of: a finite number above 0 (a run that completed
    nothing has 0 req/s and NaN times; a JSON file has null for NaN)."""
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def paired_lines(comparisons: list[dict[str, Any]]) -> list[str]:
    names = {"ttft_p50_ms": "TTFT p50", "ttft_p99_ms": "p99", "ttft_mean_ms": "mean"}
    out = []
    for c in comparisons:
        cells = []
        for key, lower in PAIRED:
            f = c["figures"].get(key)
            if f is None:
                continue
            what = names.get(key, "req/s")
            word = "lower" if lower else "higher"
            cells.append(
                f"{what} {word} in {f['better']} ({f['geomean']:.2f}x, "
                f"{f['low']:.2f}-{f['high']:.2f})"
            )
        which = "" if c["rounds"] == "all" else " where least_load >= 3x unloaded"
        out.append(
            f"{c['target']} / {c['reference']}, {c['workload']} {c['load']:g}, {c['count']} "
            f"rounds{which}: " + "; ".join(cells)
        )
    return out


def no_nan(value: Any) -> Any:
    """JSON has no NaN: null instead (a figure with no sample)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return value


def plot(path: Path, runs: list[dict[str, Any]], unloaded: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in runs)]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, wl in zip(axes[0], workloads, strict=True):
        for i, policy in enumerate(policies):
            rows = sorted(
                (r for r in runs if r["workload"] == wl and r["policy"] == policy),
                key=lambda r: r["load"],
            )
            x = [r["load"] for r in rows]
            c = colors[i % len(colors)]
            ax.plot(x, [r["ttft_p50_ms"] for r in rows], "o-", color=c, label=f"{policy} p50")
            ax.plot(x, [r["ttft_p99_ms"] for r in rows], "x--", color=c, label=f"{policy} p99")
        if wl in unloaded:
            ax.axhline(unloaded[wl]["ttft_p50_ms"], color="grey", lw=0.8, label="unloaded p50")
        ax.set_yscale("log")
        ax.set_title(wl)
        ax.set_xlabel(UNITS[wl])
        ax.set_ylabel("TTFT (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- main


def parse_loads(items: Iterable[str], workloads: list[str]) -> dict[str, list[float]]:
    loads = {w: list(LOADS[w]) for w in workloads}
    for item in items:
        scope, _, values = item.rpartition(":")
        parsed = [float(v) for v in values.split(",") if v]
        if scope and scope not in WORKLOADS:
            sys.exit(f"--loads {item}: no workload {scope!r}")
        for w in [scope] if scope else workloads:
            if w in loads:
                loads[w] = parsed
    return loads


def traffic_of(args: argparse.Namespace, load_index: int, round_no: int) -> int:
    """The traffic seed of a run: one per load and, with `--traffic per-round`, per round too
    (every target of a round replays the same sessions; each round draws new ones, so that
    the rounds sample the traffic, not only the machine's noise)."""
    traffic = getattr(args, "traffic", "same")
    if traffic == "per-round":
        return load_index + 100 * round_no
    if traffic == "same":
        return load_index
    return load_index + int(traffic)  # one round's traffic, replayed in every round


def sessions_of(
    args: argparse.Namespace, wl: str, load: float, plan: Plan, traffic: int
) -> list[Session]:
    """The sessions of workload `wl` at `load` for one run of `plan` (its seed, prompt scale)."""
    return list(
        WORKLOADS[wl](
            load,
            args.seed,
            plan.warmup + plan.seconds,
            plan.max_requests,
            traffic,
            scale=args.prompt_scale,
        )
    )


async def run_workloads(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    label: str,
    args: argparse.Namespace,
    loads: dict[str, list[float]],
    pids: tuple[int, int],
    results: dict[str, Any],
    round_no: int = 0,
) -> None:
    """Every workload at every load through one target (`label`): a run each, into results."""
    log = print if not args.quiet else (lambda *a, **k: None)
    plan = Plan(args.warmup, args.seconds, args.drain, args.max_requests)
    lb_pid, replicas_pid = pids
    for wl in args.workloads:
        await reset(http, fleet)
        for i, load in enumerate(loads[wl]):
            reset_before = not await wait_idle(http, fleet, 5 if not fleet.real else 60)
            if reset_before:
                await reset(http, fleet)  # the last run's leftovers, aborted
            traffic = traffic_of(args, i, round_no)
            sessions = sessions_of(args, wl, load, plan, traffic)
            cpu0 = (cpu_seconds(lb_pid), cpu_seconds(replicas_pid), time.process_time())
            records, samples, at_warmup, span = await run_sessions(http, fleet, sessions, plan)
            cpu1 = (cpu_seconds(lb_pid), cpu_seconds(replicas_pid), time.process_time())
            run = {
                "policy": label,
                "round": round_no,
                "workload": wl,
                "load": load,
                "unit": UNITS[wl],
                "traffic": traffic,
                **summarize(records, samples, at_warmup, plan),
                "span_s": span,
                "reset_before": reset_before,
                "cpu_pct": {
                    name: 100 * (b - a) / span
                    for name, a, b in zip(("lb", "replicas", "driver"), cpu0, cpu1, strict=True)
                },
            }
            results["runs"].append(run)
            cpu = run["cpu_pct"]
            log(
                f"{label} {wl} {load:g}: TTFT p50 {run['ttft_p50_ms']:.0f} ms, "
                f"{run['completed']}/{run['requests']} ok"
                + (f" ({run['past_context']} past the context)" if run["past_context"] else "")
                + ", hit "
                f"{run['hit_rate']:.2f}, {span:.1f} s, cpu lb {cpu['lb']:.0f}% "
                f"replicas {cpu['replicas']:.0f}% driver {cpu['driver']:.0f}%"
                + ("" if run["preemptions"] is None else f", {run['preemptions']:.0f} preempted")
            )


def new_results(args: argparse.Namespace, loads: dict[str, list[float]]) -> dict[str, Any]:
    plan = Plan(args.warmup, args.seconds, args.drain, args.max_requests)
    return {
        "engine": args.engine,
        "model": asdict(config_of(args)) if args.engine == "fake" else {},
        "replicas": args.replicas,
        "plan": asdict(plan),
        "loads": loads,
        "seed": args.seed,
        "traffic": getattr(args, "traffic", "same"),
        "prompt_scale": args.prompt_scale,
        "unloaded": {},
        "runs": [],
        "skipped": {},
        "lb_metrics": {},
        "max_extra_load": {},
        "choices": {},
    }


async def measure_unloaded(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    args: argparse.Namespace,
    results: dict[str, Any],
    round_no: int = 0,
) -> None:
    """The unloaded TTFT of each workload: `unloaded` holds the first round's, and
    `unloaded_rounds` each round's (with --rounds, measured again at each round's start, as
    a shared machine's background load changes it too)."""
    log = print if not args.quiet else (lambda *a, **k: None)
    rounds = results.setdefault("unloaded_rounds", [])
    while len(rounds) <= round_no:
        rounds.append({})
    for wl in args.workloads:
        u = await unloaded_ttft(http, fleet, wl, args.seed, args.unloaded_requests, args)
        if round_no == 0:
            results["unloaded"][wl] = u
        rounds[round_no][wl] = u
        log(
            f"unloaded {wl}"
            + (f" (round {round_no + 1})" if args.rounds > 1 else "")
            + f": TTFT p50 {u['ttft_p50_ms']:.0f} ms ({u['requests']} requests)"
        )


async def bench(args: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    if args.engine == "vllm":
        return await bench_vllm(args, procs)
    ports, replicas_pid = start_replicas(procs, args)
    engine = FakeEngine(
        f"http://127.0.0.1:{ports[0]}/-/stats", [f"http://127.0.0.1:{p}/-/reset" for p in ports]
    )
    loads = parse_loads(args.loads, args.workloads)
    results = new_results(args, loads)
    log = print if not args.quiet else (lambda *a, **k: None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        # The unloaded TTFT: one request at a time, straight to one replica (its cache holds
        # each conversation's earlier turns, as a perfectly cache-aware router's would).
        await measure_unloaded(http, Fleet(f"http://127.0.0.1:{ports[0]}", engine), args, results)

        for policy in args.policies:
            base, overrides = split_target(policy)
            options = {**lb_options(args, base), **overrides}
            start = log_size(procs, policy)
            lb = start_lb(procs, base, options, ports, label=policy)
            if isinstance(lb, str):
                results["skipped"][policy] = lb
                log(f"{policy}: skipped: {lb}")
                continue
            fleet = Fleet(f"http://127.0.0.1:{lb.port}", engine)
            results["max_extra_load"][policy] = max_extra_load(base, options)
            await run_workloads(http, fleet, policy, args, loads, (lb.pid, replicas_pid), results)
            if base == "cache_aware":
                results["lb_metrics"][policy] = lb_choice_metrics(lb)
            counts = choice_counts(procs, policy, start) if options.get("log_choices") else {}
            if counts.get("choices"):
                results["choices"][policy] = counts
            procs.stop(lb.proc)
        if args.routers:
            from engines import start_router

            for kind in args.routers:
                router = start_router(
                    procs, kind, "cache_aware", [f"http://127.0.0.1:{p}" for p in ports]
                )
                if isinstance(router, str):
                    results["skipped"][kind] = router
                    log(f"{kind}: skipped: {router}")
                    continue
                label = f"{kind.split('-')[0]}:cache_aware"
                fleet = Fleet(f"http://127.0.0.1:{router.port}", engine)
                pids = (router.proc.pid, replicas_pid)
                await run_workloads(http, fleet, label, args, loads, pids, results)
                procs.stop(router.proc)
    results["queueing_from"] = queueing_from(results["runs"], results["unloaded"])
    return results


# --calibrate: the load between trials changes by this factor until the target is bracketed,
# then by halving the bracket (geometrically); at most this many trials.
CALIBRATE_STEP = 1.3
CALIBRATE_TRIES = 6
CALIBRATE_TRAFFIC = 900_000  # trials draw traffics of their own, never a round's


async def calibrated_load(
    measure: Callable[[float], Awaitable[float]],
    start: float,
    target: float,
    tries: int = CALIBRATE_TRIES,
) -> tuple[float, list[tuple[float, float]]]:
    """The load at which `measure(load)` (least_load's TTFT p50 over the unloaded TTFT) is
    at least `target`: trials from `start`, up by CALIBRATE_STEP while below the target, down
    while above twice it, then between the two nearest. It stops at a trial within [target,
    2 x target] or after `tries`, and returns the lowest load tried that reached the target
    (the highest tried, if none did) with every (load, ratio) tried."""
    tried: list[tuple[float, float]] = []
    low: float | None = None
    high: float | None = None
    load = start
    for _ in range(tries):
        ratio = await measure(load)
        tried.append((load, ratio))
        if target <= ratio <= 2 * target:
            break
        if ratio < target:
            low = load
        else:
            high = load
        if low is not None and high is not None:
            load = math.sqrt(low * high)
        elif low is not None:
            load = low * CALIBRATE_STEP
        else:
            assert high is not None
            load = high / CALIBRATE_STEP
    reached = [load for load, ratio in tried if ratio >= target]
    return (min(reached) if reached else max(load for load, _ in tried)), tried


async def calibrate(
    http: aiohttp.ClientSession,
    procs: Procs,
    vllm: Any,
    args: argparse.Namespace,
    loads: dict[str, list[float]],
    results: dict[str, Any],
) -> None:
    """--calibrate X: for each workload, the load (from its first --loads value) at which
    least_load's TTFT p50 is X times the unloaded TTFT on this machine, by short trials
    through a least_load LB (caches reset before each); every target then runs at it. A
    machine twice as fast needs about twice the load for the same regime."""
    log = print if not args.quiet else (lambda *a, **k: None)
    lb = start_lb(procs, "least_load", lb_options(args, "least_load"), vllm.ports, "calibrate")
    if isinstance(lb, str):
        sys.exit(f"--calibrate: the least_load LB did not start: {lb}")
    fleet = Fleet(f"http://127.0.0.1:{lb.port}", vllm, real=True)
    direct = Fleet(vllm.urls[0], vllm, real=True)
    plan = Plan(args.warmup, min(args.seconds, 20.0), args.drain, args.max_requests)
    found: dict[str, Any] = {}
    try:
        for wl in args.workloads:
            unloaded = await unloaded_ttft(
                http, direct, wl, args.seed, args.unloaded_requests, args
            )
            base = unloaded["ttft_p50_ms"]
            trial = 0

            async def measure(load: float, wl: str = wl, base: float = base) -> float:
                nonlocal trial
                await wait_idle(http, fleet, 60)
                await vllm.reset(http)
                sessions = sessions_of(args, wl, load, plan, CALIBRATE_TRAFFIC + trial)
                trial += 1
                records, samples, at_warmup, _ = await run_sessions(http, fleet, sessions, plan)
                p50 = summarize(records, samples, at_warmup, plan)["ttft_p50_ms"]
                ratio = p50 / base if base > 0 and not math.isnan(p50) else math.inf
                log(
                    f"calibrating {wl} at {load:.3g} {UNITS[wl]}: least_load TTFT p50 "
                    f"{p50:.0f} ms, {ratio:.1f}x unloaded ({base:.0f} ms)"
                )
                return ratio

            load, tried = await calibrated_load(measure, loads[wl][0], args.calibrate)
            loads[wl] = [round(load, 3)]
            # (a trial with no first token at all weighs as past any target: null in the JSON)
            trials = [[x, r if math.isfinite(r) else None] for x, r in tried]
            found[wl] = {"target": args.calibrate, "unloaded_ms": base, "tried": trials}
            log(f"calibrated {wl}: {loads[wl][0]:g} {UNITS[wl]} (least_load ~{args.calibrate:g}x)")
    finally:
        procs.stop(lb.proc)
    # The first target must start as cold as the others (the trials share its system prompts).
    await wait_idle(http, direct, 60)
    await vllm.reset(http)
    results["calibration"] = found
    results["loads"] = loads


async def bench_vllm(args: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    """Real vLLM replicas; each target (fleetserve's LB with each policy, then each router)
    in front of the same replicas, restarted before each target so that it starts cold."""
    log = print if not args.quiet else (lambda *a, **k: None)
    from engines import VllmFleet, start_router, testbed_model

    loads = parse_loads(args.loads, args.workloads)
    results = new_results(args, loads)
    vllm = VllmFleet(
        procs,
        args.replicas,
        testbed_model(),
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        kv_blocks=args.kv_blocks,
        extra_args=[a for arg in args.vllm_arg for a in shlex.split(arg)],
    )
    results["model"] = {
        "engine": "vllm (CPU build)",
        "model": vllm.model,
        "kv_cache_gib": args.kv_cache_gib,
        "kv_blocks": args.kv_blocks,
        "max_model_len": args.max_model_len,
        "vllm_args": args.vllm_arg,
    }
    targets = [("fleetserve", p) for p in args.policies]
    targets += [(r, "cache_aware") for r in args.routers]
    plan = [(r, t) for r in range(args.rounds) for t in round_order(targets, r, args.order)]
    bases = {split_target(p)[0] for p in args.policies}
    if args.between_targets == "reset" and PRECISE in bases:
        vllm.kv_events = True  # never restarted: every target's replicas publish
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as http:
        for n, (round_no, (kind, policy)) in enumerate(plan):
            if args.between_targets == "restart":
                # cache_aware_precise: cache_aware following the engines' KV cache events,
                # which only its replicas publish.
                vllm.kv_events = split_target(policy)[0] == PRECISE
                took = vllm.start(log) if n == 0 else vllm.restart(log)
                log(f"{args.replicas} vLLM replicas up in {took:.0f} s (fresh, cold caches)")
            elif n == 0:
                took = vllm.start(log)
                log(f"{args.replicas} vLLM replicas up in {took:.0f} s")
            if n == 0 and args.calibrate:
                await calibrate(http, procs, vllm, args, loads, results)
            else:
                await wait_idle(http, Fleet("", vllm, real=True), 120)
                await vllm.reset(http)  # cold caches, without a restart
                log("prefix caches reset")
            replicas_pid = vllm.running[0].pid  # CPU of one replica (each the same process tree)
            base = split_target(policy)[0] if kind == "fleetserve" else policy
            if kind == "fleetserve":
                base, overrides = split_target(policy)
                options = {**lb_options(args, base), **overrides}
                lb_policy = base
                if base == PRECISE:
                    lb_policy = "cache_aware"
                    options = {**lb_options(args, lb_policy), "kv_events": {}, **overrides}
                    options["tokenizer"] = vllm.model
                start = log_size(procs, policy)
                lb = start_lb(procs, lb_policy, options, vllm.ports, label=policy)
                if isinstance(lb, str):
                    results["skipped"][policy] = lb
                    log(f"{policy}: skipped: {lb}")
                    continue
                label, url, pid, stop = policy, f"http://127.0.0.1:{lb.port}", lb.pid, lb.proc
                results["max_extra_load"][policy] = max_extra_load(lb_policy, options)
                if base == PRECISE:
                    await asyncio.sleep(3)  # subscribed to every replica's events
            else:
                router = start_router(procs, kind, policy, vllm.urls)
                if isinstance(router, str):
                    results["skipped"][kind] = router
                    log(f"{kind}: skipped: {router}")
                    continue
                label = f"{kind.split('-')[0]}:{policy}"
                url, pid, stop = f"http://127.0.0.1:{router.port}", router.proc.pid, router.proc
            fleet = Fleet(url, vllm, real=True)
            if n % len(targets) == 0:  # each round's start
                # Straight to one replica, whatever the round's first target: through a
                # router that spreads a conversation's turns (least_load) the later turns miss
                # the cache, and the baseline was 75-90 ms against 46-62 ms through a
                # cache-aware one (results-2026-12-05e.md).
                direct = Fleet(vllm.urls[0], vllm, real=True)
                await measure_unloaded(http, direct, args, results, round_no)
            if args.rounds > 1:
                label = f"{label} #{round_no + 1}"
            await run_workloads(
                http, fleet, label, args, loads, (pid, replicas_pid), results, round_no
            )
            if (
                kind == "fleetserve"
                and base in ("cache_aware", PRECISE)
                and not isinstance(lb, str)
            ):
                results["lb_metrics"][policy] = lb_choice_metrics(lb)
            if kind == "fleetserve" and options.get("log_choices"):
                counts = choice_counts(procs, policy, start)
                if counts["choices"]:
                    results["choices"][label] = counts
            procs.stop(stop)
        vllm.stop()
    results["queueing_from"] = queueing_from(
        results["runs"], results["unloaded"], results.get("unloaded_rounds")
    )
    if args.rounds > 1:
        results["paired"] = paired(results["runs"], results.get("unloaded_rounds"))
    return results


_LB_METRIC = re.compile(
    r"^(fleetserve_lb_choice_extra_load_max|fleetserve_lb_prompt_blocks_total)"
    r'\{[^}]*?(?:kind="(\w+)")?[^}]*\}\s+([0-9.eE+-]+)$',
    re.M,
)


def max_extra_load(policy: str, options: dict[str, Any]) -> int | None:
    """The threshold the balancer of `policy` runs with (its default when not given)."""
    from fleetserve.policies.factory import make_selector

    selector = make_selector(policy, max_extra_load=options.get("max_extra_load"))
    value = getattr(selector, "max_extra_load", None)
    return value if isinstance(value, int) else None


def log_size(procs: Procs, label: str) -> int:
    """How long an LB's log already is (its next run's lines start there)."""
    path = procs.workdir / f"lb-{label}.log"
    return path.stat().st_size if path.exists() else 0


def choice_counts(procs: Procs, label: str, start: int) -> dict[str, int]:
    """The choices an LB logged (`log_choices`) past `start` in its log, by why the chosen
    replica won (fleetserve.policies.cache_aware.CacheAware._why): `match`, `new`, and the
    moves away from the replica holding the most, by `cost` and by `bound`."""
    reasons = ("match", "new", "cost", "bound")
    counts = dict.fromkeys(("choices", *reasons), 0)
    try:
        with open(procs.workdir / f"lb-{label}.log", "rb") as f:
            f.seek(start)
            for line in f:
                _, sep, rest = line.partition(b" choice {")
                if not sep:
                    continue
                try:
                    why = json.loads(b"{" + rest)["why"]
                except (ValueError, KeyError, TypeError, RecursionError):
                    continue
                if isinstance(why, str) and why in reasons:
                    counts["choices"] += 1
                    counts[why] += 1
    except OSError:  # no log: nothing logged
        pass
    return counts


def lb_choice_metrics(lb: Lb) -> dict[str, float]:
    """What the cache_aware balancer says of its own choices, over all of its runs: the most
    requests a chosen replica had in flight beyond the least loaded one, and the share of
    prompt blocks its prefix index matched."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{lb.admin}/metrics", timeout=10).read()
    found: dict[str, float] = {}
    for _name, kind, value in _LB_METRIC.findall(text.decode()):
        found[kind or "extra_load_max"] = float(value)
    out = {"extra_load_max": found.get("extra_load_max", float("nan"))}
    if found.get("routed"):
        out["index_match_rate"] = found.get("matched", 0.0) / found["routed"]
    return out


def report(results: dict[str, Any]) -> None:
    m = results["model"]
    plan = results["plan"]
    if results.get("engine") == "vllm":
        cache = (
            f"{m['kv_blocks']} KV blocks ({m['kv_blocks'] * 128:,} tokens)"
            if m.get("kv_blocks")
            else f"KV cache {m['kv_cache_gib']:g} GiB"
        )
        what = (
            f"vLLM (CPU build) on {m['model']}, {cache} each, max-model-len "
            f"{m.get('max_model_len')}, prompts x{results['prompt_scale']:g}, "
            f"seed {results['seed']}" + "".join(f", {a}" for a in m.get("vllm_args") or ())
        )
    else:
        what = (
            f"prefill {m['prefill_ms_per_token']} ms/token, decode {m['decode_ms_per_step']} "
            f"ms/step, batch {m['max_batch']}, cache {m['cache_blocks']} blocks x "
            f"{m['block_tokens']} tokens"
        )
    print(
        f"\n{results['replicas']} replicas: {what}; runs: {plan['warmup']:g} s warm-up + "
        f"{plan['seconds']:g} s measured (drain <= {plan['drain']:g} s)"
    )
    for line in table(results["runs"], results["unloaded"]):
        print(line)
    print("\nshare: the busiest replica's share of requests; diff: in-flight busiest - least")
    print("busy replica, mean/max of 50 ms samples; x LL: ratio to least_load, same load")
    for wl, load in results["queueing_from"].items():
        us = [r[wl]["ttft_p50_ms"] for r in results.get("unloaded_rounds") or [] if wl in r]
        us = us or [results["unloaded"][wl]["ttft_p50_ms"]]
        where = f"from {load:g} {UNITS[wl]}" if load is not None else "at none of the loads"
        many = " in every round" if len(us) > 1 else ""
        print(
            f"{wl}: least_load's TTFT p50 >= {QUEUEING:g}x unloaded "
            f"({' / '.join(f'{u:.0f}' for u in us)} ms){many} {where}"
        )
    for policy, found in results["lb_metrics"].items():
        threshold = results.get("max_extra_load", {}).get(policy)
        print(
            f"{policy}, at its choices (its last round): a chosen replica had at most "
            f"{found['extra_load_max']:g} more requests in flight than the least loaded one "
            f"(max_extra_load {threshold}); its prefix index matched "
            f"{100 * found.get('index_match_rate', 0):.0f}% of the prompt blocks it routed"
        )
    for label, c in results.get("choices", {}).items():
        with_history = c["choices"] - c["new"]
        print(
            f"{label}: of {c['choices']} choices logged, {with_history} of prompts some replica "
            f"held part of; {c['cost'] + c['bound']} went elsewhere than the replica that held "
            f"the most ({c['cost']} by the cost rule, {c['bound']} by max_extra_load)"
        )
    if results.get("paired"):
        print(
            "\nround by round (the same traffic within a round): rounds as good or better, "
            "geometric mean of the ratio (lowest-highest)"
        )
        for line in paired_lines(results["paired"]):
            print(line)
    timelines = [r for r in results["runs"] if r.get("timeline")]
    if results.get("engine") == "vllm" and timelines:
        print(
            f"\nby {TIMELINE_S:g} s of sending: new prompt characters sent (thousands) and "
            "TTFT p90 (ms)"
        )
        for r in timelines:
            cells = " ".join(
                f"{c / 1000:.0f}k:{fmt(p90, '.0f')}" for _, _, c, _, p90 in r["timeline"]
            )
            print(f"{r['policy']:<24} {r['workload']} {r['load']:g}: {cells}")
    for policy, why in results["skipped"].items():
        print(f"{policy}: skipped: {why}")
    if results["runs"]:
        peak = {
            k: max(r["cpu_pct"][k] for r in results["runs"]) for k in ("lb", "replicas", "driver")
        }
        print(
            f"highest CPU of a run (% of one core): load balancer {peak['lb']:.0f}, "
            f"replicas {peak['replicas']:.0f}, driver {peak['driver']:.0f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"only {', '.join(QUICK_WORKLOADS)}, at the middle load, short runs (< 1 min)",
    )
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", help=f"default {','.join(WORKLOADS)}")
    ap.add_argument(
        "--loads",
        action="append",
        default=[],
        help="comma-separated, for every workload, or WORKLOAD:a,b,c (repeatable); "
        + "default "
        + " ".join(f"{w}:{','.join(f'{x:g}' for x in v)}" for w, v in LOADS.items()),
    )
    ap.add_argument("--warmup", type=float, help="seconds of unmeasured arrivals (default 1.5)")
    ap.add_argument("--seconds", type=float, help="measured seconds of arrivals (default 3)")
    ap.add_argument("--drain", type=float, help="most seconds to finish after (default 8)")
    ap.add_argument("--max-requests", type=int, default=400, help="per run, warm-up included")
    ap.add_argument("--unloaded-requests", type=int, help="for the unloaded TTFT (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lb-option",
        action="append",
        default=[],
        help="KEY=VALUE, or POLICY:KEY=VALUE for one policy: load_balancer options (repeatable)",
    )
    ap.add_argument(
        "--lb-workers",
        type=int,
        help="fleetserve LB processes (default: 1 on the fake engine, the LB's default on vllm)",
    )
    ap.add_argument(
        "--engine",
        choices=["fake", "vllm"],
        default="fake",
        help="fake: the modelled replicas (replica.py); vllm: real vLLM replicas of the testbed "
        "(./scripts/llm/setup.sh), restarted before each target",
    )
    ap.add_argument(
        "--routers",
        default="",
        help="other routers to put in front of the same replicas (fake or vLLM; installed "
        "by ./scripts/llm/setup.sh), "
        "comma-separated: sglang-router,vllm-router (their cache_aware policy)",
    )
    ap.add_argument(
        "--prompt-scale",
        type=float,
        help="scale the workloads' prompt lengths (default 1; 0.25 with --engine vllm)",
    )
    ap.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="vllm: KV cache per replica (GiB)"
    )
    ap.add_argument("--max-model-len", type=int, default=4096, help="vllm: context length")
    ap.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="vllm: more arguments for every replica's server, e.g. '--max-num-seqs 6' "
        "(repeatable; the same for every target)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="vllm: run the targets this many times (in the order --order says)",
    )
    ap.add_argument(
        "--order",
        choices=("mirror", "rotate"),
        default="mirror",
        help="vllm: the targets' order in each round: `mirror`, in order then reversed (A B C, "
        "C B A: a trend in the machine's load weighs on every target alike, but the middle "
        "ones are never first or last), or `rotate` (A B C, B C A, C A B: over as many rounds "
        "as targets, each runs once in each place; bench/llm/positions.py shows why)",
    )
    ap.add_argument(
        "--traffic",
        default="per-round",
        help="vllm: new sessions each round, the same for every target of a round "
        "(per-round, the default), or the same sessions in every round: `same` (as before "
        "2026-12-05: the rounds then sample the machine's noise, not the traffic) or N, "
        "round N/100 + 1's traffic of a per-round run (e.g. 100: the second round's)",
    )
    ap.add_argument(
        "--between-targets",
        choices=["restart", "reset"],
        default="restart",
        help="vllm: restart the replicas before each target (default), or only empty their "
        "prefix caches (POST /reset_prefix_cache: cold caches in seconds, not minutes)",
    )
    ap.add_argument(
        "--kv-blocks",
        type=int,
        help="vllm: exactly this many KV cache blocks per replica (128 tokens each on the CPU "
        "build; small: the engines evict); --max-model-len must fit in one block fewer",
    )
    ap.add_argument(
        "--calibrate",
        type=float,
        metavar="X",
        help="vllm: first find the load (from each workload's first --loads value) at which "
        "least_load's TTFT p50 is X times the unloaded TTFT on this machine, by short trials, "
        "and run every target at it (the goal's regime on any machine: e.g. 4)",
    )
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--plot", type=Path, help="TTFT p50/p99 against load, PNG")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, configs)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    model_options(ap)
    args = ap.parse_args()
    args.policies = [p for p in args.policies.split(",") if p]
    default_workloads = QUICK_WORKLOADS if args.quick else list(WORKLOADS)
    args.workloads = [w for w in (args.workloads or ",".join(default_workloads)).split(",") if w]
    for w in args.workloads:
        if w not in WORKLOADS:
            sys.exit(f"no workload {w!r}: {', '.join(WORKLOADS)}")
    quick = {"warmup": 1.0, "seconds": 2.0, "drain": 4.0, "unloaded_requests": 4}
    full = {"warmup": 1.5, "seconds": 3.0, "drain": 8.0, "unloaded_requests": 8}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.routers = [r for r in args.routers.split(",") if r]
    from engines import ROUTERS

    for r in args.routers:
        if r not in ROUTERS:
            sys.exit(f"no router {r!r}: {', '.join(ROUTERS)}")
    if any(split_target(p)[0] == PRECISE for p in args.policies) and args.engine != "vllm":
        sys.exit(f"{PRECISE} needs --engine vllm (it follows real engines' KV cache events)")
    if args.traffic not in ("per-round", "same") and not re.fullmatch(r"[0-9]{1,6}", args.traffic):
        sys.exit(f"--traffic must be per-round, same or a number (0-999999), not {args.traffic!r}")
    if args.calibrate is not None:
        if args.engine != "vllm":
            sys.exit("--calibrate is for --engine vllm (the fake model's time is simulated)")
        if not 1.5 <= args.calibrate <= 100:
            sys.exit(f"--calibrate must be in [1.5, 100], not {args.calibrate:g}")
    if args.prompt_scale is None:
        args.prompt_scale = 0.25 if args.engine == "vllm" else 1.0
    if not 0 < args.prompt_scale <= 4:
        sys.exit("--prompt-scale must be in (0, 4]")
    if args.lb_workers is None and args.engine == "fake":
        args.lb_workers = 1
    if args.quick and not args.loads:
        args.loads = [f"{w}:{LOADS[w][len(LOADS[w]) // 2]:g}" for w in args.workloads]

    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C: every process started is stopped.
    def on_term(_sig: int, _frame: object) -> None:
        # Once: a second SIGTERM (`timeout` and a shell both passing one on) must not cut
        # the clean-up short and orphan the replicas.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="fleetserve-bench-llm-"))
    procs = Procs(work)
    started = time.monotonic()
    try:
        results = asyncio.run(bench(args, procs))
    finally:
        procs.stop_all()
        if args.keep:
            print(f"work folder: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.monotonic() - started
    if args.json:
        args.json.write_text(json.dumps(no_nan(results), indent=2))
    report(results)
    print(f"wall time {results['wall_s']:.0f} s")
    if args.plot:
        plot(args.plot, results["runs"], results["unloaded"])


if __name__ == "__main__":
    main()
