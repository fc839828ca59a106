"""Loading a service YAML into a `ServiceTask`, with errors that name the field and the rule.

A YAML may come from anyone who can reach the API: its text is read by
fleetserve.spec.yaml_bounded, which bounds every cost (size, nesting, values after alias
expansion, number length) before anything large is built; this module applies --env/--secret
overrides and SkyPilot's conventions, validates the models and words the errors.
docs/limits.md lists each limit and the error it gives.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.models import (
    MAX_REPLICAS_CONTEXT,
    LoadBalancerOptions,
    Pool,
    ReadinessProbe,
    ReplicaPolicy,
    Resources,
    ServiceSection,
    ServiceTask,
    Tls,
    max_replicas_limit,
    shape_error,
)
from fleetserve.spec.yaml_bounded import (
    MAX_NUMBER_CHARS,
    MAX_SHOWN_CHARS,
    MAX_YAML_BYTES,
    read_yaml,
)
from fleetserve.spec.yaml_bounded import clip as _clip
from fleetserve.spec.yaml_bounded import format_loc as _format_loc

__all__ = [
    "MAX_ERROR_LINES",
    "MAX_NUMBER_CHARS",
    "MAX_YAML_BYTES",
    "load_spec",
    "load_spec_file",
    "parse_spec",
    "require_values",
]

MAX_ERROR_LINES = 20  # problems listed in one error; the rest are counted

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


_BRANCH_LABELS = frozenset(
    {"int", "float", "str", "bool", "list", "dict", "none", "function-after", "function-before"}
)


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Drop pydantic's union-branch labels (`int`, `str`, `constrained-float`,
    `function-after[...]`, a model's class name) from a path."""
    kept: list[int | str] = []
    for part in loc:
        if isinstance(part, str) and (
            "[" in part or part in _BRANCH_LABELS or part.startswith("constrained-")
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
    # A known name is misplaced, not misspelled: suggesting itself would say nothing.
    if name in _known_fields():
        return " (it belongs elsewhere in the YAML)"
    close = difflib.get_close_matches(name, sorted(_known_fields()), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


_SECRET_FIELDS = frozenset({"api_keys", "secrets"})
MIN_HIDDEN_CHARS = 4  # a secret value this long or longer never appears in an error
_SECRET_VALUE = re.compile(r"'[^']*'")  # a quoted input inside a message


def format_validation_error(err: ValidationError) -> list[str]:
    """One line per problem: `field.path: what is wrong`. Union noise is folded together; past
    MAX_ERROR_LINES the rest are only counted (a list of 10,000 bad items is one error)."""
    lines: list[str] = []
    seen: set[str] = set()
    hidden = 0
    for e in err.errors(include_url=False):
        loc = _clean_loc(tuple(e["loc"]))
        where = _format_loc(loc)
        if where in seen and e["type"] not in ("extra_forbidden", "missing"):
            # Several union branches failed on the same field: the first says enough.
            continue
        seen.add(where)
        if len(lines) == MAX_ERROR_LINES:
            hidden += 1
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown field" + _suggestion(str(loc[-1]) if loc else "")
        elif e["type"] == "missing":
            msg = "field required"
        else:
            msg = _clip(str(e["msg"]).removeprefix("Value error, "), 2 * MAX_SHOWN_CHARS)
            msg = _MODEL_NAME.sub("", msg)  # "a valid dictionary or instance of Tls": no class
        secret = any(str(part) in _SECRET_FIELDS for part in loc)
        if e["type"] != "extra_forbidden" and "input" in e and e["type"] != "missing":
            value = e["input"]
            if secret:
                pass  # never echo an API key or a secret, even a malformed one
            elif isinstance(value, str | int | float | bool) and repr(value) not in msg:
                msg += f" (got {_clip(repr(value))})"
        if secret:
            msg = _SECRET_VALUE.sub("'<hidden>'", msg)
        lines.append(f"{where}: {msg}")
    if hidden:
        lines.append(f"... and {hidden} more")
    return lines


def _substitute_envs(value: Any, envs: dict[str, str], budget: list[int]) -> Any:
    """Replace $VAR / ${VAR} taken from the task's `envs` in the service section's strings.

    `budget[0]` is how many characters the substitutions may add in all: `$A$A$A...` with a
    long A would otherwise turn one megabyte of YAML into gigabytes."""

    def replace(m: re.Match[str]) -> str:
        out = envs.get(m.group(1) or m.group(2), m.group(0))
        budget[0] -= len(out)
        if budget[0] < 0:
            raise InvalidSpec(
                f"service: substituting envs ($VAR) adds more than {MAX_YAML_BYTES} characters"
            )
        return out

    if isinstance(value, str):
        return _ENV_REF.sub(replace, value)
    if isinstance(value, dict):
        return {k: _substitute_envs(v, envs, budget) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute_envs(v, envs, budget) for v in value]
    return value


def _with_overrides(
    data: dict[str, Any], envs: Mapping[str, str], secrets: Mapping[str, str]
) -> dict[str, Any]:
    """The document with `--env` / `--secret` values over its `envs` / `secrets` (a field that
    is not a mapping is left for the model to refuse)."""
    out = dict(data)
    for field, extra in (("envs", envs), ("secrets", secrets)):
        base = out.get(field)
        if extra and (base is None or isinstance(base, dict)):
            out[field] = {**(base or {}), **extra}
    return out


def _hide(text: str, secret_values: list[str]) -> str:
    """A message with every secret value in it replaced (values shorter than
    MIN_HIDDEN_CHARS would blank out ordinary words and digits, and hide little)."""
    for value in sorted(secret_values, key=len, reverse=True):
        if len(value) >= MIN_HIDDEN_CHARS:
            text = text.replace(value, "<hidden>")
    return text


_MODEL_NAME = re.compile(r" or instance of [A-Za-z_]+")


def _kind(value: object) -> str:
    """A YAML value's kind in YAML's words."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return type(value).__name__


def require_values(spec: ServiceTask) -> None:
    """SkyPilot's rule: an `envs` or `secrets` entry set to null must be given a value (by
    `--env` / `--secret`, or the API's `envs` / `secrets`), else nothing starts. SkyPilot's
    current task parser refuses both alike ("Environment variable ... is None", "Secret
    variable ... is None"; 0.14.1 took a null secret as a managed-secret reference, resolved
    at launch), and so do `validate`, `up` and `update`: fleetserve has no secret store."""
    missing = [f"envs.{k}" for k, v in spec.envs.items() if v is None]
    missing += [f"secrets.{k}" for k, v in spec.secrets.items() if v is None]
    if missing:
        raise InvalidSpec(
            f"{', '.join(missing)}: null in the YAML, which means a value is required: pass "
            "--env KEY=VALUE (--secret for secrets), or --env KEY to take it from your shell"
        )


def load_spec(
    data: Any,
    source: str = "service YAML",
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> ServiceTask:
    """Validate an already-parsed YAML document, bounded as `parse_spec` bounds a text.
    `envs` and `secrets` (`--env`, `--secret`) take precedence over the YAML's.

    FLEETSERVE_MAX_REPLICAS is read here, at each validation: the result depends only on the
    document, the overrides and that limit."""
    if not isinstance(data, dict):
        raise InvalidSpec(
            f"{source}: the document is empty: a service YAML is a mapping of fields "
            "(service:, run:, ...)"
            if data is None
            else f"{source}: the document must be a mapping of fields, not {_kind(data)}"
        )
    # A top-level key set to null is absent, as in SkyPilot (`secrets:` with nothing under it);
    # not `envs` (SkyPilot refuses that) nor `service` (then not a service).
    data = {k: v for k, v in data.items() if v is not None or k in ("envs", "service")}
    if "envs" in data and data["envs"] is None:
        raise InvalidSpec(
            f"{source}: envs: is empty (null), which SkyPilot refuses too: list the variables "
            "under it (`envs: {NAME: value}`) or remove the key"
        )
    top_level_pool = data.get("pool") is not None
    if top_level_pool:  # SkyPilot's pool YAML: its service section's pool
        if data.get("service") is not None:
            raise InvalidSpec(f"{source}: set either 'service' or 'pool', not both")
        data = {k: v for k, v in data.items() if k != "pool"} | {"service": {"pool": data["pool"]}}
    if "service" not in data:
        raise InvalidSpec(
            f"{source}: service: field required (a 'service:' section makes a task a service)"
        )
    # Data from elsewhere than parse_spec (whose loader refused this already, with a line).
    problem = shape_error(data)
    if problem:
        raise InvalidSpec(f"{source}: the document {problem}")
    context = {MAX_REPLICAS_CONTEXT: max_replicas_limit()}
    data = _with_overrides(data, envs or {}, secrets or {})
    for field, given in (("--env", envs), ("--secret", secrets)):
        problem = shape_error(dict(given or {}))
        if problem:
            raise InvalidSpec(f"{field}: {problem.removeprefix('holds ')}")
    # envs and secrets are both substituted in the service section (a probe header may carry
    # a secret token); a secret's value is hidden from any error below. A null entry (a value
    # the user must give) is left as written: substituted as "", it would fail a field that
    # must not be empty with a message about that field instead of require_values' own.
    values: dict[str, str] = {}
    hidden: list[str] = []
    for field in ("envs", "secrets"):
        given = data.get(field)
        if isinstance(given, dict):
            for k, v in given.items():
                if v is None:
                    continue
                values[str(k)] = str(v)
                if field == "secrets":
                    hidden.append(str(v))
    if values and isinstance(data["service"], dict):
        try:
            service = _substitute_envs(data["service"], values, [MAX_YAML_BYTES])
        except InvalidSpec as e:
            raise InvalidSpec(f"{source}: {e.message}") from None
        data = {**data, "service": service}
    try:
        return ServiceTask.model_validate(data, context=context)
    except ValidationError as e:
        lines = format_validation_error(e)
        if top_level_pool:  # name the field where the YAML has it
            lines = [line.replace("service.pool", "pool", 1) for line in lines]
        raise InvalidSpec(_hide(f"{source}: " + "\n".join(lines), hidden)) from None


def parse_spec(
    text: str,
    source: str = "service YAML",
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> ServiceTask:
    """Parse and validate a YAML text: a spec, or InvalidSpec naming the rule broken."""
    return load_spec(read_yaml(text, source), source, envs, secrets)


def load_spec_file(
    path: str | Path,
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> tuple[ServiceTask, str]:
    """Read and validate a YAML file; returns the spec and the file's text. At most
    MAX_YAML_BYTES (and one more) are read, whatever the file is (a device, a FIFO)."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as f:
            text = f.read(MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise InvalidSpec(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidSpec(f"{p}: cannot be read: {reason}") from None
    return parse_spec(text, str(p), envs, secrets), text
