"""The active controller's lease (docs/scaling.md, high availability).

One row names the controller that may act: its holder id, a generation that grows by one at
every change of holder, an expiry, and the address of its API (so that a standby can say where
writes go). The active controller renews it every few seconds; a standby takes it once it has
expired. Every write of the active controller checks, inside its own transaction, that the
row still carries its holder and generation (`check`), locking the row against a takeover
until that transaction ends (FOR SHARE on PostgreSQL; SQLite has one writer at a time): a
controller that was paused past its lease and wakes up changes nothing.

Times are the controllers' own clocks: hosts that share a database must keep them in step
(NTP) to well within the lease.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, insert, select, update

from fleetserve.core.errors import Fenced
from fleetserve.store import tables as t

NAME = "controller"


@dataclass(frozen=True)
class Lease:
    holder: str
    generation: int
    expires_at: float
    address: str


def read(conn: Connection, lock: bool = False) -> Lease | None:
    query = select(t.leader).where(t.leader.c.name == NAME)
    if lock and conn.dialect.name == "postgresql":
        query = query.with_for_update()
    row = conn.execute(query).first()
    if row is None:
        return None
    return Lease(str(row.holder), int(row.generation), float(row.expires_at), str(row.address))


def acquire(conn: Connection, holder: str, address: str, now: float, ttl: float) -> Lease | None:
    """Take the lease if nobody holds it, it has expired, or `holder` holds it already (a
    renewal keeps the generation). None if another controller holds it."""
    current = read(conn, lock=True)
    if current is None:
        conn.execute(
            insert(t.leader).values(
                name=NAME,
                holder=holder,
                generation=1,
                expires_at=now + ttl,
                address=address,
                renewed_at=now,
            )
        )
        return Lease(holder, 1, now + ttl, address)
    if current.holder != holder and current.expires_at > now:
        return None
    generation = current.generation if current.holder == holder else current.generation + 1
    taken = conn.execute(
        update(t.leader)
        .where(t.leader.c.name == NAME, t.leader.c.generation == current.generation)
        .values(
            holder=holder,
            generation=generation,
            expires_at=now + ttl,
            address=address,
            renewed_at=now,
        )
    )
    if taken.rowcount != 1:  # another standby was quicker
        return None
    return Lease(holder, generation, now + ttl, address)


def renew(conn: Connection, holder: str, generation: int, now: float, ttl: float) -> bool:
    """Extend our own lease; False if it is no longer ours (expired and taken)."""
    done = conn.execute(
        update(t.leader)
        .where(
            t.leader.c.name == NAME,
            t.leader.c.holder == holder,
            t.leader.c.generation == generation,
        )
        .values(expires_at=now + ttl, renewed_at=now)
    )
    return done.rowcount == 1


def release(conn: Connection, holder: str, generation: int, now: float) -> None:
    """Give the lease up at a clean stop: a standby takes over at once, not after the TTL."""
    conn.execute(
        update(t.leader)
        .where(
            t.leader.c.name == NAME,
            t.leader.c.holder == holder,
            t.leader.c.generation == generation,
        )
        .values(expires_at=now)
    )


def check(conn: Connection, holder: str, generation: int) -> None:
    """Raise Fenced unless the lease is still (holder, generation); on PostgreSQL the row is
    then share-locked until the caller's transaction ends, so no takeover commits under it."""
    query = select(t.leader.c.holder, t.leader.c.generation).where(t.leader.c.name == NAME)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(read=True)
    row = conn.execute(query).first()
    if row is None or str(row.holder) != holder or int(row.generation) != generation:
        active = None if row is None else str(row.holder)
        raise Fenced(
            f"this controller lost its lease (generation {generation}; now held by "
            f"{active or 'nobody'}): it no longer writes"
        )
