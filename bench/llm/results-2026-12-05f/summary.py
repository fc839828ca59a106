"""Prints the figures of results-2026-12-05f.md from the raw files of this folder and of
results-2026-12-05e: each run's rounds side by side with the bench's round-by-round
comparisons, then every round of cache_aware, least_load and sglang-router at the goal's
setting (2 vLLM replicas, 64 KV blocks each, chat at 2.0 conversations/s, prompts x0.45)
pooled over the runs, per seed and in all. Run from the repository root:

    .venv/bin/python bench/llm/results-2026-12-05f/summary.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run.py and its neighbours are top-level modules
sys.path.insert(0, str(HERE.parent / "results-2026-12-05e"))
import rounds as earlier  # noqa: E402  (results-2026-12-05e/rounds.py)
import run  # noqa: E402

RUNS = (
    ("V5", "6 rounds, seed 32 (V2's first six traffics), cache_new: recent beside the default"),
    ("V6", "6 rounds, seed 31, cache_new: recent beside the default"),
    ("V7", "5 rounds, seed 34, cache_load_weight 0 beside the default"),
    (
        "V8",
        "5 rounds, seed 34 (V7's traffics): one LB worker; cache_load_weight 0 + max_extra_load 64",
    ),
    ("V9", "6 rounds, seed 35: one LB worker beside the default two"),
    ("V10", "6 rounds, seed 36: one LB worker beside the default two, no router"),
)
# Runs with least_load, cache_aware and sglang-router at the goal's setting: (file, seed,
# whether the bench measured its unloaded TTFT straight to a replica; V1 and V2 measured it
# through each round's first target and get results-2026-12-05e's correction).
POOLED = (
    (HERE.parent / "results-2026-12-05e" / "V1.json.gz", 30, False),
    (HERE.parent / "results-2026-12-05e" / "V2.json.gz", 32, False),
    (HERE / "V5.json.gz", 32, True),
    (HERE / "V6.json.gz", 31, True),
    (HERE / "V7.json.gz", 34, True),
)
TARGETS = ("least_load", "cache_aware", "sglang:cache_aware")


def pooled(files: list[tuple[dict[str, Any], bool]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The three targets' runs of several files as one run of many rounds (renumbered), and
    their unloaded TTFTs as a direct measurement gives them."""
    runs: list[dict[str, Any]] = []
    unloaded: list[Any] = []
    for d, direct in files:
        base = len(unloaded)
        for r in d["runs"]:
            if run.base_label(r["policy"]) in TARGETS:
                runs.append({**r, "round": base + r.get("round", 0)})
        unloaded += d["unloaded_rounds"] if direct else earlier.direct_baseline(d)
    return runs, unloaded


def main() -> None:
    for name, what in RUNS:
        path = HERE / f"{name}.json.gz"
        if path.exists():
            print(f"\n{name}: {what}")
            earlier.rounds(earlier.load(path), measured_direct=True)
    loaded = [((earlier.load(p), direct), seed) for p, seed, direct in POOLED if p.exists()]
    for seed in sorted({s for _, s in loaded}):
        files = [d for d, s in loaded if s == seed]
        runs, unloaded = pooled(files)
        rounds = len(unloaded)
        print(f"\npooled, seed {seed} ({len(files)} run{'s' * (len(files) > 1)}, {rounds} rounds):")
        for line in run.paired_lines(run.paired(runs, unloaded)):
            print("  " + line)
    runs, unloaded = pooled([d for d, _ in loaded])
    print(f"\npooled, every seed ({len(loaded)} runs, {len(unloaded)} rounds):")
    for line in run.paired_lines(run.paired(runs, unloaded)):
        print("  " + line)


if __name__ == "__main__":
    main()
