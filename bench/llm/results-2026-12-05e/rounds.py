"""Prints the figures of results-2026-12-05e.md from the raw files of this folder and of
results-2026-12-05d: each run's rounds side by side, the round-by-round comparisons the bench
now prints (bench/llm/run.py `paired`), and the timelines of T4 and T5 rebuilt from their
per-request records. Run from the repository root with the project's venv:

    .venv/bin/python bench/llm/results-2026-12-05e/rounds.py
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run.py and its neighbours are top-level modules
import run  # noqa: E402


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path) as f:
        return json.load(f)  # type: ignore[no-any-return]


def rounds(d: dict[str, Any], measured_direct: bool = False) -> None:
    """A run's rounds side by side and its round-by-round comparisons; then, for a run from
    before the bench measured the unloaded TTFT straight to a replica, those of the rounds
    where least_load queued 3x against `direct_baseline`."""
    unloaded = d.get("unloaded_rounds") or []
    by: dict[int, dict[str, dict[str, Any]]] = {}
    for r in d["runs"]:
        by.setdefault(r.get("round", 0), {})[run.base_label(r["policy"])] = r
    names = sorted({k for v in by.values() for k in v})
    print("round, traffic, unloaded TTFT p50 ms, least_load's p50 / unloaded | per target:")
    print("TTFT p50 / p99 / mean ms, engine hit rate")
    for n in sorted(by):
        u = unloaded[n]["chat"]["ttft_p50_ms"] if n < len(unloaded) else math.nan
        ll = by[n].get("least_load")
        times = f"{ll['ttft_p50_ms'] / u:.1f}x" if ll else "-"
        cells = []
        for name in names:
            r = by[n].get(name)
            cells.append(
                f"{name[:18]:>18} -"
                if r is None
                else f"{name[:18]:>18} {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f}/"
                f"{r['ttft_mean_ms']:.0f} {r['hit_rate'] * 100:.0f}%"
            )
        traffic = next(iter(by[n].values())).get("traffic", "-")
        print(f"  {n + 1:2d} {traffic!s:>4} {u:4.0f} {times:>5} |" + " |".join(cells))
    for line in run.paired_lines(run.paired(d["runs"], unloaded)):
        print("  " + line)
    fixed = unloaded if measured_direct else direct_baseline(d)
    if fixed != unloaded:
        print("  with the rounds measured through least_load given the others' mean baseline:")
        for line in run.paired_lines(run.paired(d["runs"], fixed)):
            if "where least_load" in line:
                print("  " + line)


def direct_baseline(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Each round's unloaded TTFT as these runs should have measured it (the bench now goes
    straight to a replica): a round whose first target was least_load measured it through
    least_load, whose spreading of a conversation's turns made the later turns miss; such a
    round gets the mean of the rounds measured through a cache-aware target instead."""
    first: dict[int, str] = {}
    for r in d["runs"]:
        first.setdefault(r.get("round", 0), run.base_label(r["policy"]))
    rounds_ = d.get("unloaded_rounds") or []
    kept = [u["chat"]["ttft_p50_ms"] for n, u in enumerate(rounds_) if first.get(n) != "least_load"]
    if not kept:
        return rounds_
    mean = sum(kept) / len(kept)
    return [
        {"chat": {"ttft_p50_ms": mean}} if first.get(n) == "least_load" else u
        for n, u in enumerate(rounds_)
    ]


def timelines(path: Path) -> None:
    """A run's timeline from its measured requests (a conversation that began in the
    warm-up counts its first measured prompt whole: a little more new text early on)."""
    d = load(path)
    plan = run.Plan(**d["plan"])
    for r in d["runs"]:
        records = [
            run.Record(
                sent=sent,
                measured=True,
                max_tokens=0,
                turn=turn,
                session=session,
                prompt_chars=chars,
                ttft=None if ttft is None else ttft / 1e3,
            )
            for sent, session, turn, chars, ttft, *_ in r["per_request"]
        ]
        cells = " ".join(
            f"{c / 1000:.0f}k:{'-' if p90 is None else f'{p90:.0f}'}"
            for _, _, c, _, p90 in run.timeline(records, plan)
        )
        print(f"  {r['policy']:<24}{cells}")


def main() -> None:
    for name, what in (
        ("V1", "10 rounds at the goal's load, seed 30, chat 2.0"),
        ("V2", "8 rounds, a held-out seed 32, chat 2.0"),
        ("V3", "6 rounds, seed 30, chat 2.0: the precise mode beside the approximate one"),
        ("V4", "6 rounds, seed 32, chat 2.0: cache_load_weight 0.1 beside the default"),
        ("U1", "3 rounds, seed 30, chat 1.9, and the longest match"),
        ("U4", "2 rounds, replicas with --max-num-seqs 5"),
        ("U5", "one traffic (round 2's) four times, --max-num-seqs 5"),
        ("U2", "cache_aware alone, 2 rounds, with its choice log"),
    ):
        path = HERE / f"{name}.json.gz"
        if path.exists():
            print(f"\n{name}: {what}")
            rounds(load(path))
    older = HERE.parent / "results-2026-12-05d"
    for name in ("T4", "T5"):
        print(f"\n{name} (results-2026-12-05d): new prompt characters : TTFT p90 ms, per 10 s")
        timelines(older / f"{name}.json.gz")


if __name__ == "__main__":
    main()
