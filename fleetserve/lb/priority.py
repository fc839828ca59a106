"""`load_balancer.engine_priority`: cache_aware tells the replica how much of each prompt it
lacks, as the request's scheduling priority (vLLM's `X-Vllm-Priority` header; lower is
earlier, read by an engine started with `--scheduling-policy priority`), so that an engine
with a queue admits first the requests it can answer soonest (docs/load-balancer.md)."""

from __future__ import annotations

import time
from collections.abc import Callable

# The client's own header is dropped from the head (fleetserve.lb.client) while the LB sends
# its hint: a client does not set its own priority.
PRIORITY = frozenset({b"x-vllm-priority"})
INT64_MAX = (1 << 63) - 1


class PriorityHints:
    """Writes the hint into a request's head. `uncached`: the prompt blocks the chosen
    replica does not hold; `deadline`: the time in ms since the epoch at which the request was
    first sent plus `ms_per_block` per such block (a long prefill is passed only by shorter
    ones that arrive within that margin after it). A request whose prompt the LB did not read
    whole (token ids, a list of prompts, a body past the read limit, one sent after `Expect:
    100-continue`, a request moved to another replica) counts as lacking all of its body: its
    bytes / `block_chars`."""

    __slots__ = ("block_chars", "clock", "deadline", "ms_per_block")

    def __init__(
        self,
        mode: str,
        ms_per_block: float,
        block_chars: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.deadline = mode == "deadline"
        self.ms_per_block = ms_per_block
        self.block_chars = block_chars
        self.clock = clock

    def stamp(self) -> int:
        """Now, in ms since the epoch (the LB's processes share it)."""
        return int(self.clock() * 1000)

    def head(self, head: bytes, missing: int | None, body_bytes: int, since_ms: int) -> bytes:
        if missing is None:
            missing = body_bytes // self.block_chars
        value = since_ms + round(self.ms_per_block * missing) if self.deadline else missing
        # (vLLM keeps it as a 64-bit integer; a client may claim any Content-Length)
        return b"%sX-Vllm-Priority: %d\r\n\r\n" % (head[:-2], min(value, INT64_MAX))


def priority_hints(mode: str | None, ms_per_block: float, block_chars: int) -> PriorityHints | None:
    """The hints of `load_balancer.engine_priority` (None: no mode)."""
    return None if mode is None else PriorityHints(mode, ms_per_block, block_chars)
