"""A full disk: the user gets one line naming it, the fleet keeps serving, and everything works
again once there is room. The home lives on a small tmpfs this test mounts (root only)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, endpoint_of

pytestmark = pytest.mark.e2e

SPEC = """\
    service:
      readiness_probe: /health
      replicas: 1
    workdir: {workdir}
    run: python3 server.py
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_is_one_clear_line_and_the_fleet_keeps_serving(
    tmp_path: Path, fleet: Fleet
) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        home = mnt / "home"
        fleet.env["FLEETSERVE_HOME"] = str(home)
        fleet.home = home
        spec = fleet.write_service("svc", SPEC.format(workdir=fleet.workdir))
        endpoint = endpoint_of(fleet.cli("up", str(spec), "-n", "svc").stdout)
        second = fleet.write_service("two", SPEC.format(workdir=fleet.workdir))
        filler = mnt / "filler"
        # Unbuffered: the write that finds the disk full raises here, and closing the file has
        # nothing left to flush (a buffered close raised ENOSPC again, by chance of sizes).
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # bounded by the tmpfs's 8 MB
                f.write(b"\0" * 65536)
        proc = fleet.cli("up", "-d", str(second), "-n", "two", check=False)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "disk is full" in lines[0], proc.stderr
        assert str(home) in lines[0]
        for _ in range(20):  # the endpoint keeps answering while the disk is full
            with urllib.request.urlopen(endpoint + "/x", timeout=5) as r:
                assert r.status == 200
        assert fleet.cli("status").returncode == 0  # reads still work
        filler.unlink()
        fleet.cli("up", "-d", str(second), "-n", "two")
        assert {s.name for s in fleet.client().status()} == {"svc", "two"}
    finally:
        fleet.cli("down", "--all", "--purge", check=False)
        fleet.cli("server", "stop", check=False)
        subprocess.run(["umount", "-l", str(mnt)], check=False)
