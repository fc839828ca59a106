"""A SkyServe YAML whose setup calls conda, which SkyPilot's VM images carry and this host (as
the replicas see it) lacks: `up` fails naming the command and what the host lacks, with the
real CLI and controller."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # about 25 s on a busy machine

# The shape of SkyPilot's llm/ examples' setup; PATH pinned so that a conda elsewhere on the
# machine (/opt/conda) is not found either.
SPEC = """\
    service:
      readiness_probe: /health
      replicas: 1
    envs:
      PATH: /usr/bin:/bin
    setup: |
      conda activate vllm
      if [ $? -ne 0 ]; then
        conda create -n vllm python=3.10 -y
        conda activate vllm
      fi
    run: python3 server.py
    """


def test_a_setup_calling_conda_on_a_host_without_it_says_so(fleet: Fleet) -> None:
    path = fleet.write_service("condasvc", SPEC)
    fleet.cli("up", str(path), "-n", "condasvc", "-d")
    deadline = time.monotonic() + 20
    failed = []
    while not failed and time.monotonic() < deadline:
        time.sleep(0.2)
        replicas = fleet.client().service("condasvc").replicas
        failed = [r for r in replicas if r.status == "FAILED_PROVISION"]
    assert failed, "no replica failed its setup within 20 s"
    replica = failed[0]
    reason = replica.reason or ""
    assert "setup failed with exit code 127: command not found in setup: conda" in reason
    assert "this host lacks conda (Miniconda), which SkyPilot's VM images carry" in reason
    assert "this host lacks conda" in fleet.cli("status", "condasvc", "-v").stdout
    fleet.cli("down", "condasvc")
