"""cache_aware's precise mode (fleetserve.policies.cache_aware_precise): live replicas are
matched on what their engines hold, the others on the approximate index."""

from __future__ import annotations

import json

from fleetserve.policies.cache_aware import block_keys
from fleetserve.policies.cache_aware_precise import PreciseCacheAware
from fleetserve.policies.kv_index import BlockRemoved, BlockStored, KvIndex, Trust
from fleetserve.policies.lb import RequestKey

TEXT = "x" * 1024  # 4 approximate blocks of 256 characters
TOKENS = tuple(range(256))  # 16 engine blocks of 16 tokens (4 characters a token)


def key() -> RequestKey:
    return RequestKey(
        prefix=TEXT[:256], blocks=block_keys(TEXT, 256), tokens=TOKENS, text_chars=1024
    )


class NoTokens:
    """The exchange's tokenizer hook; these tests give the keys' tokens themselves."""

    def inline(self, body: bytes) -> bool:
        return True

    def tokens(self, body: bytes) -> tuple[int, ...]:
        return ()

    async def tokens_off_loop(self, body: bytes) -> tuple[int, ...]:
        return ()


def policy() -> tuple[PreciseCacheAware, KvIndex]:
    kv = KvIndex()
    return PreciseCacheAware(kv, NoTokens()), kv


def store(kv: KvIndex, replica: int, blocks: int) -> None:
    hashes = tuple(range(replica * 100, replica * 100 + blocks))
    kv.apply(replica, [BlockStored(hashes, None, TOKENS[: blocks * 16], 16)])


def test_the_engine_that_holds_more_wins_over_the_lbs_memory() -> None:
    p, kv = policy()
    assert p.select([1, 2], {}, frozenset(), key()) in (1, 2)  # recorded in the approximate index
    first = p.index.match(key().blocks, [1, 2])[1][0]
    other = 2 if first == 1 else 1
    kv.set_trust(1, Trust.LIVE)
    kv.set_trust(2, Trust.LIVE)
    # The engine of `first` evicted it all; `other` holds the first 8 blocks (128 tokens).
    store(kv, other, 8)
    assert p.select([1, 2], {}, frozenset(), key()) == other
    kv.apply(other, [BlockRemoved(tuple(range(other * 100, other * 100 + 8)))])
    store(kv, first, 2)
    assert p.select([1, 2], {}, frozenset(), key()) == first


def test_a_replica_not_followed_is_matched_on_the_approximate_index() -> None:
    p, kv = policy()
    chosen = p.select([1, 2], {}, frozenset(), key())
    assert chosen is not None
    live = 2 if chosen == 1 else 1
    kv.set_trust(live, Trust.LIVE)
    store(kv, live, 2)  # 32 tokens: less than the approximate 4 x 64 of `chosen`
    assert p.select([1, 2], {}, frozenset(), key()) == chosen
    store(kv, live, 16)  # all 256 tokens: as much; ties go to the less loaded
    assert p.select([1, 2], {chosen: 1}, frozenset(), key()) == live


def test_forget_forgets_both_indexes() -> None:
    p, kv = policy()
    kv.set_trust(1, Trust.LIVE)
    store(kv, 1, 4)
    p.forget(1)
    assert kv.trusts() == {}


def test_an_engine_match_never_counts_more_blocks_than_the_prompt_has() -> None:
    """The engine's tokens include the chat template's: a replica holding all of them matches
    the prompt's 4 approximate blocks, not more (a cost below zero, a hit rate past 100%)."""
    p, kv = policy()
    kv.set_trust(1, Trust.LIVE)
    kv.set_trust(2, Trust.LIVE)
    store(kv, 1, 16)  # all 256 tokens: 4.0 blocks at 64 tokens a block
    text = TEXT + "y" * 76  # a partial fifth block: 4 keys, 1,100 characters
    longer = RequestKey(
        prefix=text[:256], blocks=block_keys(text, 256), tokens=TOKENS, text_chars=len(text)
    )  # 256 tokens at 59.6 a block: 4.3 blocks' worth of tokens for 4 keys
    p.blended.request = longer
    try:
        assert p.blended.depths(longer.blocks, [1, 2]) == {1: 4, 2: 0}
        assert p.blended.match(longer.blocks, [1, 2]) == (4, [1])
    finally:
        p.blended.request = None


def test_the_choice_log_does_not_count_the_precise_match_twice() -> None:
    """`log_choices` reads each replica's match again for its line; the precise index's
    report of its match (the LB's fleetserve_lb_precise_* counters) still comes once a
    choice."""
    reports: dict[bool, list[tuple[int, int]]] = {}
    for logged in (False, True):
        p, kv = policy()
        kv.set_trust(1, Trust.LIVE)
        store(kv, 1, 8)
        told: list[tuple[int, int]] = []
        p.blended.on_precise = lambda matched, of, told=told: told.append((matched, of))
        lines: list[dict[str, object]] = []
        if logged:
            p.explain = lines.append
        for _ in range(3):
            assert p.select([1, 2], {}, frozenset(), key()) == 1
        assert len(lines) == (3 if logged else 0)
        reports[logged] = told
    assert reports[True] == reports[False] and len(reports[True]) == 3


