"""cache_aware's precise index: which token blocks each engine really holds, from its KV cache
events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared), as llm-d's precise prefix-cache
scorer and Dynamo's KV router keep it.

Keys are the LB's own: block i of a token sequence is keyed by a hash chain over the token ids
of blocks 0..i (`token_block_keys`), so a request's keys (its prompt tokenized as the engine
tokenizes it) and an event's keys (its token ids, chained from its parent block's key) are the
same numbers, whatever hash the engine uses internally. Per replica the index maps the engine's
block hash to our key (BlockRemoved names engine hashes only) and keeps, for lookups, each
key's holders as a bit mask over replica slots (as PrefixIndex does).

What the index trusts is decided here, purely: a replica is `live` only while its history is
complete (every batch applied since the publisher's first one or since an AllBlocksCleared,
and none lost); otherwise the policy uses the approximate index for it. The subscriber
(fleetserve.lb.kv_events) feeds batches and tells of gaps, silences and restarts.

Bounded: at most `max_blocks` keys and engine hashes per replica (past it the replica is
dropped to the approximate index: an engine never holds more than its cache, so a publisher
that says it does is broken); blocks with extra keys (LoRA, multimodal, cache salt), another
cache group or another medium (a CPU offload tier) are not indexed (a plain request never
matches them).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

EngineHash = bytes | int  # vLLM's block hash: sha256 bytes, or an int with the int-hash option

DEFAULT_MAX_BLOCKS = 131_072  # per replica: 2M tokens at 16 a block; ~250 bytes each
MAX_BLOCK_SIZE = 4096
ROOT = 0  # the parent key of a sequence's first block


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    plain: bool = True  # no extra keys, cache group 0, the GPU tier: what a request can match


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    plain: bool = True


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Trust(enum.StrEnum):
    """Why a replica is (or is not) followed precisely; the metric's label."""

    LIVE = "live"
    CONNECTING = "connecting"  # not yet subscribed, or its replay not yet complete
    INCOMPLETE = "incomplete"  # batches were lost (a gap the replay could not fill)
    SILENT = "silent"  # the publisher stopped answering
    OVERFLOW = "overflow"  # more blocks, events or bytes than the bounds allow


def token_block_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The hash chain of the full blocks of `tokens` (a partial last block is not cached by an
    engine either). Python's hash of a tuple of ints is the same in every process."""
    keys = []
    prev = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[start : start + block_size])))
        keys.append(prev)
    return keys


@dataclass
class _Holdings:
    bit: int
    block_size: int | None = None
    engine: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> our key
    count: dict[int, int] = field(default_factory=dict)  # our key -> engine hashes naming it
    # Engine hash -> blocks of the engine that hold it, past the first: vLLM keeps a second
    # block with a hash it holds (a fully cached prompt's last block, computed again) and
    # reports each block's store and each block's removal.
    copies: dict[EngineHash, int] = field(default_factory=dict)
    trust: Trust = Trust.CONNECTING


