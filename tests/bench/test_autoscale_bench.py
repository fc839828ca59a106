"""bench/autoscale's service YAMLs: each policy's fleet, with and without the LB's
move_waiting_requests (`POLICY+move`), is a spec fleetserve accepts."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fleetserve.spec.loader import parse_spec

RUN = Path(__file__).resolve().parents[2] / "bench" / "autoscale" / "run.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_autoscale_run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        max_replicas=2,
        inflight_target=2,
        queue_target=1,
        ttft_target_ms=2000,
        upscale_delay=10,
        downscale_delay=40,
        max_num_seqs=2,
    )


@pytest.mark.parametrize("policy", ["request_rate", "engine_queue", "engine_queue+move"])
def test_each_fleet_is_a_valid_spec(
    bench: ModuleType, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "testbed_model", lambda: "/models/tiny")
    monkeypatch.setattr(bench, "testbed_python", lambda: Path("/venv/bin/python"))
    text = bench.service_yaml(policy, {"qps": 1.0}, _args())
    spec = parse_spec(text)
    assert spec.name == bench.fleet_name(policy)
    assert "+" not in spec.name
    lb = spec.service.load_balancer
    assert lb.move_waiting_requests is policy.endswith("+move")
    policy_block = spec.service.replica_policy
    assert policy_block is not None
    if policy.startswith("engine_queue"):
        assert policy_block.target_queue_per_replica == 1


def test_split_policy(bench: ModuleType) -> None:
    assert bench.split_policy("engine_queue+move") == ("engine_queue", True)
    assert bench.split_policy("engine_queue") == ("engine_queue", False)
    assert bench.split_policy("engine_queue+other") == ("engine_queue", False)
