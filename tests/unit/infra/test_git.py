"""`workdir: {url, ref}` cloned from a local bare repository (file://, no network)."""

from __future__ import annotations

import dataclasses
import subprocess
import time
from pathlib import Path

import pytest

from fleetserve.core.errors import TerminalError
from fleetserve.infra.git import GitSource, clone, clone_commands, shown_url
from fleetserve.infra.local import LocalHandle, LocalInfra
from tests.unit.infra.test_local import request

# Not test_local's "tok-1": that file, run beside this one, looks for processes by token.
TOKEN = "tok-git"


def git(*args: str, cwd: Path) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "HOME": str(cwd),
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A bare repository: main at "two" (commit c2), tag v1 and commit c1 at "one", and a
    branch `dev` at "dev"."""
    work = tmp_path / "work"
    work.mkdir()
    git("init", "-q", "-b", "main", cwd=work)
    (work / "server.py").write_text("one")
    git("add", ".", cwd=work)
    git("commit", "-qm", "one", cwd=work)
    git("tag", "v1", cwd=work)
    c1 = git("rev-parse", "HEAD", cwd=work)
    git("checkout", "-qb", "dev", cwd=work)
    (work / "server.py").write_text("dev")
    git("commit", "-qam", "dev", cwd=work)
    git("checkout", "-q", "main", cwd=work)
    (work / "server.py").write_text("two")
    git("commit", "-qam", "two", cwd=work)
    c2 = git("rev-parse", "HEAD", cwd=work)
    bare = tmp_path / "repo.git"
    git("clone", "-q", "--bare", str(work), str(bare), cwd=tmp_path)
    return f"file://{bare}", {"c1": c1, "c2": c2}


@pytest.mark.parametrize(
    ("ref", "content"),
    [(None, "two"), ("main", "two"), ("dev", "dev"), ("v1", "one"), ("c1", "one"), ("c1:7", "one")],
)
def test_clone_checks_out_the_ref(
    repo: tuple[str, dict[str, str]], tmp_path: Path, ref: str | None, content: str
) -> None:
    url, commits = repo
    if ref is not None and ref.startswith("c"):
        name, _, length = ref.partition(":")
        ref = commits[name][: int(length)] if length else commits[name]
    dest = tmp_path / "dest"
    clone(GitSource(url, ref), dest)
    assert (dest / "server.py").read_text() == content


@pytest.mark.parametrize(
    ("ref", "problem"),
    [("no-such-branch", "failed: .*no-such-branch"), ("0" * 40, "failed:")],
)
def test_a_ref_that_is_not_there_fails_with_a_reason(
    repo: tuple[str, dict[str, str]], tmp_path: Path, ref: str, problem: str
) -> None:
    url, _ = repo
    with pytest.raises(TerminalError, match=f"workdir: cloning {url} at {ref} {problem}"):
        clone(GitSource(url, ref), tmp_path / "dest")


def test_a_missing_repository_fails_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(TerminalError, match="workdir: cloning file:///nonexistent failed: "):
        clone(GitSource("file:///nonexistent"), tmp_path / "dest")


def test_credentials_in_a_url_are_never_shown(tmp_path: Path) -> None:
    url = "file://user:hunter2-token@localhost/nonexistent"
    with pytest.raises(TerminalError) as e:
        clone(GitSource(url), tmp_path / "dest")
    assert "hunter2" not in e.value.message and "***@" in e.value.message
    assert shown_url("https://u:p@h/x and http://t@h/y") == "https://***@h/x and http://***@h/y"


def test_branches_and_tags_are_shallow_commits_are_full() -> None:
    (cmd,) = clone_commands(GitSource("u", "main"), Path("/d"))
    assert cmd[-7:] == ["--depth", "1", "--branch", "main", "--", "u", "/d"]
    full, checkout = clone_commands(GitSource("u", "abc1234"), Path("/d"))
    assert "--depth" not in full and checkout[-3:] == ["--detach", "abc1234", "--"]


def test_the_clone_is_bounded_in_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A "git" whose helper hangs (holding stderr) stands for a server that never answers.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text("#!/bin/sh\n/bin/sleep 30\necho done\n")
    (fake / "git").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    started = time.monotonic()
    with pytest.raises(TerminalError, match=r"took longer than 0\.5 s"):
        clone(GitSource("file:///x"), tmp_path / "dest", timeout=0.5)
    assert time.monotonic() - started < 5


async def test_the_local_infra_clones_the_workdir_and_runs_in_it(
    repo: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, _ = repo
    infra = LocalInfra(tmp_path / "home", grace_seconds=2, home_id="bbbb0000bbbb")
    req = request(
        tmp_path, token=TOKEN, workdir=None, workdir_git=GitSource(url, "v1"), setup="cat server.py"
    )
    launched = await infra.launch(dataclasses.replace(req, run="sleep 60"))
    try:
        h = LocalHandle.from_json(launched.handle)
        assert (Path(h.dir) / "workdir" / "server.py").read_text() == "one"
        assert "one" in infra.log_path("svc", 1).read_text()  # setup ran in the clone
    finally:
        await infra.terminate(launched.handle, TOKEN)


async def test_a_failed_clone_fails_the_launch_with_its_reason(tmp_path: Path) -> None:
    infra = LocalInfra(tmp_path / "home", grace_seconds=2, home_id="bbbb0000bbbb")
    req = request(
        tmp_path, token=TOKEN, workdir=None, workdir_git=GitSource(f"file://{tmp_path}/none")
    )
    with pytest.raises(TerminalError, match=r"workdir: cloning file://.*/none failed: "):
        await infra.launch(req)
