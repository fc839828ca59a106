"""cache_aware: route an LLM request to the replica whose KV cache most likely holds the
longest prefix of its prompt, unless that replica is too loaded.

The load balancer cannot see a replica's cache, so it keeps its own approximation: for every
replica, the prompts it recently sent there, cut into blocks of `block_chars` characters and
keyed by a hash chain (block i's key covers blocks 0..i, as vLLM's prefix cache keys its token
blocks). A set of such keys is a prefix tree: a prompt matches a replica for as many leading
blocks as that replica holds. Each replica's keys live in an LRU of `blocks` entries, evicted
least recently used first, as the replica's own cache evicts.

Choosing (`CacheAware.select`): the replicas fewer than `max_extra_load` requests busier than
the least loaded one are eligible (so none is ever chosen past that). Among them, by default
(`choice="cost"`), the one that would give this prompt its first token soonest by an estimate
in prompt blocks: the blocks it would have to prefill for it (the prompt's blocks past what
its cache holds), plus `load_weight` x (the blocks it still has to prefill for the streamed
requests sent to it that have not yet answered their first byte, which the load balancer
counts: `prefilling`; plus `decode_weight` per request it has in flight). A conversation
thus stays on the replica that holds its history while the queue there costs less than
prefilling the history elsewhere, and goes elsewhere when it costs more: the trade is made
per request in the unit that decides the time to first token, not by a fixed load margin.
With `choice="match"` (the policy before 2026-12-05): the longest match, ties to the less
loaded. With `choice="owner"`: the longest match, ties to a keeper rather than the less
loaded, so that the conversations sharing a system prompt stay on one replica as
sglang-router's tree keeps them (each system prompt lives in one cache, until the load bound
sends it to a second replica). With `choice="cost_owner"`: the cost rule, except that when
the replica it picks is one of several that hold the prompt's deepest matched prefix, their
keeper gets the prompt. The keeper is the one of those replicas that the consistent hash of
the prompt's first block picks (`_tie`): every process agrees on it. Between equally good
replicas (cost: the same cost; match: a new conversation, a prompt nobody shares) the less
loaded wins, then a consistent hash of the prompt's first block, so that the processes of one
load balancer and a restarted one place the same new prompt on the same replica (the precise
mode first keeps, of those, the replicas whose engines hold clearly fewer blocks: `_roomiest`
in fleetserve.policies.cache_aware_precise; close counts still go to the hash). Requests
without a prompt (GET, non-JSON) or with one shorter than a block go by least load (cost: the
least queue first).

Several processes of one load balancer (fleetserve.lb.index_share) share one index: each
process tells the others its choices (`on_record`) and its in-flight counts, and applies
theirs (`PrefixIndex.record`, `peer_inflight`). Their keys must agree, so such processes key
the chain with a secret of the load balancer (`share_keys`: keyed BLAKE2b) instead of Python's
per-process salted `hash()`; either way a client cannot predict the keys.

Cost on the request path: one pass over the prompt (slices and tuple hashes, ~0.3 us a block;
keyed BLAKE2b ~1.2 us) and one dict lookup per block until the match ends. Memory: ~200 bytes
per (replica, block).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from fleetserve.policies.lb import NO_KEY, HashRing, LeastLoad, RequestKey
from fleetserve.policies.prompt import prompt_prefix

# ~64 tokens (4 of vLLM's 16-token blocks): finer would cost more hashing and index upkeep per
# request (bench/lb/policies.py) for no better choice (bench/llm).
DEFAULT_BLOCK_CHARS = 256
DEFAULT_BLOCKS = 2048  # per replica: ~512K characters, ~128K tokens of prompt
MAX_PROMPT_CHARS = 4 * 1024 * 1024  # what one request may make the index hash
MAX_MESSAGES = 4096  # messages (and content parts) read of one request; the rest is ignored
DEFAULT_MAX_BODY_BYTES = 256 * 1024  # of a body read before choosing (cache_max_body_bytes)
CHOICES = ("cost", "match", "owner", "cost_owner")


def _part_text(content: object) -> str:
    """A message's content: a string, or OpenAI's list of parts (their text parts); anything
    else (numbers, objects) is no text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (p.get("text") for p in content[:MAX_MESSAGES] if isinstance(p, dict))
        return "".join(t for t in texts if isinstance(t, str))
    return ""


_STREAM = re.compile(rb'"stream"\s*:\s*true')


