"""Every input of a service YAML is bounded, and breaking a bound is an InvalidSpec that names
the field (or line) and the rule: no input freezes, crashes or exhausts whoever parses it."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec import load_spec_file, parse_spec
from fleetserve.spec.loader import MAX_ERROR_LINES, MAX_NUMBER_CHARS, MAX_YAML_BYTES
from fleetserve.spec.models import (
    DEFAULT_MAX_REPLICAS,
    MAX_NESTING_DEPTH,
    MAX_VALUES,
    ServiceTask,
)

PROBE = "service:\n  readiness_probe: /h\n"


def err(text: str) -> str:
    with pytest.raises(InvalidSpec) as e:
        parse_spec(text)
    return e.value.message


def quickly_refused(text: str, seconds: float = 5.0) -> str:
    """The refusal, which must come well within `seconds` (generous for slow CI cores)."""
    start = time.perf_counter()
    msg = err(text)
    assert time.perf_counter() - start < seconds, msg
    return msg


# -- 1. replica counts ---------------------------------------------------------------------------

COUNT_FIELDS = [
    ("service.replicas", "service:\n  readiness_probe: /h\n  replicas: {n}\n"),
    (
        "service.replica_policy.min_replicas",
        "service:\n  readiness_probe: /h\n  replica_policy: {{min_replicas: {n}}}\n",
    ),
    (
        "service.replica_policy.max_replicas",
        "service:\n  readiness_probe: /h\n  replica_policy: {{min_replicas: 1, "
        "max_replicas: {n}, target_qps_per_replica: 1}}\n",
    ),
    (
        "service.replica_policy.num_overprovision",
        "service:\n  readiness_probe: /h\n  replica_policy: {{min_replicas: 1, "
        "num_overprovision: {n}}}\n",
    ),
    (
        "service.replica_policy.base_ondemand_fallback_replicas",
        "service:\n  readiness_probe: /h\n  replica_policy: {{min_replicas: 1, "
        "base_ondemand_fallback_replicas: {n}}}\nresources: {{use_spot: true}}\n",
    ),
    ("service.max_surge", "service:\n  readiness_probe: /h\n  max_surge: {n}\n"),
    ("service.max_unavailable", "service:\n  readiness_probe: /h\n  max_unavailable: {n}\n"),
    ("service.pool.workers", "service:\n  pool: {{workers: {n}}}\n"),
    ("service.pool.min_workers", "service:\n  pool: {{min_workers: {n}, max_workers: {n}}}\n"),
    ("service.pool.max_workers", "service:\n  pool: {{min_workers: 1, max_workers: {n}}}\n"),
]


@pytest.mark.parametrize(("field", "template"), COUNT_FIELDS, ids=[f for f, _ in COUNT_FIELDS])
def test_every_replica_count_is_bounded(field: str, template: str) -> None:
    parse_spec(template.format(n=DEFAULT_MAX_REPLICAS))  # the limit itself is fine
    msg = err(template.format(n=1_000_000_000))
    assert f"{field}: must be <= {DEFAULT_MAX_REPLICAS}" in msg, msg
    assert "FLEETSERVE_MAX_REPLICAS" in msg and "1000000000" in msg, msg


def test_the_replica_limit_is_read_from_the_environment_at_each_validation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETSERVE_MAX_REPLICAS", "5")
    parse_spec(PROBE + "  replicas: 5\n")
    assert "service.replicas: must be <= 5" in err(PROBE + "  replicas: 6\n")
    monkeypatch.setenv("FLEETSERVE_MAX_REPLICAS", "2000")
    assert parse_spec(PROBE + "  replicas: 1500\n").service.replicas == 1500


@pytest.mark.parametrize("raw", ["0", "-1", "many", "1e3", "9" * 50])
def test_a_bad_replica_limit_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("FLEETSERVE_MAX_REPLICAS", raw)
    assert "FLEETSERVE_MAX_REPLICAS" in err(PROBE)


def test_a_stored_spec_is_read_back_whatever_the_limit_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's JSON was validated when it came in: lowering the limit later must not make
    the controller unable to read its own services."""
    stored = parse_spec(PROBE + "  replicas: 500\n").model_dump_json()
    monkeypatch.setenv("FLEETSERVE_MAX_REPLICAS", "10")
    assert ServiceTask.model_validate_json(stored).service.replicas == 500


# -- 2. size, nesting and aliases ----------------------------------------------------------------


def _laughs() -> str:
    """The classic "billion laughs": 9 levels of 9 aliases, 9**9 strings in 400 bytes."""
    lines = []
    for prev, name in zip(["", *"abcdefgh"], "abcdefghi", strict=True):
        item = f"*{prev}" if prev else "lol"
        lines.append(f"  {name}: &{name} [{', '.join([item] * 9)}]\n")
    return "".join(lines)


