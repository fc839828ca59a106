"""bench/lb/policies.py: what a load-balancing policy costs on the request path.

Starts 2 fast replicas (bench/lb/replica.py) and one fleetserve load balancer (python data
plane, default workers) per policy, then runs the same bounded wrk load against each,
interleaved over rounds: POSTs of OpenAI-style chat bodies (a shared system prompt and a
history of a few KiB, 64 different conversations in turn), the shape cache_aware parses.
Prints req/s, p50 and p99 per policy and the ratios to round_robin measured in the same run.

Needs wrk (Debian: apt-get install wrk). Run from the repository root:
    .venv/bin/python bench/lb/policies.py [--rounds 3] [--seconds 5] [--connections 32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import Procs, start_fleetserve, start_replica, wrk

POLICIES = ("round_robin", "least_load", "prefix_affinity", "cache_aware")
# Variants measured beside them: a name, the policy, its options.
VARIANTS = {"cache_aware/match": ("cache_aware", {"cache_choice": "match"})}
SYSTEM = "You are a support assistant for an online shop. Answer briefly and politely. " * 8


def chat_lua(conversations: int = 64) -> str:
    """A wrk script that sends each conversation's body in turn (2-5 KiB each)."""
    bodies = []
    for c in range(conversations):
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(1 + c % 4):
            messages.append({"role": "user", "content": f"conversation {c}, question {t}. " * 20})
            messages.append({"role": "assistant", "content": f"answer {t} to {c}. " * 15})
        messages.pop()
        bodies.append(json.dumps({"model": "m", "messages": messages, "stream": False}))
    table = ",\n".join("[[" + b + "]]" for b in bodies)
    return f"""bodies = {{
{table}
}}
n = 0
request = function()
  n = n + 1
  local body = bodies[(n % #bodies) + 1]
  return wrk.format("POST", "/v1/chat/completions", {{["Content-Type"] = "application/json"}}, body)
end
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/lb/policies.py needs wrk: apt-get install wrk")
    work = Path(tempfile.mkdtemp(prefix="fleetserve-bench-policies-"))
    procs = Procs(work)
    lua = work / "chat.lua"
    lua.write_text(chat_lua())
    try:
        ports = [start_replica(procs, i)[0] for i in (1, 2)]
        targets = {}
        plan: list[tuple[str, str, dict[str, object]]] = [(p, p, {}) for p in POLICIES]
        plan += [(name, p, opts) for name, (p, opts) in VARIANTS.items()]
        for name, policy, options in plan:
            port, _admin = start_fleetserve(
                procs, f"lb-{name.replace('/', '-')}", ports, policy=policy, options=options
            )
            targets[name] = f"http://127.0.0.1:{port}/"
        time.sleep(0.5)
        runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in targets}
        for r in range(args.rounds):
            for name, url in targets.items():
                runs[name].append(wrk(url, args.seconds, args.connections, lua))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        procs.stop_all()
    figures = {
        name: {
            "rps": statistics.median(x[0] for x in v),
            "p50_ms": statistics.median(x[1] for x in v),
            "p99_ms": statistics.median(x[2] for x in v),
        }
        for name, v in runs.items()
    }
    base = figures["round_robin"]
    print(
        f"\nchat bodies (2-5 KiB), {args.connections} connections, 2 replicas, "
        f"LB workers: default, median of {args.rounds} interleaved rounds of {args.seconds} s"
    )
    print(
        f"{'policy':<18}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'req/s vs rr':>13}{'p99 vs rr':>11}"
    )
    for name, f in figures.items():
        print(
            f"{name:<18}{f['rps']:>10,.0f}{f['p50_ms']:>9.2f}{f['p99_ms']:>9.2f}"
            f"{f['rps'] / base['rps']:>12.2f}x{f['p99_ms'] / base['p99_ms']:>10.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
