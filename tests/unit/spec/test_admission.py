"""Admission: relative paths start from the caller's folder; a git workdir is checked and
reaches the launch request."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.controller.executor import launch_request
from fleetserve.core.errors import InvalidSpec, TerminalError
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import ReplicaRecord
from fleetserve.infra.git import GitSource
from fleetserve.oshelpers import netcaps
from fleetserve.spec import admission
from fleetserve.spec.admission import check_deployable, resolve_paths, service_name
from fleetserve.spec.loader import parse_spec

BASE = "run: python3 server.py\nservice:\n  readiness_probe: /health\n  replicas: 1\n"


def test_relative_paths_start_from_the_base_folder_given(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "data.txt").write_text("x")
    (tmp_path / "k.pem").write_text("k")
    (tmp_path / "c.pem").write_text("c")
    text = (
        "workdir: app\nfile_mounts: {/data.txt: data.txt}\n"
        + BASE
        + "  tls: {keyfile: k.pem, certfile: c.pem}\n"
    )
    spec = resolve_paths(parse_spec(text), tmp_path)
    assert spec.workdir == str(tmp_path / "app")
    assert spec.file_mounts == {"/data.txt": str(tmp_path / "data.txt")}
    assert spec.service.tls is not None and spec.service.tls.keyfile == str(tmp_path / "k.pem")
    with pytest.raises(InvalidSpec, match=f"workdir: {tmp_path}/elsewhere/app is not a dir"):
        resolve_paths(parse_spec(text), tmp_path / "elsewhere")


def test_a_git_workdir_is_kept_and_reaches_the_launch_request(tmp_path: Path) -> None:
    spec = parse_spec("workdir: {url: 'file:///r.git', ref: v1}\n" + BASE)
    spec = resolve_paths(spec, tmp_path)
    check_deployable(spec, "local")
    rec = ReplicaRecord(
        service="s", replica_id=1, version=1, status=ReplicaStatus.PENDING, launch_token="t"
    )
    req = launch_request(spec, rec, tmp_path)
    assert req.workdir is None and req.workdir_git == GitSource("file:///r.git", "v1")


@pytest.mark.parametrize(
    "workdir", ["{url: '-uoops'}", "{url: 'file:///r', ref: '--upload-pack=x'}", "{url: ' '}"]
)
def test_a_git_workdir_that_would_be_an_option_is_refused(workdir: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="must not be empty or start with '-'"):
        resolve_paths(parse_spec(f"workdir: {workdir}\n" + BASE), tmp_path)


def test_a_git_workdir_is_refused_on_ray_and_unknown_keys_are_errors() -> None:
    spec = parse_spec("workdir: {url: 'file:///r.git'}\n" + BASE)
    with pytest.raises(InvalidSpec, match="cloned on the local infra only, not on ray"):
        check_deployable(spec, "ray")
    with pytest.raises(InvalidSpec, match=r"workdir\..*branch: unknown field"):
        parse_spec("workdir: {url: 'file:///r.git', branch: main}\n" + BASE)


# -- a fixed port shared by several replicas: namespaces, else a refusal --------------------

FIXED = "service:\n  readiness_probe: /h\n  ports: 8080\n  replicas: {n}\nrun: python3 s.py\n"


def test_a_fixed_port_fleet_needs_namespaces_and_says_so_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netcaps, "veth_available", lambda: False)
    monkeypatch.setattr(netcaps, "userns_available", lambda: False)
    with pytest.raises(InvalidSpec, match="needs root and iproute2") as e:
        admission.check_deployable(parse_spec(FIXED.format(n=3)))
    assert "$PORT" in e.value.message and "unprivileged user namespaces" in e.value.message
    assert "FLEETSERVE_REPLICA_NETNS=auto" in e.value.message
    admission.check_deployable(parse_spec(FIXED.format(n=1)))  # one replica: this machine's
    admission.check_deployable(parse_spec(FIXED.format(n=3)), "ray")  # one per node there


def test_a_fixed_port_fleet_is_accepted_where_namespaces_can_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netcaps, "veth_available", lambda: True)
    monkeypatch.setattr(netcaps, "userns_available", lambda: False)
    admission.check_deployable(parse_spec(FIXED.format(n=3)))
    with pytest.raises(InvalidSpec, match="FLEETSERVE_REPLICA_NETNS=userns"):
        admission.check_deployable(parse_spec(FIXED.format(n=3)), "local", "userns")


def test_a_normal_user_gets_user_namespaces_for_a_fixed_port_fleet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netcaps, "veth_available", lambda: False)  # not root
    monkeypatch.setattr(netcaps, "userns_available", lambda: True)
    admission.check_deployable(parse_spec(FIXED.format(n=3)))
    assert netcaps.kind("auto") == "userns"
    with pytest.raises(InvalidSpec, match="neither is possible"):
        admission.check_deployable(parse_spec(FIXED.format(n=3)), "local", "veth")


def test_an_unknown_replica_netns_mode_is_named() -> None:
    with pytest.raises(TerminalError, match="FLEETSERVE_REPLICA_NETNS='bridge'"):
        netcaps.kind("bridge")


@pytest.mark.parametrize(
    ("yaml_name", "expected"),
    [
        ("vllm-llama3", "vllm-llama3"),
        ("Llama_3.1-8B", "llama-3-1-8b"),  # a SkyPilot task name, not a service name
        ("sd.xl__turbo", "sd-xl-turbo"),
        ("123", None),  # nothing of it: SkyServe's default
    ],
)
def test_the_yamls_task_name_becomes_a_service_name_and_never_refuses_the_file(
    yaml_name: str, expected: str | None
) -> None:
    spec = parse_spec(f"name: '{yaml_name}'\n" + BASE)
    got = service_name(None, spec)
    if expected is None:
        assert got.startswith("sky-service-")
    else:
        assert got == expected
    with pytest.raises(InvalidSpec, match="service name 'Bad_Name'"):
        service_name("Bad_Name", spec)  # a name given with -n is taken as it is, or refused
