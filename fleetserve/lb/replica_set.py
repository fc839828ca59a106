"""The routable replicas as the load balancer knows them, their in-flight counts and the
queue of requests waiting for the first READY replica."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from fleetserve.core.types import Endpoint
from fleetserve.lb.messages import ReplicaPush
from fleetserve.policies.capabilities import Capabilities, capabilities
from fleetserve.policies.lb import NO_KEY, LeastLoad, RequestKey, Selector

log = logging.getLogger("fleetserve.lb")


# A routable replica: the same record the controller's reconciler makes.
Upstream = Endpoint


def _no_share() -> None:
    """ReplicaSet.on_count of a process that shares no index (one worker, another policy)."""


class ReplicaSet:
    """`selector` chooses among the replicas; its capabilities (`caps`) are found when it is
    installed, never per request."""

    def __init__(self, selector: Selector, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.inflight: dict[int, int] = {}
        # WeighsPrefill: prompt blocks sent to each replica and not yet answered (exchange.py)
        self.prefilling: dict[int, int] = {}
        self.last_charge = 0  # the blocks the last pick's replica has to prefill for it
        self.last_missing: int | None = None  # ... of the prompt, streamed or not (None: none)
        # Called after `inflight` or `prefilling` changed (exchange.py): the index share's wake
        # (fleetserve.lb.index_share), so that it sends counts when they change, not on a timer;
        # nothing without one.
        self.on_count: Callable[[], None] = _no_share
        self.selector = selector
        self.monotonic = monotonic  # the load balancer's clock (fleetserve.core.clock)
        self.upstreams: dict[int, Upstream] = {}
        self.order: tuple[int, ...] = ()
        self.weights: dict[int, float] = {}  # shared with a weighted selector
        self.generation = 0  # bumped by each push from the controller
        self.canary: tuple[int, int] | None = None  # (new version, percent of requests)
        self._sides: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.rng = random.Random()
        self._ready = asyncio.Event()
        self._discarded: set[int] = set()  # out until the next push, which may drop them
        self._fallback = LeastLoad()  # when the policy fails on a request
        self.policy_errors = 0
        self._policy_error_logged = -60.0

    @property
    def selector(self) -> Selector:
        return self._selector

    @selector.setter
    def selector(self, selector: Selector) -> None:
        self._selector = selector
        self.caps: Capabilities = capabilities(selector)
        if self.caps.weighs_prefill is not None:
            self.caps.weighs_prefill.prefilling = self.prefilling

    def replace(
        self, upstreams: list[Upstream], canary: tuple[int, int] | None = None
    ) -> tuple[set[int], set[int]]:
        """Install a new set; returns (added ids, removed ids). In-flight counts of replicas
        that stay are kept; requests still running on a removed replica finish normally."""
        new: dict[int, Upstream] = {u.replica_id: u for u in upstreams}
        added = set(new) - set(self.upstreams)
        removed = set(self.upstreams) - set(new)
        forget = self.caps.forget  # (a cache-aware policy: their caches are gone)
        if forget is not None:
            for rid in (removed | self._discarded) - set(new):
                forget(rid)
        self._discarded.clear()
        self.upstreams = new
        self.order = tuple(sorted(new))
        self.canary = canary
        self._split()
        self.weights.clear()
        self.weights.update({u.replica_id: u.weight for u in upstreams})
        self.generation += 1
        self._signal()
        return added, removed

    def apply(self, push: ReplicaPush) -> tuple[set[int], set[int]]:
        """Install the set that the controller pushed (see `replace`)."""
        canary = push.canary
        return self.replace(
            [r.endpoint() for r in push.replicas],
            (canary.version, canary.percent) if canary else None,
        )

    def _signal(self) -> None:
        if self.upstreams:
            self._ready.set()
        else:
            self._ready.clear()

    async def wait_ready(self, seconds: float) -> bool:
        """Wait up to `seconds` for a routable replica; True if there is one."""
        if self.upstreams:
            return True
        try:
            async with asyncio.timeout(seconds):
                await self._ready.wait()
        except TimeoutError:
            return False
        return bool(self.upstreams)

    def _split(self) -> None:
        """The candidates of each side of a canary split (none without a canary)."""
        if self.canary is None:
            self._sides = None
            return
        version = self.canary[0]
        new = tuple(r for r in self.order if self.upstreams[r].version == version)
        old = tuple(r for r in self.order if self.upstreams[r].version != version)
        self._sides = (new, old) if new and old else None

    def pick(self, exclude: frozenset[int], key: RequestKey = NO_KEY) -> Upstream | None:
        """A replica for a request (None: none left). A policy that fails on a request (a bug
        that some input reaches) never fails the request: it is routed by least load, and
        the failure is logged (once a minute) and counted (`policy_errors`)."""
        self.last_charge = 0
        self.last_missing = None
        try:
            picked = self._pick(exclude, key)
            weighs = self.caps.weighs_prefill
            if weighs is not None and picked is not None:
                self.last_charge = weighs.last_uncached
                self.last_missing = weighs.last_missing
            return picked
        except Exception:
            self.policy_failed(f"the {type(self._selector).__name__} policy failed on a request")
            rid = self._fallback.select(self.order, self.inflight, exclude, NO_KEY)
            return None if rid is None else self.upstreams[rid]

    def policy_failed(self, what: str) -> None:
        """Count a policy's failure on a request (its key, or its choice) and log it with its
        traceback, at most once a minute: a client may repeat the input that reaches it."""
        self.policy_errors += 1
        now = self.monotonic()
        if now - self._policy_error_logged >= 60:
            self._policy_error_logged = now
            log.exception("%s (routed by least load; %d so far)", what, self.policy_errors)

    def _pick(self, exclude: frozenset[int], key: RequestKey) -> Upstream | None:
        candidates = self.order
        if self._sides is not None and self.canary is not None:
            # A canary: its share of requests goes to the new version, the rest to the old.
            new, old = self._sides
            first, second = (new, old) if self.rng.random() * 100 < self.canary[1] else (old, new)
            rid = self._selector.select(first, self.inflight, exclude, key)
            if rid is None:
                rid = self._selector.select(second, self.inflight, exclude, key)
            return None if rid is None else self.upstreams[rid]
        rid = self._selector.select(candidates, self.inflight, exclude, key)
        return None if rid is None else self.upstreams[rid]

    def discard(self, replica_id: int) -> None:
        """Stop routing to a replica that refused a connection, until the next push."""
        if self.upstreams.pop(replica_id, None) is not None:
            self._discarded.add(replica_id)
            self.order = tuple(r for r in self.order if r != replica_id)
            self._split()
            self._signal()