def prompt_text(body: bytes) -> str | None:
    """The prompt of an OpenAI-style JSON body, rendered so that a later turn of the same
    conversation starts with an earlier turn's rendering: chat `messages` (role and content of
    each, in order), else `prompt` (a string, or the first of a list), else `input`. None when
    the body is not such JSON."""
    return parse_prompt(body)[0]


def parse_prompt(body: bytes) -> tuple[str | None, bool, bool]:
    """`prompt_text` of the body, whether it asks for a streamed answer, and whether that
    text is all of the prompt (False: the first of a list of prompts, or cut at a bound)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, False, False
    if not isinstance(doc, dict):
        return None, False, False
    text, whole = _render(doc)
    return text, doc.get("stream") is True, whole


def _render(doc: dict[str, object]) -> tuple[str | None, bool]:
    messages = doc.get("messages")
    whole = True
    if isinstance(messages, list) and messages:
        parts = []
        size = 0
        whole = len(messages) <= MAX_MESSAGES
        for m in messages[:MAX_MESSAGES]:
            if isinstance(m, dict):
                role = m.get("role")
                part = f"\x1e{role if isinstance(role, str) else ''}\x1f"
                part += _part_text(m.get("content"))
                parts.append(part)
                size += len(part)
                if size >= MAX_PROMPT_CHARS:
                    break
        text = "".join(parts)
    else:
        prompt = doc.get("prompt", doc.get("input"))
        if isinstance(prompt, list) and prompt:
            whole = len(prompt) == 1  # a batch: placed by its first prompt
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else ""
    if len(text) > MAX_PROMPT_CHARS:
        text, whole = text[:MAX_PROMPT_CHARS], False
    return text or None, whole


def block_keys(text: str, block_chars: int) -> tuple[int, ...]:
    """The hash chain of the prompt's full blocks (a trailing partial block is not cached by a
    replica either). Keys are process-local (Python's salted hash), as is the index."""
    keys = []
    prev = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        prev = hash((prev, text[start : start + block_chars]))
        keys.append(prev)
    return tuple(keys)


def keyed_block_keys(text: str, block_chars: int, keyed: hashlib.blake2b) -> tuple[int, ...]:
    """The same chain under a secret: block i's key is the keyed BLAKE2b (8 bytes) of the
    prompt's first i + 1 blocks (UTF-8), so every process that holds the secret (`keyed` is a
    hasher made with it) computes the same keys, and nobody without it can aim at one."""
    keys = []
    h = keyed.copy()
    update, digest = h.update, h.digest
    for start in range(0, len(text) - block_chars + 1, block_chars):
        # (surrogatepass: a JSON string may hold a lone surrogate)
        update(text[start : start + block_chars].encode("utf-8", "surrogatepass"))
        keys.append(int.from_bytes(digest(), "little"))
    return tuple(keys)


class PrefixIndex:
    """Which replica recently held which prompt blocks: an LRU of block keys per replica and,
    for lookups, each key's holders as a bit mask over replica slots."""

    def __init__(self, blocks: int = DEFAULT_BLOCKS) -> None:
        self.capacity = blocks
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._holders: dict[int, int] = {}  # key -> bit mask of replica slots
        self._slot: dict[int, int] = {}  # replica id -> bit
        self._free_slots: list[int] = []

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def _bit(self, replica: int) -> int:
        bit = self._slot.get(replica)
        if bit is None:
            bit = self._free_slots.pop() if self._free_slots else 1 << len(self._slot)
            self._slot[replica] = bit
            self._lru[replica] = OrderedDict()
        return bit

    def record(self, replica: int, keys: Sequence[int]) -> None:
        """`replica` now holds these blocks (most recently used); its oldest ones past the
        capacity are forgotten."""
        if not keys:
            return
        bit = self._bit(replica)
        lru = self._lru[replica]
        holders = self._holders
        # Last block first: a prompt's first blocks end up the most recent, so its tail is
        # evicted before its prefix (as vLLM frees a sequence's blocks), and what stays of
        # it still matches.
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holders[key] = holders.get(key, 0) | bit
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def _drop(self, key: int, bit: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def forget(self, replica: int) -> None:
        """A replica left the set: its cache went with it."""
        bit = self._slot.pop(replica, None)
        if bit is None:
            return
        for key in self._lru.pop(replica):
            self._drop(key, bit)
        self._free_slots.append(bit)

    def match(self, keys: Sequence[int], among: Sequence[int]) -> tuple[int, list[int]]:
        """The longest run of leading blocks held by one of `among`, and the replicas that hold
        that many (all of `among` when the match is 0)."""
        alive = 0
        for rid in among:
            bit = self._slot.get(rid)
            if bit is not None:
                alive |= bit
        depth = 0
        holders = self._holders
        for key in keys:
            left = alive & holders.get(key, 0)
            if not left:
                break
            alive = left
            depth += 1
        if depth == 0:
            return 0, list(among)
        return depth, [rid for rid in among if self._slot.get(rid, 0) & alive]

    def depths(self, keys: Sequence[int], among: Sequence[int]) -> dict[int, float]:
        """How many leading blocks of `keys` each of `among` holds (0 for one it holds none
        of, or never heard of)."""
        out: dict[int, float] = dict.fromkeys(among, 0)
        bits = [(rid, self._slot[rid]) for rid in among if rid in self._slot]
        alive = 0
        for _, bit in bits:
            alive |= bit
        depth = 0
        holders = self._holders
        for key in keys:
            if not alive:
                break
            held = alive & holders.get(key, 0)
            if held != alive:
                gone = alive & ~held
                for rid, bit in bits:
                    if gone & bit:
                        out[rid] = depth
            alive = held
            depth += 1
        if alive:
            for rid, bit in bits:
                if alive & bit:
                    out[rid] = depth
        return out

    def replicas(self) -> list[int]:
        return list(self._lru)

    def snapshot(self, most: int) -> dict[int, list[int]]:
        """Each replica's newest `most` keys, newest first: `record(replica, keys)` of them
        rebuilds that part of the LRU in its order (a new process catching up)."""
        out = {}
        for rid, lru in self._lru.items():
            newest: list[int] = []
            for key in reversed(lru):
                if len(newest) >= most:
                    break
                newest.append(key)
            out[rid] = newest
        return out


class CacheAware:
    """The cache_aware selector (see the module's docstring). Its capabilities
    (fleetserve.policies.capabilities): it reads the body (its first `body_limit` bytes),
    forgets replicas, reports each choice, shares its index and reads the replicas' load."""

    DEFAULT_MAX_EXTRA_LOAD = 8
    DEFAULT_CHOICE = "cost"
    DEFAULT_DECODE_WEIGHT = 1.0
    # The queue against the prompt's own prefill (bench/llm/results-2026-12-04c.md): below 1,
    # as a conversation moved away costs its later turns and a second copy of its history in
    # another cache.
    DEFAULT_LOAD_WEIGHT = 0.25

    def __init__(
        self,
        max_extra_load: int = DEFAULT_MAX_EXTRA_LOAD,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        blocks: int = DEFAULT_BLOCKS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        choice: str = DEFAULT_CHOICE,
        decode_weight: float = DEFAULT_DECODE_WEIGHT,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
    ) -> None:
        if choice not in CHOICES:
            raise ValueError(
                f"cache_aware's choice must be one of {', '.join(CHOICES)}, not {choice!r}"
            )
        self.max_extra_load = max_extra_load
        self.choice = choice
        self._costs = choice in ("cost", "cost_owner")  # the cost rule, with or without keeper
        self.decode_weight = decode_weight
        self.load_weight = load_weight
        # The prompt blocks each replica still has to prefill for the requests sent to it that
        # have not answered their first byte: this process's (the load balancer's ReplicaSet
        # keeps it: WeighsPrefill) and the LB's other processes' (fleetserve.lb.index_share).
        self.prefilling: dict[int, int] = {}
        self.peer_prefilling: dict[int, int] = {}
        # The blocks the last choice's replica has to prefill for that request: the load
        # balancer adds them to `prefilling` when the request is sent, until its first byte.
        self.last_uncached = 0
        # The prompt blocks the last choice's replica did not hold (streamed or not): the load
        # balancer's `engine_priority` hint; None for a request without a prompt.
        self.last_missing: int | None = None
        self.block_chars = block_chars
        self.body_limit = max_body_bytes
        self.index = PrefixIndex(blocks)
        self._rings: dict[tuple[int, ...], HashRing] = {}  # by member set (a canary has two)
        self.fallback = LeastLoad()
        # The replicas' own running + waiting counts, when the LB reads their metrics
        # (`replica_metrics_seconds`): a replica's load is the larger of that and our count.
        self.reported: dict[int, int] = {}
        # Told of each decision (blocks matched, blocks of the prompt, how many more requests
        # the chosen replica had in flight than the least loaded one): the LB's metrics.
        self.on_choice: Callable[[int, int, int], None] | None = None
        # Sharing the index with the LB's other processes (fleetserve.lb.index_share): told of
        # each choice (the replica and the prompt's keys, () without a prompt), and their
        # in-flight counts added up, per replica (added to this process's own).
        self.on_record: Callable[[int, tuple[int, ...]], None] | None = None
        # Told why each choice with a prompt was made (`load_balancer.log_choices`): `_why`.
        self.explain: Callable[[dict[str, object]], None] | None = None
        self.peer_inflight: dict[int, int] = {}
        self._keyed: hashlib.blake2b | None = None

    def share_keys(self, secret: bytes) -> None:
        """Key the block hashes with the load balancer's secret (all its processes hold the
        same one) instead of this process's salted `hash()`, so that their keys agree."""
        self._keyed = hashlib.blake2b(key=secret, digest_size=8)

    def keys(self, text: str | None) -> tuple[int, ...]:
        if not text:
            return ()
        if self._keyed is not None:
            return keyed_block_keys(text, self.block_chars, self._keyed)
        return block_keys(text, self.block_chars)

    def body_key(self, body: bytes, complete: bool) -> RequestKey:
        """The prompt's blocks: of a whole body, parsed; of a longer one (its first
        `body_limit` bytes), its first prompt field's start."""
        if complete:
            text, streams, whole = parse_prompt(body)
        else:
            text, streams = prompt_prefix(body, 1 << 20), _STREAM.search(body) is not None
            whole = False
        if text is None:
            return NO_KEY
        return RequestKey(
            prefix=text[: self.block_chars],
            blocks=self.keys(text),
            text_chars=len(text),
            streams=streams,
            partial=not whole,
        )

    def forget(self, replica: int) -> None:
        """A replica left the set (ReplicaSet.replace tells): its cache went with it. Not on
        a mere exclusion (a retry, a canary's side): the replica still holds what it held."""
        self.index.forget(replica)

    def select(
        self,
        candidates: Sequence[int],
        inflight: Mapping[int, int],
        exclude: frozenset[int],
        key: RequestKey = NO_KEY,
    ) -> int | None:
        peers, reported = self.peer_inflight, self.reported
        if peers or reported:
            inflight = {
                r: max(inflight.get(r, 0) + peers.get(r, 0), reported.get(r, 0)) for r in candidates
            }
        keys = key.blocks
        self.last_uncached = 0
        self.last_missing = None
        costs_rule = self._costs
        owned = False  # the owner rule overrode what cost (or load) would have chosen
        queued = costs_rule and bool(self.prefilling or self.peer_prefilling)
        if not keys and not queued:
            return self._by_load(candidates, inflight, exclude)
        eligible = [rid for rid in candidates if rid not in exclude]
        if not eligible:
            return None
        least = min(inflight.get(rid, 0) for rid in eligible)
        limit = least + self.max_extra_load  # this busy or more: passed over
        within = [rid for rid in eligible if inflight.get(rid, 0) < limit]
        if not keys:
            # No prompt to match (or one shorter than a block): the least queue, then load.
            queue = {rid: self._queue(rid, inflight) for rid in within}
            shortest = min(queue.values())
            return self._by_load([r for r in within if queue[r] == shortest], inflight, exclude)
        if costs_rule:
            depths = self.index.depths(keys, within)
            n = len(keys)
            weight = self.load_weight
            cost = {rid: n - depths[rid] + weight * self._queue(rid, inflight) for rid in within}
            lowest = min(cost.values())
            best = [rid for rid in within if cost[rid] == lowest]
            if len(best) > 1:  # (the least loaded of them, the roomiest, then the hash)
                fewest = min(inflight.get(rid, 0) for rid in best)
                best = self._roomiest([rid for rid in best if inflight.get(rid, 0) == fewest])
            choice = best[0] if len(best) == 1 else self._tie(key, candidates, best)
            deepest = max(depths.values()) if self.choice == "cost_owner" else 0
            if deepest and depths[choice] == deepest:
                holders = [rid for rid in within if depths[rid] == deepest]
                if len(holders) > 1:
                    keeper = self._tie(key, candidates, holders)
                    owned, choice = keeper != choice, keeper
            depth = round(depths[choice])
            # Counted as queued until the first byte: a streamed answer's first token. A
            # whole answer's first byte comes at its end, after all of its decoding: not
            # counted (its request still weighs as one in flight).
            self.last_uncached = max(0, len(keys) - depth) if key.streams else 0
        else:
            depth, best = self.index.match(keys, within)
            if depth and self.choice == "owner" and len(best) > 1:
                choice = self._tie(key, candidates, best)
                owned = choice != min(best, key=lambda rid: inflight.get(rid, 0))
            elif depth:
                choice = min(best, key=lambda rid: inflight.get(rid, 0))
            else:
                # Nobody holds any of it: the least loaded, ties broken by the hash.
                idle = [rid for rid in within if inflight.get(rid, 0) == least]
                choice = self._tie(key, candidates, self._roomiest(idle))
        # (a prompt read in part lacks an unknown share: engine_priority counts its body)
        self.last_missing = None if key.partial else max(0, len(keys) - depth)
        if self.explain is not None:
            costs = cost if costs_rule else None
            self.explain(self._why(keys, eligible, inflight, choice, costs, owned))
        self.index.record(choice, keys)
        if self.on_record is not None:
            self.on_record(choice, keys)
        if self.on_choice is not None:
            self.on_choice(depth, len(keys), inflight.get(choice, 0) - least)
        return choice

    def _why(
        self,
        keys: Sequence[int],
        eligible: Sequence[int],
        inflight: Mapping[int, int],
        choice: int,
        costs: Mapping[int, float] | None,
        owned: bool = False,
    ) -> dict[str, object]:
        """One choice, for the choice log: the prompt's blocks, each eligible replica's
        matched blocks, requests in flight and prompt blocks queued (and its cost under the
        cost rule; `null`: passed over by max_extra_load), and why the chosen one won:
        `match` (it holds the most of the prompt, or shares the most with others), `cost`
        (another holds more, but its queue cost more), `bound` (the one that holds the most
        was max_extra_load busier than the least loaded), `new` (nobody holds any of it)."""
        # (Without the precise index's report of its match: the choice made it already.)
        hook = getattr(self.index, "on_precise", None)
        if hook is not None:
            self.index.on_precise = None  # type: ignore[attr-defined]
        try:
            depths = self.index.depths(keys, eligible)
        finally:
            if hook is not None:
                self.index.on_precise = hook  # type: ignore[attr-defined]
        deepest = max(depths.values())
        # `costs`: the cost rule's, of the replicas within max_extra_load (the others: None).
        within = costs if costs is not None else {}
        replicas = {}
        for rid in eligible:
            cost = within.get(rid)
            replicas[str(rid)] = [
                round(depths[rid]),
                inflight.get(rid, 0),
                self._backlog(rid),
                None if cost is None else round(cost, 2),
            ]
        if not deepest:
            why = "new"
        elif owned:
            why = "owner"
        elif depths[choice] >= deepest:
            why = "match"
        elif costs is not None and any(depths[r] >= deepest for r in costs):
            why = "cost"
        else:
            why = "bound"
        return {"replica": choice, "blocks": len(keys), "why": why, "replicas": replicas}

    def _roomiest(self, tied: list[int]) -> list[int]:
        """Of replicas equally good for a request, those whose caches have clearly more room
        than the others (the approximate index cannot say: all of them; the precise mode
        knows)."""
        return tied

    def _backlog(self, rid: int) -> int:
        """The prompt blocks a replica still prefills for requests not yet answered."""
        return self.prefilling.get(rid, 0) + self.peer_prefilling.get(rid, 0)

    def _queue(self, rid: int, inflight: Mapping[int, int]) -> float:
        """What waits on a replica before a new prompt's prefill, in prompt blocks: the blocks
        it still prefills for requests not yet answered (this process's and the others') and
        `decode_weight` per request in flight."""
        return self._backlog(rid) + self.decode_weight * inflight.get(rid, 0)

    def _by_load(
        self, candidates: Sequence[int], inflight: Mapping[int, int], exclude: frozenset[int]
    ) -> int | None:
        """The least loaded of `candidates` (no prompt to place by): the other processes
        still hear of the choice (its load)."""
        picked = self.fallback.select(candidates, inflight, exclude)
        if picked is not None and self.on_record is not None:
            self.on_record(picked, ())
        return picked

    def _tie(self, key: RequestKey, candidates: Sequence[int], tied: Sequence[int]) -> int:
        """One of `tied` by a consistent hash of the prompt's first block (stable across
        processes, unlike the keys), so every LB process agrees."""
        if len(tied) == 1:
            return tied[0]
        keep = frozenset(tied)
        others = frozenset(rid for rid in candidates if rid not in keep)
        first = key.prefix if key.prefix is not None else str(key.blocks[0])
        members = tuple(candidates)
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) >= 8:
                self._rings.clear()
            ring = self._rings[members] = HashRing()
        hashed = ring.lookup(members, first, others)
        return tied[0] if hashed is None else hashed  # (a replica id may be 0)
