"""Load-balancing selectors: pick one replica among the routable ones. Pure and small.

A selector sees the candidate replica ids (in a stable order), the in-flight count of each and
the ids to avoid (already tried for this request); it keeps its own tiny state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class Selector(Protocol):
    def select(
        self, candidates: Sequence[int], inflight: Mapping[int, int], exclude: frozenset[int]
    ) -> int | None: ...


class RoundRobin:
    """Each replica in turn; a change of the set keeps the rotation going, no reshuffle."""

    def __init__(self) -> None:
        self.next_index = 0

    def select(
        self, candidates: Sequence[int], inflight: Mapping[int, int], exclude: frozenset[int]
    ) -> int | None:
        n = len(candidates)
        for step in range(n):
            rid = candidates[(self.next_index + step) % n]
            if rid not in exclude:
                self.next_index = (self.next_index + step + 1) % n
                return rid
        return None


class LeastLoad:
    """The replica with the fewest in-flight requests; ties go round-robin so that an idle
    fleet still spreads its requests."""

    def __init__(self) -> None:
        self.tie_break = 0

    def select(
        self, candidates: Sequence[int], inflight: Mapping[int, int], exclude: frozenset[int]
    ) -> int | None:
        best: list[int] = []
        best_load = -1
        for rid in candidates:
            if rid in exclude:
                continue
            load = inflight.get(rid, 0)
            if not best or load < best_load:
                best, best_load = [rid], load
            elif load == best_load:
                best.append(rid)
        if not best:
            return None
        choice = best[self.tie_break % len(best)]
        self.tie_break += 1
        return choice


def make_selector(policy: str) -> Selector:
    """The selector for a `load_balancing_policy` name.

    instance_aware_least_load falls back to least_load until per-accelerator weights arrive
    with the load balancer issue.
    """
    if policy == "round_robin":
        return RoundRobin()
    if policy in ("least_load", "instance_aware_least_load"):
        return LeastLoad()
    raise ValueError(f"unknown load_balancing_policy {policy!r}")
