"""cache_aware: its prompt rendering, its prefix index and its choices."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from fleetserve.policies.cache_aware import (
    CacheAware,
    PrefixIndex,
    block_keys,
    keyed_block_keys,
    prompt_text,
)
from fleetserve.policies.factory import make_selector
from fleetserve.policies.lb import NO_KEY, RequestKey

SYSTEM = "You are a careful assistant. " * 20


def chat(*turns: str, system: str = SYSTEM) -> bytes:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return json.dumps({"model": "m", "messages": messages, "stream": True}).encode()


def key_of(sel: CacheAware, body: bytes) -> RequestKey:
    key = sel.body_key(body, True)
    assert key.blocks and key.streams  # (chat() asks for a stream)
    return key


def test_a_later_turn_renders_as_an_extension_of_the_earlier_one() -> None:
    first = prompt_text(chat("hello there, tell me about caches"))
    later = prompt_text(chat("hello there, tell me about caches", "They hold KV.", "More?"))
    assert first is not None and later is not None
    assert later.startswith(first)
    assert len(later) > len(first)


def test_prompt_text_forms_and_refusals() -> None:
    assert prompt_text(b'{"prompt": "abc"}') == "abc"
    assert prompt_text(b'{"prompt": ["first", "second"]}') == "first"
    assert prompt_text(b'{"input": "embed me"}') == "embed me"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(json.dumps(parts).encode()) == "\x1euser\x1fhi"
    for bad in (b"", b"not json", b"[1, 2]", b'{"prompt": 5}', b'{"messages": "x"}', b"\xff"):
        assert prompt_text(bad) is None
    assert prompt_text(b"[" * 100_000) is None  # deep nesting is refused, not a crash


def test_block_keys_chain_full_blocks_only() -> None:
    a = block_keys("x" * 64 + "y" * 64 + "z" * 10, 64)
    assert len(a) == 2  # the trailing partial block is not a key
    b = block_keys("x" * 64 + "q" * 64, 64)
    assert a[0] == b[0] and a[1] != b[1]
    # The same block after a different prefix is a different key (a chain, not a bag).
    c = block_keys("w" * 64 + "y" * 64, 64)
    assert c[1] != a[1]


def test_index_match_is_the_longest_leading_run() -> None:
    idx = PrefixIndex(blocks=100)
    keys = block_keys("".join(chr(65 + i) * 8 for i in range(10)), 8)
    idx.record(1, keys[:3])
    idx.record(2, keys[:7])
    assert idx.match(keys, [1, 2, 3]) == (7, [2])
    assert idx.match(keys, [1, 3]) == (3, [1])
    assert idx.match(keys, [3]) == (0, [3])
    assert idx.match(block_keys("Z" * 80, 8), [1, 2]) == (0, [1, 2])


def test_index_evicts_least_recently_used_and_forgets_replicas() -> None:
    idx = PrefixIndex(blocks=4)
    old = block_keys("a" * 32, 8)  # 4 blocks
    new = block_keys("b" * 16, 8)  # 2 blocks
    idx.record(1, old)
    idx.record(1, old[:1])  # block 0 used again: now the most recent
    idx.record(1, new)
    assert len(idx) == 4
    # The tail goes first (blocks 3 and 2): what stays of the prompt is its prefix, which
    # still matches.
    assert idx.match(old, [1]) == (2, [1])
    assert idx.match(new, [1]) == (2, [1])
    idx.record(2, old)
    idx.forget(1)
    assert idx.match(new, [1, 2]) == (0, [1, 2])
    assert idx.match(old, [1, 2]) == (4, [2])
    idx.record(3, new)  # a new replica reuses the freed slot without inheriting its keys
    assert idx.match(old, [3]) == (0, [3])


def test_a_conversation_stays_on_its_replica() -> None:
    sel = CacheAware(max_extra_load=4, block_chars=32)
    told: list[tuple[int, int, int]] = []
    sel.on_choice = lambda matched, routed, extra: told.append((matched, routed, extra))
    load = {1: 0, 2: 0, 3: 0}
    first = sel.select([1, 2, 3], load, frozenset(), key_of(sel, chat("question one " * 10)))
    assert first is not None
    load[first] += 1  # still busy with the first turn of another conversation
    fresh = key_of(sel, chat("unrelated " * 10, system="Be brief."))
    assert sel.select([1, 2, 3], load, frozenset(), fresh) != first  # to a less loaded one
    # A new conversation with the same system prompt shares its blocks: the same replica.
    same_system = key_of(sel, chat("another question " * 10))
    assert sel.select([1, 2, 3], load, frozenset(), same_system) == first
    later = chat("question one " * 10, "answer " * 20, "question two " * 5)
    assert sel.select([1, 2, 3], load, frozenset(), key_of(sel, later)) == first
    assert told[0][0] == 0 and told[0][1] > 0  # the first turn matched nothing
    matched, routed, extra = told[-1]
    assert extra == 1  # it chose the replica busy with the first turn: one more than the least
    first_turn = len(key_of(sel, chat("question one " * 10)).blocks)
    assert first_turn - 1 <= matched < routed  # all of the earlier turn's full blocks


def test_the_threshold_bounds_how_busy_the_chosen_replica_may_be() -> None:
    sel = CacheAware(max_extra_load=2, block_chars=32)
    hot = key_of(sel, chat("hot prefix " * 30))
    load = {1: 0, 2: 0}
    owner = sel.select([1, 2], load, frozenset(), hot)
    assert owner is not None
    other = 2 if owner == 1 else 1
    load[owner] = 1
    assert sel.select([1, 2], load, frozenset(), hot) == owner  # 1 busier than least: fine
    load[owner] = 2
    assert sel.select([1, 2], load, frozenset(), hot) == other  # 2 busier: passed over
    # Now both hold it: the less loaded of the holders.
    load[other] = 1
    assert sel.select([1, 2], load, frozenset(), hot) == other


def test_skewed_traffic_never_exceeds_the_threshold() -> None:
    """Most requests share one prefix; the simulated loads never spread by more than the
    threshold at a decision, whatever the prefix index says."""
    rng = random.Random(7)
    sel = CacheAware(max_extra_load=3, block_chars=32)
    hot = chat("the one hot system prompt " * 20)
    load = dict.fromkeys(range(1, 6), 0)
    running: list[int] = []
    worst = 0
    for i in range(2000):
        body = hot if rng.random() < 0.9 else chat(f"cold {i} " * 20)
        rid = sel.select(list(load), load, frozenset(), key_of(sel, body))
        assert rid is not None
        worst = max(worst, load[rid] - min(load.values()))
        load[rid] += 1
        running.append(rid)
        if len(running) > 12 or rng.random() < 0.3:
            done = running.pop(rng.randrange(len(running)))
            load[done] -= 1
    assert worst < 3
    assert sum(1 for v in load.values() if v) > 1  # the hot prefix did spread


def test_exclusions_removed_replicas_and_keyless_requests() -> None:
    sel = CacheAware(block_chars=32)
    key = key_of(sel, chat("retry me " * 10))
    first = sel.select([1, 2], {}, frozenset(), key)
    assert first is not None
    retry = sel.select([1, 2], {}, frozenset({first}), key)
    assert retry is not None and retry != first
    assert sel.select([1, 2], {}, frozenset({1, 2}), key) is None
    # An exclusion (a retry, a canary's side) forgets nothing; a replica that leaves does.
    assert sel.select([retry], {}, frozenset(), key) == retry
    assert first in sel.index.replicas()
    sel.forget(first)
    assert first not in sel.index.replicas()
    # No prompt: least load.
    assert sel.select([1, 2], {1: 3, 2: 0}, frozenset()) == 2


def test_new_prompts_are_placed_the_same_way_by_separate_processes() -> None:
    """Two selectors (two LB processes) with no shared state place an unseen prompt on the same
    replica when loads tie: the tie is broken by a hash of the prompt's first block."""
    a, b = CacheAware(block_chars=32), CacheAware(block_chars=32)
    for i in range(20):
        body = chat(f"conversation {i} " * 8)
        assert a.select([1, 2, 3, 4], {}, frozenset(), key_of(a, body)) == b.select(
            [1, 2, 3, 4], {}, frozenset(), key_of(b, body)
        )


