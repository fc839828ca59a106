"""fleetserve: serve any model server as a fleet of replicas behind one endpoint.

`fleetserve.Client` is the Python SDK (imported lazily, so that the load balancer and the
controller do not pay for the client's imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetserve._version import __version__

__all__ = ["Client", "ServiceFailed", "WaitTimeout", "__version__"]

if TYPE_CHECKING:
    from fleetserve.client import Client
    from fleetserve.core.errors import ServiceFailed, WaitTimeout


def __getattr__(name: str) -> Any:
    if name == "Client":
        from fleetserve.client import Client

        return Client
    if name in ("ServiceFailed", "WaitTimeout"):
        from fleetserve.core import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'fleetserve' has no attribute {name!r}")
