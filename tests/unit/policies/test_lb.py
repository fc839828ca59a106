"""Load-balancing selectors, as tables."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fleetserve.policies.factory import make_selector
from fleetserve.policies.lb import (
    HashRing,
    LeastLoad,
    PowerOfTwo,
    PrefixAffinity,
    RequestKey,
    RoundRobin,
    Sticky,
)


def test_round_robin_cycles_and_skips_excluded() -> None:
    rr = RoundRobin()
    picks = [rr.select([1, 2, 3], {}, frozenset()) for _ in range(6)]
    assert picks == [1, 2, 3, 1, 2, 3]
    assert rr.select([1, 2, 3], {}, frozenset({1})) == 2
    assert rr.select([1, 2], {}, frozenset({1, 2})) is None
    assert rr.select([], {}, frozenset()) is None


def test_round_robin_survives_a_shrinking_set() -> None:
    rr = RoundRobin()
    for _ in range(5):
        rr.select([1, 2, 3, 4, 5], {}, frozenset())
    assert rr.select([7], {}, frozenset()) == 7


@pytest.mark.parametrize(
    ("inflight", "exclude", "expected"),
    [
        ({1: 3, 2: 1, 3: 2}, frozenset(), 2),
        ({1: 3, 2: 1, 3: 2}, frozenset({2}), 3),
        ({1: 0, 2: 5}, frozenset(), 1),
        ({}, frozenset({1, 2, 3}), None),
    ],
)
def test_least_load_picks_the_fewest_in_flight(
    inflight: dict[int, int], exclude: frozenset[int], expected: int | None
) -> None:
    assert LeastLoad().select([1, 2, 3], inflight, exclude) == expected


def test_least_load_spreads_ties() -> None:
    ll = LeastLoad()
    assert {ll.select([1, 2, 3], {}, frozenset()) for _ in range(3)} == {1, 2, 3}


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown load_balancing_policy"):
        make_selector("random")


def test_instance_aware_least_load_divides_by_the_replica_weight() -> None:
    # replica 1 is an A100 (target 10 QPS), replica 2 an L4 (target 2 QPS)
    selector = make_selector("instance_aware_least_load", weights={1: 10.0, 2: 2.0})
    assert selector.select([1, 2], {1: 4, 2: 1}, frozenset()) == 1  # 0.4 < 0.5
    assert selector.select([1, 2], {1: 5, 2: 2}, frozenset()) == 1  # 0.5 < 1.0
    assert selector.select([1, 2], {1: 9, 2: 1}, frozenset()) == 2  # 0.9 > 0.5


def test_power_of_two_picks_the_less_loaded_of_two_random_replicas() -> None:
    selector = PowerOfTwo(random.Random(7))
    inflight = {1: 10, 2: 0, 3: 5}
    picks = Counter(selector.select([1, 2, 3], inflight, frozenset()) for _ in range(300))
    assert picks[1] == 0  # the busiest one never wins a pair
    assert picks[2] > picks[3] > 0
    assert selector.select([1, 2], inflight, frozenset({2})) == 1
    assert selector.select([1], inflight, frozenset({1})) is None


def test_hash_ring_moves_few_keys_when_a_replica_joins() -> None:
    ring = HashRing()
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: ring.lookup([1, 2, 3, 4], k, frozenset()) for k in keys}
    after = {k: ring.lookup([1, 2, 3, 4, 5], k, frozenset()) for k in keys}
    moved = sum(before[k] != after[k] for k in keys)
    assert all(after[k] == 5 for k in keys if before[k] != after[k])  # only to the new one
    assert 0.1 < moved / len(keys) < 0.3  # about 1/5
    assert set(before.values()) == {1, 2, 3, 4}  # every replica owns keys


@pytest.mark.parametrize(
    ("key", "inflight", "exclude", "expected"),
    [
        (RequestKey(session="alice"), {}, frozenset(), "ring"),
        (RequestKey(session="alice"), {}, frozenset({"ring"}), "other"),
        (RequestKey(), {1: 3, 2: 0}, frozenset(), 2),
    ],
)
def test_sticky(
    key: RequestKey, inflight: dict[int, int], exclude: frozenset[str], expected: object
) -> None:
    owner = HashRing().lookup([1, 2], "alice", frozenset())
    assert owner is not None
    other = 2 if owner == 1 else 1
    names = {"ring": owner, "other": other}
    excl = frozenset(names[e] for e in exclude)
    want = names.get(expected, expected) if isinstance(expected, str) else expected
    assert Sticky().select([1, 2], inflight, excl, key) == want


def test_prefix_affinity_prefers_the_owner_unless_it_is_overloaded() -> None:
    owner = HashRing().lookup([1, 2], "system prompt", frozenset())
    assert owner is not None
    other = 2 if owner == 1 else 1
    selector = PrefixAffinity(max_extra_load=4)
    key = RequestKey(prefix="system prompt")
    assert selector.select([1, 2], {owner: 3, other: 0}, frozenset(), key) == owner
    assert selector.select([1, 2], {owner: 4, other: 0}, frozenset(), key) == other
    assert selector.select([1, 2], {}, frozenset({owner}), key) == other
    assert selector.select([1, 2], {1: 1}, frozenset(), RequestKey()) == 2  # no prompt: least load


def test_round_robin_on_a_shared_counter_takes_turns_across_processes() -> None:
    """Two processes' selectors (a forked child takes from the same memfd counter) alternate
    between them as one rotation; a retry skips the replica already tried."""
    import os

    from fleetserve.lb.rotation import SharedCounter

    counter = SharedCounter.create()
    here = RoundRobin(counter.take)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other process: 50 choices, reported as bytes
        os.close(read)
        there = RoundRobin(SharedCounter(counter.fd).take)
        os.write(write, bytes(there.select((1, 2, 3), {}, frozenset()) or 0 for _ in range(50)))
        os._exit(0)
    os.close(write)
    mine = [here.select((1, 2, 3), {}, frozenset()) for _ in range(50)]
    os.waitpid(pid, 0)
    theirs = list(os.read(read, 100))
    os.close(read)
    assert sorted(mine + theirs) == [1] * 34 + [2] * 33 + [3] * 33  # 100 numbers, each once
    # the next number is 100: replica (1, 2)[100 % 2] == 1 has its turn; tried already, 2 goes
    assert here.select((1, 2), {}, frozenset({1})) == 2
    assert here.select((1, 2), {}, frozenset()) == 2  # 101
