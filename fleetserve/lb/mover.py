"""Moving requests that wait in a replica's queue to a replica with room
(`load_balancer.move_waiting_requests`; docs/load-balancer.md).

The load balancer sends a request to a replica when it arrives. When an LLM engine's batch or
KV cache is full, the requests sent to it wait in its queue; a replica that becomes READY
later (the autoscaler's answer to that queue) only gets requests that arrive after it, and
the queued ones wait where they are. This module moves them.

After each round of reading the replicas' metrics (fleetserve.lb.replica_load: running and
waiting requests per replica) `plan_moves` pairs sources and targets: while some READY
replica R has waiting requests and some READY replica S has none, with S's load (running +
waiting) at least 2 below R's, one request moves from the busiest such R to the least loaded
such S. Each move takes the newest of this process's requests at R that have no byte of
their answer yet (an engine's queue is first in, first out: the newest are the ones that
wait), closes its connection (the engine aborts a request whose client is gone) and sends it
to S. A request moves at most once, and never after a byte of its answer came (the LB holds
the replica's response head until the first body byte, so a streaming answer's head is not
yet sent to the client).

Several LB processes read the same figures: each moves its share of a source's planned moves
(its own requests in flight there over the replica's load), rounded at random so that the
shares add up on average; the next round corrects what is left.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from fleetserve.lb.replica_set import Upstream

log = logging.getLogger("fleetserve.lb")
# A replica that did not answer a request moved to it gets no more moves for this long.
FAILED_TARGET_SECONDS = 30.0


class Movable(Protocol):
    """A request sent to a replica (fleetserve.lb.exchange.Exchange)."""

    def can_move(self) -> bool:
        """No byte of its answer came, it has not moved before, and it can be sent again."""
        ...

    def move_to(self, upstream: Upstream) -> bool:
        """Leave its replica (close the connection) and go to `upstream`; False if it cannot."""
        ...


def plan_moves(
    queues: Mapping[int, tuple[int, int]], ready: Collection[int], limit: int
) -> list[tuple[int, int]]:
    """(source, target) replica ids, one pair per request to move, at most `limit` pairs.

    `queues`: (running, waiting) per replica as read; only READY replicas that were read
    take part (a replica not read is neither: its load is unknown, never taken as zero).
    """
    loads: dict[int, int] = {}
    waiting: dict[int, int] = {}
    targets: list[int] = []
    for rid, (running, queued) in queues.items():
        if rid not in ready:
            continue
        loads[rid] = running + queued
        if queued > 0:
            waiting[rid] = queued
        else:
            targets.append(rid)
    moves: list[tuple[int, int]] = []
    while waiting and targets and len(moves) < limit:
        src = max(waiting, key=lambda rid: (loads[rid], -rid))
        dst = min(targets, key=lambda rid: (loads[rid], rid))
        if loads[src] - loads[dst] < 2:
            break
        moves.append((src, dst))
        loads[src] -= 1
        loads[dst] += 1
        waiting[src] -= 1
        if not waiting[src]:
            del waiting[src]
    return moves


class Mover:
    """Plans and makes one process's moves after each round of metrics (`round`)."""

    def __init__(
        self,
        queues: Mapping[int, tuple[int, int]],
        upstreams: Callable[[], Mapping[int, Upstream]],
        inflight: Mapping[int, int],
        unanswered: dict[int, dict[Movable, None]],
        on_moved: Callable[[int, int], None] | None = None,
        chance: Callable[[], float] = random.random,
        failed: dict[int, float] | None = None,
        allowed: Callable[[], bool] = lambda: True,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queues = queues  # as last read (ReplicaLoadPoller.queues)
        self.upstreams = upstreams  # the routable replicas, read each round
        self.inflight = inflight  # this process's requests in flight per replica
        # This process's requests sent and not yet answered, per replica, oldest first
        # (kept by the exchanges themselves).
        self.unanswered = unanswered
        self.on_moved = on_moved  # (source, target): metrics
        self.chance = chance
        # When a moved request last found each target silent (ExchangeContext.move_failed).
        self.failed: dict[int, float] = failed if failed is not None else {}
        # False while moving would break the routing's own split (a canary's percentage,
        # replicas of different weights): no moves then.
        self.allowed = allowed
        self.monotonic = monotonic

    def round(self) -> int:
        """Plan from the last reading and move; returns how many requests moved."""
        own = sum(len(v) for v in self.unanswered.values())
        if not own or not self.allowed():
            return 0
        upstreams = self.upstreams()
        ready: Collection[int] = upstreams.keys()
        if self.failed:
            since = self.monotonic() - FAILED_TARGET_SECONDS
            for rid in [rid for rid, at in self.failed.items() if at <= since]:
                del self.failed[rid]  # (kept only while it counts)
            quiet = set(self.failed)
            # (a source may still give; only a target that failed a move is left alone)
            ready = [rid for rid in ready if rid not in quiet or self.queues.get(rid, (0, 0))[1]]
        plan = plan_moves(self.queues, ready, limit=own)
        targets: dict[int, list[int]] = {}
        for src, dst in plan:
            targets.setdefault(src, []).append(dst)
        moved = 0
        made: dict[tuple[int, int], int] = {}
        for src, dsts in targets.items():
            mine = self.unanswered.get(src)
            if not mine:
                continue
            running, waiting = self.queues[src]
            mine_there = self.inflight.get(src, 0)
            part = mine_there / max(running + waiting, mine_there, 1)
            share = len(dsts) * part
            quota = int(share) + (self.chance() < share - int(share))
            # This process's part of the running requests is taken to be its oldest: those
            # already answering, then its oldest unanswered ones (a request in its prefill,
            # or a whole answer not yet sent), which do not move.
            answering = max(0, mine_there - len(mine))
            running_here = max(0, round(part * running) - answering)
            waiting_here = list(mine)[running_here:]
            newest_first = [ex for ex in reversed(waiting_here) if ex.can_move()][:quota]
            for ex, dst in zip(newest_first, dsts, strict=False):
                upstream = upstreams.get(dst)
                if upstream is not None and ex.move_to(upstream):
                    moved += 1
                    made[src, dst] = made.get((src, dst), 0) + 1
                    if self.on_moved is not None:
                        self.on_moved(src, dst)
        if made:
            log.info(
                "moved requests waiting in a replica's queue: %s",
                ", ".join(f"{n} from replica {s} to {d}" for (s, d), n in made.items()),
            )
        return moved
