"""Prints the figures of results-2026-12-06.md from the raw files of this folder: each run's
rounds side by side with the bench's round-by-round comparisons, then the rounds pooled by
seed and over every run. 2 vLLM replicas, 64 KV blocks each, prompts x0.45, on the slower
machine of 2026-12-06 (unloaded TTFT ~150 ms against ~70 ms before). `@log_choices=true` (a
debug log, no change of routing) is dropped from the labels. Run from the repository root:

    .venv/bin/python bench/llm/results-2026-12-06/summary.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run.py and its neighbours are top-level modules
sys.path.insert(0, str(HERE.parent / "results-2026-12-05e"))
sys.path.insert(0, str(HERE.parent / "results-2026-12-05g"))
import rounds as earlier  # noqa: E402  (results-2026-12-05e/rounds.py)
import run  # noqa: E402
import summary as pool  # noqa: E402  (results-2026-12-05g/summary.py: `pooled`)

RUNS = (
    ("Y3", "3 rounds, seed 52, chat 1.1: least_load, cache_aware, saturation weight 1, sglang"),
    ("Y4", "2 rounds, seed 52 (Y3's first two traffics): cache_aware, max_extra_load 32, sglang"),
    ("Y5", "2 rounds, seed 52 (the same): cost_owner, owner, sglang-router"),
    ("Y6", "3 rounds, seed 53, chat 0.9: least_load, cache_aware, owner, sglang-router"),
    ("Y7", "3 rounds, seed 53 (Y6's traffics): cache_aware, cost_owner, sglang-router"),
    ("Y8", "3 rounds, seed 54, chat 1.1: cache_aware, cost_owner, sglang-router"),
    ("Y9", "3 rounds, seed 55, chat 0.9: least_load, cache_aware, sglang-router"),
    ("Y10", "2 rounds, seed 56, --calibrate 4 (chat 0.845): the README's command"),
    ("Y11", "3 rounds, seed 57, --calibrate 4 (chat 0.845): the same"),
)
# Runs of one seed replay the same traffics (round n of each): pooled, each run's rounds are
# rounds of their own, and a pair is compared only within a run.
POOLS = (
    ("seed 52, far past the knee (Y3-Y5)", ("Y3", "Y4", "Y5")),
    ("seed 53, near the knee (Y6, Y7)", ("Y6", "Y7")),
    ("every run (Y3-Y11; a pair within one load)", tuple(f"Y{n}" for n in range(3, 12))),
)
pool.TARGETS = (
    "least_load",
    "cache_aware",
    "cache_aware@cache_saturation_weight=1",
    "cache_aware@max_extra_load=32",
    "cache_aware@cache_choice=cost_owner",
    "cache_aware@cache_choice=owner",
    "sglang:cache_aware",
)


def load(name: str) -> dict[str, Any]:
    d = earlier.load(HERE / f"{name}.json.gz")
    for r in d["runs"]:
        r["policy"] = r["policy"].replace("@log_choices=true", "")
    return d


def main() -> None:
    loaded = {}
    for name, what in RUNS:
        if (HERE / f"{name}.json.gz").exists():
            print(f"\n{name}: {what}")
            loaded[name] = d = load(name)
            earlier.rounds(d, measured_direct=True)
    for title, names in POOLS:
        runs, unloaded = pool.pooled([loaded[n] for n in names if n in loaded])
        print(f"\npooled, {title}: {len(unloaded)} rounds (a pair over the rounds both ran)")
        for line in run.paired_lines(run.paired(runs, unloaded)):
            print("  " + line)


if __name__ == "__main__":
    main()
