"""One record for a routable replica: the controller's Endpoint is the LB's Upstream, and the
wire model (a push, the LB's config file) converts to and from it without loss."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleetserve.core.types import Endpoint
from fleetserve.lb.messages import ReplicaPush, RoutableReplica
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.lb import LeastLoad


def test_the_lbs_upstream_is_the_controllers_endpoint() -> None:
    assert Upstream is Endpoint


def test_a_routable_replica_goes_over_the_wire_and_back_unchanged() -> None:
    endpoint = Endpoint(7, "http://10.0.0.2:8080", 3, 2.5)
    wire = RoutableReplica.of(endpoint)
    assert wire.model_dump() == {
        "replica_id": 7,
        "url": "http://10.0.0.2:8080",
        "version": 3,
        "weight": 2.5,
    }
    assert RoutableReplica.model_validate_json(wire.model_dump_json()).endpoint() == endpoint
    replicas = ReplicaSet(LeastLoad())
    replicas.apply(ReplicaPush(replicas=[wire]))
    assert replicas.upstreams == {7: endpoint}


def test_the_wire_refuses_what_no_replica_is() -> None:
    with pytest.raises(ValidationError, match="url"):
        RoutableReplica.of(Endpoint(1, "ftp://x", 1))
    with pytest.raises(ValidationError, match="weight"):
        RoutableReplica.of(Endpoint(1, "http://x", 1, 0.0))
