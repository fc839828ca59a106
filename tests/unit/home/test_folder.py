"""The home is this user's alone: a home, token or log entry another user planted is refused
before anything in it is opened, followed or trusted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetserve.home.folder import UnsafeHome, ensure_token, secure_home

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to nobody")


def test_a_new_home_is_private_and_its_token_too(tmp_path: Path) -> None:
    home = tmp_path / "home"
    secure_home(home)
    assert home.stat().st_mode & 0o777 == 0o700
    token = ensure_token(home / "api-token")
    assert len(token) >= 40 and ensure_token(home / "api-token") == token
    assert (home / "api-token").stat().st_mode & 0o777 == 0o600


def test_an_open_home_of_this_user_is_closed_again(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o777)
    secure_home(home)
    assert home.stat().st_mode & 0o777 == 0o700


def test_a_symlink_home_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "home").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeHome, match="symlink"):
        secure_home(tmp_path / "home")


@root_only
def test_a_home_another_user_created_first_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o777)
    os.chown(home, NOBODY, NOBODY)
    with pytest.raises(UnsafeHome, match=f"belongs to uid {NOBODY}"):
        secure_home(home)
    assert home.stat().st_mode & 0o777 == 0o777  # nothing was changed


@root_only
def test_entries_another_user_planted_are_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("x")
    victim.chmod(0o644)
    for planted in ("api-token", "fleetserve.db-shm", "logs/controller.log", "logs/svc/x.log"):
        home = tmp_path / planted.replace("/", "_")
        (home / planted).parent.mkdir(parents=True, exist_ok=True)
        (home / planted).symlink_to(victim)
        os.lchown(home / planted, NOBODY, NOBODY)
        with pytest.raises(UnsafeHome, match=f"belongs to uid {NOBODY}"):
            secure_home(home)
    assert victim.stat().st_mode & 0o777 == 0o644  # never chmod-ed through a symlink


def test_a_token_file_that_is_not_private_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "api-token"
    path.write_text("a-token-somebody-else-may-know-000000000000\n")
    path.chmod(0o644)
    with pytest.raises(UnsafeHome, match="not a private file"):
        ensure_token(path)
    path.chmod(0o600)
    assert ensure_token(path).startswith("a-token-somebody")


def test_every_running_controller_of_a_home_is_found_whatever_its_kind(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    import psutil

    from fleetserve.home.folder import running_controllers
    from fleetserve.oshelpers.procs import started

    home = tmp_path / "home"
    home.mkdir()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    # Two that run as a controller does (its module in the command line), one that does not.
    procs = [subprocess.Popen([*sleep, "fleetserve.api.server"]) for _ in "ab"]
    procs.append(subprocess.Popen(sleep))
    try:
        a, b, other = (psutil.Process(p.pid) for p in procs)

        def record(name: str, p: psutil.Process, **info: object) -> None:
            body = {"pid": p.pid, "create_time": started(p), "port": 1, **info}
            (home / name).write_text(json.dumps(body))

        record("server.json", a, port=5000, host="127.0.0.1", scheme="http")
        record("server-6000.json", b, port=6000, host="0.0.0.0", scheme="https")
        record("server-7000.json", b, port=7000, create_time=1.0)  # not that process
        (home / "server-8000.json").write_text("{not json")
        record("server-x.json", b, port=9000)  # not a server file's name
        record("server-9100.json", other, port=9100)  # alive, as it says, but no controller
        found = running_controllers(home)
        assert [(c.pid, c.port, c.ha) for c in found] == [(a.pid, 5000, False), (b.pid, 6000, True)]
        assert found[1].where == "https://0.0.0.0:6000"
        assert found[1].url == "https://127.0.0.1:6000"  # every interface: reached on loopback
        procs[0].kill()
        procs[0].wait()
        assert [c.port for c in running_controllers(home)] == [6000]  # a dead one is not
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_controller_is_reached_where_it_listens() -> None:
    from fleetserve.home.folder import local_url

    assert local_url("https", "0.0.0.0", 1) == "https://127.0.0.1:1"
    assert local_url("http", "127.0.0.2", 2) == "http://127.0.0.2:2"
    assert local_url("http", "::", 3) == "http://[::1]:3"
    assert local_url("http", "::1", 4) == "http://[::1]:4"
