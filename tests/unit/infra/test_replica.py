"""What every infra gives a replica (fleetserve.infra.replica): the environment the local and
the ray infra build, key for key, and the folder both make, which refuses a missing workdir
on either (ray used to start the replica in an empty one)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fleetserve.core.errors import TerminalError
from fleetserve.infra import replica
from fleetserve.infra.base import LaunchRequest
from fleetserve.infra.local import TOKEN_ENV, LocalInfra
from fleetserve.infra.ray import RayInfra, ReplicaProcess, node_env
from fleetserve.infra.replica import create_replica_dir, replica_env, replica_layout
from fleetserve.oshelpers.procs import HOME_ID_ENV
from fleetserve.spec.task_env import CLUSTER_INFO, NODE_IPS, SETUP_NODE_IPS, TASK_ID

REQUEST = LaunchRequest(
    service="web",
    replica_id=3,
    version=2,
    launch_token="home1-tok",
    run="python3 -m http.server $PORT",
    setup="echo setup",
    envs={"GREETING": "hi", "PORT": "1"},  # fleetserve's PORT wins over the spec's
    gpus=1,
    zone="local",
)
# Where the infras genuinely differ (fleetserve.infra.replica's docstring).
WHERE_IT_RUNS = {NODE_IPS, SETUP_NODE_IPS, CLUSTER_INFO, TASK_ID}


def local_env(tmp_path: Path, request: LaunchRequest = REQUEST) -> dict[str, str]:
    return LocalInfra(tmp_path, home_id="home1").replica_env(request, 40001, "local")


def ray_env(request: LaunchRequest = REQUEST) -> dict[str, str]:
    req = RayInfra.start_request(request, {"num_gpus": 1.0})
    return node_env(req, 40001, "10.1.2.3", os.environ)


def test_both_infras_give_a_replica_the_same_variables(tmp_path: Path) -> None:
    local, ray = local_env(tmp_path), ray_env()
    assert set(local) - set(ray) == {TOKEN_ENV, HOME_ID_ENV}  # local finds processes by them
    assert set(ray) - set(local) == set()
    same = {k for k in ray if local[k] == ray[k]}
    assert set(ray) - same <= WHERE_IT_RUNS
    for env in (local, ray):
        assert env["PORT"] == "40001"
        assert env["FLEETSERVE_KV_EVENTS_PORT"] == "40002"
        assert env["FLEETSERVE_KV_EVENTS_REPLAY_PORT"] == "40003"
        assert env["FLEETSERVE_REPLICA_ID"] == env["SKYPILOT_SERVE_REPLICA_ID"] == "3"
        assert env["FLEETSERVE_SERVICE"] == "web"
        assert env["FLEETSERVE_VERSION"] == "2"
        assert env["GREETING"] == "hi"
        assert env["SKYPILOT_NUM_GPUS_PER_NODE"] == "1"
    assert local[NODE_IPS] == "127.0.0.1"
    assert ray[NODE_IPS] == ray[SETUP_NODE_IPS] == "10.1.2.3"
    assert json.loads(local[CLUSTER_INFO])["cloud"] == "local"
    assert json.loads(ray[CLUSTER_INFO])["cloud"] == "ray"
    assert local[TOKEN_ENV] == "home1-tok"
    assert local[HOME_ID_ENV] == "home1"


def test_a_spec_that_sets_pythonunbuffered_keeps_its_value_on_both(tmp_path: Path) -> None:
    request = LaunchRequest(**{**REQUEST.__dict__, "envs": {"PYTHONUNBUFFERED": "0"}})
    assert local_env(tmp_path, request)["PYTHONUNBUFFERED"] == "0"
    assert ray_env(request)["PYTHONUNBUFFERED"] == "0"
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env = replica_env(base, envs={}, port=1, service="s", replica_id=1, version=1, task={})
    assert env["PYTHONUNBUFFERED"] == "1"


def test_replica_env_is_pure() -> None:
    base = {"PATH": "/bin", "FLEETSERVE_SERVICE": "old"}
    env = replica_env(
        base, envs={"A": "1"}, port=5000, service="s", replica_id=7, version=4, task={"T": "x"}
    )
    assert base == {"PATH": "/bin", "FLEETSERVE_SERVICE": "old"}
    assert env == {
        "PATH": "/bin",
        "A": "1",
        "PORT": "5000",
        "FLEETSERVE_KV_EVENTS_PORT": "5001",
        "FLEETSERVE_KV_EVENTS_REPLAY_PORT": "5002",
        "FLEETSERVE_REPLICA_ID": "7",
        "SKYPILOT_SERVE_REPLICA_ID": "7",
        "T": "x",
        "FLEETSERVE_SERVICE": "s",
        "FLEETSERVE_VERSION": "4",
        "PYTHONUNBUFFERED": "1",
    }


def test_the_layout_is_root_service_replica(tmp_path: Path) -> None:
    layout = replica_layout(tmp_path, "web", 3)
    assert layout.dir == tmp_path / "web" / "3"
    assert layout.workdir == layout.dir / "workdir"
    assert layout.setup_done.name == "setup.done"
    assert LocalInfra(tmp_path).layout("web", 3) == replica_layout(tmp_path / "replicas", "web", 3)


def test_the_folder_is_made_afresh_and_private(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "app.py").write_text("print(1)")
    layout = replica_layout(tmp_path / "root", "web", 1)
    layout.dir.mkdir(parents=True)
    (layout.dir / "left-over").write_text("from a cut-short launch")
    create_replica_dir(layout, run="python3 app.py", setup=None, workdir=src)
    assert (layout.workdir / "app.py").read_text() == "print(1)"
    assert layout.run_script.read_text() == "python3 app.py"
    assert layout.setup_script.read_text() == ""
    assert not (layout.dir / "left-over").exists()
    assert layout.dir.stat().st_mode & 0o777 == 0o700


def test_a_missing_workdir_is_refused(tmp_path: Path) -> None:
    layout = replica_layout(tmp_path, "web", 1)
    with pytest.raises(TerminalError, match=r"workdir /nonexistent/wd is not a directory"):
        create_replica_dir(layout, run="true", workdir=Path("/nonexistent/wd"))


def test_the_ray_actor_refuses_a_missing_workdir(tmp_path: Path) -> None:
    req = RayInfra.start_request(
        LaunchRequest(**{**REQUEST.__dict__, "workdir": Path("/nonexistent/wd")}), {}
    )
    answer = ReplicaProcess(str(tmp_path)).start(req)
    assert answer == {"refused": "workdir /nonexistent/wd is not a directory"}


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _FakeActor:
    """A ReplicaProcess called in this process, as a Ray actor handle would call it."""

    def __init__(self, root: str) -> None:
        self.body = ReplicaProcess(root)

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self.body, name))


class _FakeActorClass:
    def options(self, **_: Any) -> _FakeActorClass:
        return self

    def remote(self, root: str) -> _FakeActor:
        return _FakeActor(root)


class _FakeRay:
    """The few calls RayInfra.launch makes, on no cluster: refs are the values themselves."""

    @staticmethod
    def get(ref: Any, timeout: float | None = None) -> Any:
        return ref

    @staticmethod
    def get_actor(name: str, namespace: str | None = None) -> Any:
        raise ValueError(name)  # terminate: nothing to stop


async def test_a_ray_launch_with_a_missing_workdir_fails_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    infra = RayInfra(root=str(tmp_path / "ray"))
    infra._actor_cls = _FakeActorClass()

    async def fake_ray() -> _FakeRay:
        return _FakeRay()

    monkeypatch.setattr(infra, "_ray", fake_ray)
    request = LaunchRequest(**{**REQUEST.__dict__, "workdir": Path("/nonexistent/wd")})
    with pytest.raises(TerminalError) as failed:
        await infra.launch(request)
    assert "workdir /nonexistent/wd is not a directory on the Ray node" in failed.value.message
    assert "docs/ray.md" in failed.value.message


def test_the_module_documents_each_difference() -> None:
    doc = replica.__doc__ or ""
    for words in ("FLEETSERVE_LAUNCH_TOKEN", "FLEETSERVE_HOME_ID", "cloud `ray`", "workdir"):
        assert words in doc
