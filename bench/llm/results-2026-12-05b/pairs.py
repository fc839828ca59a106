"""The side-by-side pairs of results-2026-12-05b.md, from the bench's --json files here.

    cd bench/llm/results-2026-12-05b
    python3 pairs.py Q.json.gz              # or several files: the counts are over all
    python3 pairs.py --turns Q.json.gz
    python3 pairs.py --moves moves-s2.json.gz

Per load and round: fleetserve's cache_aware (CA) against sglang-router's (SG) and least_load
(LL): TTFT p50 and p99, req/s, the engines' prefix-cache hit rate; then the count of pairs
meeting each clause of issue #22's goal. With --turns: TTFT of first turns and later turns
per target (from `per_request`: sent, session, turn, prompt characters, TTFT ms, e2e s, error).
With --moves (fake replicas, runs that record the replica): later turns that stayed on their
previous turn's replica against those that moved.
"""

from __future__ import annotations

import gzip
import json
import sys
from typing import Any


def load(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def turns(paths: list[str]) -> None:
    for path in paths:
        for r in load(path)["runs"]:
            ok = [x for x in r["per_request"] if x[4] is not None and x[6] is None]
            first = [x[4] for x in ok if x[2] == 0]
            later = [x[4] for x in ok if x[2] > 0]
            print(
                f"{path.rsplit('/', 1)[-1]:20} {r['policy']:26} first n={len(first):3} p50 "
                f"{quantile(first, 0.5):6.0f} p90 {quantile(first, 0.9):6.0f} | later "
                f"n={len(later):3} p50 {quantile(later, 0.5):6.0f} p90 {quantile(later, 0.9):6.0f}"
            )


def moves(paths: list[str]) -> None:
    """Later turns that went to the replica of their previous turn against those that went
    elsewhere (the fake replicas' X-Replica: per_request's 8th field, from 2026-12-05)."""
    for path in paths:
        for r in load(path)["runs"]:
            ok = sorted((x for x in r["per_request"] if x[6] is None), key=lambda x: (x[1], x[2]))
            where: dict[tuple[int, int], str | None] = {}
            stayed: list[float] = []
            moved: list[float] = []
            for x in ok:
                before = where.get((x[1], x[2] - 1), "?")
                if x[2] > 0 and before != "?":
                    (stayed if before == x[7] else moved).append(x[4])
                where[(x[1], x[2])] = x[7]
            print(
                f"{path.rsplit('/', 1)[-1]:20} {r['policy']:22} {r['load']:>4g}: later turns "
                f"stayed n={len(stayed):3} p50 {quantile(stayed, 0.5):6.0f} p90 "
                f"{quantile(stayed, 0.9):6.0f} | moved n={len(moved):3} p50 "
                f"{quantile(moved, 0.5):6.0f} p90 {quantile(moved, 0.9):6.0f}"
            )


def pairs(paths: list[str]) -> None:
    counts = dict.fromkeys(("p50<=SG", "p99<=SG", "p50<=0.5xLL", "req/s>=LL", "pairs"), 0)
    for path in paths:
        by: dict[tuple[float, int], dict[str, dict[str, Any]]] = {}
        for r in load(path)["runs"]:
            by.setdefault((r["load"], r.get("round", 0)), {})[r["policy"].split(" #")[0]] = r
        for (load_, rnd), t in sorted(by.items()):
            ca, sg, ll = t.get("cache_aware"), t.get("sglang:cache_aware"), t.get("least_load")
            if not (ca and sg and ll):
                continue
            counts["pairs"] += 1
            counts["p50<=SG"] += ca["ttft_p50_ms"] <= sg["ttft_p50_ms"]
            counts["p99<=SG"] += ca["ttft_p99_ms"] <= sg["ttft_p99_ms"]
            counts["p50<=0.5xLL"] += ca["ttft_p50_ms"] <= 0.5 * ll["ttft_p50_ms"]
            counts["req/s>=LL"] += ca["throughput_rps"] >= ll["throughput_rps"]
            print(
                f"{path.rsplit('/', 1)[-1]:20} {load_:>4g} #{rnd + 1}: TTFT p50 CA "
                f"{ca['ttft_p50_ms']:.0f} SG {sg['ttft_p50_ms']:.0f} LL {ll['ttft_p50_ms']:.0f} "
                f"(CA/SG {ca['ttft_p50_ms'] / sg['ttft_p50_ms']:.2f}, CA/LL "
                f"{ca['ttft_p50_ms'] / ll['ttft_p50_ms']:.2f}, SG/LL "
                f"{sg['ttft_p50_ms'] / ll['ttft_p50_ms']:.2f}) | p99 CA {ca['ttft_p99_ms']:.0f} "
                f"SG {sg['ttft_p99_ms']:.0f} (CA/SG {ca['ttft_p99_ms'] / sg['ttft_p99_ms']:.2f}) "
                f"| req/s CA/LL {ca['throughput_rps'] / ll['throughput_rps']:.2f} CA/SG "
                f"{ca['throughput_rps'] / sg['throughput_rps']:.2f} | hit CA "
                f"{ca['hit_rate']:.0%} SG {sg['hit_rate']:.0%} LL {ll['hit_rate']:.0%}"
            )
    print(counts)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--turns":
        turns(args[1:])
    elif args and args[0] == "--moves":
        moves(args[1:])
    else:
        pairs(args)
