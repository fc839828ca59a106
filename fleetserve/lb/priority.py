"""`load_balancer.engine_priority`: cache_aware tells the replica how much of each prompt it
lacks, as the request's scheduling priority (vLLM's `X-Vllm-Priority` header; lower is
earlier, read by an engine started with `--scheduling-policy priority`), so that an engine
with a queue admits first the requests it can answer soonest (docs/load-balancer.md)."""

from __future__ import annotations

import time
from collections.abc import Callable

# The client's own header is dropped from the head (fleetserve.lb.client) while the LB sends
# its hint: no client puts itself ahead of the others.
PRIORITY = frozenset({b"x-vllm-priority"})

PriorityHeader = Callable[[bytes, int], bytes]


def priority_header(
    mode: str | None, ms_per_block: float, clock: Callable[[], float] = time.time
) -> PriorityHeader | None:
    """The function that adds the hint to a request's head (None: no `mode`). `uncached`: the
    prompt blocks the chosen replica does not hold; `deadline`: the time in ms since the
    epoch plus `ms_per_block` per such block (a long prefill waits for the shorter ones that
    arrive within that margin, never longer). A request whose prompt the LB does not read
    (no JSON prompt, token ids) counts as lacking none."""
    if mode is None:
        return None
    deadline = mode == "deadline"

    def write(head: bytes, missing: int) -> bytes:
        value = int(clock() * 1000) + round(ms_per_block * missing) if deadline else missing
        return b"%sX-Vllm-Priority: %d\r\n\r\n" % (head[:-2], value)

    return write
