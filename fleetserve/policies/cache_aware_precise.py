"""cache_aware's precise mode: the same choice (fleetserve.policies.cache_aware), with each
replica's match read from what its engine really holds (fleetserve.policies.kv_index, fed by
its KV cache events) while its events are followed, and from the approximate index otherwise.

The two indexes count in different units (the engine's token blocks, the LB's character
blocks); a match is compared in tokens, the approximate one converted with the request's own
characters per token. The approximate index is kept up to date either way (every choice is
recorded), so a replica whose events stop falls back to a warm index, not an empty one.

What an engine holds does not yet show what was sent to it and still waits there: its blocks
are stored when it is prefilled, seconds later behind a queue. So a live replica that still
has prompt blocks to prefill (the load balancer's count, all its processes') is also credited
with what the approximate index recorded for it lately: within `PENDING_FACTOR` times its
recent time to a first byte (a running mean of this process's streamed requests there), at
most `MAX_PENDING_SECONDS`. Its match is the larger of the two. Short queues make that window
short, and a replica with nothing left to prefill is matched on its engine alone, so where
engines answer at once the precise mode is what the events say.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from fleetserve.policies.cache_aware import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_BLOCKS,
    DEFAULT_MAX_BODY_BYTES,
    CacheAware,
    PrefixIndex,
)
from fleetserve.policies.kv_index import KvIndex
from fleetserve.policies.lb import NO_KEY, RequestKey

# A prompt sent to a replica counts as soon to be held there for this many times the replica's
# recent time to a first byte (about the longest a request waits there for its prefill)...
PENDING_FACTOR = 2.0
MAX_PENDING_SECONDS = 30.0  # ... and never longer
FIRST_BYTE_WEIGHT = 0.2  # of each new first-byte time in the replica's running mean


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

    def __init__(
        self,
        blocks: int,
        block_chars: int,
        precise: KvIndex,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(blocks, clock)
        self.block_chars = block_chars
        self.precise = precise
        self.request: RequestKey | None = None
        self.on_precise: Callable[[int, int], None] | None = None  # (tokens matched, of)
        # Per replica, the running mean of its first-byte seconds (`first_byte`), and the
        # prompt blocks it still has to prefill (the policy's count): the pending window.
        self.wait: dict[int, float] = {}
        self.backlog: Callable[[int], int] = lambda replica: 0

    def first_byte(self, replica: int, seconds: float) -> None:
        """A streamed request sent to `replica` had its first byte after `seconds`."""
        mean = self.wait.get(replica)
        self.wait[replica] = (
            seconds if mean is None else mean + FIRST_BYTE_WEIGHT * (seconds - mean)
        )

    def pending(self, keys: Sequence[int], replica: int) -> int:
        """The leading blocks of `keys` sent to a replica lately enough that they may still
        wait there for their prefill (see the module's docstring); 0 when it has nothing left
        to prefill."""
        mean = self.wait.get(replica)
        if mean is None or self.backlog(replica) <= 0:
            return 0
        window = min(MAX_PENDING_SECONDS, PENDING_FACTOR * mean)
        return self.recent_depth(keys, replica, self.clock() - window)

    def forget(self, replica: int) -> None:
        super().forget(replica)
        self.wait.pop(replica, None)

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
                depth[rid] = max(float(live[rid]), self.pending(keys, rid) * tokens_per_block)
            else:
                blocks, _ = super().match(keys, [rid])
                depth[rid] = blocks * tokens_per_block
        best = max(depth.values(), default=0.0)
        if self.on_precise is not None:
            self.on_precise(self._held(live, depth, among), len(req.tokens))
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
        tokens = {rid: out[rid] * tokens_per_block for rid in out}
        for rid in among:
            if rid in live:
                out[rid] = min(most, max(live[rid] / tokens_per_block, self.pending(keys, rid)))
                tokens[rid] = float(live[rid])
        if self.on_precise is not None:  # in the engine's tokens, as `match` reports
            self.on_precise(min(self._held(live, tokens, among), len(req.tokens)), len(req.tokens))
        return out

    @staticmethod
    def _held(live: Mapping[int, int], depth: Mapping[int, float], among: Sequence[int]) -> int:
        """For the LB's metrics (what the events promised): the most tokens one replica holds,
        a live one's as its engine holds them (what is only pending there not counted)."""
        return int(max((live[r] if r in live else depth[r] for r in among), default=0.0))


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            max_extra_load, block_chars, blocks, max_body_bytes, choice, decode_weight, load_weight
        )
        self.precise = precise
        self.tokenizer = tokenizer
        self.index = self.blended = BlendedIndex(blocks, block_chars, precise, clock)
        self.blended.backlog = self._backlog

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

    def first_byte(self, replica: int, seconds: float) -> None:
        """TimesFirstByte: a streamed request with a prompt, sent to `replica`, had its first
        byte after `seconds` (the pending window: see the module's docstring)."""
        self.blended.first_byte(replica, seconds)

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
