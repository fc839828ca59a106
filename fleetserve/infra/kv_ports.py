"""Where a replica publishes its KV cache events (cache_aware's precise mode): the two ports
after its own. Both infras export them, and the load balancer derives them from the replica's
URL (fleetserve.lb.kv_events), so nothing new travels in the routable set or the store.
Offsetting the port is vLLM's own rule for its data-parallel ranks' event endpoints."""

from __future__ import annotations

KV_EVENTS_PORTS = 2  # events (PUB), then replay (ROUTER)


def kv_events_env(port: int) -> dict[str, str]:
    return {
        "FLEETSERVE_KV_EVENTS_PORT": str(port + 1),
        "FLEETSERVE_KV_EVENTS_REPLAY_PORT": str(port + 2),
    }
