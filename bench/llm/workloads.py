"""The benchmark's workloads: generators of sessions (one client's requests) with their
arrival times, deterministic from a seed.

chat     multi-turn conversations: a system prompt (one of a few apps'), then turns whose user
         messages extend the conversation's own history; the client appends the reply it
         actually received before the next turn. Conversations arrive as a Poisson process
         (`rate` per second); a turn follows the previous reply after an exponential think time.
shared   tenants, each with a long system prompt shared by all of its requests; single-turn.
skewed   90% of the prompts start with one hot prefix, the rest are random; single-turn.
unique   no sharing at all (the control); single-turn.

Sizes are in tokens of 4 characters (bench/llm/model.py). Two seeds: `seed` makes the world
(the apps' and tenants' system prompts, the hot prefix), `traffic` the sessions; the driver
keeps the world and changes the traffic from one load to the next.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

CHARS_PER_TOKEN = 4
_WORDS = (
    "alpha beta gamma delta epsilon model server replica fleet cache token prompt batch queue "
    "latency request stream cluster region policy balance weight router memory block prefix "
    "hash evict reply answer question summary report table figure value system user tenant "
    "account invoice order shipment product review rating support ticket error warning debug "
    "north south east west river mountain forest ocean city garden window bridge market music"
)
WORDS = _WORDS.split()


@dataclass(frozen=True)
class Turn:
    user: str  # the user message (chat) or the whole prompt (completions)
    max_tokens: int
    think_s: float = 0.0  # after the previous reply (0 for the first turn)


@dataclass(frozen=True)
class Session:
    start_s: float  # when its first request is sent, from the start of the run
    endpoint: Literal["chat", "completions"]
    system: str | None
    turns: tuple[Turn, ...]
    key: str = ""  # what it belongs to (app, tenant, hot/cold), for reports


def request_body(
    session: Session, history: list[dict[str, str]], turn: Turn, stream: bool = True
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of `turn`, after `history` (the conversation's earlier messages)."""
    if session.endpoint == "completions":
        return "/v1/completions", {
            "model": "fake",
            "prompt": turn.user,
            "max_tokens": turn.max_tokens,
            "stream": stream,
        }
    system = [{"role": "system", "content": session.system}] if session.system else []
    return "/v1/chat/completions", {
        "model": "fake",
        "messages": [*system, *history, {"role": "user", "content": turn.user}],
        "max_tokens": turn.max_tokens,
        "stream": stream,
    }


def text(rng: random.Random, tokens: int, scale: float = 1.0) -> str:
    """Random words, exactly `tokens` tokens long (times `scale`: the workloads' prompts
    scaled down for slow engines, e.g. vLLM on CPU)."""
    chars = max(1, round(tokens * scale)) * CHARS_PER_TOKEN
    out = " ".join(rng.choices(WORDS, k=chars // 5 + 2))
    while len(out) < chars:
        out += " " + rng.choice(WORDS)
    return out[:chars]


def lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, median * math.exp(sigma * rng.gauss()))))


def output_tokens(rng: random.Random) -> int:
    return lognormal(rng, 40, 0.7, 10, 200)


def arrivals(rng: random.Random, rate: float, seconds: float) -> Iterator[float]:
    """Poisson arrivals at `rate` per second within [0, seconds)."""
    t = 0.0
    while True:
        t += rng.expovariate(1.0) / rate
        if t >= seconds:
            return
        yield t


def _bounded(sessions: Iterator[Session], max_requests: int) -> Iterator[Session]:
    left = max_requests
    for s in sessions:
        if left <= 0:
            return
        if len(s.turns) > left:
            s = Session(s.start_s, s.endpoint, s.system, s.turns[:left], s.key)
        left -= len(s.turns)
        yield s


def _rngs(name: str, seed: int, traffic: int) -> tuple[random.Random, random.Random, random.Random]:
    """(world, sessions, arrivals): independent streams, so that the world is the same for
    every traffic and the sessions the same at every rate."""
    return (
        random.Random(f"{name}:{seed}"),
        random.Random(f"{name}:{seed}:{traffic}"),
        random.Random(f"{name}:{seed}:{traffic}:arrivals"),
    )