def test_the_owner_choices_place_a_shared_prefix_by_its_keeper_in_the_precise_mode_too() -> None:
    """(Without tokens the precise mode matches on its approximate index, as here.)"""
    body = json.dumps({"messages": [{"role": "system", "content": "s" * 600}], "stream": True})
    for choice in ("owner", "cost_owner"):
        sel = PreciseCacheAware(KvIndex(), NoTokens(), choice=choice)
        key = sel.body_key(body.encode(), True)
        sel.index.record(3, key.blocks)
        sel.index.record(4, key.blocks)
        picks = {sel.select([3, 4], {3: busy, 4: 2 - busy}, frozenset(), key) for busy in (0, 2)}
        assert len(picks) == 1 and picks <= {3, 4}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def timed_policy() -> tuple[PreciseCacheAware, KvIndex, Clock]:
    clock = Clock()
    kv = KvIndex()
    p = PreciseCacheAware(kv, NoTokens(), clock=clock)
    kv.set_trust(1, Trust.LIVE)
    kv.set_trust(2, Trust.LIVE)
    return p, kv, clock


def test_a_prompt_still_queued_at_a_replica_counts_as_soon_held_there() -> None:
    """What an engine holds does not show a prompt sent to it and not yet prefilled: while the
    replica still has prompt blocks to prefill, what was sent to it within twice its recent
    time to a first byte counts as held there, so the next request sharing that prefix
    follows it (the engine alone would say nobody holds it and send it to the emptier
    replica, to prefill it a second time)."""
    p, kv, clock = timed_policy()
    p.first_byte(1, 2.0)  # replica 1 answers its first byte after ~2 s: a 4 s window
    p.first_byte(2, 2.0)
    p.index.record(1, key().blocks)  # sent to 1; neither engine has stored any of it yet
    p.prefilling[1] = 4  # ... and 1 still has its 4 blocks to prefill
    inflight = {1: 1, 2: 0}
    # cost: 1 holds all 4 blocks soon, its queue 0.25 x (4 + 1); 2 would prefill all 4
    assert p.select([1, 2], inflight, frozenset(), key()) == 1
    # Past the window the send no longer counts (it would have been prefilled by now, and
    # the engine's events say what stayed of it): the engines hold nothing, 2 costs less.
    clock.now += 4.5
    p.index.record(1, ())  # (nothing new recorded)
    assert p.select([1, 2], inflight, frozenset(), key()) == 2
    # Within the window, but nothing left to prefill at 1: the engine's events are the truth.
    clock.now += 10
    p.index.record(1, key().blocks)
    p.prefilling.clear()
    p.peer_prefilling[2] = 1  # (2's backlog is not 1's)
    p.blended.request = key()
    try:
        assert p.blended.depths(key().blocks, [1, 2])[1] == 0
        p.peer_prefilling[1] = 3  # another LB process's request still prefills there
        assert p.blended.depths(key().blocks, [1, 2])[1] == 4
        # A replica whose first bytes were never timed has no window.
        p.blended.wait.pop(1)
        assert p.blended.depths(key().blocks, [1, 2])[1] == 0
    finally:
        p.blended.request = None
    store(kv, 1, 8)  # the engine holds 128 of the 256 tokens: 2 blocks, whatever was sent
    p.blended.request = key()
    try:
        assert p.blended.depths(key().blocks, [1, 2])[1] == 2
    finally:
        p.blended.request = None


def test_the_pending_window_follows_the_replicas_first_byte_times() -> None:
    p, _, clock = timed_policy()
    p.first_byte(1, 10.0)
    p.first_byte(1, 0.0)  # a running mean: 8 s after these two, a 16 s window
    assert p.blended.wait[1] == 8.0
    p.index.record(1, key().blocks)
    p.prefilling[1] = 1
    p.blended.request = key()
    try:
        clock.now += 15
        assert p.blended.depths(key().blocks, [1, 2])[1] == 4
        clock.now += 2
        assert p.blended.depths(key().blocks, [1, 2])[1] == 0
        p.first_byte(1, 1000.0)  # never more than 30 s
        p.index.record(1, key().blocks)
        clock.now += 31
        assert p.blended.depths(key().blocks, [1, 2])[1] == 0
    finally:
        p.blended.request = None
    p.forget(1)
    assert 1 not in p.blended.wait


def test_the_precise_metric_counts_what_the_engines_hold_not_what_is_pending() -> None:
    """fleetserve_lb_precise_prompt_tokens_total{kind="matched"} is what the events promised:
    a match that is only pending at a replica is not in it."""
    p, kv, _ = timed_policy()
    told: list[tuple[int, int]] = []
    p.blended.on_precise = lambda matched, of: told.append((matched, of))
    p.first_byte(1, 2.0)
    p.index.record(1, key().blocks)
    p.prefilling[1] = 4
    store(kv, 2, 2)  # 2's engine holds 32 tokens
    assert p.select([1, 2], {1: 0, 2: 0}, frozenset(), key()) == 1  # all 4 blocks pending at 1
    assert told == [(32, 256)]
