"""A process's identity (pid + start) survives a step of the wall clock."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from fleetserve.oshelpers import procs
from fleetserve.oshelpers.procs import find_process, started, started_as


@pytest.fixture
def child() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    yield proc
    proc.kill()
    proc.wait()


def test_started_is_seconds_since_boot_and_fixed(child: subprocess.Popen[bytes]) -> None:
    p = psutil.Process(child.pid)
    first = started(p)
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert 0 < first <= uptime + 0.02
    assert started(psutil.Process(child.pid)) == first
    assert started(p) != started(psutil.Process())  # another process started at another tick
    assert find_process(child.pid, first) is not None
    assert find_process(child.pid, first - 1.0) is None  # a reused pid started at another time


def test_a_record_survives_a_wall_clock_step(
    child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = psutil.Process(child.pid)
    recorded = started(p)
    # The clock steps by 40 s (a VM resumed from a snapshot): psutil's create_time moves.
    real = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 40.0)
    assert started_as(psutil.Process(child.pid), recorded)
    assert find_process(child.pid, recorded) is not None


def test_a_record_from_an_older_fleetserve_is_still_recognised(
    child: subprocess.Popen[bytes],
) -> None:
    p = psutil.Process(child.pid)
    wall = p.create_time()
    assert wall >= procs._WALL_CLOCK_START
    assert started_as(p, wall)
    assert started_as(p, wall + 1.0)  # /proc/stat's boot time is whole seconds
    assert not started_as(p, wall - 60.0)


def test_a_gone_process_is_no_such_process(child: subprocess.Popen[bytes]) -> None:
    p = psutil.Process(child.pid)
    child.kill()
    child.wait()
    with pytest.raises(psutil.NoSuchProcess):
        started(p)
    assert find_process(child.pid, 1.0) is None
