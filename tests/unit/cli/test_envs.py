"""--env / --env-file / --secret parsing (SkyPilot's semantics)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.cli.envs import overrides, parse_assignments, parse_dotenv
from fleetserve.core.errors import InvalidSpec


def test_a_key_alone_takes_the_shell_value_and_a_value_may_hold_equals() -> None:
    got = parse_assignments(["A", "B=x=y", "C="], "--env", {"A": "from-shell"})
    assert got == {"A": "from-shell", "B": "x=y", "C": ""}


def test_a_key_alone_unset_in_the_shell_is_refused_by_name() -> None:
    with pytest.raises(InvalidSpec, match="--secret HF_TOKEN: no value given"):
        parse_assignments(["HF_TOKEN"], "--secret", {})


@pytest.mark.parametrize("bad", ["1A=x", "A-B=x", "=x", "A B=x"])
def test_invalid_names_are_refused(bad: str) -> None:
    with pytest.raises(InvalidSpec, match="not a valid environment variable name"):
        parse_assignments([bad], "--env", {})


def test_dotenv_comments_quotes_export_and_escapes() -> None:
    text = (
        "# a comment\n"
        "\n"
        "PLAIN=value  # trailing comment\n"
        "export EXPORTED=1\n"
        "SINGLE='a # not a comment $X'\n"
        'DOUBLE="line\\nnext \\"q\\""\n'
        "EMPTY=\n"
        "  SPACED = padded  \n"
        "HASH=a#b\n"
    )
    assert parse_dotenv(text, "f.env") == {
        "PLAIN": "value",
        "EXPORTED": "1",
        "SINGLE": "a # not a comment $X",
        "DOUBLE": 'line\nnext "q"',
        "EMPTY": "",
        "SPACED": "padded",
        "HASH": "a#b",
    }


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("NOEQUALS\n", "f.env:1: expected KEY=VALUE"),
        ("A=1\n9X=2\n", "f.env:2: expected KEY=VALUE"),
        ("A='open\n", "f.env:1: the quote is not closed"),
        ('A="x" y\n', "f.env:1: text after the closing quote"),
    ],
)
def test_dotenv_errors_name_the_line(text: str, problem: str) -> None:
    with pytest.raises(InvalidSpec, match=problem):
        parse_dotenv(text, "f.env")


def test_env_wins_over_the_file_and_secrets_stay_apart(tmp_path: Path) -> None:
    f = tmp_path / "app.env"
    f.write_text("A=file\nB=file\n")
    envs, secrets = overrides(["B=flag"], f, ["S"], {"S": "shh"})
    assert envs == {"A": "file", "B": "flag"}
    assert secrets == {"S": "shh"}


def test_a_missing_env_file_is_an_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match=r"--env-file .*cannot be read"):
        overrides(None, tmp_path / "nope.env", None, {})


def test_a_nul_in_a_value_is_refused_where_it_is_given(tmp_path: Path) -> None:
    """A process environment cannot hold a NUL: refused by `validate` and `up` at once, not by
    every launch after the service was accepted."""
    with pytest.raises(InvalidSpec, match=r"nul.env:1: a NUL character"):
        env_file = tmp_path / "nul.env"
        env_file.write_bytes(b"A=x\x00y\n")
        overrides(None, env_file, None, {})
    with pytest.raises(InvalidSpec, match=r"--secret S: a NUL character"):
        parse_assignments(["S=a\x00b"], "--secret", {})
    with pytest.raises(InvalidSpec, match=r"--env K: a NUL character"):
        parse_assignments(["K"], "--env", {"K": "a\x00"})