def test_make_selector_defaults_the_threshold_per_policy() -> None:
    cache = make_selector("cache_aware")
    assert isinstance(cache, CacheAware) and cache.max_extra_load == 8
    prefix = make_selector("prefix_affinity")
    assert getattr(prefix, "max_extra_load", None) == 4


def test_make_selector_builds_it_with_options() -> None:
    sel = make_selector("cache_aware", max_extra_load=7, cache_block_chars=128, cache_blocks=99)
    assert isinstance(sel, CacheAware)
    assert (sel.max_extra_load, sel.block_chars, sel.index.capacity) == (7, 128, 99)


def test_the_replicas_own_load_counts_when_larger() -> None:
    """With the replicas' metrics read (other LB processes' requests included), a replica the
    LB thinks idle but that reports a queue is passed over."""
    sel = CacheAware(max_extra_load=2, block_chars=32)
    key = key_of(sel, chat("a long shared history " * 20))
    owner = sel.select([1, 2], {}, frozenset(), key)
    assert owner is not None
    other = 2 if owner == 1 else 1
    assert sel.select([1, 2], {}, frozenset(), key) == owner
    sel.reported[owner] = 6  # its queue, from /metrics
    assert sel.select([1, 2], {}, frozenset(), key) == other
    # Both hold it now: the less loaded of the two, by the larger of the two counts.
    sel.reported[owner] = 1
    assert sel.select([1, 2], {other: 0}, frozenset(), key) == other
    assert sel.select([1, 2], {other: 3}, frozenset(), key) == owner


