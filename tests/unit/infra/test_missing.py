"""A setup that calls a command this host lacks (conda, uv: SkyPilot's images carry them):
the failure reason names the command and what the host lacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.core.errors import TerminalError
from fleetserve.infra.base import LaunchRequest
from fleetserve.infra.local import LocalInfra
from fleetserve.infra.missing import missing_commands, offline, what_is_missing


def test_bash_and_dash_not_found_lines_name_the_command() -> None:
    text = (
        "Collecting numpy\n"
        "/root/r/setup.sh: line 3: conda: command not found\n"
        "bash: line 1: uv: command not found\n"
        "sh: 1: conda: not found\n"
        "error: file not found\n"  # not a shell's: not a command
    )
    assert missing_commands(text) == ["conda", "uv"]
    assert what_is_missing([]) == ""
    reason = what_is_missing(["uv"])
    assert "command not found in setup: uv" in reason and "SkyPilot's VM images" in reason
    assert "this host lacks `mytool`" in what_is_missing(["mytool"])


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        ("conda create -y -n vllm python=3.10\nconda activate vllm", "conda (Miniconda)"),
        ("set -e\nuv venv\nuv pip install vllm", "uv (https://docs.astral.sh/uv/)"),
    ],
)
async def test_a_setup_calling_what_this_host_lacks_fails_naming_it(
    tmp_path: Path, setup: str, words: str
) -> None:
    infra = LocalInfra(tmp_path / "home", grace_seconds=2, home_id="cccc2222cccc")
    # A PATH without conda or uv (whatever this machine has installed).
    envs = {"PATH": "/usr/bin:/bin"}
    req = LaunchRequest(
        service="svc",
        replica_id=1,
        version=1,
        launch_token="t-1",
        run="true",
        setup=setup,
        envs=envs,
    )
    with pytest.raises(TerminalError) as e:
        await infra.launch(req)
    assert "setup failed with exit code 127" in e.value.message
    assert words in e.value.message and "this host lacks" in e.value.message


def test_a_download_that_cannot_reach_the_network_is_named() -> None:
    pip = (
        "WARNING: Retrying (Retry(total=4)) after connection broken by "
        "'NewConnectionError(': Failed to establish a new connection: [Errno -3] Temporary "
        "failure in name resolution')': /simple/vllm/\n"
        "ERROR: No matching distribution found for vllm\n"
    )
    reason = offline(pip)
    assert "setup could not reach the network" in reason and "no internet access" in reason
    assert "Could not resolve host: github.com" in offline(
        "curl: (6) Could not resolve host: github.com\n"
    )
    assert offline("Collecting numpy\nSuccessfully installed numpy\n") == ""


async def test_a_setup_whose_download_fails_to_resolve_says_the_network_is_unreachable(
    tmp_path: Path,
) -> None:
    infra = LocalInfra(tmp_path / "home", grace_seconds=2, home_id="dddd3333dddd")
    # .invalid never resolves (RFC 6761), with or without internet access.
    fetch = "python3 -c \"import urllib.request; urllib.request.urlopen('http://pkgs.invalid/x')\""
    req = LaunchRequest(
        service="svc", replica_id=1, version=1, launch_token="t-2", run="true", setup=fetch
    )
    with pytest.raises(TerminalError) as e:
        await infra.launch(req)
    assert "setup failed with exit code 1: setup could not reach the network" in e.value.message
