"""The figures of results-2026-12-05c.md, from the bench's --json files here.

    cd bench/llm/results-2026-12-05c
    python3 settings.py                       # each setting against sglang-router, 8 pairs each
    python3 settings.py --why matched         # why later turns changed replica (decision log)

Each SETTING-sSEED.json.gz is one run of `bench/llm/run.py --policies cache_aware --routers
sglang-router --workloads chat --loads chat:10,13 --seconds 15 --lb-workers 2 --cache-blocks
1024 --seed SEED` plus the setting's --lb-option (results-2026-12-05c.md lists them); their
`per_request` was dropped to keep them small. Per setting: in how many pairs (seed, load)
cache_aware's TTFT p50 and p99 were no higher than sglang-router's, the geometric mean of
the ratios, and the mean difference of the engines' prefix-cache hit rates; a run with
several cache_aware variants (`fk`, `ev`: `--policies ...,cache_aware@cache_choice=match@
max_extra_load=32`) gets a line per variant. `fk` ran without `--cache-blocks` (caches that
hold the working set) at 18 and 20 conversations/s, seeds 0 and 2, least_load beside.

--why NAME reads NAME.json.gz (a run with per_request) and NAME.decisions.jsonl.gz (one line
per cache_aware choice, written by a logging patch of this day, not kept: the prompt's length
`tc` in rendered characters, its blocks `n`, each eligible replica's matched blocks `d`,
queue `q` and requests in flight `i`, those within max_extra_load `w`, the choice `c`). Each
later turn is joined to its choice by its prompt's length (the rendering adds 14 characters
to a first turn's text and 17 per earlier turn) and counted by whether it stayed on its
previous turn's replica and why the choice fell where it did: `longest` (the replica the
index said held the most of it; `holders` how many tied there), `cost` (a replica holding
more was eligible but cost more), `limit` (every replica holding more was past
max_extra_load).
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import sys
from collections import Counter, defaultdict
from typing import Any

SETTINGS = (
    "matched",
    "matched2",
    "default",
    "default2",
    "x64",
    "least_cached",
    "least_cached_matched",
    "w01",
    "x16",
    "x16b",
    "x32",
    "fk",
    "ev",
)


def load(path: str) -> Any:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def geo(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def settings(names: list[str]) -> None:
    for name in names:
        p50: dict[str, list[float]] = defaultdict(list)
        p99: dict[str, list[float]] = defaultdict(list)
        hits: dict[str, list[float]] = defaultdict(list)
        for path in sorted(glob.glob(f"{name}-s*.json.gz")):
            by: dict[float, dict[str, Any]] = defaultdict(dict)
            for r in load(path)["runs"]:
                by[r["load"]][r["policy"].split(" #")[0]] = r
            for _, t in sorted(by.items()):
                sg = t.get("sglang:cache_aware")
                for policy, ca in t.items():
                    if sg is None or not policy.startswith("cache_aware"):
                        continue
                    p50[policy].append(ca["ttft_p50_ms"] / sg["ttft_p50_ms"])
                    p99[policy].append(ca["ttft_p99_ms"] / sg["ttft_p99_ms"])
                    hits[policy].append(ca["hit_rate"] - sg["hit_rate"])
        if not p50:
            print(f"{name:13} no runs")
        for policy, r50 in p50.items():
            r99, h = p99[policy], hits[policy]
            label = name if policy == "cache_aware" else f"{name} {policy}"
            print(
                f"{label:13} pairs {len(r50)}: p50 <= SG {sum(x <= 1 for x in r50)}, p99 <= SG "
                f"{sum(x <= 1 for x in r99)} | CA/SG geo mean p50 {geo(r50):.2f} p99 "
                f"{geo(r99):.2f} | hit rate - SG's {100 * sum(h) / len(h):+.1f} points | p50 "
                "ratios " + " ".join(f"{x:.2f}" for x in r50)
            )


def why(name: str) -> None:
    by_chars: dict[int, list[dict[str, Any]]] = defaultdict(list)
    with gzip.open(f"{name}.decisions.jsonl.gz", "rt") as f:
        for line in f:
            d = json.loads(line)
            by_chars[d["tc"]].append(d)
    counts: Counter[tuple[str, str]] = Counter()
    for run in load(f"{name}.json.gz")["runs"]:
        ok = sorted((x for x in run["per_request"] if x[6] is None), key=lambda x: (x[1], x[2]))
        replica: dict[tuple[int, int], str] = {}
        for _, session, turn, chars, *_rest, rep in ok:
            replica[(session, turn)] = rep
            before = replica.get((session, turn - 1))
            if turn == 0 or before is None:
                continue
            moved = "moved" if before != rep else "stayed"
            found = by_chars.get(chars + 14 + 17 * turn, [])
            if len(found) != 1:
                counts[(moved, "not joined")] += 1
                continue
            d = found[0]
            depth = {int(k): v for k, v in d["d"].items()}
            most = max(depth.values())
            holders = [k for k, v in depth.items() if v == most]
            if depth[d["c"]] == most:
                reason = f"longest, holders {len(holders)}"
            elif any(h in d["w"] for h in holders):
                reason = "cost"
            else:
                reason = "limit"
            counts[(moved, reason)] += 1
    for (moved, reason), n in sorted(counts.items()):
        print(f"{name}: {moved:6} {reason:20} {n}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--why"]:
        for n in args[1:]:
            why(n)
    else:
        settings(args or list(SETTINGS))