@dataclass
class Applied:
    """What one batch did (the LB's metrics)."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    ignored: int = 0  # blocks not indexed: not plain, parent unknown, wrong shape
    overflow: bool = False


class KvIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._replicas: dict[int, _Holdings] = {}
        self._holders: dict[int, int] = {}  # key -> bit mask of replica slots
        self._free_bits: list[int] = []
        self._next_bit = 1

    # -- state --------------------------------------------------------------------------------

    def _holdings(self, replica: int) -> _Holdings:
        h = self._replicas.get(replica)
        if h is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit << 1
            h = self._replicas[replica] = _Holdings(bit)
        return h

    def trust(self, replica: int) -> Trust:
        h = self._replicas.get(replica)
        return Trust.CONNECTING if h is None else h.trust

    def set_trust(self, replica: int, trust: Trust) -> None:
        self._holdings(replica).trust = trust

    def trusts(self) -> dict[int, Trust]:
        return {rid: h.trust for rid, h in self._replicas.items()}

    def blocks(self, replica: int) -> int:
        h = self._replicas.get(replica)
        return 0 if h is None else len(h.count)

    def keys_of(self, replica: int) -> set[int]:
        h = self._replicas.get(replica)
        return set() if h is None else set(h.count)

    def block_size(self, replica: int) -> int | None:
        h = self._replicas.get(replica)
        return None if h is None else h.block_size

    def clear(self, replica: int) -> None:
        """Forget what the replica holds (its engine cleared, or its history is lost)."""
        h = self._replicas.get(replica)
        if h is None:
            return
        for key in h.count:
            self._drop(key, h.bit)
        h.engine.clear()
        h.count.clear()
        h.copies.clear()

    def forget(self, replica: int) -> None:
        """The replica left the set."""
        self.clear(replica)
        h = self._replicas.pop(replica, None)
        if h is not None:
            self._free_bits.append(h.bit)

    def _drop(self, key: int, bit: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    # -- events -------------------------------------------------------------------------------

    def apply(self, replica: int, events: Iterable[KvEvent]) -> Applied:
        """Apply one batch's events in order. On overflow the replica's holdings are cleared
        and its trust is OVERFLOW (the caller resynchronises or leaves it to the fallback)."""
        h = self._holdings(replica)
        done = Applied()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(h, event, done)
            elif isinstance(event, BlockRemoved):
                self._removed(h, event, done)
            else:
                self.clear(replica)
                done.cleared += 1
            if done.overflow:
                self.clear(replica)
                h.trust = Trust.OVERFLOW
                break
        return done

    def _stored(self, h: _Holdings, e: BlockStored, done: Applied) -> None:
        n = len(e.block_hashes)
        size = e.block_size
        if not e.plain or size <= 0 or size > MAX_BLOCK_SIZE or len(e.token_ids) != n * size:
            done.ignored += n  # a partial block, or tokens that do not cut into these blocks
            return
        if h.block_size is None:
            h.block_size = size
        elif size != h.block_size:
            done.ignored += n
            return
        if e.parent is None:
            prev = ROOT
        else:
            parent = h.engine.get(e.parent)
            if parent is None:  # stored before we followed, or not indexed: cannot chain
                done.ignored += n
                return
            prev = parent
        tokens = e.token_ids
        holders = self._holders
        for i, engine_hash in enumerate(e.block_hashes):
            prev = hash((prev, tokens[i * size : (i + 1) * size]))
            old = h.engine.get(engine_hash)
            if old == prev:
                # Another block of the engine with this content: held until both are removed.
                h.copies[engine_hash] = h.copies.get(engine_hash, 0) + 1
                continue
            if old is not None:
                self._unname(h, engine_hash, old)
            # (Engine hashes are bounded too: a broken publisher could name one key by many.)
            full = len(h.count) >= self.max_blocks and prev not in h.count
            if full or len(h.engine) >= self.max_blocks:
                done.overflow = True
                return
            h.engine[engine_hash] = prev
            h.count[prev] = h.count.get(prev, 0) + 1
            holders[prev] = holders.get(prev, 0) | h.bit
            done.stored += 1

    def _unname(self, h: _Holdings, engine_hash: EngineHash, key: int) -> None:
        del h.engine[engine_hash]
        h.copies.pop(engine_hash, None)
        left = h.count[key] - 1
        if left:
            h.count[key] = left
        else:
            del h.count[key]
            self._drop(key, h.bit)

    def _removed(self, h: _Holdings, e: BlockRemoved, done: Applied) -> None:
        if not e.plain:
            done.ignored += len(e.block_hashes)
            return
        for engine_hash in e.block_hashes:
            key = h.engine.get(engine_hash)
            if key is None:
                done.ignored += 1
                continue
            done.removed += 1
            more = h.copies.get(engine_hash, 0)
            if more:  # another block of the engine still holds it
                if more > 1:
                    h.copies[engine_hash] = more - 1
                else:
                    del h.copies[engine_hash]
                continue
            self._unname(h, engine_hash, key)

    # -- lookups ------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], among: Sequence[int]) -> dict[int, int]:
        """For each LIVE replica of `among`: how many leading tokens of `tokens` it holds (in
        whole blocks of its engine's block size). Replicas not live are left out."""
        groups: dict[int, int] = {}  # block size -> bit mask of live replicas
        bits: dict[int, int] = {}
        for rid in among:
            h = self._replicas.get(rid)
            if h is None or h.trust is not Trust.LIVE:
                continue
            bits[rid] = h.bit
            size = h.block_size or 16  # nothing stored yet: holds nothing, any size will do
            groups[size] = groups.get(size, 0) | h.bit
        depth_of_bit: dict[int, int] = {}
        holders = self._holders
        for size, alive in groups.items():
            depth = 0
            for key in token_block_keys(tokens, size):
                left = alive & holders.get(key, 0)
                gone = alive & ~left
                while gone:
                    bit = gone & -gone
                    depth_of_bit[bit] = depth * size
                    gone ^= bit
                alive = left
                if not alive:
                    break
                depth += 1
            while alive:
                bit = alive & -alive
                depth_of_bit[bit] = depth * size
                alive ^= bit
        return {rid: depth_of_bit.get(bit, 0) for rid, bit in bits.items()}
