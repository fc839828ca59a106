"""bench/lb/idle_streams.py runs end to end (real LB processes, real replicas, streams held
open): a short run of each policy prints its figures and the ratio line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_prints_both_policies_and_the_ratio() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "lb" / "idle_streams.py"),
            "--streams",
            "4",
            "--seconds",
            "1",
            "--repeat",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"^least_load: LB CPU \d+\.\d\d% of a core$", out.stdout, re.M)
    assert re.search(r"^cache_aware: LB CPU \d+\.\d\d% of a core$", out.stdout, re.M)
    assert re.search(r"^4 streams open, 2 LB processes, 1 s each, median of 1: ", out.stdout, re.M)


def test_bounds_are_refused_with_a_clear_error() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lb" / "idle_streams.py"), "--seconds", "60"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "--seconds 1-25" in out.stderr
