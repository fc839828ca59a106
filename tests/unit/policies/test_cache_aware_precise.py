"""cache_aware's precise mode (fleetserve.policies.cache_aware_precise): live replicas are
matched on what their engines hold, the others on the approximate index."""

from __future__ import annotations

import json
from dataclasses import replace

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


def live_policy() -> tuple[PreciseCacheAware, KvIndex]:
    p, kv = policy()
    kv.set_trust(1, Trust.LIVE)
    kv.set_trust(2, Trust.LIVE)
    return p, kv


def streamed() -> RequestKey:
    return replace(key(), streams=True)


def depth_at(p: PreciseCacheAware, replica: int) -> float:
    p.blended.request = streamed()
    try:
        return p.blended.depths(streamed().blocks, [1, 2])[replica]
    finally:
        p.blended.request = None


def test_a_prompt_sent_and_not_yet_answered_counts_as_held_by_its_replica() -> None:
    """An engine stores a prompt's blocks when it prefills it, behind its queue: until the
    request's first byte the events cannot show it. A live replica is credited with what was
    sent to it and not yet answered, so the next request sharing that prefix follows it
    (the engines alone say nobody holds it: the emptier replica would prefill it again)."""
    p, kv = live_policy()
    inflight = {1: 1, 2: 0}
    assert p.select([1, 2], inflight, frozenset(), streamed()) == 2  # nobody holds it: 2
    first = p.sending(1, streamed())  # (the load balancer's TracksSends) sent to 1, no token
    p.prefilling[1] = 4  # ... so 1 still has its 4 blocks to prefill
    # cost: 1 soon holds all 4 blocks, its queue 0.25 x (4 + 1) = 1.25; 2 would prefill 4
    assert p.select([1, 2], inflight, frozenset(), streamed()) == 1
    assert depth_at(p, 1) == 4
    # Two requests sharing the prompt were sent: the credit lasts until both are answered.
    second = p.sending(1, streamed())
    p.answered(1, streamed(), second)
    assert depth_at(p, 1) == 4
    p.answered(1, streamed(), first)  # the first byte: the engine's events say what it holds
    assert depth_at(p, 1) == 0
    assert p.select([1, 2], inflight, frozenset(), streamed()) == 2
    # The larger of the two: the engine holds 8 of the 16 engine blocks (2 of 4), a shorter
    # prompt with the same start is pending.
    store(kv, 1, 8)
    assert depth_at(p, 1) == 2
    short = "x" * 256
    p.blended.sending(1, block_keys(short, 256))  # 1 block of the prefix
    assert depth_at(p, 1) == 2
    p.blended.sending(1, key().blocks)
    assert depth_at(p, 1) == 4


def test_only_streamed_requests_are_credited_and_a_forgotten_replica_keeps_nothing() -> None:
    """A whole (not streamed) answer's first byte comes after its decoding, long after its
    prefill: not credited (nothing to answer). A replica that left keeps no credit, and an
    answer that comes after it left (its request still running) takes nothing of the credit
    of the requests sent to it once it is back."""
    p, _ = live_policy()
    whole = key()
    assert not whole.streams
    assert p.sending(1, whole) is None
    assert depth_at(p, 1) == 0
    before = p.sending(1, streamed())
    assert depth_at(p, 1) == 4
    p.forget(1)
    assert depth_at(p, 1) == 0
    p.precise.set_trust(1, Trust.LIVE)  # back (a READY flap keeps its id)
    after = p.sending(1, streamed())
    p.answered(1, streamed(), before)  # the request sent before it left had its first byte
    assert depth_at(p, 1) == 4
    p.answered(1, streamed(), after)
    assert depth_at(p, 1) == 0 and p.blended._sent == {}


def test_the_other_processes_pending_prompts_are_credited_too() -> None:
    """Each LB process tells the others its pending set per replica (fleetserve.lb.
    index_share): a prompt another process sent is credited as one of this process's own, a
    later set replaces that process's earlier one, and a replica that leaves takes it along."""
    p, _ = live_policy()
    p.take_peer_sent(5, {1: set(key().blocks[:3])})
    assert depth_at(p, 1) == 3
    p.take_peer_sent(6, {1: set(key().blocks)})
    assert depth_at(p, 1) == 4
    p.take_peer_sent(6, {})
    assert depth_at(p, 1) == 3
    own = p.sending(1, streamed())
    assert depth_at(p, 1) == 4
    p.answered(1, streamed(), own)
    p.forget(1)
    p.precise.set_trust(1, Trust.LIVE)
    assert depth_at(p, 1) == 0


