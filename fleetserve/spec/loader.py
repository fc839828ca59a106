"""Loading a service YAML into a `ServiceTask`, with errors that name the field and the rule.

A YAML may come from anyone who can reach the API, so every input is bounded before it can
cost much: the text's size, how deep it nests, how many values it holds once aliases are
expanded, how long a number is; duplicate keys, cycles and non-JSON tags are refused.
docs/limits.md lists each limit and the error it gives.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import ValidationError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.models import (
    MAX_NESTING_DEPTH,
    MAX_REPLICAS_CONTEXT,
    MAX_VALUES,
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

MAX_YAML_BYTES = 1024 * 1024  # the text of one service YAML (UTF-8)
# Mappings and lists inside each other: MAX_NESTING_DEPTH (64; a real spec nests about 6 deep).
# Values (scalars, lists, mappings) in the document, an alias counting as every value it
# repeats: MAX_VALUES (20,000: about 0.4 s of parsing on a slow core; a real spec holds a few
# hundred). Both are in models.py, which bounds a JSON post_data string the same way.
MAX_NUMBER_CHARS = 100  # a longer int costs quadratic time to read (1:2:3... is base 60)
MAX_ERROR_LINES = 20  # problems listed in one error; the rest are counted
_MAX_SHOWN_CHARS = 200  # of a value or field path quoted in an error

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_CORE = "tag:yaml.org,2002:"
# What a service YAML may hold: JSON's values. Timestamps, binary, sets, ordered maps and
# custom tags would reach the models as values that JSON (the store, the probe body) cannot
# carry. A plain scalar that looks like a date stays a string.
_ALLOWED_TAGS = frozenset(
    _CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")
)
_NUMBER_TAGS = frozenset((_CORE + "int", _CORE + "float"))
_MERGE_KEY = object()  # stands for `<<` when keys are compared


def _clip(text: str, limit: int = _MAX_SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return _clip(out) or "(top level)"


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
            msg = _clip(str(e["msg"]).removeprefix("Value error, "), 2 * _MAX_SHOWN_CHARS)
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


def require_values(spec: ServiceTask, secrets_too: bool = True) -> None:
    """SkyPilot's rule: an `envs` or `secrets` entry set to null must be given a value (by
    `--env` / `--secret`, or the API's `envs` / `secrets`), else nothing starts. SkyPilot's
    parser refuses a null env, but takes a null secret until launch: `validate` does the
    same (`secrets_too=False`); `up` needs both."""
    missing = [f"envs.{k}" for k, v in spec.envs.items() if v is None]
    if secrets_too:
        missing += [f"secrets.{k}" for k, v in spec.secrets.items() if v is None]
    if missing:
        raise InvalidSpec(
            f"{', '.join(missing)}: null in the YAML, which means a value is required: pass "
            "--env KEY=VALUE (--secret for secrets), or --env KEY to take it from your shell"
        )


def missing_secrets(spec: ServiceTask) -> list[str]:
    """The null `secrets` entries, which `up` needs with --secret."""
    return [k for k, v in spec.secrets.items() if v is None]


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
            f"{source}: the document must be a mapping of fields, not {type(data).__name__}"
        )
    # A top-level key set to null is absent, as in SkyPilot (`secrets:` with nothing under it);
    # not `envs` (SkyPilot refuses that) nor `service` (then not a service).
    data = {k: v for k, v in data.items() if v is not None or k in ("envs", "service")}
    if data.get("pool") is not None:  # SkyPilot's pool YAML: its service section's pool
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
    # envs and secrets are both substituted in the service section (a probe header may carry
    # a secret token); a secret's value is hidden from any error below.
    values: dict[str, str] = {}
    hidden: list[str] = []
    for field in ("envs", "secrets"):
        given = data.get(field)
        if isinstance(given, dict):
            for k, v in given.items():
                values[str(k)] = "" if v is None else str(v)
                if field == "secrets" and v is not None:
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
        raise InvalidSpec(_hide(f"{source}: " + "\n".join(lines), hidden)) from None


class _Mark(Protocol):
    """Where a YAML node starts (PyYAML's pure and libyaml marks both have it)."""

    line: int


class _Refused(Exception):
    """A rule of `_BoundedLoader` broken at `path` (YAML line `mark`)."""

    def __init__(self, path: tuple[int | str, ...], mark: _Mark | None, rule: str) -> None:
        super().__init__(rule)
        self.path = path
        self.mark = mark
        self.rule = rule

    def message(self, source: str) -> str:
        """`source: field.path (line N): rule`; a deep path shows its first 8 steps."""
        parts = []
        if self.path:
            parts.append(_format_loc(self.path[:8]) + ("..." if len(self.path) > 8 else ""))
        if self.mark is not None:
            parts.append(f"(line {self.mark.line + 1})" if parts else f"line {self.mark.line + 1}")
        return f"{source}: {' '.join(parts) or '(top level)'}: {self.rule}"


def _tag_name(tag: str) -> str:
    return "!!" + tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounds, checked while the document is composed (before any
    Python value exists), so nothing is ever built that a bound refuses.

    Why count instead of refusing aliases: anchors are valid YAML that SkyPilot files may
    use to share a block; what hurts is only their expansion (`a: &a [x, x]`, `b: &b [*a, *a]`
    ... doubles per line: 543 bytes make 10**9 values for every later walk: env substitution,
    pydantic, JSON). Each node's expanded size is counted once when it is composed, an alias
    adds its anchor's size, and the document stops at MAX_VALUES: linear time, nothing
    expanded. An alias inside its own anchor (a cycle) is refused.

    Why depth here: PyYAML's composer (and merge flattening) recurse once per level, so 20,000
    `[` reach Python's recursion limit; the depth is checked before each level is entered."""

    # No implicit dates (JSON has none), no `=` value key: such plain scalars stay strings.
    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag in _ALLOWED_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._path: list[int | str] = []
        self._values = 0
        self._sizes: dict[str, int] = {}  # anchor -> values its node stands for
        self._open: set[str] = set()  # anchors whose node is still being composed
        self._merge_depth = 0

    def _count(self, values: int, mark: _Mark | None) -> None:
        self._values += values
        if self._values > MAX_VALUES:
            raise _Refused(
                tuple(self._path),
                mark,
                f"the document holds more than {MAX_VALUES} values (each alias counts "
                "as the values it repeats)",
            )

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if parent is not None:  # the root has no place in the path
            if isinstance(index, ScalarNode):
                self._path.append(_clip(str(index.value)))
            else:  # a list index, or a key (index None)
                self._path.append(index if isinstance(index, int) else "(key)")
        try:
            return self._compose_bounded(parent, index)
        finally:
            if parent is not None:
                self._path.pop()

    def _compose_bounded(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in the stubs
        if isinstance(event, yaml.AliasEvent):
            anchor = event.anchor
            if anchor is not None and anchor in self._open:
                raise _Refused(
                    tuple(self._path),
                    event.start_mark,
                    f"the alias *{_clip(anchor)} is inside its own anchor (a cycle)",
                )
            # An undefined alias counts nothing here; PyYAML refuses it just below.
            self._count(self._sizes.get(anchor or "", 0), event.start_mark)
            return super().compose_node(parent, index)
        if len(self._path) > MAX_NESTING_DEPTH:
            raise _Refused(
                tuple(self._path),
                event.start_mark,
                f"nested deeper than {MAX_NESTING_DEPTH} levels",
            )
        before = self._values
        self._count(1, event.start_mark)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open.add(anchor)
        node = super().compose_node(parent, index)
        if anchor is not None:
            self._open.discard(anchor)
            self._sizes[anchor] = self._values - before
        if node is not None:
            self._check_node(node)
        return node

    def _check_node(self, node: Node) -> None:
        path = tuple(self._path)
        if node.tag not in _ALLOWED_TAGS:
            raise _Refused(
                path,
                node.start_mark,
                f"the tag {_clip(_tag_name(node.tag))} is not supported: a service YAML holds "
                "strings, numbers, booleans, null, lists and mappings",
            )
        if isinstance(node, ScalarNode):
            if "\x00" in node.value:
                raise _Refused(path, node.start_mark, "a NUL character (\\0) is not allowed")
            if node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
                raise _Refused(
                    path,
                    node.start_mark,
                    f"a number longer than {MAX_NUMBER_CHARS} characters (quote it to make "
                    "it a string)",
                )
        elif isinstance(node, MappingNode):
            self._check_duplicate_keys(node, path)

    def _check_duplicate_keys(self, node: MappingNode, path: tuple[int | str, ...]) -> None:
        """Keys compared as the dict will compare them (`1`, `1.0` and `true` are one key);
        checked before merges (`<<`) are flattened, which may override keys on purpose."""
        first_seen: dict[Any, ScalarNode] = {}
        for key, _value in node.value:
            if not isinstance(key, ScalarNode):
                continue  # a list or mapping as a key is refused when it is constructed
            if key.tag == _CORE + "merge":
                ident: Any = _MERGE_KEY
            else:
                ident = self.yaml_constructors[key.tag](self, key)
            first = first_seen.setdefault(ident, key)
            if first is not key:
                line = first.start_mark.line + 1 if first.start_mark else "?"
                raise _Refused(
                    (*path, _clip(str(key.value))),
                    key.start_mark,
                    f"duplicate key (first at line {line}); a key may appear once in a mapping",
                )

    def flatten_mapping(self, node: MappingNode) -> None:
        # Merges recurse through chains of anchors (`&x3 {<<: *x2}`), which an alias can make
        # deeper than the text nests.
        self._merge_depth += 1
        try:
            if self._merge_depth > MAX_NESTING_DEPTH:
                raise _Refused(
                    (), node.start_mark, f"merge keys (<<) chained deeper than {MAX_NESTING_DEPTH}"
                )
            super().flatten_mapping(node)
        finally:
            self._merge_depth -= 1


def _checked(
    kind: str, construct: Callable[[_BoundedLoader, ScalarNode], Any]
) -> Callable[[_BoundedLoader, ScalarNode], Any]:
    """PyYAML's scalar constructors raise KeyError, IndexError or ValueError on an explicit
    tag that does not fit (`!!bool maybe`, `!!int ""`): make those YAML errors."""

    def construct_checked(loader: _BoundedLoader, node: ScalarNode) -> Any:
        try:
            return construct(loader, node)
        except (KeyError, IndexError, ValueError):
            problem = f"{_clip(repr(node.value))} is not a valid {kind}"
            raise ConstructorError(None, None, problem, node.start_mark) from None

    return construct_checked


for _kind, _tag in (("boolean", "bool"), ("integer", "int"), ("number", "float")):
    _BoundedLoader.add_constructor(
        _CORE + _tag, _checked(_kind, SafeConstructor.yaml_constructors[_CORE + _tag])
    )


def _yaml_size_error(text: str) -> str | None:
    # Characters <= bytes: a text with too many characters is too large without encoding it.
    size = len(text)
    if size <= MAX_YAML_BYTES:
        size = len(text.encode("utf-8", "surrogatepass"))
    if size <= MAX_YAML_BYTES:
        return None
    return f"the YAML is larger than {MAX_YAML_BYTES} bytes (at least {size})"


def parse_spec(
    text: str,
    source: str = "service YAML",
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> ServiceTask:
    """Parse and validate a YAML text: a spec, or InvalidSpec naming the rule broken."""
    too_big = _yaml_size_error(text)
    if too_big:
        raise InvalidSpec(f"{source}: {too_big}")
    try:
        loader = _BoundedLoader(text)  # reading starts here: it may refuse a character
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except _Refused as e:
        raise InvalidSpec(e.message(source)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        if "another document" in problem:  # `---` then more: valid YAML, not one service
            raise InvalidSpec(
                f"{source}: a second YAML document starts{where}: a service YAML is one "
                "document (SkyPilot's `sky serve up` takes one task too); split the file"
            ) from None
        raise InvalidSpec(f"{source}: not valid YAML{where}: {_clip(problem)}") from None
    return load_spec(data, source, envs, secrets)


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