LAUGHS = _laughs()


def test_an_alias_bomb_is_refused_at_once() -> None:
    text = "config:\n" + LAUGHS + PROBE
    assert len(text.encode()) < 600
    msg = quickly_refused(text, seconds=2)
    assert f"more than {MAX_VALUES} values" in msg and "alias" in msg, msg
    assert re.search(r"config\.\w\[\d\] \(line \d+\)", msg), msg


def test_an_alias_bomb_in_the_probe_body_is_refused_at_once() -> None:
    text = "service:\n  readiness_probe:\n    path: /h\n    post_data:\n" + LAUGHS.replace(
        "  ", "      "
    )
    msg = quickly_refused(text, seconds=2)
    assert "service.readiness_probe.post_data." in msg and f"more than {MAX_VALUES}" in msg, msg


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    msg = err("config: {a: &a [1, *a]}\n" + PROBE)
    assert "config.a[1] (line 1): the alias *a is inside its own anchor" in msg, msg


def test_anchors_aliases_and_merges_within_bounds_still_work() -> None:
    spec = parse_spec(
        "config:\n  base: &base {x: 1, y: 2}\n  copy: *base\n  merged: {<<: *base, y: 3}\n"
        "service:\n  readiness_probe: &probe {path: /h, timeout_seconds: 5}\n"
        "  replicas: 1\n"
    )
    assert spec.config == {
        "base": {"x": 1, "y": 2},
        "copy": {"x": 1, "y": 2},
        "merged": {"x": 1, "y": 3},  # a merged key may be overridden: that is no duplicate
    }


def test_a_merge_chain_deeper_than_the_text_is_refused() -> None:
    """Anchors each merging the previous one, the last used near the top: PyYAML flattens the
    merges recursively (a RecursionError before)."""
    lines = ["config:", "  deep:", "    - - - - &x0 {k0: 0}"]
    lines += [f"    - - - - &x{i} {{<<: *x{i - 1}, k{i}: {i}}}" for i in range(1, 90)]
    lines += ["  shallow: *x89", PROBE]
    msg = err("\n".join(lines))
    assert f"merge keys (<<) chained deeper than {MAX_NESTING_DEPTH}" in msg, msg


@pytest.mark.parametrize(
    "text",
    [
        "config: " + "[" * 20_000 + "]" * 20_000 + "\n" + PROBE,
        "config: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n" + PROBE,
        "config:\n" + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(1000)) + PROBE,
        "config:\n" + "".join(" " * (i + 1) + "-\n" for i in range(1000)) + PROBE,
    ],
    ids=["flow-lists", "flow-maps", "block-maps", "block-lists"],
)
def test_deep_nesting_is_a_clear_error_not_a_recursion_error(text: str) -> None:
    msg = quickly_refused(text)
    assert f"nested deeper than {MAX_NESTING_DEPTH} levels" in msg, msg
    assert msg.startswith("service YAML: config") and "(line " in msg, msg


def test_nesting_up_to_the_limit_loads() -> None:
    depth = MAX_NESTING_DEPTH - 2  # config and its key are two levels
    spec = parse_spec("config: {a: " + "[" * depth + "]" * depth + "}\n" + PROBE)
    assert spec.config is not None


def test_a_yaml_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    text = PROBE + "run: " + "x" * MAX_YAML_BYTES + "\n"
    assert f"larger than {MAX_YAML_BYTES} bytes" in err(text)
    multibyte = PROBE + "run: " + "é" * (MAX_YAML_BYTES // 2) + "\n"  # fewer characters
    assert f"larger than {MAX_YAML_BYTES} bytes" in err(multibyte)
    big = tmp_path / "big.yaml"
    big.write_text(text * 4)
    with pytest.raises(InvalidSpec, match=f"{big}: the YAML is larger than {MAX_YAML_BYTES}"):
        load_spec_file(big)


def test_a_yaml_just_under_the_limit_loads_within_seconds() -> None:
    text = PROBE + "run: " + "x" * (MAX_YAML_BYTES - 100) + "\n"
    start = time.perf_counter()
    assert parse_spec(text).run is not None
    assert time.perf_counter() - start < 5


def test_as_many_values_as_allowed_parse_within_seconds() -> None:
    items = MAX_VALUES // 2 - 10  # a key and a value each
    text = PROBE + "config:\n" + "".join(f"  k{i}: {i}\n" for i in range(items))
    start = time.perf_counter()
    assert len(parse_spec(text).config or {}) == items
    assert time.perf_counter() - start < 5
    more = PROBE + "config:\n" + "".join(f"  k{i}: {i}\n" for i in range(items + 20))
    assert f"more than {MAX_VALUES} values" in quickly_refused(more)


# -- 3. duplicate keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (PROBE + "  replicas: 1\n  replicas: 3\n", "service.replicas (line 4): duplicate key"),
        (PROBE + "run: a\nrun: b\n", "run (line 4): duplicate key (first at line 3)"),
        ("service: {readiness_probe: /a, readiness_probe: /b}\n", "service.readiness_probe"),
        (PROBE + "config: {1: a, 1.0: b}\n", "config.1.0 (line 3)"),  # one dict key
        (PROBE + "envs: {A: 1, B: 2, A: 3}\n", "envs.A (line 3)"),
    ],
)
def test_a_duplicate_key_names_the_key_and_line(text: str, where: str) -> None:
    msg = err(text)
    assert where in msg and "a key may appear once" in msg, msg


