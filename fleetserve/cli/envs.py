"""`--env KEY[=VALUE]`, `--env-file FILE` and `--secret KEY[=VALUE]`, read as SkyPilot reads
them: a KEY without a value takes the caller's shell variable; `--env` wins over the file."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from fleetserve.core.errors import InvalidSpec

MAX_ENV_FILE_BYTES = 1024 * 1024
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}


def parse_assignments(items: list[str], flag: str, shell: Mapping[str, str]) -> dict[str, str]:
    """`KEY=VALUE` as given; `KEY` alone from `shell` (an error names it when unset there)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not _NAME.fullmatch(key):
            raise InvalidSpec(f"{flag} {key[:80]!r}: not a valid environment variable name")
        if not sep:
            if key not in shell:
                raise InvalidSpec(
                    f"{flag} {key}: no value given and {key} is not set in this shell"
                )
            value = shell[key]
        out[key] = _no_nul(value, f"{flag} {key}")
    return out


def _no_nul(value: str, where: str) -> str:
    if "\x00" in value:  # (a process environment cannot hold one)
        raise InvalidSpec(f"{where}: a NUL character (\\0) is not allowed in a value")
    return value


def _unquote(raw: str, where: str) -> str:
    """A dotenv value: '...' literal, "..." with backslash escapes, else up to a ` #`."""
    if raw[:1] in ("'", '"'):
        quote = raw[0]
        out: list[str] = []
        i = 1
        while i < len(raw):
            c = raw[i]
            if c == quote:
                rest = raw[i + 1 :].strip()
                if rest and not rest.startswith("#"):
                    raise InvalidSpec(f"{where}: text after the closing quote")
                return "".join(out)
            if c == "\\" and quote == '"' and i + 1 < len(raw):
                i += 1
                out.append(_ESCAPES.get(raw[i], "\\" + raw[i]))
            else:
                out.append(c)
            i += 1
        raise InvalidSpec(f"{where}: the quote is not closed")
    return re.split(r"\s#", raw, maxsplit=1)[0].strip()


def parse_dotenv(text: str, source: str) -> dict[str, str]:
    """KEY=VALUE lines (optionally `export KEY=VALUE`); blank lines and `#` comments skipped.
    A value is one line (quotes included)."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source}:{number}"
        stripped = stripped.removeprefix("export ").lstrip()
        key, sep, raw = stripped.partition("=")
        key = key.strip()
        if not sep or not _NAME.fullmatch(key):
            raise InvalidSpec(f"{where}: expected KEY=VALUE")
        out[key] = _no_nul(_unquote(raw.strip(), where), where)
    return out


def read_env_file(path: Path) -> dict[str, str]:
    try:
        with path.open(encoding="utf-8") as f:
            text = f.read(MAX_ENV_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidSpec(f"--env-file {path}: cannot be read: {reason}") from None
    if len(text) > MAX_ENV_FILE_BYTES:
        raise InvalidSpec(f"--env-file {path}: larger than {MAX_ENV_FILE_BYTES} bytes")
    return parse_dotenv(text, str(path))


def overrides(
    env: list[str] | None,
    env_file: Path | None,
    secret: list[str] | None,
    shell: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, str]]:
    """(envs, secrets) from the flags: the file first, then each `--env` over it."""
    envs = read_env_file(env_file) if env_file is not None else {}
    envs.update(parse_assignments(env or [], "--env", shell))
    return envs, parse_assignments(secret or [], "--secret", shell)
