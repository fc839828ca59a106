"""Paired rounds of several bench/llm real-vLLM runs, pooled: for two targets that ran in the
same rounds (the same traffic, the same run), the ratio of one to the other per round, then
the geometric mean over all such rounds of all the files given and how many rounds the first
was as good or better in. The round is the unit: a run's own summary only pools its own.

    .venv/bin/python bench/llm/pooled.py A=cache_aware B=sglang:cache_aware \\
        [--load 1.099] bench/llm/results-*/*.json.gz /tmp/runs/*.json

Figures: TTFT p50, p99, the p50 of first turns (a new conversation: where its system prompt
is placed) and of later turns (a conversation's next turn: whether its history is still
cached), req/s, and the engines' hit rate (difference in points, not a ratio).
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from positions import load, target  # (bench/llm/positions.py, run from this folder's parent)

METRICS = (
    ("TTFT p50", "ttft_p50_ms", True),
    ("TTFT p99", "ttft_p99_ms", True),
    ("first turns' p50", "ttft_first_turn_p50_ms", True),
    ("later turns' p50", "ttft_later_turns_p50_ms", True),
    ("req/s", "throughput_rps", False),
)


def pairs(
    data: dict[str, Any], a: str, b: str, load_: float | None
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], int]:
    """(a's run, b's run) of each round where both ran once (the same workload and load),
    and how many rounds were left out because one of them ran more than once there."""
    rounds: dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]] = defaultdict(dict)
    for run in data.get("runs", []):
        if load_ is not None and abs(float(run.get("load", -1)) - load_) > 1e-9:
            continue
        key = (run["round"], run["workload"], run["load"])
        rounds[key].setdefault(target(run["policy"]), []).append(run)
    out, twice = [], 0
    for r in rounds.values():
        if a in r and b in r:
            if len(r[a]) == 1 and len(r[b]) == 1:
                out.append((r[a][0], r[b][0]))
            else:
                twice += 1
    return out, twice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="A=target (as in the runs: cache_aware, sglang:cache_aware)")
    ap.add_argument("b", help="B=target")
    ap.add_argument("--load", type=float, default=None, help="only the runs at this load")
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args()
    a, b = args.a.removeprefix("A="), args.b.removeprefix("B=")
    found: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    seen: dict[str, Path] = {}
    twice = 0
    for path in args.results:
        name = path.name.removesuffix(".gz").removesuffix(".json")
        if name in seen:  # (one run's JSON, gzipped and not: counted once)
            print(f"skipped {path}: the same run as {seen[name]}")
            continue
        data = load(path)
        if data is not None:
            seen[name] = path
            got, left_out = pairs(data, a, b, args.load)
            found += [(name, x, y) for x, y in got]
            twice += left_out
    if not found:
        raise SystemExit(f"no round where both {a} and {b} ran in the files given")
    files = sorted({name for name, _, _ in found})
    loads = sorted({x["load"] for _, x, _ in found})
    print(
        f"{a} / {b}: {len(found)} paired rounds in {len(files)} files ({', '.join(files)}),"
        f" loads {', '.join(map(str, loads))}"
    )
    if twice:
        print(f"({twice} rounds left out: {a} or {b} ran more than once in them)")
    for label, field, lower_is_better in METRICS:
        logs = []
        better = 0
        for _, x, y in found:
            vx, vy = x.get(field), y.get(field)
            if not (isinstance(vx, (int, float)) and isinstance(vy, (int, float))):
                continue
            if vx <= 0 or vy <= 0:
                continue
            logs.append(math.log(vx / vy))
            better += (vx <= vy) if lower_is_better else (vx >= vy)
        if logs:
            mean = math.exp(sum(logs) / len(logs))
            low, high = math.exp(min(logs)), math.exp(max(logs))
            print(
                f"  {label:17} {mean:5.2f}x  (as good or better in {better} of {len(logs)};"
                f" {low:.2f}-{high:.2f})"
            )
    hits = []
    for _, x, y in found:
        hx, hy = x.get("hit_rate"), y.get("hit_rate")
        if isinstance(hx, (int, float)) and isinstance(hy, (int, float)):
            hits.append(100 * (hx - hy))
    if hits:
        up = sum(1 for h in hits if h > 0)
        mean = sum(hits) / len(hits)
        print(f"  engine hit rate   {mean:+.1f} points (higher in {up} of {len(hits)})")


if __name__ == "__main__":
    main()
