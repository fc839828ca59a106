"""Prints the comparisons of results-2026-12-05d.md from the raw files: far past the knee on
real vLLM, fleetserve's cache_aware (defaults) against sglang-router, round by round (runs Q2,
Q3 of results-2026-12-05c and T1, T3 here), and what the load balancer's choice log says of
runs T2 and T3. Standalone on purpose (each results folder's script is)."""

from __future__ import annotations

import collections
import gzip
import json
import math
from pathlib import Path

HERE = Path(__file__).parent
RUNS = [
    HERE.parent / "results-2026-12-05c" / "Q2.json.gz",
    HERE.parent / "results-2026-12-05c" / "Q3.json.gz",
    HERE / "T1.json.gz",
    HERE / "T3.json.gz",
]
# At the goal's load (least_load's TTFT p50 3.9-5.8x unloaded): R2 and T4.
GOAL_RUNS = [HERE.parent / "results-2026-12-05c" / "R2.json.gz", HERE / "T4.json.gz"]
FAST_MS = 500


def load(path: Path) -> dict:
    with gzip.open(path) as f:
        return json.load(f)


def figures(run: dict) -> dict[str, float]:
    t = sorted(x[4] for x in run["per_request"] if x[4] is not None)
    n = len(t)
    return {
        "p50": run["ttft_p50_ms"],
        "mean": sum(t) / n,
        "p99": run["ttft_p99_ms"],
        "fast": sum(1 for x in t if x < FAST_MS) / n,
        "share": max(run["shares"]),
        "req/s": run["throughput_rps"],
    }


def rounds(runs: list[Path], title: str) -> None:
    print(
        f"\n{title}: TTFT ms, cache_aware (defaults) / sglang-router / least_load; "
        f"fast: share under {FAST_MS} ms"
    )
    rows = []
    for path in runs:
        by = {}
        for run in load(path)["runs"]:
            policy, _, rnd = run["policy"].partition(" #")
            by[(policy, rnd)] = figures(run)
        for rnd in ("1", "2"):
            ca, sg, ll = (by[(p, rnd)] for p in ("cache_aware", "sglang:cache_aware", "least_load"))
            rows.append((ca, sg, ll))
            name = f"{path.name.split('.')[0]} #{rnd}"
            print(
                f"{name:6} "
                + "  ".join(
                    f"{k} {ca[k]:.4g}/{sg[k]:.4g}/{ll[k]:.4g}"
                    for k in ("p50", "mean", "p99", "fast", "share", "req/s")
                )
            )
    print()
    for k in ("p50", "mean", "p99", "fast", "req/s"):
        better = (lambda a, b: a >= b) if k in ("fast", "req/s") else (lambda a, b: a <= b)
        wins = sum(1 for ca, sg, _ in rows if better(ca[k], sg[k]))

        def geo(i: int, j: int, k: str = k) -> float:
            return math.exp(sum(math.log(r[i][k] / r[j][k]) for r in rows) / len(rows))

        print(
            f"{k}: cache_aware at least as good as sglang-router in {wins} of {len(rows)} rounds; "
            f"geometric means: cache_aware/sglang {geo(0, 1):.2f}, cache_aware/least_load "
            f"{geo(0, 2):.2f}, sglang/least_load {geo(1, 2):.2f}"
        )


def choices() -> None:
    print("\nThe choice log (load_balancer.log_choices), both rounds of each target:")
    for path in sorted(HERE.glob("*.choices.gz")):
        counts: collections.Counter[str] = collections.Counter()
        with gzip.open(path) as f:
            for line in f:
                rec = json.loads(line.partition(b" choice ")[2])
                reps = rec["replicas"].values()
                depths = [v[0] for v in reps]
                counts[rec["why"]] += 1
                counts["choices"] += 1
                if rec["why"] != "new" and depths.count(max(depths)) > 1:
                    counts["tied"] += 1  # two replicas hold the same most of the prompt
                if rec["why"] in ("cost", "bound") and min(v[2] for v in reps) > 0:
                    counts["moved, every replica prefilling"] += 1
        print(f"  {path.name.split('.')[0]}: {dict(counts)}")


if __name__ == "__main__":
    rounds(RUNS, "Far past the knee (Q2, Q3, T1, T3)")
    rounds(GOAL_RUNS, "At the goal's load (R2, T4)")
    choices()
