"""cache_aware's precise mode: the same choice (fleetserve.policies.cache_aware), with each
replica's match read from what its engine really holds (fleetserve.policies.kv_index, fed by
its KV cache events) while its events are followed, and from the approximate index otherwise.

The two indexes count in different units (the engine's token blocks, the LB's character
blocks); a match is compared in tokens, the approximate one converted with the request's own
characters per token. The approximate index is kept up to date either way (every choice is
recorded), so a replica whose events stop falls back to a warm index, not an empty one.

What an engine holds does not show what was sent to it and still waits there: it stores a
prompt's blocks when it prefills it, behind a queue seconds later. So a live replica is also
credited with the prompts of the streamed requests this process sent it that have not had
their first byte yet (TracksSends: from each attempt's send to its first byte, or to its end
without one), and with those the LB's other processes sent it (SharesSends: they tell theirs,
fleetserve.lb.index_share); its match is the larger of the two.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from fleetserve.policies.cache_aware import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_BLOCKS,
    DEFAULT_MAX_BODY_BYTES,
    CacheAware,
    PrefixIndex,
)
from fleetserve.policies.kv_index import KvIndex, Trust
from fleetserve.policies.lb import NO_KEY, RequestKey


class PromptTokens(Protocol):
    """The engine's token ids of a request body (fleetserve.lb.prompt_tokens.LoopTokenizer):
    the same from either method; () when there are none to vouch for."""

    def inline(self, body: bytes) -> bool:
        """Whether to tokenize this body on the event loop (`tokens`), as cheaper than
        `tokens_off_loop`."""
        ...

    def tokens(self, body: bytes) -> tuple[int, ...]: ...

    async def tokens_off_loop(self, body: bytes) -> tuple[int, ...]: ...


class BlendedIndex(PrefixIndex):
    """The approximate index whose `match` consults the precise one for live replicas while a
    request with token ids is being placed (`PreciseCacheAware.select` sets `request`)."""

    def __init__(self, blocks: int, block_chars: int, precise: KvIndex) -> None:
        super().__init__(blocks)
        self.block_chars = block_chars
        self.precise = precise
        self.request: RequestKey | None = None
        self.on_precise: Callable[[int, int], None] | None = None  # (tokens matched, of)
        # Per replica, the prompt blocks of the requests this process sent there that wait
        # for their first byte: block key -> how many of them hold it (a prefix tree, as the
        # keys chain); bumped at each change, for the LB's other processes (`sent_keys`).
        self._sent: dict[int, dict[int, int]] = {}
        self.sent_version = 0
        # ... and those of each of the LB's other processes (fleetserve.lb.index_share).
        self._peer_sent: dict[int, dict[int, set[int]]] = {}  # process -> replica -> keys

    def sending(self, replica: int, keys: Sequence[int]) -> dict[int, int]:
        """Credit `replica` with these blocks until `answered` is given what this returns
        (the replica's table: one made after a `forget` is another, so an answer from before
        takes nothing of the new one's credit)."""
        sent = self._sent.get(replica)
        if sent is None:
            sent = self._sent[replica] = {}
        for k in keys:
            sent[k] = sent.get(k, 0) + 1
        self.sent_version += 1
        return sent

    def answered(self, replica: int, keys: Sequence[int], table: dict[int, int]) -> None:
        if self._sent.get(replica) is not table:
            return  # (forgotten meanwhile: nothing of the credit it has now is this one's)
        for k in keys:
            left = table.get(k, 0) - 1
            if left > 0:
                table[k] = left
            else:
                table.pop(k, None)
        if not table:
            del self._sent[replica]
        self.sent_version += 1

    def sent_keys(self, most: int) -> list[tuple[int, list[int]]]:
        """This process's pending blocks per replica, at most `most` keys in all, shared
        evenly among the replicas (what one leaves goes to the others). Within a replica's
        table every key comes after the keys of its prefix (a key is held by no more requests
        than its prefix, so it never leaves it before them): a cut list still matches its
        prompts' starts."""
        tables = list(self._sent.items())
        share = {rid: 0 for rid, _ in tables}
        left = most
        waiting = [(rid, len(t)) for rid, t in tables]
        while left > 0 and waiting:
            each = max(1, left // len(waiting))
            still = []
            for rid, size in waiting:
                take = min(each, size - share[rid], left)
                share[rid] += take
                left -= take
                if share[rid] < size:
                    still.append((rid, size))
                if left <= 0:
                    break
            waiting = still
        out = []
        for rid, table in tables:
            n = share[rid]
            if n:
                out.append((rid, list(table)[:n] if n < len(table) else list(table)))
        return out

    def take_peer_sent(self, source: int, sent: dict[int, set[int]]) -> None:
        """Another LB process's pending blocks per replica (its whole set: empty, none)."""
        if sent:
            self._peer_sent[source] = sent
        else:
            self._peer_sent.pop(source, None)

    def pending(self, keys: Sequence[int], replica: int) -> int:
        """The leading blocks of `keys` that a request sent to `replica` and not yet answered
        holds (this process's or another's): they will be in its engine once that request is
        prefilled."""
        tables: list[Container[int]] = []
        own = self._sent.get(replica)
        if own:
            tables.append(own)
        for peer in self._peer_sent.values():
            theirs = peer.get(replica)
            if theirs:
                tables.append(theirs)
        if not tables:
            return 0
        depth = 0
        for k in keys:
            if not any(k in t for t in tables):
                break
            depth += 1
        return depth

    def forget(self, replica: int) -> None:
        super().forget(replica)
        if self._sent.pop(replica, None) is not None:
            self.sent_version += 1
        for peer in self._peer_sent.values():
            peer.pop(replica, None)

    def _live(self, among: Sequence[int]) -> tuple[RequestKey, dict[int, int], float] | None:
        """For the request being placed: the live replicas' matches in engine tokens and the
        request's tokens per approximate block; None when only the approximate index can say
        (no tokens, or no replica of `among` followed live)."""
        req = self.request
        if req is None or not req.tokens or req.text_chars <= 0:
            return None
        live = self.precise.match(req.tokens, among)
        if not live:
            return None
        return req, live, self.block_chars * len(req.tokens) / req.text_chars

    def match(self, keys: Sequence[int], among: Sequence[int]) -> tuple[int, list[int]]:
        found = self._live(among)
        if found is None:
            return super().match(keys, among)
        req, live, tokens_per_block = found
        depth: dict[int, float] = {}
        for rid in among:
            if rid in live:
                depth[rid] = float(live[rid])
            else:
                blocks, _ = super().match(keys, [rid])
                depth[rid] = blocks * tokens_per_block
        if self.on_precise is not None:  # (what the engines hold: before the pending credit)
            self.on_precise(int(max(depth.values(), default=0.0)), len(req.tokens))
        for rid in live:
            depth[rid] = max(depth[rid], self.pending(keys, rid) * tokens_per_block)
        best = max(depth.values(), default=0.0)
        if best <= 0:
            return 0, list(among)
        # The policy's metrics count in the approximate index's blocks: convert back (never
        # more than the prompt's keys: the engine's tokens include the chat template's).
        blocks = min(len(keys), max(1, round(best / tokens_per_block)))
        return blocks, [r for r in among if depth[r] == best]

    def depths(self, keys: Sequence[int], among: Sequence[int]) -> dict[int, float]:
        """As PrefixIndex.depths, in the approximate index's blocks, each live replica's from
        what its engine holds (its tokens converted with the request's characters per
        token)."""
        found = self._live(among)
        if found is None:
            return super().depths(keys, among)
        req, live, tokens_per_block = found
        out = super().depths(keys, [rid for rid in among if rid not in live])
        # (the engine's tokens include the chat template's: never more than the prompt's keys)
        most = len(keys)
        if self.on_precise is not None:  # in the engine's tokens, as `match` reports
            best = max(
                (live[rid] if rid in live else out[rid] * tokens_per_block for rid in among),
                default=0.0,
            )
            self.on_precise(int(min(best, len(req.tokens))), len(req.tokens))
        for rid in among:
            if rid in live:
                out[rid] = min(most, max(live[rid] / tokens_per_block, self.pending(keys, rid)))
        return out


class PreciseCacheAware(CacheAware):
    """cache_aware with a precise index (see the module's docstring). A whole body's key
    carries its prompt's tokens: a short prompt is tokenized at once (`body_key`), a long
    one by the load balancer off the event loop (CompletesKeyOffLoop: `complete_key`)."""

    def __init__(
        self,
        precise: KvIndex,
        tokenizer: PromptTokens,
        max_extra_load: int = CacheAware.DEFAULT_MAX_EXTRA_LOAD,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        blocks: int = DEFAULT_BLOCKS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        choice: str = CacheAware.DEFAULT_CHOICE,
        decode_weight: float = CacheAware.DEFAULT_DECODE_WEIGHT,
        load_weight: float = CacheAware.DEFAULT_LOAD_WEIGHT,
    ) -> None:
        super().__init__(
            max_extra_load, block_chars, blocks, max_body_bytes, choice, decode_weight, load_weight
        )
        self.precise = precise
        self.tokenizer = tokenizer
        self.index = self.blended = BlendedIndex(blocks, block_chars, precise)

    def body_key(self, body: bytes, complete: bool) -> RequestKey:
        key = super().body_key(body, complete)
        if complete and key.text_chars and self.tokenizer.inline(body):
            return replace(key, tokens=self.tokenizer.tokens(body))
        return key

    def completes_later(self, key: RequestKey, body: bytes, complete: bool) -> bool:
        """A whole body with a prompt too long to tokenize on the event loop."""
        return complete and key.text_chars > 0 and not self.tokenizer.inline(body)

    async def complete_key(self, key: RequestKey, body: bytes) -> RequestKey:
        return replace(key, tokens=await self.tokenizer.tokens_off_loop(body))

    def forget(self, replica: int) -> None:
        super().forget(replica)
        self.precise.forget(replica)

    def _roomiest(self, tied: list[int]) -> list[int]:
        """Of replicas equally good for a request (the same cost and load: a prompt nobody
        holds, on idle replicas), when every one is followed: those whose engines hold at
        most 3/4 of what the fullest of them holds, if some do (a new prompt goes where it
        evicts less, as sglang-router's smallest tree places one, instead of by the hash
        alone, which may put a few tenants' prompts on one replica, its cache thrashing while
        the other's stays empty). Counts closer than that leave the choice to the hash: the
        LB's processes each follow the engines' events and may be a batch apart, and the
        hash is what they agree on. Counts are blocks, so caches of one size compare."""
        trust = self.precise.trust
        if len(tied) < 2 or any(trust(rid) is not Trust.LIVE for rid in tied):
            return tied
        held = {rid: self.precise.blocks(rid) for rid in tied}
        most = max(held.values())
        roomy = [rid for rid in tied if 4 * held[rid] <= 3 * most]
        return roomy or tied

    def sending(self, replica: int, key: RequestKey) -> object | None:
        """TracksSends: a request with a prompt is sent to `replica`. A streamed one is
        credited there until its answer (`answered`, given what this returns); a whole one
        is not (its first byte comes after its decoding): None, nothing to answer."""
        if not key.streams:
            return None
        return self.blended.sending(replica, key.blocks)

    def answered(self, replica: int, key: RequestKey, token: object) -> None:
        """TracksSends: ... and had its first byte there, or went no further."""
        if isinstance(token, dict):
            self.blended.answered(replica, key.blocks, token)

    @property
    def sent_version(self) -> int:
        """SharesSends: changes whenever this process's pending prompts do."""
        return self.blended.sent_version

    def sent_keys(self, most: int) -> list[tuple[int, list[int]]]:
        """SharesSends: this process's pending prompt blocks per replica (for the others)."""
        return self.blended.sent_keys(most)

    def take_peer_sent(self, source: int, sent: dict[int, set[int]]) -> None:
        """SharesSends: another process's pending prompt blocks per replica."""
        self.blended.take_peer_sent(source, sent)

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        self.blended.request = key if key.tokens else None
        try:
            return super().select(candidates, inflight, exclude, key)
        finally:
            self.blended.request = None
