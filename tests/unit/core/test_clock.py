"""The injected clock's two readings: wall time and monotonic time."""

from __future__ import annotations

import time

from fleetserve.core.clock import FakeClock, SystemClock


async def test_a_fake_clock_moves_both_readings_only_when_told() -> None:
    clock = FakeClock(start=1_700_000_000.0, monotonic_start=50.0)
    assert (clock.now(), clock.monotonic()) == (1_700_000_000.0, 50.0)
    clock.advance(2.5)
    assert (clock.now(), clock.monotonic()) == (1_700_000_002.5, 52.5)
    await clock.sleep(1.0)
    assert (clock.now(), clock.monotonic()) == (1_700_000_003.5, 53.5)


def test_the_system_clocks_monotonic_reading_is_the_builtin() -> None:
    """(A bound method read once per request would cost a Python frame; this costs none.)"""
    reading = SystemClock().monotonic
    assert reading is time.monotonic
    before = time.monotonic()
    assert before <= reading() <= time.monotonic()
