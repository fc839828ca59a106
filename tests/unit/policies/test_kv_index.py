"""The precise index (fleetserve.policies.kv_index): keys from events agree with keys from
tokens; stores, removals, clears, unknown parents, bounds and trust."""

from __future__ import annotations

from fleetserve.policies.kv_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvIndex,
    Trust,
    token_block_keys,
)

BS = 4


def stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, **kw: object
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, **kw)  # type: ignore[arg-type]


def live(index: KvIndex, *replicas: int) -> KvIndex:
    for r in replicas:
        index.set_trust(r, Trust.LIVE)
    return index


PROMPT = list(range(100, 114))  # 3 full blocks of 4, and 2 tokens over


def test_event_keys_are_token_keys() -> None:
    index = live(KvIndex(), 1)
    # Stored in two events, the second chained to the first by the engine's hash.
    index.apply(1, [stored([11, 12], PROMPT[:8]), stored([13], PROMPT[8:12], parent=12)])
    assert index.keys_of(1) == set(token_block_keys(PROMPT, BS))
    assert index.match(PROMPT, [1]) == {1: 12}
    assert index.match(PROMPT[:7], [1]) == {1: 4}
    assert index.match([7, *PROMPT], [1]) == {1: 0}  # another first block: nothing


def test_removed_and_cleared() -> None:
    index = live(KvIndex(), 1, 2)
    index.apply(1, [stored([11, 12, 13], PROMPT[:12])])
    index.apply(2, [stored([21, 22], PROMPT[:8])])
    assert index.match(PROMPT, [1, 2]) == {1: 12, 2: 8}
    index.apply(1, [BlockRemoved((12,))])  # the middle block: the match stops before it
    assert index.match(PROMPT, [1, 2]) == {1: 4, 2: 8}
    index.apply(2, [AllBlocksCleared()])
    assert index.match(PROMPT, [1, 2]) == {1: 4, 2: 0}
    assert index.blocks(2) == 0


def test_duplicate_engine_blocks_are_held_until_each_is_removed() -> None:
    """vLLM keeps a second block with a hash it holds (a fully cached prompt's last block is
    computed again) and reports each block's store and each one's removal (vLLM 0.32's
    BlockPool): the content is held until every block of it is removed (the index dropped it
    at the first removal, while the engine still held it)."""
    index = live(KvIndex(), 1)
    index.apply(1, [stored([11, 12], PROMPT[:8])])
    index.apply(1, [stored([12], PROMPT[4:8], parent=11)])  # a second block of 12's content
    assert index.blocks(1) == 2
    index.apply(1, [BlockRemoved((12,))])  # one of the two
    assert index.match(PROMPT, [1]) == {1: 8}
    index.apply(1, [BlockRemoved((12,)), BlockRemoved((99,))])  # the other; an unknown one
    assert index.match(PROMPT, [1]) == {1: 4}
    index.apply(1, [stored([12], PROMPT[4:8], parent=11)] * 3)  # three blocks of it again
    index.apply(1, [AllBlocksCleared()])  # a clear forgets every copy
    index.apply(1, [stored([11, 12], PROMPT[:8]), BlockRemoved((12,))])
    assert index.match(PROMPT, [1]) == {1: 4}


def test_unknown_parent_and_odd_blocks_are_not_indexed() -> None:
    index = live(KvIndex(), 1)
    done = index.apply(1, [stored([13], PROMPT[8:12], parent=12)])  # stored before we listened
    assert done.ignored == 1 and index.blocks(1) == 0
    done = index.apply(1, [stored([11], PROMPT[:3])])  # a partial block
    assert done.ignored == 1
    done = index.apply(1, [stored([11], PROMPT[:4], plain=False)])  # LoRA, media, salt, CPU tier
    assert done.ignored == 1 and index.blocks(1) == 0
    odd = BlockStored((11,), None, tuple(range(8)), 8)  # another block size than the first
    index.apply(1, [stored([11], PROMPT[:4])])
    assert index.apply(1, [odd]).ignored == 1


def test_only_live_replicas_match() -> None:
    index = KvIndex()
    index.apply(1, [stored([11], PROMPT[:4])])
    assert index.match(PROMPT, [1]) == {}  # CONNECTING: the approximate index answers
    index.set_trust(1, Trust.LIVE)
    assert index.match(PROMPT, [1, 2]) == {1: 4}
    index.set_trust(1, Trust.SILENT)
    assert index.match(PROMPT, [1]) == {}


def test_overflow_drops_the_replica() -> None:
    index = live(KvIndex(max_blocks=2), 1, 2)
    index.apply(2, [stored([21], PROMPT[:4])])
    done = index.apply(1, [stored([11, 12, 13], PROMPT[:12])])
    assert done.overflow
    assert index.trust(1) is Trust.OVERFLOW and index.blocks(1) == 0
    assert index.match(PROMPT, [1, 2]) == {2: 4}  # the other replica is untouched


def test_forget_frees_the_slot() -> None:
    index = live(KvIndex(), 1, 2)
    index.apply(1, [stored([11], PROMPT[:4])])
    index.forget(1)
    assert index.trusts() == {2: Trust.LIVE}
    live(index, 3)
    assert index.match(PROMPT, [3]) == {3: 0}  # 3 took 1's bit: none of 1's blocks


def test_many_engine_hashes_for_the_same_blocks_overflow() -> None:
    # A publisher that names the same token blocks under ever new engine hashes (a real
    # engine's hash chain never does) must not grow the index past max_blocks entries.
    index = live(KvIndex(max_blocks=8), 1)
    done = None
    for i in range(10):
        done = index.apply(1, [stored([100 * i + 1, 100 * i + 2], PROMPT[:8])])
        if done.overflow:
            break
    assert done is not None and done.overflow
    assert index.trust(1) is Trust.OVERFLOW and index.blocks(1) == 0
    assert len(index._replicas[1].engine) == 0
