"""Does a target's place in a round change its figures? Reads bench/llm/run.py's JSON results
(`--json`, gzipped or not) of real-vLLM runs with several targets a round and prints, for the
first, middle and last places of a round, the TTFT p50 (and p99) against the round's geometric
mean: with no effect of the place, each would be ~1.00. Then, per target that ran in more
than one place, the same split, which separates the place from the target.

    .venv/bin/python bench/llm/positions.py bench/llm/results-*/*.json.gz

Why it matters: `--order mirror` (A B C, C B A) never runs a middle target first or last, so
an effect of the place weighs on the targets unevenly; `--order rotate` puts each target in
each place.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any] | None:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("engine") == "vllm" else None


def place(i: int, n: int) -> str:
    return "first" if i == 0 else "last" if i == n - 1 else "middle"


def target(policy: str) -> str:
    return policy.rsplit(" #", 1)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args()
    by_place: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_target: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    files = 0
    for path in args.results:
        data = load(path)
        if data is None:
            continue
        files += 1
        rounds: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
        for run in data.get("runs", []):  # (in the order they ran)
            rounds[(run["round"], run["workload"], run["load"])].append(run)
        for runs in rounds.values():
            if len(runs) < 3:
                continue
            for metric in ("ttft_p50_ms", "ttft_p99_ms"):
                values = [r.get(metric) for r in runs]
                if not all(isinstance(v, (int, float)) and v > 0 for v in values):
                    continue
                logs = [math.log(v) for v in values]  # type: ignore[arg-type]
                mean = sum(logs) / len(logs)
                for i, (run, lv) in enumerate(zip(runs, logs, strict=True)):
                    where = place(i, len(runs))
                    by_place[metric][where].append(lv - mean)
                    by_target[f"{target(run['policy'])} {metric}"][where].append(lv - mean)
    print(f"{files} result files with real vLLM; rounds of 3 or more targets")
    print("place    metric        rounds  x round's geometric mean  above it")
    for metric, places in by_place.items():
        for where in ("first", "middle", "last"):
            v = places.get(where, [])
            if v:
                above = sum(1 for x in v if x > 0) / len(v)
                print(
                    f"{where:8} {metric:13} {len(v):6}  {math.exp(sum(v) / len(v)):24.2f}"
                    f"  {above:7.0%}"
                )
    print("\nper target that ran in more than one place (TTFT p50, p99: x round mean, rounds)")
    for name, places in sorted(by_target.items()):
        if len(places) < 2:
            continue
        cells = ", ".join(
            f"{w} {math.exp(sum(v) / len(v)):.2f} ({len(v)})"
            for w in ("first", "middle", "last")
            if (v := places.get(w))
        )
        print(f"  {name}: {cells}")


if __name__ == "__main__":
    main()