def test_a_canary_split_keeps_each_sides_index() -> None:
    """With a canary, the LB asks for a choice among one side's replicas, then maybe the
    other's: neither call may forget the other side's prefixes."""
    sel = CacheAware(block_chars=32)
    matched: list[int] = []
    sel.on_choice = lambda depth, routed, extra: matched.append(depth)
    sides = ([1, 2], [3, 4])
    for turn in range(4):
        for conv in range(6):
            turns = [f"conversation {conv} turn {t} " * 10 for t in range(turn + 1)]
            body = chat(*turns, system=f"system of {conv}")
            assert sel.select(sides[conv % 2], {}, frozenset(), key_of(sel, body)) is not None
    assert matched[:6] == [0] * 6  # first turns: nothing to match
    assert all(depth > 0 for depth in matched[6:])  # every later turn found its history
    assert len(sel.index.replicas()) >= 3


def test_the_replicas_own_load_counts_for_requests_without_a_prompt() -> None:
    sel = CacheAware()
    sel.reported.update({1: 100, 2: 0})
    assert [sel.select([1, 2], {}, frozenset()) for _ in range(4)] == [2, 2, 2, 2]


def test_hostile_messages_cost_a_bounded_rendering() -> None:
    many = json.dumps({"messages": [{}] * 100_000}).encode()
    assert prompt_text(many) == "\x1e\x1f" * 4096
    odd = {"messages": [{"role": 10**50, "content": [{"text": 5}, {"text": "ok"}, "x"]}]}
    assert prompt_text(json.dumps(odd).encode()) == "\x1e\x1fok"


async def test_the_replica_set_tells_the_index_who_left() -> None:
    """ReplicaSet.replace forgets the replicas a push drops, also one that was out of the
    rotation meanwhile (it refused a connection), and nothing else."""
    from fleetserve.lb.replica_set import ReplicaSet, Upstream

    sel = CacheAware(block_chars=32)
    replicas = ReplicaSet(sel)
    ups = {i: Upstream(i, f"http://127.0.0.1:{9000 + i}", 1) for i in (1, 2, 3)}
    replicas.replace(list(ups.values()))
    key = key_of(sel, chat("held everywhere " * 10))
    for rid in (1, 2, 3):
        sel.index.record(rid, key.blocks)
    replicas.discard(2)  # refused a connection: out until the next push
    replicas.replace([ups[1], ups[3]])  # ... which drops it, and keeps 1 and 3
    assert sorted(sel.index.replicas()) == [1, 3]
    replicas.replace([ups[1]])
    assert sel.index.replicas() == [1]


