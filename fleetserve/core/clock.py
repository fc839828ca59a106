"""Injected time: the system clock in production, a fake one in tests and the simulator.

Two readings: `now` (wall time, stored and shown) and `monotonic` (durations and deadlines,
never going back; its zero is arbitrary). The load balancer takes only the monotonic one
(`Monotonic`), once, as a bound method (no object per request)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Monotonic(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (its zero is arbitrary)."""
        ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (wall time: it is stored and shown to users)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)  # (the builtin itself: no Python frame per call)

    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to; `sleep` advances it at once. Both readings move
    together (`monotonic` starts at `monotonic_start`)."""

    def __init__(self, start: float = 1_700_000_000.0, monotonic_start: float = 1_000.0) -> None:
        self._now = start
        self._offset = monotonic_start - start

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now + self._offset

    def advance(self, seconds: float) -> None:
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        self._now += seconds
        await asyncio.sleep(0)
