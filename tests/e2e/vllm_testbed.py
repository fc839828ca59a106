"""The real-engine testbed for the tests on real vLLM: vLLM's interpreter (from
./scripts/llm/setup.sh's .venv-vllm, which scripts/test.sh makes) and the small model it makes
offline."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("FLEETSERVE_VLLM_VENV", REPO / ".venv-vllm"))


def vllm_testbed() -> tuple[Path, str]:
    """vLLM's interpreter and the testbed model's folder (made if missing)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no vLLM testbed at {VENV}: run ./scripts/llm/setup.sh (scripts/test.sh does)")
    out = subprocess.run(
        [str(python), str(REPO / "scripts" / "llm" / "make_model.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return python, out.stdout.strip().splitlines()[-1]
