"""The home is this user's alone: a home, token or log entry another user planted is refused
before anything in it is opened, followed or trusted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetserve.controller.home import UnsafeHome, ensure_token, secure_home

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
