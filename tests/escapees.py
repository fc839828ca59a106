"""Processes that clear their environment and leave their session, as a replica's or a job's
`run` starts them (tests of fleetserve.infra.cgroups): setsid, a double fork, nohup, a daemon.
Each writes its pid to a file; the tests find them by that and kill by pid what is left."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fleetserve.oshelpers.procs import find_process, started

SHAPES = ("setsid", "double", "nohup", "daemon")


def escaping(pids: Path, tail: str = "exec sleep 300") -> str:
    """A run script whose children clear their environment and leave the session, each in
    another way, each writing its pid to `pids`/<shape> (then it becomes `sleep 2222`)."""
    pids.mkdir(parents=True, exist_ok=True)
    daemon = pids / "daemon.py"
    daemon.write_text(
        "import os\n"
        "if os.fork(): os._exit(0)\n"
        "os.setsid()\n"
        "if os.fork(): os._exit(0)\n"
        "os.chdir('/')\n"
        "fd = os.open(os.devnull, os.O_RDWR)\n"
        "for i in (0, 1, 2): os.dup2(fd, i)\n"
        f"open({str(pids / 'daemon')!r}, 'w').write(f'{{os.getpid()}}\\n')\n"
        "os.execve('/bin/sleep', ['sleep', '2222'], {})\n"
    )

    def sh(shape: str) -> str:
        return f"/bin/sh -c 'echo $$ > {pids / shape}; exec sleep 2222'"

    return "\n".join(
        [
            f"(setsid env -i {sh('setsid')} &)",
            f"( ( env -i {sh('double')} & ) & )",
            f"nohup env -i setsid {sh('nohup')} > /dev/null 2>&1 &",
            f"env -i {sys.executable} {daemon}",
            tail,
        ]
    )


class Escapees:
    """The escaped processes a test saw (pid and start), killed by pid at the end if any is
    still there."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def collect(self, pids: Path, timeout: float = 20.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        found: dict[str, psutil.Process] = {}
        while len(found) < len(SHAPES) and time.monotonic() < deadline:
            for shape in SHAPES:
                if shape in found:
                    continue
                with contextlib.suppress(OSError, ValueError, psutil.Error):
                    text = (pids / shape).read_text()
                    if text.endswith("\n"):
                        p = psutil.Process(int(text))
                        self.seen[p.pid] = started(p)
                        found[shape] = p
            time.sleep(0.05)
        assert sorted(found) == sorted(SHAPES), f"escapees seen: {sorted(found)}"
        return list(found.values())

    def alive(self) -> list[int]:
        return [pid for pid, t in self.seen.items() if find_process(pid, t) is not None]

    def wait_gone(self, timeout: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.alive()

    def cleanup(self) -> None:
        for pid in self.alive():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def escapees() -> Iterator[Escapees]:
    e = Escapees()
    yield e
    e.cleanup()
