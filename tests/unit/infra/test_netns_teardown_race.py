"""A replica's network made while another interface in its range is being removed (a sibling
replica's veth torn down that second): the launch waits that out instead of failing. Real
namespaces and veths (root, iproute2), in a range of this test's own."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time

import pytest

from fleetserve.core.errors import TerminalError
from fleetserve.infra.netns import ReplicaNetworks, namespaces

if os.geteuid() != 0 or shutil.which("ip") is None:  # never skipped in CI, which runs as root
    pytest.fail("the replica network tests need root and iproute2", pytrace=False)

RANGE = "10.252.0.0/16"  # not the default range: launches of other tests are not disturbed


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def a_foreign_interface_in_the_range() -> str:
    name = f"fs25x{secrets.token_hex(3)}"
    ip("link", "add", name, "type", "veth", "peer", "name", f"{name}p")
    ip("addr", "add", "10.252.0.1/30", "dev", name)
    ip("link", "set", name, "up")
    return name


def test_an_interface_removed_during_the_launch_does_not_refuse_the_range() -> None:
    nets = ReplicaNetworks(f"h25-{secrets.token_hex(4)}", RANGE)
    token = "race-" + secrets.token_hex(4)
    foreign = a_foreign_interface_in_the_range()
    remover = threading.Timer(0.3, lambda: ip("link", "del", foreign))
    remover.start()
    try:
        started = time.monotonic()
        name, address = nets.create(token)
        assert time.monotonic() - started >= 0.3  # it waited for the removal
        assert name in namespaces() and address.startswith("10.252.")
    finally:
        remover.join()
        nets.remove(token)
    assert name not in namespaces()


def test_an_interface_that_stays_still_refuses_the_range_naming_it() -> None:
    nets = ReplicaNetworks(f"h25-{secrets.token_hex(4)}", RANGE)
    foreign = a_foreign_interface_in_the_range()
    try:
        with pytest.raises(TerminalError, match=f"overlaps this machine's routes .*{foreign}"):
            nets.create("stay-" + secrets.token_hex(4))
    finally:
        ip("link", "del", foreign)
