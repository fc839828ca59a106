"""Workdirs with the real CLI: a git repository (file://, no network) cloned for each replica,
and a clone that fails as the replica's FAILED_PROVISION reason."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import SERVER, Fleet, endpoint_of

pytestmark = pytest.mark.e2e

SPEC = """\
    service:
      readiness_probe: /health
      replicas: 1
    workdir:
      url: {url}
      ref: {ref}
    run: python3 server.py
    """


def bare_repo(tmp_path: Path) -> str:
    work = tmp_path / "src"
    work.mkdir()
    (work / "server.py").write_text(SERVER)
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    for cmd in (
        ["init", "-q", "-b", "main"],
        ["add", "."],
        [*ident, "commit", "-qm", "server"],
        ["clone", "-q", "--bare", ".", str(tmp_path / "repo.git")],
    ):
        subprocess.run(["git", *cmd], cwd=work, check=True, capture_output=True)
    return f"file://{tmp_path / 'repo.git'}"


def test_a_git_workdir_is_cloned_and_a_bad_ref_fails_the_replica(
    fleet: Fleet, tmp_path: Path
) -> None:
    url = bare_repo(tmp_path)
    good = fleet.write_service("cloned", SPEC.format(url=url, ref="main"))
    out = fleet.cli("up", str(good), "-n", "cloned")
    with urllib.request.urlopen(endpoint_of(out.stdout) + "/x", timeout=10) as r:
        assert json.loads(r.read())["path"] == "/x"
    bad = fleet.write_service("badref", SPEC.format(url=url, ref="no-such-branch"))
    failed = fleet.cli("up", str(bad), "-n", "badref", check=False)
    assert failed.returncode != 0
    replica = fleet.client().service("badref").replicas[0]
    assert replica.status == "FAILED_PROVISION"
    assert replica.reason is not None
    assert f"workdir: cloning {url} at no-such-branch failed" in replica.reason
    assert "no-such-branch" in fleet.cli("status", "badref", "-v").stdout
    fleet.cli("down", "cloned")
    fleet.cli("down", "badref")
