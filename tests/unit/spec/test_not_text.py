"""Strings that are no text (lone surrogates: YAML's "\\ud800" escape, JSON's, or bytes of a
command line that are not UTF-8) are refused where they come in, with one line, instead of
failing later when the spec is stored or sent (a 500 and a traceback in the controller's log,
found by an outside attack)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec import load_spec, parse_spec

OK = "service:\n  readiness_probe: /\nrun: python3 server.py\n"


@pytest.mark.parametrize(
    "text",
    [
        'service:\n  readiness_probe: /\nrun: "echo \\ud800"\n',
        'service:\n  readiness_probe: /\nenvs:\n  "\\udc80": x\nrun: x\n',
        'service:\n  readiness_probe:\n    path: /\n    headers: {X: "\\udfff"}\nrun: x\n',
    ],
)
def test_a_lone_surrogate_in_the_yaml_is_one_clear_error(text: str) -> None:
    with pytest.raises(InvalidSpec, match="not valid Unicode text") as e:
        parse_spec(text)
    assert "\\ud" in e.value.message  # shown escaped, printable


def test_a_lone_surrogate_in_an_override_or_parsed_data_is_refused() -> None:
    with pytest.raises(InvalidSpec, match="--env: a string that is not valid Unicode"):
        parse_spec(OK, envs={"A": "\udcff"})
    with pytest.raises(InvalidSpec, match="--secret"):
        parse_spec(OK, secrets={"\ud800": "x"})
    data = {"service": {"readiness_probe": "/"}, "run": "echo \ud83d"}
    with pytest.raises(InvalidSpec, match="not valid Unicode"):
        load_spec(data)
    assert parse_spec(OK, envs={"A": "snow ☃ 🙂"}).envs["A"] == "snow ☃ 🙂"  # real text passes


def test_a_command_line_argument_that_is_not_utf8_is_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fleetserve", "status", b"a\xff".decode("utf-8", "surrogateescape")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr
    assert "a\\xff" in proc.stderr


def test_a_null_envs_key_is_refused_with_a_line_that_says_what_to_do() -> None:
    with pytest.raises(InvalidSpec, match=r"envs: is empty \(null\).*remove the key"):
        parse_spec("service:\n  readiness_probe: /\nenvs:\nrun: x\n")
