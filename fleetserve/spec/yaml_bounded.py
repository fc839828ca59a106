"""Reading a YAML text with every cost bounded: a PyYAML SafeLoader that refuses, before it
builds anything large, what a hostile document could use against the controller.

The text's size (MAX_YAML_BYTES), how deep it nests (MAX_NESTING_DEPTH), how many values it
holds once aliases are expanded (MAX_VALUES), how long a number is (MAX_NUMBER_CHARS);
duplicate keys, alias cycles and tags beyond JSON's values are refused with the path and line.
`read_yaml` is the one entry point; fleetserve.spec.loader turns what it returns into a spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.models import MAX_NESTING_DEPTH, MAX_VALUES

MAX_YAML_BYTES = 1024 * 1024  # the text of one service YAML (UTF-8)
# Mappings and lists inside each other: MAX_NESTING_DEPTH (64; a real spec nests about 6 deep).
# Values (scalars, lists, mappings) in the document, an alias counting as every value it
# repeats: MAX_VALUES (20,000: about 0.4 s of parsing on a slow core; a real spec holds a few
# hundred). Both are in models.py, which bounds a JSON post_data string the same way.
MAX_NUMBER_CHARS = 100  # a longer int costs quadratic time to read (1:2:3... is base 60)
MAX_SHOWN_CHARS = 200  # of a value or field path quoted in an error
_CORE = "tag:yaml.org,2002:"
# What a service YAML may hold: JSON's values. Timestamps, binary, sets, ordered maps and
# custom tags would reach the models as values that JSON (the store, the probe body) cannot
# carry. A plain scalar that looks like a date stays a string.
_ALLOWED_TAGS = frozenset(
    _CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")
)
_NUMBER_TAGS = frozenset((_CORE + "int", _CORE + "float"))
_MERGE_KEY = object()  # stands for `<<` when keys are compared


def clip(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def format_loc(loc: tuple[int | str, ...]) -> str:
    """A field path as the YAML spells it: `service.replica_policy.max_replicas`, `a[2].b`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return clip(out) or "(top level)"


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
            parts.append(format_loc(self.path[:8]) + ("..." if len(self.path) > 8 else ""))
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
                self._path.append(clip(str(index.value)))
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
                    f"the alias *{clip(anchor)} is inside its own anchor (a cycle)",
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
                f"the tag {clip(_tag_name(node.tag))} is not supported: a service YAML holds "
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
                    (*path, clip(str(key.value))),
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
            problem = f"{clip(repr(node.value))} is not a valid {kind}"
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


def read_yaml(text: str, source: str = "service YAML") -> Any:
    """The document in `text`, or InvalidSpec naming the rule it breaks (and where)."""
    too_big = _yaml_size_error(text)
    if too_big:
        raise InvalidSpec(f"{source}: {too_big}")
    try:
        loader = _BoundedLoader(text)  # reading starts here: it may refuse a character
        try:
            return loader.get_single_data()
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
        raise InvalidSpec(f"{source}: not valid YAML{where}: {clip(problem)}") from None
