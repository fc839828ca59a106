"""The controller process of bench/controller: fleetserve's real controller, REST API and store
(`fleetserve.api.server.main`), with the bench's fake infra (bench_infra.BenchInfra) as its
default infra, and two probes of its own for the benchmark:

- each reconcile round's duration (wrapped around `ServiceMetrics.round`, which the
  reconciler calls once per round), every SQL statement and commit (SQLAlchemy engine
  events) and each garbage collection's pause (`gc.callbacks`), counted in this process;
- on SIGUSR1 it writes them to $BENCH_STATS (JSON, replaced atomically) and goes on.

Environment: what `python -m fleetserve.api.server` reads (FLEETSERVE_*), plus bench_infra's
BENCH_* variables and BENCH_STATS.
    python bench/controller/fake_controller.py
"""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from bench_infra import BenchInfra  # this folder: the script's own (sys.path[0])
from sqlalchemy import Engine, event

from fleetserve.api import server
from fleetserve.controller.metrics import ServiceMetrics

MAX_ROUNDS = 500_000  # the newest rounds kept (about 8 minutes of 1,000 services)


class Stats:
    def __init__(self) -> None:
        self.rounds: collections.deque[tuple[float, str, float]] = collections.deque(
            maxlen=MAX_ROUNDS
        )
        self.statements = 0  # every SQL statement
        self.writes = 0  # INSERT, UPDATE, DELETE statements
        self.rows_written = 0  # rows they changed
        self.commits = 0
        self.dumps = 0
        self.gc: collections.deque[tuple[float, int, float]] = collections.deque(
            maxlen=MAX_ROUNDS
        )  # (when, generation, seconds) of each garbage collection
        self._gc_started = 0.0

    def dump(self, path: Path) -> None:
        self.dumps += 1
        data: dict[str, Any] = {
            "dumps": self.dumps,
            "at": time.monotonic(),
            "statements": self.statements,
            "writes": self.writes,
            "rows_written": self.rows_written,
            "commits": self.commits,
            "rounds": list(self.rounds),
            "gc": list(self.gc),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


STATS = Stats()


def install() -> None:
    original = ServiceMetrics.round

    def timed_round(self: ServiceMetrics, seconds: float, failed: bool = False) -> None:
        STATS.rounds.append((time.monotonic(), self.service, seconds))
        original(self, seconds, failed)

    ServiceMetrics.round = timed_round  # type: ignore[method-assign]

    @event.listens_for(Engine, "after_cursor_execute")
    def _statement(
        _conn: Any, cursor: Any, statement: str, _params: Any, _ctx: Any, _many: bool
    ) -> None:
        STATS.statements += 1
        verb = statement.lstrip()[:6].upper()
        if verb in ("INSERT", "UPDATE", "DELETE"):
            STATS.writes += 1
            STATS.rows_written += max(0, int(cursor.rowcount or 0))

    @event.listens_for(Engine, "commit")
    def _commit(_conn: Any) -> None:
        STATS.commits += 1

    def timed_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            STATS._gc_started = time.perf_counter()
        else:
            took = time.perf_counter() - STATS._gc_started
            STATS.gc.append((time.monotonic(), info["generation"], took))

    gc.callbacks.append(timed_gc)

    path = Path(os.environ["BENCH_STATS"])

    def on_usr1(_sig: int, _frame: FrameType | None) -> None:
        STATS.dump(path)

    signal.signal(signal.SIGUSR1, on_usr1)


if __name__ == "__main__":
    install()
    server.main(infra=BenchInfra.from_env())
