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