def test_the_pending_set_shared_with_the_others_is_cut_evenly_and_by_prefix() -> None:
    """At most `most` keys go to the other processes: shared among the replicas (one with a
    long queue does not leave the others out), each replica's list in an order where a key
    follows its prefix's keys, so a cut list still matches its prompts' starts."""
    p, _ = live_policy()
    long_queue = [tuple(range(r * 100, r * 100 + 10)) for r in range(40)]  # 400 keys at 1
    for keys in long_queue:
        p.blended.sending(1, keys)
    p.blended.sending(2, (7, 8, 9))
    shared = dict(p.blended.sent_keys(100))
    assert shared[2] == [7, 8, 9] and len(shared[1]) == 97
    # A prompt sent twice and one sharing its start: the shared keys first, whatever the order
    # they were sent in; a list cut anywhere holds only whole prefixes.
    q, _ = live_policy()
    q.blended.sending(1, (1, 2, 3))
    q.blended.sending(1, (1, 2, 4))
    q.blended.sending(1, (1, 5))
    listed = dict(q.blended.sent_keys(100))[1]
    for n in range(1, len(listed) + 1):
        cut = set(dict(q.blended.sent_keys(n))[1])
        for chain in ((1, 2, 3), (1, 2, 4), (1, 5)):
            held = [k in cut for k in chain]
            assert held == sorted(held, reverse=True), (n, chain, cut)


def test_the_precise_metric_counts_what_the_engines_hold_not_what_is_pending() -> None:
    """fleetserve_lb_precise_prompt_tokens_total{kind="matched"} is what the engines' events
    promised: a prompt only sent to a replica is not in it."""
    p, kv = live_policy()
    told: list[tuple[int, int]] = []
    p.blended.on_precise = lambda matched, of: told.append((matched, of))
    assert p.sending(1, streamed()) is not None
    p.prefilling[1] = 4
    store(kv, 2, 2)  # 2's engine holds 32 tokens
    assert p.select([1, 2], {1: 0, 2: 0}, frozenset(), streamed()) == 1  # all 4 pending at 1
    assert told == [(32, 256)]
    for choice in ("match", "owner"):  # (the choices that read `match`, not `depths`)
        kv = KvIndex()
        kv.set_trust(1, Trust.LIVE)
        kv.set_trust(2, Trust.LIVE)
        q = PreciseCacheAware(kv, NoTokens(), choice=choice)
        seen: list[tuple[int, int]] = []
        q.blended.on_precise = lambda matched, of, seen=seen: seen.append((matched, of))
        q.sending(1, streamed())
        store(kv, 2, 2)
        assert q.select([1, 2], {1: 3, 2: 0}, frozenset(), streamed()) == 1, choice
        assert seen == [(32, 256)]


def held_blocks(kv: KvIndex, replica: int, n: int) -> None:
    """`replica`'s engine holds n blocks of a prompt no test request shares."""
    hashes = tuple(range(replica * 10_000, replica * 10_000 + n))
    kv.apply(replica, [BlockStored(hashes, None, tuple(range(50_000, 50_000 + 16 * n)), 16)])


PROMPTS = [
    RequestKey(
        prefix=f"tenant {t} " * 30,
        blocks=block_keys(f"tenant {t} " * 100, 256),
        tokens=tuple(range(1000 + t, 1256 + t)),
        text_chars=len(f"tenant {t} " * 100),
        streams=True,
    )
    for t in range(12)
]


def placements(held: dict[int, int], choice: str = "cost") -> list[int | None]:
    """Where a fresh precise policy places each of PROMPTS, on idle live replicas whose
    engines hold `held` blocks."""
    out = []
    for prompt in PROMPTS:
        kv = KvIndex()
        for rid, n in held.items():
            kv.set_trust(rid, Trust.LIVE)
            if n:
                held_blocks(kv, rid, n)
        p = PreciseCacheAware(kv, NoTokens(), choice=choice)
        out.append(p.select(list(held), dict.fromkeys(held, 0), frozenset(), prompt))
    return out


def test_a_prompt_no_engine_holds_goes_where_the_engines_hold_clearly_less() -> None:
    """Between followed replicas equally good for a request (a prompt none holds, the same
    load), one whose engine holds at most 3/4 of what the fullest holds gets it, whatever
    the hash would say (it evicts less there): a few tenants' prompts no longer pile onto
    one replica by the hash while the other's cache stays empty. Under both choice rules."""
    for choice in ("cost", "match"):
        assert placements({1: 8, 2: 0}, choice) == [2] * 12
        assert placements({1: 0, 2: 8}, choice) == [1] * 12
        assert placements({1: 12, 2: 9}, choice) == [2] * 12  # (9 <= 3/4 of 12)


def test_counts_close_together_leave_the_new_prompt_to_the_hash() -> None:
    """The LB's processes each follow the engines' events and may be a batch apart: where
    the counts are close the hash decides, so processes that see 10 / 12 or 11 / 12 blocks
    (or equal counts, or none followed) place each new prompt alike."""
    by_hash = placements({1: 12, 2: 12})
    assert set(by_hash) == {1, 2}  # (the hash spreads the twelve prompts)
    assert placements({1: 10, 2: 12}) == by_hash
    assert placements({1: 12, 2: 11}) == by_hash
    assert placements({1: 0, 2: 0}) == by_hash


def test_room_comes_after_the_load() -> None:
    """Equal costs, unequal loads: the less loaded replica gets the prompt, however full its
    engine (room only parts replicas equally good and equally loaded)."""
    p, kv = live_policy()
    held_blocks(kv, 2, 12)  # 2's engine full, 1's empty
    p.prefilling[2] = 4  # cost: 1 has 4 requests in flight, 2 four blocks to prefill: equal
    for prompt in PROMPTS:
        assert p.select([1, 2], {1: 4, 2: 0}, frozenset(), prompt) == 2
