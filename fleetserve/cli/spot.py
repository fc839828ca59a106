"""`fleetserve simulate --spot-trace`: spot placers compared on a spot-capacity trace."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fleetserve.sim.simulator import Trace, need_matplotlib
from fleetserve.sim.spot import ALL_POLICIES, SpotRun, SpotTrace, simulate_spot
from fleetserve.spec.models import ReplicaPolicy


def run_spot(
    trace: SpotTrace,
    policies: list[str],
    target: int,
    requests: Trace | None,
    target_qps: float,
    min_replicas: int,
    max_replicas: int,
    cold_start: float,
    overprovision: int,
    seeds: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[tuple[SpotRun, int]]:
    """Each policy over the trace; a placer with random ties runs `seeds` times and the runs
    are averaged (returned as the mean run and the number of seeds). `progress(what, done,
    total)` is told before each run."""
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}: use {', '.join(ALL_POLICIES)}")
    rp = ReplicaPolicy(
        min_replicas=1, dynamic_ondemand_fallback=True, num_overprovision=overprovision
    )
    if requests is not None:
        reqs = requests

        def want(t: float) -> int:
            need = math.ceil(reqs.at(t) / target_qps) if target_qps > 0 else min_replicas
            return max(min_replicas, min(max_replicas, need))

        goal: int | Callable[[float], int] = want
    else:
        goal = target
    results = []
    counts = [seeds if name == "dynamic_fallback" else 1 for name in policies]
    done, total = 0, sum(counts)
    for name, n in zip(policies, counts, strict=True):  # dynamic_fallback: random ties
        runs = []
        for seed in range(n):
            if progress is not None:
                progress(name if n == 1 else f"{name} (seed {seed + 1} of {n})", done, total)
            runs.append(
                simulate_spot(
                    trace,
                    name,
                    target=goal,
                    replica_policy=rp,
                    cold_start=cold_start,
                    requests=requests,
                    capacity_qps=target_qps,
                    seed=seed,
                )
            )
            done += 1
        results.append((_mean(runs), n))
    return results


def _mean(runs: list[SpotRun]) -> SpotRun:
    if len(runs) == 1:
        return runs[0]
    m = SpotRun(runs[0].policy)
    for field in (
        "seconds",
        "cost",
        "on_demand_cost",
        "available_seconds",
        "requests",
        "over_capacity",
        "spot_seconds",
        "od_seconds",
    ):
        setattr(m, field, sum(getattr(r, field) for r in runs) / len(runs))
    for field in ("preemptions", "launches", "failed_launches"):
        setattr(m, field, round(sum(getattr(r, field) for r in runs) / len(runs)))
    return m


def show(
    console: Console, trace: SpotTrace, results: list[tuple[SpotRun, int]], as_json: bool
) -> None:
    if as_json:
        doc = {
            "trace": trace.name,
            "zones": trace.zones,
            "days": round(trace.seconds / 86400, 2),
            "policies": [dict(r.as_dict(), seeds=n) for r, n in results],
        }
        console.print_json(json.dumps(doc))
        return
    table = Table(
        title=f"Spot placers on {trace.name}: {len(trace.zones)} zones, "
        f"{trace.seconds / 86400:.1f} days",
        title_justify="left",
    )
    for col in (
        "POLICY",
        "COST vs ON-DEMAND",
        "AVAILABILITY",
        "OVER CAPACITY",
        "PREEMPTIONS",
        "LAUNCHES",
        "FAILED LAUNCHES",
        "SPOT SHARE",
    ):
        table.add_column(col)
    for r, n in results:
        d = r.as_dict()
        table.add_row(
            r.policy + (f" (mean of {n})" if n > 1 else ""),
            f"{r.relative_cost:.3f}",
            f"{100 * r.availability:.2f}%",
            f"{100 * r.over_capacity_share:.2f}%",
            str(r.preemptions),
            str(r.launches),
            str(r.failed_launches),
            f"{100 * float(d['spot_share']):.0f}%",
        )
    console.print(table)


def plot_spot(trace: SpotTrace, results: list[tuple[SpotRun, int]], out: Path) -> None:
    """Cost against availability, one point per policy."""
    need_matplotlib()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, _n in results:
        ax.scatter(r.relative_cost, 100 * r.availability)
        ax.annotate(r.policy, (r.relative_cost, 100 * r.availability), fontsize=8)
    ax.set_xlabel("cost relative to all on-demand")
    ax.set_ylabel("availability (% of time with the target READY)")
    ax.set_title(f"Spot placers on {trace.name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
