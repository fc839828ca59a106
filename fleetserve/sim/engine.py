"""A model of one LLM engine replica (vLLM-like continuous batching) on a virtual clock.

A replica holds a FIFO waiting queue and a running batch of at most `max_batch` requests whose
KV cache reservations fit in `kv_tokens`. A request is admitted (FIFO, nobody overtakes the
head) when the batch has room and its whole context (prompt + output tokens) fits in the KV
cache: the model reserves it at admission, so nothing is ever preempted, and the reported KV
cache usage is the reserved share. The engine runs steps, as vLLM's scheduler does: admit,
prefill up to `max_prefill_tokens` prompt tokens of the admitted requests (chunked prefill,
FIFO), and every running request whose prompt is done emits one token. A step takes the
longer of its memory time (reading the weights once, plus the KV cache of the batch) and its
compute time (every token it computes: the prefill chunk and one per decoding request): a
roofline. A request's first token comes at the end of the step in which its prefill
completes, then one token a step.

Between events (a request finishing, an arrival, the caller's horizon) every step is the
same, so the model jumps over them at once: the cost of a run is per request, not per step.
Deterministic: no randomness here (the arrivals and the lengths come from the caller).

The default `EngineConfig` is an illustration, not a measurement: Llama-3.1-8B in bf16 on one
NVIDIA L4 (24 GB, 300 GB/s, 121 TFLOPS bf16 dense) with vLLM's defaults, from the datasheet
by roofline arithmetic (docs/autoscaling.md, "Comparing policies on an engine model").
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineConfig:
    """One replica's engine. Times in milliseconds."""

    max_batch: int = 256  # running requests at most (vLLM's max_num_seqs)
    kv_tokens: int = 32_768  # KV cache capacity in tokens
    weights_ms: float = 55.0  # memory time of a step: the weights read once (16 GB at 300 GB/s)
    kv_ms_per_token: float = 0.00044  # + per token of context in the batch (128 KiB at 300 GB/s)
    compute_ms_per_token: float = 0.25  # compute time per token computed (16 GFLOP at ~65 TFLOPS)
    max_prefill_tokens: int = 2048  # prompt tokens prefilled per step (max_num_batched_tokens)
    prefix_hit: float = 0.0  # share of each prompt found in the prefix cache (not prefilled)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.kv_tokens < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_batch, kv_tokens and max_prefill_tokens must be >= 1")
        for name in ("weights_ms", "kv_ms_per_token", "compute_ms_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.weights_ms <= 0 and self.compute_ms_per_token <= 0:
            raise ValueError("a step must take some time: weights_ms or compute_ms_per_token > 0")
        if not 0 <= self.prefix_hit < 1:
            raise ValueError(f"prefix_hit must be in [0, 1), got {self.prefix_hit}")

    def step_seconds(self, decoding: int, context: float, prefill: int) -> float:
        """A step's time: the longer of reading the weights and the batch's KV cache, and
        computing its tokens (`prefill` prompt tokens and one per decoding request)."""
        memory = self.weights_ms + self.kv_ms_per_token * context
        compute = self.compute_ms_per_token * (decoding + prefill)
        return max(memory, compute) / 1000.0


class Request:
    """One request: its lengths and, once served, its times (seconds on the virtual clock)."""

    __slots__ = (
        "arrived",
        "finish_step",
        "finished_at",
        "first_token_at",
        "moved",
        "output",
        "prompt",
        "sent",
        "to_prefill",
    )

    def __init__(self, arrived: float, prompt: int, output: int) -> None:
        if prompt < 1 or output < 1:
            raise ValueError("a request has at least one prompt and one output token")
        self.arrived = arrived  # at the load balancer: its TTFT counts from here
        self.sent = arrived  # its wait in an engine counts from here (a move re-sends it)
        self.moved = False  # moved to another replica's queue by the load balancer (once)
        self.prompt = prompt
        self.output = output
        self.to_prefill = 0
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_step = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived

    @property
    def context(self) -> int:
        return self.prompt + self.output

    def __lt__(self, other: Request) -> bool:  # heap ties
        return self.arrived < other.arrived


@dataclass
class Replica:
    """One engine. `advance(until, arrivals)` runs it up to `until`; requests that got their
    first token or finished on the way are appended to `first_tokens` and `finished`."""

    config: EngineConfig
    now: float = 0.0  # the engine's clock: the end of its last step (may pass a horizon)
    waiting: deque[Request] = field(default_factory=deque)
    incoming: deque[Request] = field(default_factory=deque)  # sent, not yet arrived
    prefilling: deque[Request] = field(default_factory=deque)
    decoding: list[tuple[int, Request]] = field(default_factory=list)  # heap by finish step
    steps: int = 0  # decoding steps run (a request finishes when this reaches its mark)
    kv_used: int = 0  # tokens reserved by running requests
    context: float = 0.0  # the decoding requests' context, each at its mean over decoding
    first_tokens: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    moved_waiting: int = 0  # of the waiting requests, those moved here from another replica

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def queued(self) -> int:
        """Requests waiting (vLLM's num_requests_waiting), those sent to it included."""
        return len(self.waiting) + len(self.incoming)

    @property
    def load(self) -> int:
        """Requests in the engine: running and waiting."""
        return self.queued + self.running

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.config.kv_tokens

    def fits(self, request: Request) -> bool:
        return request.context <= self.config.kv_tokens

    def _admit(self) -> None:
        cfg = self.config
        while self.waiting and self.running < cfg.max_batch:
            head = self.waiting[0]
            if self.kv_used + head.context > cfg.kv_tokens:
                return
            self.waiting.popleft()
            if head.moved:
                self.moved_waiting -= 1
            self.kv_used += head.context
            head.to_prefill = max(1, round(head.prompt * (1 - cfg.prefix_hit)))
            self.prefilling.append(head)

    def _finish_decodes(self) -> None:
        while self.decoding and self.decoding[0][0] <= self.steps:
            _, r = heapq.heappop(self.decoding)
            r.finished_at = self.now
            self.kv_used -= r.context
            self.context -= r.prompt + r.output / 2
            self.finished.append(r)

    def advance(self, until: float, arrivals: Iterable[Request] = ()) -> None:
        """Run the engine up to `until`, the `arrivals` (in time order, none before an earlier
        call's arrivals) joining the waiting queue at the first step boundary at or after
        their arrival. A step that begins before `until` ends after it."""
        cfg = self.config
        incoming = self.incoming
        incoming.extend(arrivals)
        while True:
            while incoming and incoming[0].arrived <= self.now:
                self.waiting.append(incoming.popleft())
            if not self.prefilling and not self.decoding and not self.waiting:
                if incoming and incoming[0].arrived < until:
                    self.now = max(self.now, incoming[0].arrived)  # idle until it arrives
                    continue
                self.now = max(self.now, until)
                return
            if self.now >= until:
                return
            self._admit()
            decoding = len(self.decoding)
            if self.prefilling:
                budget = cfg.max_prefill_tokens
                chunk = 0
                done: list[Request] = []
                for r in self.prefilling:
                    take = min(budget, r.to_prefill)
                    r.to_prefill -= take
                    chunk += take
                    budget -= take
                    if r.to_prefill == 0:
                        done.append(r)
                    if budget == 0:
                        break
                self.now += cfg.step_seconds(decoding, self.context, chunk)
                self.steps += 1
                self._finish_decodes()
                for r in done:
                    self.prefilling.popleft()  # FIFO: the finished ones are at the front
                    r.first_token_at = self.now
                    self.first_tokens.append(r)
                    if r.output == 1:
                        r.finished_at = self.now
                        self.kv_used -= r.context
                        self.finished.append(r)
                    else:
                        r.finish_step = self.steps + r.output - 1
                        heapq.heappush(self.decoding, (r.finish_step, r))
                        self.context += r.prompt + r.output / 2
                continue
            if not self.decoding:
                # Waiting requests that cannot be admitted with nothing running never will be.
                raise RuntimeError("a waiting request does not fit in an empty engine")
            step = cfg.step_seconds(decoding, self.context, 0)
            horizon = min(incoming[0].arrived, until) if incoming else until
            k_time = max(1, math.ceil((horizon - self.now) / step - 1e-9))
            k = max(1, min(self.decoding[0][0] - self.steps, k_time))
            self.now += k * step
            self.steps += k
            self._finish_decodes()

    def expire(self, before: float) -> int:
        """Drop the waiting requests sent to this engine before `before` (their client, or the
        load balancer's read timeout, gave up on them): how many. Waiting is in the order they
        were sent (a request moved here was sent at its move, and joined the end)."""
        n = 0
        for queue in (self.waiting, self.incoming):
            while queue and queue[0].sent < before:
                if queue.popleft().moved:
                    self.moved_waiting -= 1
                n += 1
        return n

    def take_newest_waiting(self) -> Request | None:
        """Remove and return the newest waiting request that was never moved (the load
        balancer's move_waiting_requests takes it to another replica), or None."""
        if self.moved_waiting >= self.queued:
            return None
        for queue in (self.incoming, self.waiting):
            for i in range(len(queue) - 1, -1, -1):
                r = queue[i]
                if not r.moved:
                    del queue[i]
                    return r
        return None

    def receive_moved(self, request: Request, at: float) -> None:
        """`request`, moved here from another replica's queue at `at`, joins the end of the
        waiting queue as a new arrival (its TTFT still counts from its first arrival)."""
        request.moved = True
        request.sent = at
        if not (self.waiting or self.incoming or self.prefilling or self.decoding):
            self.now = max(self.now, at)  # an idle engine starts on it no earlier than `at`
        (self.incoming if self.incoming else self.waiting).append(request)
        self.moved_waiting += 1

    def take_events(self) -> tuple[list[Request], list[Request]]:
        """The requests that got their first token, and those that finished, since the last
        call."""
        first, done = self.first_tokens, self.finished
        self.first_tokens, self.finished = [], []
        return first, done