def chat(
    rate: float,
    seed: int,
    seconds: float,
    max_requests: int,
    traffic: int = 0,
    apps: int = 8,
    think_s: float = 0.5,
    *,
    scale: float = 1.0,
) -> Iterator[Session]:
    """`rate` new conversations per second, 2-5 turns each, on one of `apps` system prompts."""
    world, rng, times = _rngs("chat", seed, traffic)
    systems = [text(world, lognormal(world, 300, 0.5, 100, 800), scale) for _ in range(apps)]

    def gen() -> Iterator[Session]:
        for t in arrivals(times, rate, seconds):
            app = rng.randrange(apps)
            turns = tuple(
                Turn(
                    user=text(rng, lognormal(rng, 300, 0.8, 30, 1500), scale),
                    max_tokens=output_tokens(rng),
                    think_s=rng.expovariate(1 / think_s) if i else 0.0,
                )
                for i in range(rng.randint(2, 5))
            )
            yield Session(t, "chat", systems[app], turns, f"app{app}")

    return _bounded(gen(), max_requests)


def shared(
    rate: float,
    seed: int,
    seconds: float,
    max_requests: int,
    traffic: int = 0,
    tenants: int = 8,
    *,
    scale: float = 1.0,
) -> Iterator[Session]:
    """Tenants chosen uniformly; each has a system prompt of 1,000-3,500 tokens."""
    world, rng, times = _rngs("shared", seed, traffic)
    systems = [text(world, lognormal(world, 2000, 0.4, 1000, 3500), scale) for _ in range(tenants)]

    def gen() -> Iterator[Session]:
        for t in arrivals(times, rate, seconds):
            tenant = rng.randrange(tenants)
            turn = Turn(text(rng, lognormal(rng, 150, 0.7, 30, 600), scale), output_tokens(rng))
            yield Session(t, "chat", systems[tenant], (turn,), f"tenant{tenant}")

    return _bounded(gen(), max_requests)


def skewed(
    rate: float,
    seed: int,
    seconds: float,
    max_requests: int,
    traffic: int = 0,
    hot: float = 0.9,
    *,
    scale: float = 1.0,
) -> Iterator[Session]:
    """`hot` of the prompts: one 1,500-token prefix and a random suffix; the rest random."""
    world, rng, times = _rngs("skewed", seed, traffic)
    prefix = text(world, 1500, scale)

    def gen() -> Iterator[Session]:
        for t in arrivals(times, rate, seconds):
            if rng.random() < hot:
                prompt = prefix + " " + text(rng, lognormal(rng, 200, 0.6, 50, 800), scale)
                key = "hot"
            else:
                prompt = text(rng, lognormal(rng, 1200, 0.5, 300, 3000), scale)
                key = "cold"
            yield Session(t, "completions", None, (Turn(prompt, output_tokens(rng)),), key)

    return _bounded(gen(), max_requests)


def unique(
    rate: float,
    seed: int,
    seconds: float,
    max_requests: int,
    traffic: int = 0,
    *,
    scale: float = 1.0,
) -> Iterator[Session]:
    """Random prompts of 300-3,000 tokens: nothing to share."""
    _, rng, times = _rngs("unique", seed, traffic)

    def gen() -> Iterator[Session]:
        for t in arrivals(times, rate, seconds):
            prompt = text(rng, lognormal(rng, 1200, 0.5, 300, 3000), scale)
            yield Session(t, "completions", None, (Turn(prompt, output_tokens(rng)),), "unique")

    return _bounded(gen(), max_requests)


class Generator(Protocol):
    def __call__(
        self,
        rate: float,
        seed: int,
        seconds: float,
        max_requests: int,
        traffic: int = 0,
        *,
        scale: float = 1.0,
    ) -> Iterator[Session]: ...


WORKLOADS: dict[str, Generator] = {
    "chat": chat,
    "shared": shared,
    "skewed": skewed,
    "unique": unique,
}
UNITS = {"chat": "conversations/s", "shared": "req/s", "skewed": "req/s", "unique": "req/s"}
