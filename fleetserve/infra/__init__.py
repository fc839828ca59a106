"""Where replicas run: the `Infra` protocol and its adapters."""

from fleetserve.infra.base import Infra, InstanceKind, InstanceState, LaunchRequest, Location

__all__ = ["Infra", "InstanceKind", "InstanceState", "LaunchRequest", "Location"]
