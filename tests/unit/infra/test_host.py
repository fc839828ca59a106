"""This host's id (fleetserve.infra.host): FLEETSERVE_HOST_ID, else host name and machine id."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fleetserve.core.errors import InvalidSpec
from fleetserve.infra.host import HOST_ID_ENV, MAX_HOST_ID, elsewhere, host_id, host_of
from fleetserve.infra.local import LocalInfra


def test_the_host_id_is_the_host_name_and_the_machine_id(tmp_path: Path) -> None:
    machine, boot = tmp_path / "machine-id", tmp_path / "boot_id"
    machine.write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    boot.write_text("6dcffc45-ff2b-4879-a4b2-4ef4228e60af\n")
    name = socket.gethostname()
    assert host_id({}, (machine, boot)) == f"{name}:3d1219c7c4c5404aaa1f6d2a48adfda4"
    assert host_id({HOST_ID_ENV: ""}, (machine, boot)) == host_id({}, (machine, boot))
    # no machine id (or an empty one): the next source, here the boot id
    assert host_id({}, (tmp_path / "missing", boot)).endswith(
        ":6dcffc45-ff2b-4879-a4b2-4ef4228e60af"
    )
    (tmp_path / "empty").write_text("\n")
    assert host_id({}, (tmp_path / "empty", boot)) == host_id({}, (boot,))
    # this machine's own, stable from call to call, and within the store's column
    assert host_id({}) == host_id({}) and len(host_id({})) <= MAX_HOST_ID
    assert host_id({}, (tmp_path / "missing",)) == name  # nothing: the name


def test_fleetserve_host_id_overrides_it_and_is_bounded() -> None:
    assert host_id({HOST_ID_ENV: " host-a "}) == "host-a"
    assert host_id({HOST_ID_ENV: "x" * MAX_HOST_ID}) == "x" * MAX_HOST_ID
    with pytest.raises(InvalidSpec, match=f"{HOST_ID_ENV}: at most {MAX_HOST_ID}"):
        host_id({HOST_ID_ENV: "x" * (MAX_HOST_ID + 1)})
    with pytest.raises(InvalidSpec, match="printable"):
        host_id({HOST_ID_ENV: "a\x00b"})


def test_a_record_is_elsewhere_only_when_both_hosts_are_known_and_differ() -> None:
    assert elsewhere("host-a", "host-b")
    assert not elsewhere("host-a", "host-a")
    assert not elsewhere(None, "host-b")  # recorded before hosts were: this host's
    assert not elsewhere("host-a", None)  # an infra of no host (Ray): never a host's process


def test_the_local_infra_knows_its_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "host-z")
    assert host_of(LocalInfra(tmp_path)) == "host-z"
    assert host_of(LocalInfra(tmp_path, host="host-y")) == "host-y"
    assert host_of(object()) is None
