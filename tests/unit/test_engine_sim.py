"""The LLM engine model (fleetserve.sim.engine), the fleet harness that feeds the autoscaler
from it (fleetserve.sim.engine_sim), and `fleetserve simulate --engine`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fleetserve.sim.engine_sim as engine_sim
from fleetserve.policies.autoscaler import LoadObservation
from fleetserve.sim.engine import EngineConfig, Replica, Request
from fleetserve.sim.engine_sim import (
    POLICIES,
    Arrivals,
    Calibration,
    Workload,
    calibrate,
    engine_policy,
    move_waiting,
    plan_moves,
    run_engine_fleet,
)
from fleetserve.sim.simulator import Trace

ENGINE = EngineConfig()

# -- the engine model ---------------------------------------------------------------------------


def test_a_lone_request_waits_only_for_its_prefill_then_one_step_a_token() -> None:
    r = Request(0.0, prompt=600, output=5)
    replica = Replica(ENGINE)
    replica.advance(10.0, [r])
    prefill = ENGINE.step_seconds(0, 0, 600)
    assert r.ttft == pytest.approx(prefill)
    decode = ENGINE.step_seconds(1, 600 + 5 / 2, 0)
    assert r.finished_at == pytest.approx(prefill + 4 * decode)
    assert replica.load == 0 and replica.kv_used == 0
    # Prefix-cache hits shorten the prefill of a compute-bound prompt.
    hit = Request(0.0, prompt=600, output=5)
    Replica(dataclasses.replace(ENGINE, prefix_hit=0.5)).advance(10.0, [hit])
    assert hit.ttft is not None and hit.ttft < prefill
    assert hit.ttft == pytest.approx(ENGINE.step_seconds(0, 0, 300))


def test_a_decode_step_takes_longer_as_the_batch_and_its_context_grow() -> None:
    steps = [ENGINE.step_seconds(n, n * 800, 0) for n in (1, 16, 64, 256)]
    assert steps == sorted(steps) and steps[-1] > steps[0]
    # Past the memory time, a step is compute bound: each token computed counts.
    assert ENGINE.step_seconds(0, 0, 4000) > ENGINE.step_seconds(0, 0, 2000)


def test_a_queue_forms_when_arrivals_exceed_the_batch() -> None:
    cfg = dataclasses.replace(ENGINE, max_batch=2)
    reqs = [Request(0.0, 100, 200) for _ in range(5)]
    replica = Replica(cfg)
    replica.advance(0.5, reqs)
    assert replica.running == 2 and replica.queued == 3
    replica.advance(600.0)
    ttfts = [r.ttft for r in reqs]
    assert all(t is not None for t in ttfts)
    # The third waited for a place in the batch: for the first ones' whole decoding.
    assert ttfts[2] > ttfts[0] + 100 * ENGINE.step_seconds(2, 0, 0)  # type: ignore[operator]


def test_the_kv_cache_limits_what_runs() -> None:
    cfg = dataclasses.replace(ENGINE, kv_tokens=1000)
    reqs = [Request(0.0, 300, 100) for _ in range(4)]  # 400 tokens of context each
    replica = Replica(cfg)
    replica.advance(0.2, reqs)
    assert replica.running == 2 and replica.queued == 2
    assert replica.kv_usage == pytest.approx(0.8)
    replica.advance(1000.0)
    assert all(r.finished_at is not None for r in reqs)
    assert replica.kv_usage == 0


def test_expire_drops_the_oldest_waiting_requests() -> None:
    cfg = dataclasses.replace(ENGINE, max_batch=1)
    reqs = [Request(float(i), 100, 1000) for i in range(4)]
    replica = Replica(cfg)
    replica.advance(4.0, reqs)
    assert replica.running == 1 and replica.queued == 3
    assert replica.expire(2.5) == 2  # arrived at 1 and 2; the one at 3 still waits
    assert replica.queued == 1


def test_the_same_seed_gives_the_same_requests_and_times() -> None:
    def run(seed: int) -> list[tuple[float, int, int, float | None]]:
        reqs = Arrivals(Workload(), seed).second(0.0, 50.0, length=10.0)
        replica = Replica(ENGINE)
        replica.advance(600.0, reqs)
        return [(r.arrived, r.prompt, r.output, r.ttft) for r in reqs]

    a = run(1)
    assert len(a) > 100
    assert run(1) == a
    assert run(2) != a


def test_bad_engine_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="prefix_hit"):
        EngineConfig(prefix_hit=1.0)
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig(max_batch=0)
    with pytest.raises(ValueError, match="weights_ms"):
        EngineConfig(weights_ms=float("nan"))


# -- the harness --------------------------------------------------------------------------------

RISING = Trace("rising", 60.0, tuple(0.2 + 0.2 * i for i in range(30)))  # 0.2 -> 6 req/s


def calibration() -> Calibration:
    return calibrate(ENGINE, Workload(), 1000.0, seconds=600.0)


def test_the_targets_come_from_one_replicas_capacity() -> None:
    cal = calibration()
    assert cal.qps == pytest.approx(0.8 * cal.capacity_qps)
    ttfts, _, _ = engine_sim._steady(ENGINE, Workload(), cal.capacity_qps, 600.0, 0)
    assert engine_sim._percentile(ttfts, 90) <= 1.0  # the capacity meets the target
    ttfts, _, _ = engine_sim._steady(ENGINE, Workload(), 3 * cal.capacity_qps, 600.0, 0)
    assert engine_sim._percentile(ttfts, 90) > 1.0  # three times as much does not
    assert 0 < cal.kv_cache < 1 and cal.inflight > 0


def test_a_policy_that_scales_keeps_more_requests_under_target_than_one_that_does_not() -> None:
    cal = calibration()
    common = (ENGINE, Workload(), 1.0, 60.0, 0)
    fixed = run_engine_fleet(
        RISING, engine_policy("request_rate", cal, 1, 1, 60, 300, 60), "fixed", *common
    )
    scaling = run_engine_fleet(
        RISING, engine_policy("request_rate", cal, 1, 12, 60, 300, 60), "rr", *common
    )
    assert fixed.requests == scaling.requests  # the same requests
    assert fixed.max_replicas == 1 and scaling.max_replicas > 1
    assert scaling.over_target < fixed.over_target
    assert scaling.replica_hours > fixed.replica_hours


def test_replicas_scaled_down_drain_their_requests() -> None:
    """Up on a rise, down after it: every request gets its first token (none is lost with a
    replica taken away), and the fleet is billed for its drain."""
    cal = calibration()
    up_down = Trace("up-down", 60.0, (4.0,) * 15 + (0.2,) * 30)
    pol = engine_policy("in_flight", cal, 1, 12, 30, 120, 60)
    run = run_engine_fleet(up_down, pol, "in_flight", ENGINE, Workload(), 1.0, 60.0, 0)
    assert run.max_replicas > 2 and run.ready[-1] < run.max_replicas
    assert run.unserved == run.timed_out == 0
    assert len(run.ttfts) == run.requests


def test_every_policy_gets_the_engine_signals_and_scales_on_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cal = calibration()
    seen: dict[str, list[LoadObservation]] = {}
    real = engine_sim.autoscale

    def spy(policy, state, load, now, accelerator=None):  # type: ignore[no-untyped-def]
        seen.setdefault(current, []).append(load)
        return real(policy, state, load, now, accelerator)

    monkeypatch.setattr(engine_sim, "autoscale", spy)
    for current in POLICIES:
        pol = engine_policy(current, cal, 1, 12, 60, 300, 60)
        run = run_engine_fleet(RISING, pol, current, ENGINE, Workload(), 1.0, 60.0, 0)
        assert run.max_replicas > 1, current  # each signal saw the load rise
    for name, loads in seen.items():
        late = loads[-1]
        assert {"queue", "running", "kv_cache"} <= set(late.signals), name
        kv = late.signals["kv_cache"]
        assert kv.answered == kv.ready and kv.mean is not None and 0 <= kv.mean <= 1
        # the running requests come with the queue, per replica too (the queue's onset)
        running, queue = late.signals["running"], late.signals["queue"]
        assert len(running.pairs) == running.answered == queue.answered
        assert sum(w for _, w in running.pairs) / len(running.pairs) == queue.mean
    # while the load rose, some replica ran requests with others waiting behind them
    assert any(w > 0 and r > 0 for o in seen["queue"] for r, w in o.signals["running"].pairs)
    assert any(o.latency_ms is not None for o in seen["ttft"])
    assert all(o.latency_ms is None for o in seen["request_rate"])  # measured only if used


def test_latency_is_read_from_the_lb_buckets_as_the_controller_reads_it() -> None:
    """The simulator's window of TTFTs gives what the controller would get from the LB's
    histogram of the same requests (both read it with fleetserve.core.histogram.quantile)."""
    from fleetserve.controller.history import quantile
    from fleetserve.lb.metrics import LATENCY_BUCKETS

    bounds = list(LATENCY_BUCKETS)
    size = len(bounds) + 1
    window = engine_sim._LatencyWindow()
    ttfts = [0.2, 0.3, 0.45, 0.6, 0.7, 0.8, 1.5, 3.0, 0.4, 0.55]
    for i, t in enumerate(ttfts):
        window.add(float(i), t)
    hist = [sum(1 for t in ttfts if t <= b) for b in bounds] + [len(ttfts)]
    assert window.percentile_ms(90) == pytest.approx(1000 * quantile(bounds, hist, 0.9))  # type: ignore[operator]
    window.drop_until(7.0)  # the first 8 leave the window
    assert window.percentile_ms(50) == pytest.approx(
        1000 * quantile(bounds, [0] * 8 + [1, 2] + [2] * (size - 10), 0.5)
    )  # type: ignore[operator]
    window.drop_until(100.0)
    assert window.percentile_ms(90) is None


def test_a_trace_past_the_bound_is_refused_before_it_runs() -> None:
    huge = Trace("huge", 60.0, (1e6,) * 60)
    pol = engine_policy("request_rate", calibration(), 1, 2, 60, 300, 60)
    with pytest.raises(ValueError, match="--duration or --scale"):
        run_engine_fleet(huge, pol, "request_rate", ENGINE, Workload(), 1.0)


# -- the load balancer's moves of waiting requests (--move-waiting) ---------------------------


def test_plan_moves_follows_the_load_balancers_rule() -> None:
    # L = running + waiting: 10 against 0, one move at a time until L_R - L_S < 2.
    assert plan_moves([(2, 8), (0, 0)]) == [(0, 1)] * 5
    assert plan_moves([(0, 2), (0, 0)]) == [(0, 1)]
    assert plan_moves([(0, 1), (0, 0)]) == []  # 1 - 0 < 2
    assert plan_moves([(1, 1), (1, 1)]) == []  # no replica without a queue: no target
    assert plan_moves([(3, 0), (0, 0)]) == []  # nothing waits: no source
    # Sources: 0, 1 and 4 (waiting > 0; 4 has the lowest L but is never a target); targets:
    # 2 and 3. The busiest source to the least loaded target, ties to the first.
    # L = [7, 9, 1, 3, 2] -> [5, 5, 5, 5, 2]
    readings = [(4, 3), (4, 5), (1, 0), (3, 0), (0, 2)]
    assert plan_moves(readings) == [(1, 2), (1, 2), (0, 2), (1, 3), (0, 2), (1, 3)]
    # A source gives at most its waiting requests: 1 waiting, L 20 against 0.
    assert plan_moves([(19, 1), (0, 0)]) == [(0, 1)]


SMALL = dataclasses.replace(ENGINE, max_batch=2)


def _queued(n: int) -> list[Request]:
    return [Request(0.1 * i, 100, 200) for i in range(n)]


def _ttfts(reqs: list[Request]) -> list[float]:
    out = []
    for r in reqs:
        assert r.ttft is not None
        out.append(r.ttft)
    return out


def test_the_newest_waiting_requests_move_to_a_replica_that_became_ready() -> None:
    """One replica runs 2 and queues 8; a second becomes READY: 5 requests move (L 10 against
    0 down to 5 and 5), the 5 newest, newest first, to the end of its queue; their TTFT
    drops (but for the oldest of them, which now waits behind the four newer ones), the
    others' does not change; nothing moves back."""
    reqs, alone = _queued(10), _queued(10)
    a, b = Replica(SMALL), Replica(SMALL, now=1.0)
    a.advance(1.0, reqs)
    assert (a.running, a.queued) == (2, 8)
    moves = move_waiting([a, b], 1.0)
    assert [(r, i, j) for r, i, j in moves] == [(reqs[k], 0, 1) for k in (9, 8, 7, 6, 5)]
    assert list(b.waiting) == [reqs[9], reqs[8], reqs[7], reqs[6], reqs[5]]
    assert (a.queued, b.queued) == (3, 5) and all(r.moved for r in reqs[5:])
    assert not any(r.moved for r in reqs[:5])
    assert move_waiting([a, b], 1.0) == []  # L 5 and 5; b waits: no target
    a.advance(3600.0)
    b.advance(3600.0)
    one = Replica(SMALL)  # the same requests without the move
    one.advance(3600.0, alone)
    ttft, before = _ttfts(reqs), _ttfts(alone)
    for k in (6, 7, 8, 9):
        assert ttft[k] < before[k] - 10
        assert ttft[k] >= 1.0 - reqs[k].arrived  # counted from its first arrival, served after
    assert sum(ttft[5:]) < sum(before[5:]) - 50
    assert ttft[:5] == pytest.approx(before[:5])


