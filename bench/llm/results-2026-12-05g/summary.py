"""Prints the figures of results-2026-12-05g.md from the raw files of this folder: each run's
rounds side by side with the bench's round-by-round comparisons, then every round pooled over
the runs (least_load, cache_aware at its default `cache_choice: cost`, the `owner` and
`cost_owner` choices, sglang-router; 2 vLLM replicas, 64 KV blocks each, chat at 2.0
conversations/s, prompts x0.45). Run from the repository root:

    .venv/bin/python bench/llm/results-2026-12-05g/summary.py
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
    ("W1", "5 rounds, seed 34 (far past the knee): owner beside the default"),
    ("W2", "5 rounds, seed 37 (nearer the knee): owner and cost_owner beside the default"),
    ("W3", "4 rounds, seed 35 (far past the knee): owner and cost_owner beside the default"),
    ("W4", "5 rounds, seed 34 (W1's traffics): cost_owner beside the default, no least_load"),
    ("W5", "4 rounds, seed 32: cost_owner beside the default, no least_load"),
    ("W6", "4 rounds, seed 38: cost_owner (its keeper by hash, 2nd commit) beside the default"),
)
OWNER = "cache_aware@cache_choice=owner"
COST_OWNER = "cache_aware@cache_choice=cost_owner"
TARGETS = ("least_load", "cache_aware", OWNER, COST_OWNER, "sglang:cache_aware")


def pooled(files: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The targets' runs of several files as one run of many rounds (renumbered), with their
    unloaded TTFTs (measured straight to a replica in every run here)."""
    runs: list[dict[str, Any]] = []
    unloaded: list[Any] = []
    for d in files:
        base = len(unloaded)
        for r in d["runs"]:
            if run.base_label(r["policy"]) in TARGETS:
                runs.append({**r, "round": base + r.get("round", 0)})
        unloaded += d["unloaded_rounds"]
    return runs, unloaded


def main() -> None:
    loaded = []
    for name, what in RUNS:
        path = HERE / f"{name}.json.gz"
        if path.exists():
            print(f"\n{name}: {what}")
            d = earlier.load(path)
            earlier.rounds(d, measured_direct=True)
            loaded.append(d)
    runs, unloaded = pooled(loaded)
    print(f"\npooled ({len(loaded)} runs, {len(unloaded)} rounds; a target absent from a run")
    print("is compared over the rounds it ran):")
    for line in run.paired_lines(run.paired(runs, unloaded)):
        print("  " + line)


if __name__ == "__main__":
    main()
