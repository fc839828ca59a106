"""Load-balancing selectors: pick one replica among the routable ones. Pure and small.

A selector sees the candidate replica ids (in a stable order), the in-flight count of each, the
ids to avoid (already tried for this request) and what the request offers for affinity (a
session key, a prompt prefix). Selectors that need randomness get an injected `random.Random`.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, get_args

from fleetserve.spec.models import LbPolicy

POLICIES: tuple[str, ...] = get_args(LbPolicy)  # the names the YAML accepts


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
    requests without a key are spread by least load."""

    def __init__(self) -> None:
        self.ring = HashRing()
        self.fallback = LeastLoad()

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
    least loaded one: then least load wins."""

    DEFAULT_MAX_EXTRA_LOAD = 4

    def __init__(self, max_extra_load: int = DEFAULT_MAX_EXTRA_LOAD) -> None:
        self.ring = HashRing()
        self.fallback = LeastLoad()
        self.max_extra_load = max_extra_load

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


def make_selector(
    policy: str,
    weights: Mapping[int, float] | None = None,
    rng: random.Random | None = None,
    max_extra_load: int | None = None,
    cache_block_chars: int = 256,
    cache_blocks: int = 2048,
) -> Selector:
    """The selector for a `load_balancing_policy` name."""
    if policy == "round_robin":
        return RoundRobin()
    if policy == "least_load":
        return LeastLoad()
    if policy == "instance_aware_least_load":
        return LeastLoad(weights)
    if policy == "power_of_two":
        return PowerOfTwo(rng)
    if policy == "sticky":
        return Sticky()
    if policy == "prefix_affinity":
        return PrefixAffinity(max_extra_load or PrefixAffinity.DEFAULT_MAX_EXTRA_LOAD)
    if policy == "cache_aware":
        from fleetserve.policies.cache_aware import CacheAware  # it builds on this module

        return CacheAware(
            max_extra_load or CacheAware.DEFAULT_MAX_EXTRA_LOAD, cache_block_chars, cache_blocks
        )
    raise ValueError(f"unknown load_balancing_policy {policy!r}; use one of {', '.join(POLICIES)}")
