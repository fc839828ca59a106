"""The one ownership rule (fleetserve.oshelpers.procs.of_home) that replicas, jobs and load
balancers are adopted, stopped and swept by."""

from __future__ import annotations

import os
import subprocess
import sys

from fleetserve.oshelpers.procs import HOME_ID_ENV, of_home, owned_by, process_alive, started


def test_a_process_of_this_home_carries_its_id() -> None:
    assert of_home({HOME_ID_ENV: "h1"}, "h1")
    assert not of_home({HOME_ID_ENV: "h2"}, "h1")
    assert not of_home({}, "h1")


def test_an_upgraded_home_also_owns_processes_with_its_path_and_no_id() -> None:
    legacy = {"FLEETSERVE_HOME": "/home/a/.fleetserve"}
    assert of_home(legacy, "h1", "/home/a/.fleetserve")
    assert not of_home(legacy, "h1")  # no legacy home: the id alone decides
    assert not of_home(legacy, "h1", "/home/b/.fleetserve")
    # A process with another home's id is never this home's, whatever its path says.
    assert not of_home({**legacy, HOME_ID_ENV: "h2"}, "h1", "/home/a/.fleetserve")


def test_owned_by_and_process_alive_read_a_real_process_environment() -> None:
    env = {**os.environ, HOME_ID_ENV: "home-xyz"}
    child = "import time; print('up', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE)
    try:
        # Once it runs: just after exec, before the new process first runs, the kernel may
        # still show an empty environment (seen on a loaded machine).
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        import psutil

        p = psutil.Process(proc.pid)
        assert owned_by(p, "home-xyz")
        assert not owned_by(p, "home-other")
        start = started(p)
        assert process_alive(proc.pid, start)
        assert process_alive(proc.pid, start, "home-xyz")
        assert not process_alive(proc.pid, start, "home-other")
    finally:
        proc.kill()
        proc.wait()
    assert not process_alive(proc.pid, start)
