"""The fake LLM replica's model, pure (no sockets; the clock is injected): tokens, a paged KV
cache with prefix sharing, continuous batching.

Tokens are 4 characters of the rendered prompt, counted from its start, so a prompt that
extends an earlier one shares all of the earlier one's full tokens. The cache holds
`cache_blocks` blocks of `block_tokens` tokens; a full block's key chains the key of the block
before it with its own tokens, so a key names a whole prefix. Blocks in use by a request are
referenced; a finished request's blocks stay cached, unreferenced, until evicted (least
recently used first). The scheduler runs steps, as vLLM's does: admit waiting requests (FIFO)
while the batch and the cache have room, prefill up to `max_prefill_tokens` uncached prompt
tokens (chunked prefill), then every running request whose prompt is done emits one token.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4
# Generated text: 4-character tokens (3 letters and a space), safe inside JSON strings.
_WORDS = (
    "the and for are but not you all any can had her was one our out day get has him his "
    "how man new now old see two way who boy did its let put say she too use act add age "
    "ago aid aim air art ask bad bag bed big bit box bus buy car cat cup cut dog dry due "
    "ear eat egg end eye fan far few fit fix fly fun gap gas god gun hat hit hot ice job"
)
VOCAB = tuple(f"{w} " for w in _WORDS.split())


def render_chat(messages: Iterable[Mapping[str, str]]) -> str:
    """The chat template: `<|role|>content<|end|>` per message, then `<|assistant|>`."""
    return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"


def count_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def tokenize(text: str) -> list[str]:
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def block_keys(text: str, block_tokens: int) -> list[int]:
    """The keys of the full blocks of `text`'s tokens: block i's key hashes block i-1's key
    and block i's tokens (the text of its `block_tokens` tokens, the same thing since tokens
    are fixed slices)."""
    chars = block_tokens * CHARS_PER_TOKEN
    full = count_tokens(text) // block_tokens
    keys: list[int] = []
    key = 0
    for i in range(full):
        key = hash((key, text[i * chars : (i + 1) * chars]))
        keys.append(key)
    return keys


def reply_text(prompt: str, tokens: int) -> str:
    """The generated text: `tokens` tokens drawn from a generator seeded by the prompt, so the
    same prompt always gets the same reply (the client's next turn re-renders it exactly)."""
    seed = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return "".join(random.Random(seed).choices(VOCAB, k=tokens))


@dataclass(frozen=True)
class ModelConfig:
    block_tokens: int = 16  # vLLM's default block size on GPUs
    cache_blocks: int = 8192  # per replica: 131,072 tokens of KV cache
    max_batch: int = 16  # running requests (vLLM: max_num_seqs)
    max_waiting: int = 256  # waiting requests; past it, 503
    prefill_ms_per_token: float = 0.15
    decode_ms_per_step: float = 12.0  # a step in which any request emits a token
    max_prefill_tokens: int = 2048  # per step (vLLM: max_num_batched_tokens)
    max_output_tokens: int = 1024  # a request's max_tokens is cut to this


class Rejected(Exception):
    """The request is refused: `status` 503 (queue full) or 400 (can never fit)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Request:
    rid: int
    text: str  # the rendered prompt
    prompt_tokens: int
    max_tokens: int
    keys: list[int]  # the prompt's full blocks
    arrived: float
    reply: str = ""  # the generated text (known in advance: it is the model's to choose)
    admitted: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0  # prompt tokens found in the cache at admission
    prefilled: int = 0  # prompt tokens computed or found in the cache
    generated: int = 0
    refs: list[int] = field(default_factory=list)  # cached blocks it references, in order
    private: int = 0  # blocks reserved for it that no other request can use (yet)
    aborted: bool = False

    @property
    def to_prefill(self) -> int:
        return self.prompt_tokens - self.prefilled

    @property
    def done(self) -> bool:
        return self.generated >= self.max_tokens or self.aborted

    def token(self, i: int) -> str:
        """The text of output token i."""
        return self.reply[i * CHARS_PER_TOKEN : (i + 1) * CHARS_PER_TOKEN]


class KvCache:
    """`capacity` blocks: cached blocks by key (each with the number of requests using it),
    an LRU order of the unreferenced ones (the evictable), and private blocks (reserved by a
    request, not yet shareable: prompt blocks not computed yet, output, a partial last block).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.refs: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.private = 0
        self.evictions = 0

    @property
    def used(self) -> int:
        return len(self.refs) + self.private

    @property
    def in_use(self) -> int:
        """Blocks that running requests hold (vLLM's kv_cache_usage counts these)."""
        return len(self.refs) - len(self.lru) + self.private

    def hits(self, keys: Iterable[int]) -> list[int]:
        """The leading keys that are cached (a prefix hit stops at the first miss)."""
        out = []
        for key in keys:
            if key not in self.refs:
                break
            out.append(key)
        return out

    def can_take(self, hits: list[int], new: int) -> bool:
        """Whether `new` more blocks fit once `hits` are referenced (evicting others)."""
        evictable = len(self.lru) - sum(1 for k in hits if k in self.lru)
        return new <= self.capacity - self.used + evictable

    def acquire(self, key: int) -> None:
        if self.refs[key] == 0:
            del self.lru[key]
        self.refs[key] += 1

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.lru[key] = None  # most recently used: evicted last

    def _make_room(self, blocks: int) -> bool:
        while self.capacity - self.used < blocks:
            if not self.lru:
                return False
            key, _ = self.lru.popitem(last=False)
            del self.refs[key]
            self.evictions += 1
        return True

    def reserve(self, blocks: int) -> None:
        if not self._make_room(blocks):
            raise RuntimeError("reserve past can_take")
        self.private += blocks

    def publish(self, key: int) -> None:
        """A private block now holds the computed prefix `key`: shareable. If another request
        published the same prefix meanwhile, use that one and free the private block."""
        self.private -= 1
        if key in self.refs:
            self.acquire(key)
        else:
            self.refs[key] = 1

    def add(self, key: int) -> bool:
        """One more cached block for `key`, if there is room (evicting); False if not."""
        if key in self.refs:
            self.acquire(key)
            return True
        if not self._make_room(1):
            return False
        self.refs[key] = 1
        return True

    def clear(self) -> None:
        self.refs.clear()
        self.lru.clear()
        self.private = 0
        self.evictions = 0


@dataclass
class Counters:
    """vLLM's counters (vllm/v1/metrics/loggers.py), all in tokens but `requests`/`success`."""

    requests: int = 0  # received (not in vLLM's set: for the bench's load spread)
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found cached
    prompt_tokens: int = 0  # prompts whose first token was emitted
    generation_tokens: int = 0
    success: int = 0  # finished requests
    rejected: int = 0  # 503 / 400 (not in vLLM's set)


@dataclass
class Step:
    duration: float  # seconds
    prefill: list[tuple[Request, int]]  # prompt tokens each request computes in this step
    emit: list[Request]  # requests that emit a token at the end of the step
    epoch: int  # a reset drops a step begun before it


class Scheduler:
    """One replica: `submit` requests, then repeat `schedule` (a Step and how long it lasts),
    wait that long, `complete(step)` (the requests that emitted a token)."""

    def __init__(self, config: ModelConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.cache = KvCache(config.cache_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = Counters()
        self.epoch = 0
        self._next_id = 0

    def submit(self, text: str, max_tokens: int) -> Request:
        """Queue a prompt (raises Rejected)."""
        cfg = self.config
        self.counters.requests += 1
        max_tokens = max(1, min(max_tokens, cfg.max_output_tokens))
        prompt_tokens = count_tokens(text)
        if prompt_tokens == 0:
            self.counters.rejected += 1
            raise Rejected(400, "empty prompt")
        if self._blocks_needed(prompt_tokens, max_tokens) > cfg.cache_blocks:
            self.counters.rejected += 1
            raise Rejected(400, "prompt and max_tokens exceed the KV cache")
        if len(self.waiting) >= cfg.max_waiting:
            self.counters.rejected += 1
            raise Rejected(503, f"{cfg.max_waiting} requests already waiting")
        self._next_id += 1
        req = Request(
            rid=self._next_id,
            text=text,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            keys=block_keys(text, cfg.block_tokens),
            arrived=self.clock(),
            reply=reply_text(text, max_tokens),
        )
        self.waiting.append(req)
        return req

    def _blocks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        return -(-(prompt_tokens + max_tokens) // self.config.block_tokens)

    def _admit(self, req: Request) -> bool:
        """Reserve the request's blocks: cached prompt blocks are referenced, the rest (the
        uncached prompt, all of its output) reserved privately. False if they do not fit."""
        cfg, cache = self.config, self.cache
        # At least the prompt's last token is computed, for its logits (vLLM:
        # max_cache_hit_length = num_tokens - 1 in kv_cache_manager.get_computed_blocks).
        hits = cache.hits(req.keys[: (req.prompt_tokens - 1) // cfg.block_tokens])
        new = self._blocks_needed(req.prompt_tokens, req.max_tokens) - len(hits)
        if not cache.can_take(hits, new):
            return False
        for key in hits:
            cache.acquire(key)
        cache.reserve(new)
        req.refs = hits
        req.private = new
        req.cached_tokens = req.prefilled = len(hits) * cfg.block_tokens
        req.admitted = self.clock()
        self.counters.prefix_cache_queries += req.prompt_tokens
        self.counters.prefix_cache_hits += req.cached_tokens
        return True

    def schedule(self) -> Step | None:
        """Admit what fits, plan one step; None when there is nothing to do."""
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_batch:
            if not self._admit(self.waiting[0]):
                break  # FIFO: the head waits for room, nobody overtakes it
            self.running.append(self.waiting.popleft())
        budget = cfg.max_prefill_tokens
        prefill: list[tuple[Request, int]] = []
        emit: list[Request] = []
        for req in self.running:
            if req.to_prefill > 0:
                n = min(req.to_prefill, budget)
                if n == 0:
                    continue
                budget -= n
                prefill.append((req, n))
                if n == req.to_prefill:
                    emit.append(req)  # its prompt is done: first token at the end of the step
            else:
                emit.append(req)
        if not prefill and not emit:
            return None
        tokens = sum(n for _, n in prefill)
        ms = (cfg.decode_ms_per_step if emit else 0.0) + cfg.prefill_ms_per_token * tokens
        return Step(ms / 1000, prefill, emit, self.epoch)

    def complete(self, step: Step) -> list[Request]:
        """The end of `step`: prompts advance, tokens are emitted, finished requests leave.
        Returns the requests that emitted a token (check `.done`)."""
        if step.epoch != self.epoch:
            return []
        for req, n in step.prefill:
            if not req.aborted:
                req.prefilled += n
        now = self.clock()
        out: list[Request] = []
        for req in step.emit:
            if req.aborted:
                continue
            if req.generated == 0:
                req.first_token_at = now
                self.counters.prompt_tokens += req.prompt_tokens
                self._publish(req, req.keys)
            req.generated += 1
            self.counters.generation_tokens += 1
            out.append(req)
            if req.done:
                req.finished_at = now
                self.counters.success += 1
                # The output's blocks stay cached too: the prompt and the reply, cut into
                # tokens again as the client's next turn will be.
                self._publish(req, block_keys(req.text + req.reply, self.config.block_tokens))
                self._release(req)
        return out

    def _publish(self, req: Request, keys: list[int]) -> None:
        held = set(req.refs)
        for key in keys:
            if key in held:
                continue
            if req.private > 0:
                req.private -= 1
                self.cache.publish(key)
            elif not self.cache.add(key):
                # Only the block with a prompt's partial last token, cut again, needs one more.
                return
            req.refs.append(key)
            held.add(key)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        # In reverse, so that a sequence's tail is evicted before its prefix (as vLLM frees).
        for key in reversed(req.refs):
            self.cache.release(key)
        self.cache.private -= req.private
        req.refs, req.private = [], 0

    def abort(self, req: Request) -> None:
        """The client went away: drop the request, free its blocks."""
        if req.done:
            return
        req.aborted = True
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self._release(req)

    def reset(self) -> list[Request]:
        """Empty the cache and the counters; requests in flight are aborted (returned)."""
        dropped = [*self.running, *self.waiting]
        for req in dropped:
            req.aborted = True
        self.running.clear()
        self.waiting.clear()
        self.cache.clear()
        self.counters = Counters()
        self.epoch += 1
        return dropped

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_cache_usage": self.cache.in_use / self.cache.capacity,
            "cached_blocks": len(self.cache.refs),
            "evictions": self.cache.evictions,
            "requests": c.requests,
            "rejected": c.rejected,
            "success": c.success,
            "prefix_cache_queries": c.prefix_cache_queries,
            "prefix_cache_hits": c.prefix_cache_hits,
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
        }