# -- 4. strict types -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (PROBE + "  replicas: true\n", "service.replicas"),
        (PROBE + "  replicas: '2'\n", "service.replicas"),
        (PROBE + "  replicas: 2.5\n", "service.replicas"),
        (
            PROBE + "  replica_policy: {min_replicas: false}\n",
            "service.replica_policy.min_replicas",
        ),
        (
            PROBE + "  replica_policy: {min_replicas: 1, dynamic_ondemand_fallback: 'yes'}\n",
            "service.replica_policy.dynamic_ondemand_fallback",
        ),
        (
            "service:\n  readiness_probe: {path: /h, initial_delay_seconds: true}\n",
            "service.readiness_probe.initial_delay_seconds",
        ),
        (
            "service:\n  readiness_probe: {path: /h, timeout_seconds: '5'}\n",
            "service.readiness_probe.timeout_seconds",
        ),
        (PROBE + "  ports: true\n", "service.ports"),
        (PROBE + "resources: {use_spot: 1}\n", "resources.use_spot"),
        (PROBE + "resources: {cpus: true}\n", "resources.cpus"),
        (PROBE + "num_nodes: true\n", "num_nodes"),
    ],
)
def test_no_bool_or_string_where_a_number_is_expected(text: str, where: str) -> None:
    assert f"{where}: Input should be a valid" in err(text)


def test_an_int_is_still_a_fine_float() -> None:
    probe = parse_spec("service:\n  readiness_probe: {path: /h, timeout_seconds: 5}\n")
    assert probe.service.readiness_probe is not None
    assert probe.service.readiness_probe.timeout_seconds == 5.0


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1.0e+400"])
def test_a_float_must_be_finite_so_the_stored_spec_reads_back(value: str) -> None:
    """An infinite delay used to be stored as JSON null, which the controller cannot read."""
    msg = err(f"service:\n  readiness_probe: {{path: /h, initial_delay_seconds: {value}}}\n")
    assert "service.readiness_probe.initial_delay_seconds: Input should be a finite" in msg


# -- 5. names and patterns match in full ---------------------------------------------------------


def test_python_dollar_matches_before_a_trailing_newline_so_patterns_use_fullmatch() -> None:
    """Why the models call `fullmatch`: `$` takes "x\\n". Pydantic's `pattern` is no way out
    either: its default (Rust) engine is strict, but with `regex_engine="python-re"` it is not,
    and a pattern without anchors matches anywhere."""
    assert re.match(r"^[a-z]+$", "hello\n") is not None
    assert re.fullmatch(r"[a-z]+", "hello\n") is None

    class RustEngine(BaseModel):
        name: Annotated[str, Field(pattern=r"^[a-z]+$")]

    class PythonEngine(BaseModel):
        model_config = ConfigDict(regex_engine="python-re")
        name: Annotated[str, Field(pattern=r"^[a-z]+$")]

    with pytest.raises(ValidationError):
        RustEngine(name="hello\n")
    assert PythonEngine(name="hello\n").name == "hello\n"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('name: "hello\\n"\n' + PROBE, "name"),
        ("name: hello world\n" + PROBE, "name"),
        ("name: ''\n" + PROBE, "name"),
        (PROBE + 'envs: {"FOO\\n": x}\n', "envs"),
        (PROBE + 'secrets: {"FOO\\n": x}\n', "secrets"),
        (
            PROBE + "  replica_policy: {min_replicas: 1, max_replicas: 2, "
            'target_qps_per_replica: {"A100\\n": 1}}\n'
            "  load_balancing_policy: instance_aware_least_load\n",
            "service.replica_policy.target_qps_per_replica",
        ),
        (
            'service:\n  readiness_probe: "/health\\nX-Injected: 1"\n',
            "service.readiness_probe.path",
        ),
    ],
)
def test_a_trailing_newline_or_other_stray_character_is_refused(text: str, where: str) -> None:
    assert f"{where}:" in err(text)


