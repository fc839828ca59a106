"""Which of several controllers on one database acts (docs/scaling.md, high availability).

With `FLEETSERVE_HA=1` a controller starts as a standby: it serves the API's reads from the
store and polls the lease (fleetserve.store.leader). Once the lease is free or expired it
takes it, fences its writes with the new generation, and becomes active: the same recovery as
a restart (adopt replicas and load balancers, sweep what no row names, start a reconciler per
service). The active one renews the lease every `renew_every` seconds; if a renewal fails, or
its own lease runs out while the database cannot be reached, it steps down: its reconcilers
stop (replicas and load balancers keep running for the next active one) and it is a standby
again. A clean stop gives the lease up, so a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable

from sqlalchemy.exc import SQLAlchemyError

from fleetserve.core.clock import Clock
from fleetserve.store import Store
from fleetserve.store.leader import Lease

log = logging.getLogger("fleetserve.controller")


def holder_id() -> str:
    """This controller process, for the lease's row: host, pid and a random part (a pid is
    reused; a host name is not unique)."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class Leadership:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        address: str,
        ttl: float = 6.0,
        poll_every: float = 1.0,
        holder: str | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.address = address  # this controller's API, for standbys to name
        self.ttl = ttl
        self.renew_every = ttl / 3
        self.poll_every = poll_every
        self.holder = holder or holder_id()
        self.lease: Lease | None = None  # ours, while active
        self.changed = asyncio.Event()
        self._lock = threading.Lock()  # one lease call at a time, the release after the rest
        self._released = False  # at a clean stop: no lease call after it

    @property
    def active(self) -> bool:
        return self.lease is not None

    def active_address(self) -> str | None:
        """Where the active controller's API is, as its lease says (None: nobody holds it)."""
        try:
            lease = self.store.lease()
        except SQLAlchemyError:
            return None
        if lease is None or lease.expires_at <= self.clock.now():
            return None
        return lease.address

    async def run(
        self,
        on_active: Callable[[], Awaitable[None]],
        on_lost: Callable[[], Awaitable[None]],
    ) -> None:
        """Forever: take the lease when it is free, keep it while we can, step down when not."""
        while True:
            now = self.clock.now()
            if self.lease is None:
                lease = await self._call(self.store.acquire_lease, self.holder, self.address, now)
                if isinstance(lease, Lease):
                    self.lease = lease
                    self.store.fence = (self.holder, lease.generation)
                    log.info(
                        "lease taken (generation %s): this controller is active", lease.generation
                    )
                    self.changed.set()
                    await on_active()
                    continue
                await self.clock.sleep(self.poll_every)
                continue
            renewed = await self._call(
                self.store.renew_lease, self.holder, self.lease.generation, now
            )
            if renewed is True:
                self.lease = Lease(self.holder, self.lease.generation, now + self.ttl, self.address)
            elif renewed is False or now >= self.lease.expires_at:
                why = "taken by another controller" if renewed is False else "expired"
                log.warning("lease %s: this controller steps down to standby", why)
                self.lease = None
                self.changed.set()
                await on_lost()
                continue
            await self.clock.sleep(self.renew_every)

    async def _call(self, fn: Callable[..., object], *args: object) -> object:
        """A lease call of the store (its last argument the TTL), off the loop; None if the
        database cannot be reached now."""

        def locked() -> object:
            with self._lock:
                if self._released:
                    return None  # a renewal that was queued behind the release
                return fn(*args, self.ttl)

        try:
            return await asyncio.to_thread(locked)
        except SQLAlchemyError as e:
            log.warning("lease: the database did not answer (%s)", type(e).__name__)
            return None

    def release(self) -> None:
        """At a clean stop: give the lease up so that a standby takes over at once."""
        # After a renewal still running in its thread (the loop's task was cancelled, the
        # thread goes on): a release before it would be undone by it.
        with self._lock:
            self._released = True
            if self.lease is None:
                return
            try:
                self.store.release_lease(self.holder, self.lease.generation, self.clock.now())
            except SQLAlchemyError:
                log.warning("could not release the lease; a standby takes over when it expires")
            self.lease = None
