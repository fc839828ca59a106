"""Spec rules: every field, default and rule of REFERENCE.md, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec import load_spec_file, parse_spec
from fleetserve.spec.models import (
    DEFAULT_DOWNSCALE_DELAY_SECONDS,
    DEFAULT_INITIAL_DELAY_SECONDS,
    DEFAULT_PROBE_TIMEOUT_SECONDS,
    DEFAULT_UPSCALE_DELAY_SECONDS,
)

FIXTURES = Path(__file__).parents[2] / "fixtures" / "skyserve"


def err(text: str) -> str:
    with pytest.raises(InvalidSpec) as e:
        parse_spec(text)
    return e.value.message


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.yaml")), ids=lambda p: p.name)
def test_skyserve_example_files_load_unchanged(path: Path) -> None:
    spec, text = load_spec_file(path)
    assert text == path.read_text()
    assert spec.service is not None


def test_probe_shorthand_and_defaults() -> None:
    spec = parse_spec("service:\n  readiness_probe: /health\n")
    probe = spec.service.readiness_probe
    assert probe is not None
    assert probe.path == "/health"
    assert probe.method == "GET"
    assert probe.initial_delay_seconds == DEFAULT_INITIAL_DELAY_SECONDS == 1200
    assert probe.timeout_seconds == DEFAULT_PROBE_TIMEOUT_SECONDS == 15
    assert spec.service.replica_bounds() == (1, 1)
    assert spec.service.load_balancing_policy == "least_load"


def test_post_data_makes_a_post_probe_and_accepts_a_json_string() -> None:
    spec = parse_spec(
        "service:\n  readiness_probe:\n    path: /v1\n    post_data: '{\"a\": 1}'\n"
        "    headers: {X-Key: k}\n"
    )
    probe = spec.service.readiness_probe
    assert probe is not None
    assert probe.method == "POST"
    assert probe.post_data == {"a": 1}
    assert probe.headers == {"X-Key": "k"}


def test_post_data_string_must_be_json() -> None:
    msg = err("service:\n  readiness_probe:\n    path: /v1\n    post_data: 'not json'\n")
    assert "service.readiness_probe.post_data" in msg and "JSON" in msg


def test_envs_are_substituted_in_the_service_section() -> None:
    spec, _ = load_spec_file(FIXTURES / "vllm.yaml")
    probe = spec.service.readiness_probe
    assert probe is not None and probe.post_data is not None
    assert probe.post_data["model"] == "meta-llama/Meta-Llama-3-8B-Instruct"


def test_autoscaling_defaults() -> None:
    spec = parse_spec(
        "service:\n  readiness_probe: /h\n  replica_policy:\n    min_replicas: 1\n"
        "    max_replicas: 3\n    target_qps_per_replica: 2\n"
    )
    policy = spec.service.replica_policy
    assert policy is not None
    assert policy.upscale_delay_seconds == DEFAULT_UPSCALE_DELAY_SECONDS == 300
    assert policy.downscale_delay_seconds == DEFAULT_DOWNSCALE_DELAY_SECONDS == 1200
    assert policy.base_ondemand_fallback_replicas == 0
    assert policy.dynamic_ondemand_fallback is False
    assert spec.service.replica_bounds() == (1, 3)


@pytest.mark.parametrize(
    ("yaml_text", "where", "words"),
    [
        ("service:\n  readiness_probe: health\n", "service.readiness_probe.path", "start with '/'"),
        (
            "service:\n  readiness_probe: /h\n  replicas: 2\n  replica_policy: {min_replicas: 1}\n",
            "service",
            "not both",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_policy: {min_replicas: 3, max_replicas: 2,"
            " target_qps_per_replica: 1}\n",
            "service.replica_policy",
            "max_replicas (2) must be >= min_replicas (3)",
        ),
        (
            "service:\n  readiness_probe: /h\n"
            "  replica_policy: {min_replicas: 1, max_replicas: 3}\n",
            "service.replica_policy",
            "must equal min_replicas",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_policy: {min_replicas: 1,"
            " target_qps_per_replica: 2}\n",
            "service.replica_policy",
            "max_replicas is required",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_policy: {min_replicas: -1}\n",
            "service.replica_policy.min_replicas",
            "greater than or equal to 0",
        ),
        ("service:\n  readiness_probe: /h\n  ports: 70000\n", "service.ports", "65535"),
        (
            "service:\n  readiness_probe: /h\n  load_balancing_policy: random\n",
            "service.load_balancing_policy",
            "round_robin",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_policy: {min_replicas: 1, max_replicas: 2,"
            " target_qps_per_replica: {A100: 1}}\n",
            "service",
            "requires load_balancing_policy: instance_aware_least_load",
        ),
        (
            "service:\n  readiness_probe: /h\n  load_balancing_policy: instance_aware_least_load\n",
            "service",
            "per-accelerator dict",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_policy: {min_replicas: 1, max_replicas: 2,"
            " target_qps_per_replica: {'A100:x': 1}}\n"
            "  load_balancing_policy: instance_aware_least_load\n",
            "service.replica_policy.target_qps_per_replica",
            "ACC:COUNT",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_policy: {min_replicas: 1,"
            " base_ondemand_fallback_replicas: 1}\n",
            "(top level)",
            "need spot resources",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_policy: {min_replicas: 1,"
            " spot_placer: dynamic_fallback}\n",
            "(top level)",
            "spot_placer needs spot resources",
        ),
        (
            "service:\n  readiness_probe: /h\nresources:\n  any_of:\n    - use_spot: true\n"
            "    - use_spot: false\n",
            "(top level)",
            "every alternative must be spot",
        ),
        (
            "service:\n  readiness_probe: /h\nresources:\n  ports: [8000, 8001]\n",
            "(top level)",
            "set service.ports",
        ),
        (
            "service:\n  readiness_probe: /h\nresources:\n  ports: '9-x'\n",
            "resources.ports",
            "range",
        ),
        ("service:\n  readiness_probe: /h\nresources:\n  cpus: lots\n", "resources.cpus", "number"),
        (
            "service:\n  readiness_probe: /h\nresources:\n  memory: big\n",
            "resources.memory",
            "size",
        ),
        (
            "service:\n  readiness_probe: /h\n  tls: {keyfile: k}\n",
            "service.tls.certfile",
            "required",
        ),
        (
            "service:\n  readiness_probe: /h\n  replica_polcy: 1\n",
            "service.replica_polcy",
            "unknown field (did you mean 'replica_policy'?)",
        ),
        ("service:\n  readiness_probe: /h\nresource: {}\n", "resource", "unknown field"),
        (
            "service:\n  pool: {workers: 1, min_workers: 1}\n",
            "service.pool",
            "max_workers must be set when min_workers is set",
        ),
        (
            "service:\n  pool: {workers: 2, queue_length_threshold: 3}\n",
            "service.pool",
            "max_workers must be set when queue_length_threshold is set",
        ),
        (
            "service:\n  pool: {min_workers: 4, max_workers: 2}\n",
            "service.pool",
            "min_workers (4) must be <= max_workers (2)",
        ),
        (
            "service:\n  pool: {workers: 5, max_workers: 3}\n",
            "service.pool",
            "workers (5) must be <= max_workers (3)",
        ),
        ("service:\n  pool: {}\n", "service.pool", "set 'workers', or both"),
        (
            "service:\n  pool: {workers: 3, upscale_delay_seconds: 10}\n",
            "service.pool",
            "max_workers must be set when upscale_delay_seconds is set",
        ),
        (
            "service:\n  pool: {workers: 1}\n  replica_policy: {min_replicas: 1}\n",
            "service",
            "a pool cannot have 'replica_policy'",
        ),
        ("service:\n  readiness_probe: /h\nenvs: {'1BAD': x}\n", "envs", "not a valid environment"),
        ("name: x\n", "service YAML", "service: field required"),
        ("- a\n- b\n", "service YAML", "must be a mapping"),
        ("service: [\n", "service YAML", "not valid YAML at line"),
    ],
)
def test_broken_rules_name_the_field(yaml_text: str, where: str, words: str) -> None:
    msg = err(yaml_text)
    assert f"{where}:" in msg, msg
    assert words in msg, msg


def test_every_problem_is_reported_on_its_own_line() -> None:
    msg = err("service:\n  readiness_probe: /h\n  bogus: 1\nresources:\n  cpus: x\n")
    lines = msg.splitlines()
    assert any("service.bogus: unknown field" in line for line in lines)
    assert any("resources.cpus:" in line for line in lines)


def test_replica_port_from_service_or_resources() -> None:
    assert parse_spec("service:\n  readiness_probe: /h\n  ports: 9000\n").replica_port() == 9000
    spec = parse_spec("service:\n  readiness_probe: /h\nresources:\n  ports: 8081\n")
    assert spec.replica_port() == 8081
    assert parse_spec("service:\n  readiness_probe: /h\n").replica_port() is None


def test_the_accelerator_a_replica_has() -> None:
    spec = parse_spec("service:\n  readiness_probe: /h\nresources:\n  accelerators: A100:1\n")
    assert spec.accelerator() == "A100"
    spec = parse_spec(
        "service:\n  readiness_probe: /h\nresources:\n  accelerators: {L4: 1, A10G: 1}\n"
    )
    assert spec.accelerator() is None  # any of several: unknown until placed
    assert parse_spec("service:\n  readiness_probe: /h\n").accelerator() is None


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="no such file"):
        load_spec_file(tmp_path / "nope.yaml")


def test_skyserve_probe_and_load_balancer_keys_have_their_meaning() -> None:
    spec = parse_spec(
        "service:\n  replicas: 1\n  readiness_probe:\n    path: /h\n"
        "    endpoint_probe_interval_seconds: 3\n    consecutive_failure_threshold_timeout: 40\n"
        "  load_balancer: {stream_timeout_seconds: 90}\n"
    )
    probe = spec.service.readiness_probe
    assert probe is not None
    assert probe.endpoint_probe_interval_seconds == 3
    assert probe.consecutive_failure_threshold_timeout == 40
    assert spec.service.load_balancer.read_timeout_seconds == 90  # the LB's per-read timeout
    conflict = err(
        "service:\n  readiness_probe: /\n"
        "  load_balancer: {stream_timeout_seconds: 90, read_timeout_seconds: 30}\n"
    )
    assert "set one of them" in conflict


def test_without_a_readiness_probe_skyserve_probes_the_root() -> None:
    probe = parse_spec("service:\n  replicas: 1\n").service.readiness_probe
    assert probe is not None and probe.path == "/" and probe.method == "GET"


def test_a_top_level_pool_is_skypilots_pool_yaml_and_not_beside_a_service() -> None:
    spec = parse_spec("pool: {workers: 3}\nsetup: echo hi\n")
    assert spec.service.pool is not None and spec.service.pool.workers == 3
    with pytest.raises(InvalidSpec, match="set either 'service' or 'pool', not both"):
        parse_spec("service: {replicas: 1}\npool: {workers: 1}\n")
    # SkyPilot's examples/batch pool YAMLs carry a `run`, which `sky jobs pool apply` ignores
    # with a warning (sky/serve/server/impl.py); so does fleetserve (the workers run jobs').
    assert parse_spec("pool: {workers: 1}\nrun: echo job\n").run == "echo job"


@pytest.mark.parametrize(
    ("pool", "bounds", "autoscaled"),
    [
        ("{workers: 3}", (3, 3), False),
        ("{min_workers: 1, max_workers: 5}", (1, 5), True),
        ("{min_workers: 0, max_workers: 5, queue_length_threshold: 2}", (0, 5), True),
        # SkyPilot's docs (pools section): `workers` with min_workers/max_workers; as its
        # service_spec reads it, min_workers wins, and `workers` is the minimum without it.
        ("{workers: 2, min_workers: 1, max_workers: 4}", (1, 4), True),
        ("{workers: 2, max_workers: 4}", (2, 4), True),
        ("{max_workers: 4}", (1, 4), True),  # SkyServe's default minimum, 1
        ("{workers: 0, max_workers: 4}", (0, 4), True),
    ],
)
def test_pool_sizes_are_read_as_skypilot_reads_them(
    pool: str, bounds: tuple[int, int], autoscaled: bool
) -> None:
    spec = parse_spec(f"pool: {pool}\n")
    assert spec.service.pool is not None
    assert spec.service.pool.bounds() == bounds
    assert spec.service.pool.autoscaled is autoscaled


def test_skypilot_task_and_resources_keys_are_accepted() -> None:
    spec = parse_spec(
        "service: {replicas: 1}\nsecrets: [HF_TOKEN]\n"
        "workdir: {url: 'https://github.com/x/y.git', ref: v1}\n"
        "volume_mounts: [{path: /data, volume_name: v}]\n"
        "resources: {max_hourly_cost: 1.5, local_disk: 'nvme:2', ephemeral_storage: 20,"
        " priority_class: high, volumes: [{path: /d, name: v}]}\n"
    )
    assert spec.secrets == {} and spec.managed_secrets == ["HF_TOKEN"]
    assert not isinstance(spec.workdir, str) and spec.workdir is not None
    assert spec.workdir.url.endswith("y.git") and spec.workdir.ref == "v1"
    assert parse_spec("service: {replicas: 1}\nworkdir: ./app\n").workdir == "./app"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "service:\n  readiness_probe: /\n  replica_policy:\n    min_replicas: 1\n"
            "    max_replicas: 2\n    target_qps_per_replica: -1\n",
            "service.replica_policy.target_qps_per_replica:",
        ),
        (
            "service: {replicas: 1}\nresources: {max_hourly_cost: -1}\n",
            "resources.max_hourly_cost:",
        ),
    ],
)
def test_no_union_branch_label_leaks_into_an_error_path(text: str, where: str) -> None:
    message = err(text)
    assert where in message
    assert "constrained" not in message and "function-" not in message


def test_skypilots_leniencies_null_blocks_vcpu_multiples_and_integral_floats() -> None:
    spec = parse_spec(
        "service:\n  replica_policy: {min_replicas: 1.0, max_replicas: 2.0, "
        "target_qps_per_replica: 1}\nsecrets:\nfile_mounts:\nnum_nodes:\n"
        "resources: {memory: 4x+}\nrun: python3 s.py\n"
    )
    assert spec.secrets == {} and spec.file_mounts == {} and spec.num_nodes == 1
    assert spec.service.replica_bounds() == (1, 2)
    assert spec.resources.memory == "4x+"
    with pytest.raises(InvalidSpec, match=r"got 1\.5"):
        parse_spec("service:\n  replicas: 1.5\n")
    with pytest.raises(InvalidSpec, match="envs"):
        parse_spec("service:\n  replicas: 1\nenvs:\n")
    with pytest.raises(InvalidSpec, match="a second YAML document starts at line 3"):
        parse_spec("service:\n  replicas: 1\n---\nservice:\n  replicas: 2\n")


@pytest.mark.parametrize("value", ['"3"', "true", "0", "3.5"])
def test_lb_connection_limits_are_whole_numbers_not_strings_or_booleans(value: str) -> None:
    for field in ("max_connections", "max_connections_per_client"):
        with pytest.raises(InvalidSpec, match=f"service.load_balancer.{field}"):
            parse_spec(f"service:\n  replicas: 1\n  load_balancer: {{{field}: {value}}}\n")
    spec = parse_spec("service:\n  replicas: 1\n  load_balancer: {max_connections_per_client: 3}\n")
    assert spec.service.load_balancer.max_connections_per_client == 3


def test_a_top_level_pools_errors_name_its_own_path() -> None:
    with pytest.raises(InvalidSpec) as e:
        parse_spec("pool: {workers: -1}\n")
    assert e.value.message.startswith("service YAML: pool.workers:"), e.value.message


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "the document is empty"),
        ("[1, 2]\n", "must be a mapping of fields, not a list"),
        ("service:\nrun: x\n", "service: Input should be a valid dictionary"),
    ],
)
def test_errors_about_the_documents_shape_speak_yaml_not_python(text: str, says: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        parse_spec(text)
    assert says in e.value.message
    assert "NoneType" not in e.value.message and "instance of" not in e.value.message