def test_a_request_moves_at_most_once() -> None:
    """A replica whose waiting requests were all moved there gives none, though the plan
    counts them; the LB's plan is kept, not redone (a skipped move is not made elsewhere)."""
    reqs = _queued(6)
    a = Replica(dataclasses.replace(ENGINE, max_batch=1))
    b = Replica(dataclasses.replace(ENGINE, max_batch=1), now=1.0)
    a.advance(1.0, reqs)
    assert (a.running, a.queued) == (1, 5)
    assert [r for r, _, _ in move_waiting([a, b], 1.0)] == [reqs[5], reqs[4], reqs[3]]
    b.advance(1.5)  # b runs reqs[5], reqs[4] and reqs[3] wait there (moved)
    assert (a.running, a.queued, b.running, b.queued) == (1, 2, 1, 2)
    assert b.moved_waiting == 2
    c = Replica(SMALL, now=1.5)
    # plan: a -> c, then b -> c (L 3, 3, 0); b has nothing it may move
    assert plan_moves([(1, 2), (1, 2), (0, 0)]) == [(0, 2), (1, 2)]
    moves = move_waiting([a, b, c], 1.5)
    assert [(r, i, j) for r, i, j in moves] == [(reqs[2], 0, 2)]
    assert list(b.waiting) == [reqs[4], reqs[3]] and list(c.waiting) == [reqs[2]]
    # the one moved to c does not move again, even to an idle replica
    c.advance(1.6)
    d = Replica(SMALL, now=1.6)
    c.incoming.extend([Request(1.6, 100, 200) for _ in range(2)])
    c.advance(1.7)
    assert c.queued == 1 and c.waiting[0] is not reqs[2]  # reqs[2] runs; a newer one waits
    assert all(r is not reqs[2] for r, _, _ in move_waiting([c, d], 1.7))


