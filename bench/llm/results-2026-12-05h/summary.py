"""Prints the figures of results-2026-12-05h.md from the raw files of this folder: each run's
rounds side by side with the bench's round-by-round comparisons, then the rounds of X3-X8 and X10
pooled (4 vLLM replicas, 64 KV blocks each, chat at 1.8 conversations/s, prompts x0.45).
X1 and X2 (one round at two loads each: the calibration) are in the logs. Run from the
repository root:

    .venv/bin/python bench/llm/results-2026-12-05h/summary.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run.py and its neighbours are top-level modules
sys.path.insert(0, str(HERE.parent / "results-2026-12-05e"))
sys.path.insert(0, str(HERE.parent / "results-2026-12-05g"))
import rounds as earlier  # noqa: E402  (results-2026-12-05e/rounds.py)
import run  # noqa: E402
import summary as pool  # noqa: E402  (results-2026-12-05g/summary.py: `pooled`)

RUNS = (
    ("X3", "3 rounds, seed 42: cache_aware, its `match` choice, sglang-router"),
    ("X4", "3 rounds, seed 43: the same and the precise mode"),
    ("X5", "3 rounds, seed 44: least_load, cache_aware, the precise mode, sglang-router"),
    ("X6", "3 rounds, seed 45: cache_aware, `workers: 1`, sglang-router"),
    ("X7", "3 rounds, seed 46: the same"),
    ("X8", "3 rounds, seed 47: the same, after the index share stopped polling (a fix)"),
    ("X10", "3 rounds, seed 49, after the fix: least_load, cache_aware, sglang-router"),
)
# Two replicas at 2.0 conversations/s (results-2026-12-05g's setting), after the fix: printed
# on its own, not pooled with the four-replica runs.
TWO_REPLICAS = ("X9", "4 rounds, seed 48, 2 replicas: least_load, cache_aware, sglang-router")
pool.TARGETS = (
    "least_load",
    "cache_aware",
    "cache_aware@cache_choice=match",
    "cache_aware_precise",
    "cache_aware@workers=1",
    "sglang:cache_aware",
)


def main() -> None:
    loaded = []
    for name, what in RUNS:
        path = HERE / f"{name}.json.gz"
        print(f"\n{name}: {what}")
        d = earlier.load(path)
        earlier.rounds(d, measured_direct=True)
        loaded.append(d)
    for name, files in (("X3-X5", loaded[:3]), ("X3-X8 and X10", loaded)):
        runs, unloaded = pool.pooled(files)
        print(f"\npooled, {name} ({len(unloaded)} rounds; a target absent from a run")
        print("is compared over the rounds it ran):")
        for line in run.paired_lines(run.paired(runs, unloaded)):
            print("  " + line)
    name, what = TWO_REPLICAS
    print(f"\n{name}: {what}")
    earlier.rounds(earlier.load(HERE / f"{name}.json.gz"), measured_direct=True)


if __name__ == "__main__":
    main()
