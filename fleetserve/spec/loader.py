"""Loading a service YAML into a `ServiceTask`, with errors that name the field and the rule."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.models import (
    LoadBalancerOptions,
    Pool,
    ReadinessProbe,
    ReplicaPolicy,
    Resources,
    ServiceSection,
    ServiceTask,
    Tls,
)

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Drop pydantic's union-branch labels (`int`, `str`, `function-after[...]`) from a path."""
    kept: list[int | str] = []
    for part in loc:
        if isinstance(part, str) and (
            "[" in part
            or part in {"int", "float", "str", "bool", "list", "dict", "constrained-int"}
        ):
            continue
        kept.append(part)
    return tuple(kept)


def _known_fields() -> set[str]:
    names: set[str] = set()
    models = (ServiceTask, ServiceSection, ReadinessProbe, ReplicaPolicy, Resources, Pool, Tls)
    for model in (*models, LoadBalancerOptions):
        names |= set(model.model_fields)
    return names


def _suggestion(name: str) -> str:
    close = difflib.get_close_matches(name, sorted(_known_fields()), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_validation_error(err: ValidationError) -> list[str]:
    """One line per problem: `field.path: what is wrong`. Union noise is folded together."""
    lines: list[str] = []
    seen: set[str] = set()
    for e in err.errors(include_url=False):
        loc = _clean_loc(tuple(e["loc"]))
        where = _format_loc(loc)
        if e["type"] == "extra_forbidden":
            msg = "unknown field" + _suggestion(str(loc[-1]) if loc else "")
        elif e["type"] == "missing":
            msg = "field required"
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] != "extra_forbidden" and "input" in e and e["type"] != "missing":
            value = e["input"]
            if isinstance(value, str | int | float | bool) and repr(value) not in msg:
                msg += f" (got {value!r})"
        line = f"{where}: {msg}"
        if where in seen and e["type"] not in ("extra_forbidden", "missing"):
            # Several union branches failed on the same field: the first says enough.
            continue
        seen.add(where)
        lines.append(line)
    return lines


def _substitute_envs(value: Any, envs: dict[str, str]) -> Any:
    """Replace $VAR / ${VAR} taken from the task's `envs` in the service section's strings."""
    if isinstance(value, str):
        return _ENV_REF.sub(lambda m: envs.get(m.group(1) or m.group(2), m.group(0)), value)
    if isinstance(value, dict):
        return {k: _substitute_envs(v, envs) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute_envs(v, envs) for v in value]
    return value


def load_spec(data: Any, source: str = "service YAML") -> ServiceTask:
    """Validate an already-parsed YAML document."""
    if not isinstance(data, dict):
        raise InvalidSpec(
            f"{source}: the document must be a mapping of fields, not {type(data).__name__}"
        )
    if "service" not in data:
        raise InvalidSpec(
            f"{source}: service: field required (a 'service:' section makes a task a service)"
        )
    envs = data.get("envs")
    if isinstance(envs, dict) and isinstance(data["service"], dict):
        str_envs = {str(k): "" if v is None else str(v) for k, v in envs.items()}
        data = {**data, "service": _substitute_envs(data["service"], str_envs)}
    try:
        return ServiceTask.model_validate(data)
    except ValidationError as e:
        lines = format_validation_error(e)
        raise InvalidSpec(f"{source}: " + "\n".join(lines)) from None


def parse_spec(text: str, source: str = "service YAML") -> ServiceTask:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise InvalidSpec(f"{source}: not valid YAML{where}: {problem}") from None
    return load_spec(data, source)


def load_spec_file(path: str | Path) -> tuple[ServiceTask, str]:
    """Read and validate a YAML file; returns the spec and the file's text."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise InvalidSpec(f"{p}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise InvalidSpec(f"{p}: cannot be read: {e}") from None
    return parse_spec(text, str(p)), text