def test_replica_id_zero_is_a_replica_like_any_other() -> None:
    """An unseen prompt with every replica idle goes where the first block's hash says, even
    when that is replica 0 (an id is never taken for "no choice")."""
    sel = CacheAware(block_chars=32)
    picks = {
        sel.select([1, 0], {}, frozenset(), key_of(sel, chat("hi", system=f"tenant {i} " * 8)))
        for i in range(40)
    }
    assert picks == {0, 1}


# -- one index for several LB processes (fleetserve.lb.index_share) --------------------------

KEYS_IN_A_PROCESS = """
import sys
from fleetserve.policies.cache_aware import CacheAware
sel = CacheAware(block_chars=16)
sel.share_keys(bytes.fromhex(sys.argv[1]))
print(list(sel.keys("a conversation that every process keys alike \\ud800 " * 4)))
"""


def test_keys_under_one_secret_agree_across_processes_and_differ_across_secrets() -> None:
    """Two interpreters with different hash salts compute the same keyed keys; another secret
    gives other keys (a client cannot aim at them without it)."""
    secret = os.urandom(32).hex()

    def keys_in_a_process(secret: str, salt: str) -> list[int]:
        env = {**os.environ, "PYTHONHASHSEED": salt}
        out = subprocess.run(
            [sys.executable, "-c", KEYS_IN_A_PROCESS, secret],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return list(json.loads(out.stdout))

    first = keys_in_a_process(secret, "1")
    assert len(first) > 8
    assert keys_in_a_process(secret, "2") == first
    assert keys_in_a_process(os.urandom(32).hex(), "1") != first


def test_keyed_keys_chain_prefixes_like_the_salted_ones() -> None:
    sel = CacheAware(block_chars=8)
    sel.share_keys(b"k" * 32)
    short, long = sel.keys("abcdefgh" * 3), sel.keys("abcdefgh" * 3 + "different" * 2)
    assert len(short) == 3 and long[:3] == short and len(set(long)) == len(long)
    assert sel.keys("abcdefgh" * 3 + "abc") == short  # a partial block is not a key
    assert keyed_block_keys("x" * 7, 8, sel._keyed) == ()  # type: ignore[arg-type]
    assert block_keys("abcdefgh" * 3, 8) != short  # (the salted chain is another space)


def test_peers_in_flight_counts_bound_the_choice() -> None:
    """Another process's requests count: a holder busy there is passed over."""
    sel = CacheAware(max_extra_load=2, block_chars=32)
    body = chat("a long question " * 20)
    assert sel.select([1, 2], {}, frozenset(), key_of(sel, body)) is not None
    holder = sel.index.replicas()[0]
    other = 2 if holder == 1 else 1
    assert sel.select([1, 2], {}, frozenset(), key_of(sel, body)) == holder
    sel.peer_inflight = {holder: 1}  # within the bound: the holder still
    assert sel.select([1, 2], {}, frozenset(), key_of(sel, body)) == holder
    sel.peer_inflight = {holder: 2}  # the other processes have 2 requests on it
    assert sel.select([1, 2], {}, frozenset(), key_of(sel, body)) == other
    sel.peer_inflight = {holder: 1}
    assert sel.select([1, 2], {holder: 1}, frozenset(), key_of(sel, body)) == other
    # Requests without a prompt go by least load over the same fleet-wide counts.
    sel.peer_inflight = {1: 5}
    assert sel.select([1, 2], {2: 1}, frozenset()) == 2


def test_each_choice_is_told_and_a_snapshot_rebuilds_the_index() -> None:
    sel = CacheAware(block_chars=32, blocks=64)
    told: list[tuple[int, tuple[int, ...]]] = []
    sel.on_record = lambda rid, keys: told.append((rid, keys))
    bodies = [chat(f"conversation {i} " * 30) for i in range(6)]
    for body in bodies:
        sel.select([1, 2, 3], {}, frozenset(), key_of(sel, body))
    sel.select([1, 2, 3], {}, frozenset())  # no prompt: told too, with no keys
    assert len(told) == 7 and told[-1][1] == () and all(keys for _, keys in told[:-1])
    # A peer that records what it was told holds the same index.
    peer = PrefixIndex(64)
    for rid, keys in told:
        peer.record(rid, keys)
    for body in bodies:
        keys = key_of(sel, body).blocks
        assert peer.match(keys, [1, 2, 3]) == sel.index.match(keys, [1, 2, 3])
    # A new process rebuilds it from a snapshot, newest blocks and LRU order kept.
    fresh = PrefixIndex(64)
    for rid, keys in sel.index.snapshot(most=64).items():
        fresh.record(rid, keys)
    assert fresh._lru == sel.index._lru
    assert all(len(keys) <= 5 for keys in sel.index.snapshot(most=5).values())


def test_depths_are_each_replicas_own_leading_run() -> None:
    index = PrefixIndex(blocks=100)
    index.record(1, [10, 11, 12, 13])
    index.record(2, [10, 11])
    index.record(3, [99])
    assert index.depths([10, 11, 12, 14], [1, 2, 3, 4]) == {1: 3, 2: 2, 3: 0, 4: 0}
    assert index.depths([10, 11, 12, 13], [1, 2]) == {1: 4, 2: 2}
    assert index.depths([], [1]) == {1: 0}
    # A block held out of order does not count past the first miss.
    index.record(4, [11, 12])
    assert index.depths([10, 11, 12], [4]) == {4: 0}


def history(turns: int) -> bytes:
    """A conversation `turns` exchanges long, each turn ~400 characters."""
    parts: list[str] = []
    for i in range(turns):
        parts += [f"question {i} " * 30, f"answer {i} " * 30]
    return chat(*parts, f"question {turns} " * 5)


def test_the_cost_choice_trades_a_history_against_the_prefill_queued_ahead() -> None:
    """A conversation's next turn stays where its history is cached while the prefill queued
    there costs less than prefilling the history elsewhere; past that it goes elsewhere, and
    the replica it chose is told how many blocks it must prefill."""
    assert CacheAware().choice == "cost" and CacheAware().load_weight == 0.25  # the defaults
    sel = CacheAware(block_chars=32, load_weight=1.0)  # the queue at full weight
    load = {1: 0, 2: 0}
    early = key_of(sel, history(3))
    home = sel.select([1, 2], load, frozenset(), early)
    assert home is not None
    away = 2 if home == 1 else 1
    assert sel.last_uncached == len(early.blocks)  # a cold index: all of it
    later = key_of(sel, history(4))
    held = len(early.blocks)
    # Two requests decoding at home, none elsewhere: the history still wins.
    load[home] = 2
    assert sel.select([1, 2], load, frozenset(), later) == home
    assert sel.last_uncached == len(later.blocks) - held
    # Home's queue of prompts not yet prefilled now costs more than the history: elsewhere.
    sel.prefilling[home] = len(later.blocks) - 1  # (+ 2 decoding) > all home holds of it
    nxt = key_of(sel, history(5))
    assert sel.select([1, 2], load, frozenset(), nxt) == away
    assert sel.last_uncached == len(nxt.blocks)
    # The same queue told by another LB process weighs the same.
    sel.prefilling.clear()
    sel.peer_prefilling = {away: 10 * len(nxt.blocks)}
    assert sel.select([1, 2], load, frozenset(), key_of(sel, history(6))) == home


def test_the_match_choice_keeps_the_longest_match_whatever_is_queued() -> None:
    sel = CacheAware(block_chars=32, choice="match")
    load = {1: 0, 2: 0}
    home = sel.select([1, 2], load, frozenset(), key_of(sel, history(3)))
    assert home is not None
    sel.prefilling[home] = 10_000
    load[home] = 3
    assert sel.select([1, 2], load, frozenset(), key_of(sel, history(4))) == home
    assert sel.last_uncached == 0  # nothing charged: the match choice weighs no queue


def _spill(sel: CacheAware) -> tuple[int, int]:
    """A conversation over SYSTEM, then one sent past the load bound (max_extra_load 4): both
    replicas hold the system prompt. Returns (first, other)."""
    load = {1: 0, 2: 0}
    first = sel.select([1, 2], load, frozenset(), key_of(sel, chat("a" * 200)))
    assert first is not None
    load[first] = 4
    other = sel.select([1, 2], load, frozenset(), key_of(sel, chat("b" * 200)))
    assert other is not None and other != first
    return first, other


def _new_conversations(sel: CacheAware) -> set[int | None]:
    """Where four new conversations over SYSTEM go, one replica or the other 3 busier in turn
    (within the load bound of 4)."""
    picks = set()
    for i, busy in enumerate((1, 2, 1, 2)):
        load = {1: 0, 2: 0}
        load[busy] = 3
        picks.add(sel.select([1, 2], load, frozenset(), key_of(sel, chat(f"c{i}" * 100))))
    return picks


def test_the_owner_choice_keeps_a_shared_prefix_on_one_replica_in_every_process() -> None:
    """Once two replicas hold a system prompt, the conversations over it go to one of them
    (a hash of the prompt's first block: the same in every LB process, whatever order they
    heard of the holders in), whichever is less loaded within the bound; `match` takes the
    less loaded. A conversation keeps its history (the longest match)."""
    sel = CacheAware(max_extra_load=4, block_chars=32, choice="owner")
    match = CacheAware(max_extra_load=4, block_chars=32, choice="match")
    first, other = _spill(sel)
    _spill(match)
    picks, by_load = _new_conversations(sel), _new_conversations(match)
    assert len(picks) == 1 and by_load == {1, 2}
    keeper = picks.pop()
    assert keeper is not None
    peer = CacheAware(max_extra_load=4, block_chars=32, choice="owner")
    peer.index.record(other, key_of(peer, chat("b" * 200)).blocks)
    peer.index.record(first, key_of(peer, chat("a" * 200)).blocks)
    for busy in (1, 2):
        load = {1: 0, 2: 0}
        load[busy] = 3
        assert peer.select([1, 2], load, frozenset(), key_of(peer, chat("d" * 200))) == keeper
    later = key_of(sel, chat("b" * 200, "ok", "more"))
    assert sel.select([1, 2], {1: 0, 2: 0}, frozenset(), later) == other
    # The keeper leaves: the other holder takes the prompt.
    sel.forget(keeper)
    rest = other if keeper == first else first
    assert sel.select([1, 2], {1: 0, 2: 0}, frozenset(), key_of(sel, chat("e" * 200))) == rest


def test_cost_owner_places_a_shared_prefix_by_its_keeper_and_later_turns_by_cost() -> None:
    """cost_owner: among replicas that hold the same deepest prefix, the keeper (the cost rule
    would take the less queued one), told as `owner` in the choice log; a conversation whose
    history only one replica holds is still moved when the queue there costs more than it."""
    sel = CacheAware(max_extra_load=4, block_chars=32, choice="cost_owner")
    plain = CacheAware(max_extra_load=4, block_chars=32)
    _spill(sel)
    _spill(plain)
    why: list[dict[str, object]] = []
    sel.explain = why.append
    picks, by_cost = _new_conversations(sel), _new_conversations(plain)
    assert len(picks) == 1 and by_cost == {1, 2}
    assert [w["why"] for w in why].count("owner") == 2  # overrode the cost rule twice of four
    keeper = picks.pop()
    assert keeper is not None
    # A later turn held only by the keeper, with a queue there worth more than its history.
    sel.select([1, 2], {1: 0, 2: 0}, frozenset(), key_of(sel, chat("f" * 200)))
    turn = key_of(sel, chat("f" * 200, "ok", "more"))
    sel.prefilling[keeper] = 100 * len(turn.blocks)
    assert sel.select([1, 2], {1: 0, 2: 0}, frozenset(), turn) != keeper


def test_the_cost_choice_still_honours_the_load_bound_and_spreads_new_prompts() -> None:
    sel = CacheAware(max_extra_load=2, block_chars=32)
    load = {1: 0, 2: 0}
    key = key_of(sel, history(8))
    home = sel.select([1, 2], load, frozenset(), key)
    assert home is not None
    load[home] = 2  # at the bound: passed over, whatever it holds
    assert sel.select([1, 2], load, frozenset(), key_of(sel, history(9))) != home
    # New prompts on an idle fleet: both replicas get some, each always the same one.
    fresh = CacheAware(block_chars=32)
    idle = {1: 0, 2: 0}
    picks = [
        fresh.select([1, 2], idle, frozenset(), key_of(fresh, chat("x", system=f"s{i} " * 40)))
        for i in range(40)
    ]
    assert set(picks) == {1, 2}
    again = CacheAware(block_chars=32)
    assert picks == [
        again.select([1, 2], idle, frozenset(), key_of(again, chat("x", system=f"s{i} " * 40)))
        for i in range(40)
    ]


def test_cost_options_are_checked() -> None:
    import pytest
    from pydantic import ValidationError

    from fleetserve.spec.models import LoadBalancerOptions

    with pytest.raises(ValueError, match="cost, match, owner"):
        CacheAware(choice="nearest")
    with pytest.raises(ValidationError, match="cache_choice"):
        LoadBalancerOptions(cache_choice="nearest")
    with pytest.raises(ValidationError, match="cache_decode_weight"):
        LoadBalancerOptions(cache_decode_weight=-1)
    with pytest.raises(ValidationError, match="cache_load_weight"):
        LoadBalancerOptions(cache_load_weight=1e9)
    sel = make_selector(
        "cache_aware", cache_choice="match", cache_decode_weight=2.5, cache_load_weight=0.5
    )
    assert isinstance(sel, CacheAware) and sel.choice == "match" and sel.decode_weight == 2.5
    assert sel.load_weight == 0.5


def test_the_load_weight_scales_the_queue_against_the_history() -> None:
    """The same queue at home: weighed in full it sends the turn away; at a quarter of its
    weight the cached history wins."""
    picks = {}
    for weight in (1.0, 0.25):
        sel = CacheAware(block_chars=32, load_weight=weight)
        load = {1: 0, 2: 0}
        home = sel.select([1, 2], load, frozenset(), key_of(sel, history(4)))
        assert home is not None
        sel.prefilling[home] = len(key_of(sel, history(4)).blocks) + 2
        picks[weight] = sel.select([1, 2], load, frozenset(), key_of(sel, history(5))) == home
    assert picks == {1.0: False, 0.25: True}


@pytest.mark.parametrize("choice", ["cost", "match", "owner", "cost_owner"])
def test_the_blocks_a_replica_lacks_are_told_for_every_request_with_a_prompt(choice: str) -> None:
    """`last_missing` (load_balancer.engine_priority's hint): the prompt blocks the chosen
    replica does not hold, under every rule, streamed or not; None without a prompt."""
    sel = CacheAware(block_chars=32, choice=choice)
    load = {1: 0, 2: 0}
    body = json.loads(history(2))
    whole = sel.body_key(json.dumps({**body, "stream": False}).encode(), True)
    sel.select([1, 2], load, frozenset(), whole)
    assert sel.last_missing == len(whole.blocks) and sel.last_uncached == 0
    sel.select([1, 2], load, frozenset(), whole)
    assert sel.last_missing == 0
    longer = sel.body_key(history(3), True)
    sel.select([1, 2], load, frozenset(), longer)
    assert sel.last_missing == len(longer.blocks) - len(whole.blocks)
    assert sel.select([1, 2], load, frozenset(), NO_KEY) is not None
    assert sel.last_missing is None
    # A prompt read in part (the first of a batch, the start of a body past the limit) is
    # placed by what was read, but what the replica lacks of it is not known: None.
    prompt = body["messages"][0]["content"] * 4
    one = sel.body_key(json.dumps({"prompt": [prompt]}).encode(), True)
    batch = sel.body_key(json.dumps({"prompt": [prompt, "and more"]}).encode(), True)
    start = sel.body_key(json.dumps({"prompt": prompt}).encode()[:-10], False)
    assert not one.partial and batch.partial and start.partial
    assert batch.blocks == one.blocks
    for key in (one, batch, start):
        assert sel.select([1, 2], load, frozenset(), key) is not None
        assert (sel.last_missing is None) == key.partial


def test_only_a_streamed_answer_is_counted_as_queued_until_its_first_byte() -> None:
    """A whole answer's first byte comes after all its decoding: counting its prompt as
    queued until then would make its replica look busier than it is."""
    sel = CacheAware(block_chars=32)
    body = json.loads(history(2))
    streamed = sel.body_key(json.dumps(body).encode(), True)
    whole = sel.body_key(json.dumps({**body, "stream": False}).encode(), True)
    assert streamed.streams and not whole.streams and streamed.blocks == whole.blocks
    load = {1: 0, 2: 0}
    sel.select([1, 2], load, frozenset(), whole)
    assert sel.last_uncached == 0
    sel.select([1, 2], load, frozenset(), streamed)
    assert sel.last_uncached == 0  # all of it held now
    longer = sel.body_key(history(3), True)
    sel.select([1, 2], load, frozenset(), longer)
    assert 0 < sel.last_uncached < len(longer.blocks)
    # A body longer than body_limit: its head says whether it streams.
    head = json.dumps({"stream": True, "messages": [{"role": "user", "content": "y" * 999}]})
    assert sel.body_key(head.encode()[:500], False).streams
    assert not sel.body_key(head.replace("true", "false").encode()[:500], False).streams


def test_a_prompt_too_short_to_match_goes_to_the_least_queue() -> None:
    sel = CacheAware(block_chars=256)
    short = sel.body_key(chat("hi", system="Be brief."), True)
    assert short.blocks == ()
    load = {1: 1, 2: 3}
    assert sel.select([1, 2], load, frozenset(), short) == 1  # nothing queued: least load
    sel.prefilling[1] = 500  # a long prefill waits on replica 1
    assert sel.select([1, 2], load, frozenset(), short) == 2
    assert sel.select([1, 2], load, frozenset({2}), short) == 1  # (exclusions still hold)
    assert CacheAware(choice="match").select([1, 2], load, frozenset(), short) == 1


def test_equal_costs_go_to_the_less_loaded_replica() -> None:
    """With the queue weighed at 0 every replica that holds nothing costs the same: the less
    loaded one still gets a new prompt."""
    sel = CacheAware(block_chars=32, load_weight=0)
    load = {1: 4, 2: 0, 3: 4}
    for i in range(10):
        assert sel.select([1, 2, 3], load, frozenset(), key_of(sel, chat(f"new {i} " * 20))) == 2


def test_each_choice_is_explained_when_asked() -> None:
    """The choice log's record: every eligible replica's matched blocks, load, queued blocks
    and cost, and why the chosen one won (a new prompt, the history, the queue, the bound)."""
    sel = CacheAware(block_chars=32, max_extra_load=3, load_weight=1.0)
    told: list[dict[str, object]] = []
    sel.explain = told.append
    load = {1: 0, 2: 0}
    home = sel.select([1, 2], load, frozenset(), key_of(sel, history(3)))
    assert home is not None
    away = 2 if home == 1 else 1
    assert told[-1]["why"] == "new" and told[-1]["replica"] == home
    later = key_of(sel, history(4))
    assert sel.select([1, 2], load, frozenset(), later) == home
    rec = told[-1]
    assert rec["why"] == "match" and rec["blocks"] == len(later.blocks)
    replicas = rec["replicas"]
    assert isinstance(replicas, dict) and replicas[str(away)][0] == 0 < replicas[str(home)][0]
    sel.prefilling[home] = 10 * len(later.blocks)  # the queue outweighs the history
    assert sel.select([1, 2], load, frozenset(), key_of(sel, history(5))) == away
    rec = told[-1]
    assert rec["why"] == "cost"
    assert (
        isinstance(rec["replicas"], dict) and rec["replicas"][str(home)][2] == sel.prefilling[home]
    )
    sel.prefilling.clear()
    load[away] = 5  # past the bound: the one holding the most of history(6) is passed over
    load[home] = 0
    sel.select([1, 2], load, frozenset(), key_of(sel, history(6)))
    load[away], load[home] = 0, 3
    assert sel.select([1, 2], load, frozenset(), key_of(sel, history(7))) == away
    rec = told[-1]
    assert rec["why"] == "bound" and isinstance(rec["replicas"], dict)
    assert rec["replicas"][str(home)][3] is None  # passed over: no cost
    # Match choice: no costs, the same reasons.
    sel2 = CacheAware(block_chars=32, choice="match")
    sel2.explain = told.append
    sel2.select([1, 2], {1: 0, 2: 0}, frozenset(), key_of(sel2, history(3)))
    assert told[-1]["why"] == "new"
    assert all(v[3] is None for v in told[-1]["replicas"].values())  # type: ignore[union-attr]
