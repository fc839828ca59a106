"""Properties of the loader over generated input: whatever the text, bytes or structure, it
returns a spec or raises InvalidSpec (never another exception, never a RecursionError), within
a deadline; and every valid spec it returns survives the store (JSON) and a YAML round trip."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec import load_spec, load_spec_file, parse_spec
from fleetserve.spec.models import DEFAULT_MAX_REPLICAS, ServiceTask


def fast(examples: int) -> settings:
    """Small inputs parse in milliseconds: the deadline (5 s) catches a parse that blows up
    (a recursion, an exponential path), not a slow one, so a busy core or a parallel suite
    never fails it; `examples` keeps the whole file within seconds. No example database in
    the checkout."""
    return settings(
        max_examples=examples,
        deadline=timedelta(seconds=5),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def spec_or_invalid(text: str) -> ServiceTask | None:
    """The property: a spec, or InvalidSpec (None here). Anything else fails the test."""
    try:
        return parse_spec(text)
    except InvalidSpec as e:
        assert e.message.strip(), "an error must say something"
        return None


# -- arbitrary text and bytes --------------------------------------------------------------------


@fast(1000)
@given(st.text(max_size=400))
def test_any_text_is_a_spec_or_invalid_spec(text: str) -> None:
    spec_or_invalid(text)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("yaml")


@fast(300)
@given(st.binary(max_size=400))
def test_any_file_is_a_spec_or_invalid_spec(scratch: Path, data: bytes) -> None:
    path = scratch / "service.yaml"
    path.write_bytes(data)
    with contextlib.suppress(InvalidSpec):
        load_spec_file(path)


# -- YAML-ish token soup: anchors, tags, merges, flow and block structure -------------------------

TOKENS = [
    "[", "]", "{", "}", ", ", ": ", ":", "- ", "-", "\n", "  ", "    ", "? ", "#c", "'", '"',
    "|\n", ">\n", "---\n", "...\n", "%YAML 1.1\n", "&a ", "&b ", "*a", "*b", "<<: ", "<<: *a",
    "!!int ", "!!bool ", "!!float ", "!!str ", "!!null ", "!!binary ", "!!set ", "!!omap ",
    "!!timestamp ", "!x ", "!!map ", "!!seq ", "service", "readiness_probe", "/h", "path",
    "replicas", "replica_policy", "min_replicas", "max_replicas", "target_qps_per_replica",
    "post_data", "envs", "X", "$X", "${X}", "name", "hello", "run", "config", "resources",
    "ports", "1", "0", "-1", "1.5", "1e3", "1.0e+999", "true", "yes", "off", "null", "~",
    ".inf", ".nan", "0x1F", "0o17", "017", "1:30", "1_000", "2024-01-01", "=", "\\0", "\t",
    "\x00", "\x85", "\u2028", "\ufeff", "é",
]  # fmt: skip

soup = st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=3)), max_size=120).map("".join)


@fast(1000)
@given(soup)
def test_yaml_token_soup_is_a_spec_or_invalid_spec(text: str) -> None:
    spec_or_invalid(text)


@fast(600)
@given(soup)
def test_token_soup_inside_a_valid_skeleton_is_a_spec_or_invalid_spec(text: str) -> None:
    """The same soup where it reaches the models: under the probe, the policy and config."""
    indented = text.replace("\n", "\n    ")
    spec_or_invalid(
        "name: hello\nenvs: {X: x}\nservice:\n  readiness_probe:\n    path: /h\n"
        f"    post_data: {indented}\n  replicas: 1\nconfig:\n  a: {indented}\n"
    )


@fast(60)
@given(
    st.integers(min_value=0, max_value=3000),
    st.lists(st.sampled_from(["[", "{a: ", "- ", "a:\n", "&x [", "[*x, "]), min_size=1, max_size=4),
    st.sampled_from(["config: ", "service:\n  readiness_probe: /h\nconfig:\n  "]),
)
def test_any_nesting_is_a_spec_or_invalid_spec_never_a_recursion_error(
    depth: int, openers: list[str], prefix: str
) -> None:
    body = ""
    for i in range(depth):  # the openers over and over; a block opener indents the next line
        opener = openers[i % len(openers)]
        body += opener + " " * (i + 1) if opener.endswith("\n") else opener
    spec_or_invalid(prefix + body + "1" + "]" * depth + "\n")


# -- arbitrary structures, dumped by PyYAML (which writes anchors for shared objects) -------------

FIELDS = [
    "name", "service", "readiness_probe", "path", "replicas", "replica_policy", "min_replicas",
    "max_replicas", "target_qps_per_replica", "post_data", "headers", "envs", "secrets", "run",
    "setup", "resources", "ports", "cpus", "use_spot", "any_of", "pool", "workers", "config",
    "load_balancer", "load_balancing_policy", "max_surge", "file_mounts", "tls",
]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(["/h", "/health", "round_robin", "A100:1", "8080", "2+", "$X"]),
)
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=25,
)
documents = st.dictionaries(keys, values, max_size=6)


def with_shared_parts(doc: dict[str, Any]) -> dict[str, Any]:
    """The same object twice: safe_dump writes it as an anchor and an alias."""
    shared = doc.get("service")
    if isinstance(shared, dict | list):
        doc = {**doc, "config": {"again": shared, "and_again": [shared, shared]}}
    return doc


@fast(150)
@given(documents)
def test_any_structure_is_a_spec_or_invalid_spec(doc: dict[str, Any]) -> None:
    for data in (doc, with_shared_parts(doc)):
        with contextlib.suppress(InvalidSpec):
            load_spec(data)
        spec_or_invalid(yaml.safe_dump(data))


# -- valid specs round-trip ----------------------------------------------------------------------

safe_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00$"),
    max_size=20,
)
finite = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-3, max_value=1e9, allow_nan=False, allow_infinity=False)
count = st.integers(min_value=0, max_value=DEFAULT_MAX_REPLICAS)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**15), 10**15), finite, safe_text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(safe_text, inner, max_size=3)
    ),
    max_leaves=10,
)


@st.composite
def replica_settings(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):
        return {"replicas": draw(count)}
    low = draw(count)
    if draw(st.booleans()):  # autoscaled
        high = draw(st.integers(min_value=low, max_value=DEFAULT_MAX_REPLICAS))
        policy = {
            "min_replicas": low,
            "max_replicas": high,
            "target_qps_per_replica": draw(positive),
        }
        policy["upscale_delay_seconds"] = draw(finite)
        return {"replica_policy": policy}
    return {"replica_policy": {"min_replicas": low}}


@st.composite
def valid_specs(draw: st.DrawFn) -> dict[str, Any]:
    probe: dict[str, Any] = {
        "path": "/" + draw(st.from_regex(r"[A-Za-z0-9/_.-]{0,20}", fullmatch=True)),
        "initial_delay_seconds": draw(finite),
        "timeout_seconds": draw(positive),
    }
    if draw(st.booleans()):
        probe["post_data"] = draw(st.dictionaries(safe_text, json_values, max_size=4))
    service: dict[str, Any] = {"readiness_probe": probe, **draw(replica_settings())}
    service["load_balancing_policy"] = draw(st.sampled_from(["round_robin", "least_load"]))
    service["max_surge"] = draw(st.integers(min_value=1, max_value=DEFAULT_MAX_REPLICAS))
    doc: dict[str, Any] = {"service": service, "run": draw(safe_text)}
    if draw(st.booleans()):
        doc["name"] = draw(st.from_regex(r"[a-z0-9]+([._-][a-z0-9]+){0,3}", fullmatch=True))
    envs = st.dictionaries(
        st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True),
        st.one_of(safe_text, st.integers(-1000, 1000), st.booleans()),
        max_size=4,
    )
    doc["envs"] = draw(envs)
    return doc


@fast(100)
@given(valid_specs())
def test_valid_specs_load_and_round_trip(doc: dict[str, Any]) -> None:
    spec = parse_spec(yaml.safe_dump(doc))
    # The store keeps the spec as JSON and reads it back on every controller start.
    assert ServiceTask.model_validate_json(spec.model_dump_json()) == spec
    # What the spec says, written back as YAML, is the same spec.
    assert parse_spec(yaml.safe_dump(spec.model_dump(mode="json"))) == spec
