"""bench/lb/tokenizer_cost.py: what cache_aware's precise mode costs the load balancer's event loop
per prompt size (fleetserve.lb.prompt_tokens.LoopTokenizer), to choose INLINE_BYTES.

For each chat body size: the time to tokenize it inline (the loop is blocked that long), and
the time for a request to get its tokens from the tokenizer thread (the loop is free, but the
hand-off and the wake-up cost time on it, and the request waits), medians of --repeat runs.
Then the event loop's longest stall while one large body is tokenized inline, and off the loop
(a 1 ms ticker on the loop measures it).

From the repository root, with a model folder holding tokenizer.json (and a chat template):
    .venv/bin/python bench/lb/tokenizer_cost.py \
        --tokenizer ~/.cache/fleetserve/testbed/tiny-llama-v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from fleetserve.lb.prompt_tokens import LoopTokenizer, PromptTokenizer

WORDS = ["the", "of", "and", "cache", "prefix", "engine", "replica", "token", "model", "answer"]


def body(chars: int, seed: int) -> bytes:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    text = " ".join(words)
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


async def stall(work: asyncio.Future[tuple[int, ...]] | None, seconds: float) -> float:
    """The longest gap between 1 ms ticks on the loop while `work` runs (or `seconds` pass)."""
    worst, last = 0.0, time.perf_counter()
    end = last + seconds
    while (work is not None and not work.done()) or (work is None and time.perf_counter() < end):
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--large", type=int, default=250_000)
    args = parser.parse_args()
    loop_tok = LoopTokenizer(PromptTokenizer.load(args.tokenizer))
    await loop_tok.tokens_off_loop(body(100, 0))  # the thread (and its pool) made
    print("body bytes   inline ms   via thread ms   loop CPU of the hand-off ms   (medians)")
    for chars in (200, 1000, 2000, 4000, 8000, 16000, 64000):
        inline, thread, handoff = [], [], []
        for i in range(args.repeat):
            b = body(chars, i)
            t = time.perf_counter()
            a = loop_tok.tokens(b)
            inline.append(time.perf_counter() - t)
            t, cpu = time.perf_counter(), time.thread_time()
            c = await loop_tok.tokens_off_loop(b)
            thread.append(time.perf_counter() - t)
            handoff.append(time.thread_time() - cpu)  # this (the loop's) thread only
            assert a == c, "the thread's tokens differ from the inline ones"
        print(
            f"{len(b):>10,}   {statistics.median(inline) * 1e3:9.3f}   "
            f"{statistics.median(thread) * 1e3:13.3f}   {statistics.median(handoff) * 1e3:27.3f}"
        )
    large = body(args.large, 1)
    idle = await stall(None, 0.3)
    t = time.perf_counter()
    loop_tok.tokens(large)  # inline: the loop is blocked as long
    inline_s = time.perf_counter() - t
    off = asyncio.ensure_future(loop_tok.tokens_off_loop(large))
    t = time.perf_counter()
    worst = await stall(off, 0.0)
    off_s = time.perf_counter() - t
    print(
        f"{len(large):,}-byte body: inline {inline_s * 1e3:.0f} ms, the loop stalled as long; "
        f"off the loop {off_s * 1e3:.0f} ms, the loop's longest stall {worst * 1e3:.1f} ms "
        f"(idle: {idle * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    asyncio.run(main())
