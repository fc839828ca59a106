"""Load-balancing selectors: pick one replica among the routable ones. Pure and small.

A selector sees the candidate replica ids (in a stable order), the in-flight count of each, the
ids to avoid (already tried for this request) and what the request offers for affinity (a
session key, a prompt prefix). Selectors that need randomness get an injected `random.Random`.
What a selector reads of a request, and what else the load balancer does for it, are its
capabilities (fleetserve.policies.capabilities); `make_selector` is in
fleetserve.policies.factory.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleetserve.policies.prompt import PEEK_BYTES, prompt_prefix


@dataclass(frozen=True)
class RequestKey:
    """What a request offers to affinity policies; both optional."""

    session: str | None = None  # sticky sessions: a header or cookie value
    prefix: str | None = None  # prefix affinity: the start of the prompt
    blocks: tuple[int, ...] = ()  # cache_aware: the prompt's block keys (policies.cache_aware)
    # cache_aware's precise mode: the prompt's token ids as the engine sees them, and the
    # length of the text `blocks` were cut from (to compare the two indexes' matches).
    tokens: tuple[int, ...] = ()
    text_chars: int = 0
    streams: bool = False  # the body asks for a streamed answer ("stream": true)
    # `blocks` cover only part of the prompt (the first of a batch of prompts, the start of a
    # body past cache_max_body_bytes): what the chosen replica lacks is not known.
    partial: bool = False


NO_KEY = RequestKey()


class Selector(Protocol):
    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None: ...


class RoundRobin:
    """Each replica in turn; a change of the set keeps the rotation going, no reshuffle.

    `shared`, when set, gives the position instead of this object's own: a counter that all
    the processes of one load balancer take from (fleetserve.lb.rotation), so that the turn
    is the load balancer's, not each process's."""

    def __init__(self, shared: Callable[[], int] | None = None) -> None:
        self.next_index = 0
        self.shared = shared

    def start_turn_at(self, offset: int) -> None:
        self.next_index = offset

    def share_turns(self, take: Callable[[], int]) -> None:
        self.shared = take

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        n = len(candidates)
        if n == 0:
            return None
        start = self.shared() if self.shared is not None else self.next_index
        for step in range(n):
            rid = candidates[(start + step) % n]
            if rid not in exclude:
                self.next_index = (start + step + 1) % n
                return rid
        return None


class LeastLoad:
    """The replica with the fewest in-flight requests per unit of weight; ties go round-robin
    so that an idle fleet still spreads its requests. With weights (per-replica target QPS,
    from its accelerator) this is instance_aware_least_load."""

    def __init__(self, weights: Mapping[int, float] | None = None) -> None:
        self.tie_break = 0
        self.weights: Mapping[int, float] = weights or {}
        # As RoundRobin's: the LB's processes break ties in one turn (taken on a tie only).
        self.shared: Callable[[], int] | None = None

    def start_turn_at(self, offset: int) -> None:
        self.tie_break = offset

    def share_turns(self, take: Callable[[], int]) -> None:
        self.shared = take

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        best: list[int] = []
        best_load = 0.0
        for rid in candidates:
            if rid in exclude:
                continue
            load = inflight.get(rid, 0) / self.weights.get(rid, 1.0)
            if not best or load < best_load:
                best, best_load = [rid], load
            elif load == best_load:
                best.append(rid)
        if not best:
            return None
        if len(best) > 1 and self.shared is not None:
            return best[self.shared() % len(best)]
        choice = best[self.tie_break % len(best)]
        self.tie_break += 1
        return choice


class PowerOfTwo:
    """Two replicas at random, the less loaded of the two: near least-load balance without
    herding onto one replica when load counts are stale."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        pool = [rid for rid in candidates if rid not in exclude]
        if len(pool) <= 1:
            return pool[0] if pool else None
        a, b = self.rng.sample(pool, 2)
        return a if inflight.get(a, 0) <= inflight.get(b, 0) else b


def _hash(text: str) -> int:
    # surrogatepass: a JSON body may carry lone surrogates ("\ud800"), which strict UTF-8
    # refuses; they hash like any other text.
    data = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each replica owns `vnodes` points on a ring, a key goes to the
    first point clockwise. Adding or removing a replica moves only about 1/N of the keys."""

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._members: tuple[int, ...] = ()
        self._points: list[int] = []
        self._owners: list[int] = []

    def _rebuild(self, members: Sequence[int]) -> None:
        ring = sorted((_hash(f"{rid}#{v}"), rid) for rid in members for v in range(self.vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [rid for _, rid in ring]
        self._members = tuple(members)

    def lookup(self, members: Sequence[int], key: str, exclude: frozenset[int]) -> int | None:
        if tuple(members) != self._members:
            self._rebuild(members)
        if not self._points:
            return None
        start = bisect.bisect(self._points, _hash(key))
        for i in range(len(self._points)):
            owner = self._owners[(start + i) % len(self._points)]
            if owner not in exclude:
                return owner
        return None


class Sticky:
    """Requests with the same session key go to the same replica (consistent hashing);
    requests without a key are spread by least load. The key is the `session_header`'s value,
    else the `session_cookie`'s (ReadsHeaders)."""

    def __init__(
        self, session_header: str | None = "X-Session-Id", session_cookie: str | None = None
    ) -> None:
        self.ring = HashRing()
        self.fallback = LeastLoad()
        self._header = session_header.lower().encode() if session_header else None
        self._cookie = (
            re.compile(rb"(?:^|;\s*)" + re.escape(session_cookie.encode()) + rb"=([^;]*)")
            if session_cookie
            else None
        )

    def header_key(self, headers: Mapping[bytes, bytes]) -> RequestKey:
        session = headers.get(self._header) if self._header is not None else None
        if session is None and self._cookie is not None:
            m = self._cookie.search(headers.get(b"cookie", b""))
            session = m.group(1) if m else None
        return RequestKey(session=session.decode(errors="replace") if session else None)

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        if key.session is None:
            return self.fallback.select(candidates, inflight, exclude)
        return self.ring.lookup(candidates, key.session, exclude)


class PrefixAffinity:
    """Requests whose prompts share a prefix go to the same replica (its KV cache likely holds
    that prefix), unless that replica has `max_extra_load` more requests in flight than the
    least loaded one: then least load wins. The prefix is the prompt's first `prefix_chars`
    characters, from the body's first PEEK_BYTES (ReadsBody)."""

    DEFAULT_MAX_EXTRA_LOAD = 4
    body_limit = PEEK_BYTES

    def __init__(
        self, max_extra_load: int = DEFAULT_MAX_EXTRA_LOAD, prefix_chars: int = 256
    ) -> None:
        self.ring = HashRing()
        self.fallback = LeastLoad()
        self.max_extra_load = max_extra_load
        self.prefix_chars = prefix_chars

    def body_key(self, body: bytes, complete: bool) -> RequestKey:
        return RequestKey(prefix=prompt_prefix(body[:PEEK_BYTES], self.prefix_chars))

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        least = self.fallback.select(candidates, inflight, exclude)
        if key.prefix is None or least is None:
            return least
        preferred = self.ring.lookup(candidates, key.prefix, exclude)
        if preferred is None:
            return least
        if inflight.get(preferred, 0) - inflight.get(least, 0) >= self.max_extra_load:
            return least
        return preferred
