"""`check_deployable` on a fixed port shared by several replicas: namespaces, else a refusal."""

from __future__ import annotations

import pytest

from fleetserve.controller import admission
from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.loader import parse_spec

FIXED = "service:\n  readiness_probe: /h\n  ports: 8080\n  replicas: {n}\nrun: python3 s.py\n"


def test_a_fixed_port_fleet_needs_namespaces_and_says_so_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admission.netns, "available", lambda: False)
    with pytest.raises(InvalidSpec, match="needs root and iproute2") as e:
        admission.check_deployable(parse_spec(FIXED.format(n=3)))
    assert "$PORT" in e.value.message and "unprivileged user namespaces" in e.value.message
    admission.check_deployable(parse_spec(FIXED.format(n=1)))  # one replica: this machine's
    admission.check_deployable(parse_spec(FIXED.format(n=3)), "ray")  # one per node there


def test_a_fixed_port_fleet_is_accepted_where_namespaces_can_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admission.netns, "available", lambda: True)
    admission.check_deployable(parse_spec(FIXED.format(n=3)))
