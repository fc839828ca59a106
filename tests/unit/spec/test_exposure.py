"""Where the endpoint listens, and the warning when that is beyond loopback unprotected."""

from __future__ import annotations

import pytest

from fleetserve.controller.reconciler import lb_config
from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.exposure import exposure_warning, lb_host, override_host, reachable_host
from fleetserve.spec.loader import parse_spec

BASE = "service:\n  readiness_probe: /h\n"
KEY = "k" * 16


@pytest.mark.parametrize(
    ("extra", "infra", "host"),
    [
        ("", "local", "127.0.0.1"),
        ("", "ray", "0.0.0.0"),
        ("resources:\n  infra: ray\n", "local", "0.0.0.0"),  # the YAML's infra counts
        ("  load_balancer:\n    host: 0.0.0.0\n", "local", "0.0.0.0"),
        ("  load_balancer:\n    host: 127.0.0.1\n", "ray", "127.0.0.1"),
    ],
)
def test_the_host_defaults_by_infra_and_the_yaml_wins(extra: str, infra: str, host: str) -> None:
    spec = parse_spec(BASE + extra)
    assert lb_host(spec, infra) == host
    assert lb_config(spec, "s", 1, 2, 3, infra=infra).host == host


@pytest.mark.parametrize(
    ("lb", "warned"),
    [
        ("", False),  # loopback
        ("  load_balancer:\n    host: 127.0.0.2\n", False),
        ("  load_balancer:\n    host: 0.0.0.0\n", True),
        ("  load_balancer:\n    host: '::'\n", True),
        ("  load_balancer:\n    host: 10.1.2.3\n", True),
        (f"  load_balancer:\n    host: 0.0.0.0\n    api_keys: [{KEY}]\n", False),
    ],
)
def test_a_warning_only_when_exposed_without_api_keys_or_tls(lb: str, warned: bool) -> None:
    warning = exposure_warning(parse_spec(BASE + lb), "local")
    assert (warning is not None) == warned
    if warning:
        assert "\n" not in warning and "no api_keys" in warning


def test_a_host_must_be_an_address() -> None:
    with pytest.raises(InvalidSpec, match="not an IP address"):
        parse_spec(BASE + "  load_balancer:\n    host: example.com\n")
    with pytest.raises(InvalidSpec, match="not an IP address"):
        override_host(parse_spec(BASE), "nope")
    assert lb_host(override_host(parse_spec(BASE), "0.0.0.0"), "local") == "0.0.0.0"


def test_the_endpoint_names_a_reachable_host() -> None:
    assert reachable_host("0.0.0.0", "box") == "box"
    assert reachable_host("::", "box") == "box"
    assert reachable_host("10.1.2.3", "box") == "10.1.2.3"
    assert reachable_host("fd00::1", "box") == "[fd00::1]"
