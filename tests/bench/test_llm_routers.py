"""bench/llm's other routers (sglang-router, vllm-router, from ./scripts/llm/setup.sh's
.venv-vllm, which scripts/test.sh makes) in front of the fake replicas: every answer comes
whole through each of them. SGLang's router forwards an answer's length only as
`max_completion_tokens`; a fake replica that read `max_tokens` alone cut answers at 16 tokens,
which this run counts as failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("FLEETSERVE_VLLM_VENV", REPO / ".venv-vllm"))


@pytest.mark.slow
def test_the_other_routers_serve_the_fake_replicas_whole_answers(tmp_path: Path) -> None:
    routers = ("sglang-router", "vllm-router")
    missing = [r for r in routers if not (VENV / "bin" / r).exists()]
    if missing:
        pytest.fail(f"{missing} not in {VENV}: run ./scripts/llm/setup.sh (scripts/test.sh does)")
    out = tmp_path / "out.json"
    cmd = [
        *(sys.executable, str(REPO / "bench" / "llm" / "run.py")),
        *("--policies", "least_load", "--routers", ",".join(routers)),
        *("--workloads", "chat", "--loads", "chat:4", "--warmup", "0.5", "--seconds", "2"),
        *("--drain", "10", "--quiet", "--json", str(out)),
    ]
    env = {**os.environ, "FLEETSERVE_VLLM_VENV": str(VENV)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["skipped"] == {}
    runs = {r["policy"]: r for r in results["runs"]}
    assert set(runs) == {"least_load", "sglang:cache_aware", "vllm:cache_aware"}
    for name, run in runs.items():
        assert run["requests"] >= 5, (name, run["requests"])
        assert run["failed"] == 0 and run["completed"] == run["requests"], (name, run["errors"])
        assert run["tokens_per_s"] > 0