def test_expire_counts_a_moved_requests_wait_from_its_move() -> None:
    """The LB sends a moved request again: its read timeout starts again at the move."""
    reqs = _queued(3)
    a, b = Replica(SMALL), Replica(SMALL, now=1.0)
    a.advance(1.0, reqs)
    assert [r for r, _, _ in move_waiting([a, b], 1.0)] == [reqs[2]]
    assert b.moved_waiting == 1
    assert b.expire(0.5) == 0 and b.queued == 1  # arrived at 0.2, sent to b at 1.0
    assert b.expire(1.01) == 1 and b.queued == 0 and b.moved_waiting == 0


def test_the_fleet_moves_only_between_ready_replicas_with_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fleet whose upscale finds a queue: with the flag requests move, each between READY
    replicas that are not draining (never to one starting), read every scrape; without it,
    nothing moves (the LB never plans)."""
    cal = calibration()
    pol = engine_policy("in_flight", cal, 2, 8, 30, 120, 60)
    nodes: list[engine_sim._Node] = []
    seen: list[tuple[float, int, int]] = []  # (now, replicas passed, not READY at that time)
    real_node, real_move = engine_sim._Node, engine_sim.move_waiting

    class Node(real_node):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            nodes.append(self)

    def spy(replicas: list[Replica], now: float) -> list[tuple[Request, int, int]]:
        live = [n for n in nodes if any(n.replica is r for r in replicas)]
        assert len(live) == len(replicas)
        assert all(n.ready_at <= now and not n.draining for n in live), now
        cold = [n for n in nodes if n.ready_at > now and n.replica.load == 0]
        moves = real_move(replicas, now)
        for _, _, j in moves:
            assert replicas[j].moved_waiting > 0
        seen.append((now, len(replicas), len(cold)))
        return moves

    monkeypatch.setattr(engine_sim, "_Node", Node)
    monkeypatch.setattr(engine_sim, "move_waiting", spy)
    up_down = Trace("up-down", 60.0, (6.0,) * 15 + (0.2,) * 15)
    args = (up_down, pol, "in_flight", ENGINE, Workload(), 1.0, 60.0, 0)
    moving = run_engine_fleet(*args, move=True)
    calls = len(seen)
    still = run_engine_fleet(*args)
    assert moving.moved > 0 and still.moved == 0
    assert calls > 0 and len(seen) == calls  # without the flag the LB never plans
    assert all(b - a == 5.0 for (a, _, _), (b, _, _) in itertools.pairwise(seen))
    assert any(cold for _, _, cold in seen)  # replicas were starting while requests moved
    assert moving.requests == still.requests
    assert moving.max_replicas > 2


# -- the CLI ------------------------------------------------------------------------------------


def _fleetserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetserve", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_compares_the_five_policies_on_the_engine_model() -> None:
    args = ("--burst", "0.5:4:1800:600", "--duration", "1800", "--max", "12", "--engine")
    proc = _fleetserve(*args, "--upscale-delay", "60")
    assert proc.returncode == 0, proc.stderr
    for word in (*POLICIES, "OVER TARGET", "REPLICA-HOURS", "SCALE EVENTS", "80% of that"):
        assert word in proc.stdout, word
    doc = json.loads(_fleetserve(*args, "--policy", "queue,ttft", "-o", "json").stdout)
    assert doc["kind"] == "engine"
    assert [p["policy"] for p in doc["policies"]] == ["queue", "ttft"]
    assert doc["policies"][1]["target"] == "target_ttft_ms: 1000"
    rule = doc["policies"][0]["target"]
    assert rule == f"target_queue_per_replica: {max(doc['targets']['target_queue'], 0.01):.4g}"
    given = json.loads(
        _fleetserve(*args, "--policy", "queue", "--engine-target", "queue=2", "-o", "json").stdout
    )
    assert given["policies"][0]["target"] == "target_queue_per_replica: 2 (given)"
    bad = _fleetserve(*args, "--target-qps", "3")
    assert bad.returncode == 2 and "--target-qps does not apply with --engine" in bad.stderr
    bad = _fleetserve(*args, "--engine-param", "kv_tokens=100")
    assert bad.returncode == 2 and "must fit in kv_tokens" in bad.stderr
    bad = _fleetserve("--trace", "maf1", "--engine")
    assert bad.returncode == 2 and "more than the engine model's bound" in bad.stderr
    bad = _fleetserve(*args, "--policy", "skyserve")
    assert bad.returncode == 2 and "with --engine use request_rate" in bad.stderr
    bad = _fleetserve(*args, "--engine-target", "kv_cache=2")
    assert bad.returncode == 2 and "target_kv_cache_usage" in bad.stderr


def test_cli_move_waiting_shows_the_moves_and_goes_only_with_engine() -> None:
    args: tuple[str, ...] = ("--burst", "0.5:4:1800:600", "--duration", "1800", "--max", "6")
    args += ("--engine", "--policy", "in_flight", "--upscale-delay", "60")
    plain = _fleetserve(*args)
    assert plain.returncode == 0, plain.stderr
    assert "MOVED" not in plain.stdout and "moves waiting" not in plain.stdout
    text = _fleetserve(*args, "--move-waiting")
    assert text.returncode == 0, text.stderr
    assert "MOVED" in text.stdout and "moves waiting requests" in text.stdout
    doc = json.loads(_fleetserve(*args, "--move-waiting", "-o", "json").stdout)
    assert doc["move_waiting_requests"] is True
    assert doc["policies"][0]["moved_requests"] > 0
    off = json.loads(_fleetserve(*args, "-o", "json").stdout)
    assert off["move_waiting_requests"] is False and off["policies"][0]["moved_requests"] is None
    for spelling in (("autoscale",), ()):
        bad = _fleetserve(*spelling, "--burst", "1:2:600:60", "--move-waiting")
        assert bad.returncode == 2 and "--move-waiting goes with --engine" in bad.stderr
    bad = _fleetserve("--spot-trace", "GCP1", "--move-waiting")
    assert bad.returncode == 2 and "--move-waiting goes with --engine" in bad.stderr


def test_cli_start_replays_a_held_out_stretch_of_a_trace(tmp_path: Path) -> None:
    """--start skips the trace's first seconds: here its busy first half."""
    csv = tmp_path / "t.csv"
    csv.write_text(
        "time_s,qps\n" + "".join(f"{60 * i},{3 if i < 20 else 0.2}\n" for i in range(40))
    )
    args = ("--trace", str(csv), "--engine", "--policy", "request_rate", "-o", "json")
    whole = json.loads(_fleetserve(*args).stdout)
    later = json.loads(_fleetserve(*args, "--start", "1200").stdout)
    assert whole["seconds"] == 2400 and later["seconds"] == 1200
    assert later["trace"] == "t.csv from 1200 s" and later["peak_qps"] == 0.2
    assert later["policies"][0]["requests"] < whole["policies"][0]["requests"] / 5


def test_cli_shows_progress_on_a_terminal() -> None:
    """On a terminal, the calibration and each policy's run are announced on stderr (12 h of
    MAF take seconds); stdout keeps only the result."""
    import os
    import pty
    import select
    import time

    main, sub = pty.openpty()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "fleetserve", "simulate", "--engine"),
            *("--burst", "0.5:3:900:300", "--duration", "1800"),
        ],
        stdout=subprocess.PIPE,
        stderr=sub,
        text=True,
    )
    os.close(sub)
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1)
        if ready:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    out, _ = proc.communicate(timeout=30)
    text = seen.decode()
    assert proc.returncode == 0, text
    assert "Simulating 5 policies on burst" in text, text
    for line in ("[1/6] capacity of one replica", "[2/6] request_rate", "[6/6] ttft"):
        assert line in text, text
    assert "[1/6]" not in out and "kv_cache" in out