@pytest.mark.parametrize("name", ["hello", "my-service", "Task_1", "a.b", "llama--3"])
def test_skypilot_task_names_still_load(name: str) -> None:
    assert parse_spec(f"name: {name}\n" + PROBE).name == name


# -- values that used to escape as other exceptions ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (PROBE + "envs: {X: " + "1" * 5000 + "}\n", f"longer than {MAX_NUMBER_CHARS}"),
        (PROBE + "envs: {X: " + ":".join(["1"] * 60) + "}\n", "longer than"),  # base 60
        (PROBE + "envs: {X: !!bool maybe}\n", "'maybe' is not a valid boolean"),
        (PROBE + "envs: {X: !!int ''}\n", "'' is not a valid integer"),
        (PROBE + "envs: {X: !!float x}\n", "'x' is not a valid number"),
        (PROBE + "config: {x: !!binary /w==}\n", "the tag !!binary is not supported"),
        (PROBE + "config: {x: !!set {a: null}}\n", "the tag !!set is not supported"),
        (PROBE + "config: {x: !!timestamp 2024-01-01}\n", "the tag !!timestamp"),
        (PROBE + "config: {x: !custom 1}\n", "the tag !custom is not supported"),
        (PROBE + 'run: "echo \\0"\n', "a NUL character"),
        (
            "service:\n  readiness_probe:\n    path: /h\n    post_data: '"
            + "[" * 100_000
            + "]" * 100_000
            + "'\n",
            "the JSON is nested deeper than",
        ),
        (
            'service:\n  readiness_probe:\n    path: /h\n    post_data: \'{"a": '
            + "[" * 200
            + "]" * 200
            + "}'\n",
            f"the JSON is nested deeper than {MAX_NESTING_DEPTH}",
        ),
    ],
    ids=[
        "huge-int",
        "sexagesimal",
        "bad-bool",
        "empty-int",
        "bad-float",
        "binary",
        "set",
        "timestamp",
        "custom-tag",
        "nul",
        "json-recursion",
        "json-depth",
    ],
)
def test_values_that_escaped_as_other_exceptions_are_clear_errors(text: str, words: str) -> None:
    assert words in quickly_refused(text)


def test_dates_stay_strings_so_the_spec_is_json() -> None:
    spec = parse_spec("name: 2024-01-01\n" + PROBE + "config: {when: 2024-01-01 10:00:00}\n")
    assert spec.name == "2024-01-01"
    assert spec.config == {"when": "2024-01-01 10:00:00"}
    assert ServiceTask.model_validate_json(spec.model_dump_json()) == spec


def test_env_substitution_cannot_multiply_the_text() -> None:
    text = (
        "envs: {A: " + "x" * 100_000 + "}\n"
        "service:\n  readiness_probe: {path: '/" + "$A" * 100_000 + "'}\n"
    )
    assert f"adds more than {MAX_YAML_BYTES} characters" in quickly_refused(text)


def test_an_error_lists_a_bounded_number_of_problems_with_bounded_values() -> None:
    msg = err(PROBE + "".join(f"unknown_{i}: 1\n" for i in range(5000)))
    lines = msg.splitlines()
    assert len(lines) == MAX_ERROR_LINES + 1 and lines[-1] == f"... and {5000 - 20} more"
    long_name = err("name: " + "x-" * 100_000 + "\n" + PROBE)
    assert len(long_name) < 1000 and "characters)" in long_name


def test_an_unreadable_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="cannot be read"):
        load_spec_file(tmp_path)  # a directory
    binary = tmp_path / "x.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidSpec, match="cannot be read"):
        load_spec_file(binary)


@pytest.mark.parametrize(
    "body",
    [
        "service:\n  readiness_probe: /\n  replicas: 1\n  load_balancer:\n"
        "    api_keys: [PLANTEDk]\nrun: echo\n",
        "service:\n  readiness_probe: /\n  replicas: 1\n  load_balancer:\n"
        "    api_keys: PLANTED-not-a-list-123456789\nrun: echo\n",
        "service:\n  readiness_probe: /\n  replicas: 1\nsecrets:\n  A: [PLANTED]\nrun: echo\n",
    ],
)
def test_errors_never_echo_an_api_key_or_a_secret(body: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        parse_spec(body)
    assert "PLANTED" not in e.value.message
    assert "api_keys" in e.value.message or "secrets" in e.value.message
