"""Shell completion of service and pool names (`fleetserve --install-completion`).

Asks this home's controller only if it already runs (never starts one), with a short
timeout; any problem completes nothing."""

from __future__ import annotations

from fleetserve.client import Client

TIMEOUT = 1.5  # seconds: a shell waits on this


def _names(incomplete: str, pools: bool) -> list[str]:
    try:
        with Client(auto_start=False, timeout=TIMEOUT) as client:
            found = client.pools() if pools else client.status()
    except Exception:  # completion must never fail loudly, whatever went wrong
        return []
    return sorted(s.name for s in found if s.name.startswith(incomplete or ""))


def complete_service(incomplete: str) -> list[str]:
    return _names(incomplete, pools=False)


def complete_pool(incomplete: str) -> list[str]:
    return _names(incomplete, pools=True)
