"""bench/controller/fakefleet.py: many fake replicas in one process, for bench/controller.

One uvloop process holds every replica of the benchmark: each replica is a listener on its own
loopback port that answers any HTTP/1.1 request with `200 ok` (keep-alive), on a raw asyncio
protocol, so a thousand replicas cost a few MiB and a little CPU.

A control API (aiohttp, loopback) is what the bench's fake infra (bench/controller/infra.py,
inside the controller) and the bench itself call:

  POST /spawn {"token", "service", "replica_id"}  -> {"port", "handle"}: a new replica
  POST /stop  {"token"}                           -> its listener and connections closed
  POST /kill  {"token", "kind": "EXITED"|"LOST"}  -> the same, and a death event (the bench)
  POST /sweep {"known": [token, ...]}             -> stops replicas with another token
  GET  /events?after=N                            -> deaths after event N (waits up to 10 s)
  GET  /replicas                                  -> the live replicas, and the last
                                                     event's number (where to follow from)

With --preempt-rate R, each live replica is lost (kind LOST) at random, R times per
replica-hour on average: the spot preemptions a cloud would send.
    python bench/controller/fakefleet.py --port P [--preempt-rate 0] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, cast

from aiohttp import web

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nok\n"
MAX_EVENTS = 100_000  # deaths kept for the infra's watcher (it reads them within a second)


class Replica(asyncio.Protocol):
    """Any request (head, then a Content-Length body) -> 200 ok, kept alive."""

    def __init__(self, conns: set[asyncio.Transport]) -> None:
        self.conns = conns
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.conns.add(self.transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > 65536:
                    self.transport.close()
                return
            head = self.buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                eol = head.find(b"\r\n", i)
                length = int(head[i + 15 : eol if eol > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(RESPONSE)


@dataclass
class Held:
    service: str
    replica_id: int
    port: int
    handle: str
    server: asyncio.Server
    conns: set[asyncio.Transport] = field(default_factory=set)

    def close(self) -> None:
        self.server.close()
        for conn in list(self.conns):
            conn.abort()  # a dead process: connections reset, no goodbye


class Fleet:
    def __init__(self, preempt_rate: float, seed: int) -> None:
        self.held: dict[str, Held] = {}
        self.events: list[dict[str, Any]] = []
        self.seq = 0
        self.changed = asyncio.Condition()
        self.preempt_rate = preempt_rate  # per replica-hour
        self.rng = random.Random(seed)

    async def spawn(self, token: str, service: str, replica_id: int) -> Held:
        if token in self.held:
            return self.held[token]
        conns: set[asyncio.Transport] = set()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: Replica(conns), "127.0.0.1", 0, backlog=128, reuse_address=True
        )
        port = int(server.sockets[0].getsockname()[1])
        held = Held(service, replica_id, port, f"bench/{token}/{port}", server, conns)
        self.held[token] = held
        return held

    def stop(self, token: str) -> bool:
        held = self.held.pop(token, None)
        if held is None:
            return False
        held.close()
        return True

    async def kill(self, token: str, kind: str) -> bool:
        held = self.held.get(token)
        if held is None:
            return False
        self.stop(token)
        async with self.changed:
            self.seq += 1
            self.events.append({"seq": self.seq, "token": token, "kind": kind})
            del self.events[:-MAX_EVENTS]
            self.changed.notify_all()
        return True

    async def preempt_loop(self) -> None:
        """Each second, each replica is lost with probability rate/3600."""
        while True:
            await asyncio.sleep(1.0)
            if self.preempt_rate <= 0:
                continue
            p = self.preempt_rate / 3600.0
            for token in [t for t in self.held if self.rng.random() < p]:
                await self.kill(token, "LOST")

    async def events_after(self, after: int, wait: float) -> list[dict[str, Any]]:
        async with self.changed:
            if self.seq <= after:
                try:
                    await asyncio.wait_for(self.changed.wait_for(lambda: self.seq > after), wait)
                except TimeoutError:
                    return []
            return [e for e in self.events if e["seq"] > after]


def make_app(fleet: Fleet) -> web.Application:
    async def spawn(request: web.Request) -> web.Response:
        body = await request.json()
        held = await fleet.spawn(str(body["token"]), str(body["service"]), int(body["replica_id"]))
        return web.json_response({"port": held.port, "handle": held.handle})

    async def stop(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"stopped": fleet.stop(str(body["token"]))})

    async def kill(request: web.Request) -> web.Response:
        body = await request.json()
        kind = str(body.get("kind", "EXITED"))
        return web.json_response({"killed": await fleet.kill(str(body["token"]), kind)})

    async def sweep(request: web.Request) -> web.Response:
        known = set((await request.json())["known"])
        gone = [t for t in fleet.held if t not in known]
        for token in gone:
            fleet.stop(token)
        return web.json_response({"stopped": len(gone)})

    async def events(request: web.Request) -> web.Response:
        after = int(request.query.get("after", "0"))
        found = await fleet.events_after(after, 10.0)
        return web.json_response({"events": found, "last": fleet.seq})

    async def replicas(_request: web.Request) -> web.Response:
        live = [
            {"token": t, "service": h.service, "replica_id": h.replica_id, "port": h.port}
            for t, h in fleet.held.items()
        ]
        return web.json_response({"replicas": live, "last": fleet.seq})

    app = web.Application()
    app.router.add_post("/spawn", spawn)
    app.router.add_post("/stop", stop)
    app.router.add_post("/kill", kill)
    app.router.add_post("/sweep", sweep)
    app.router.add_get("/events", events)
    app.router.add_get("/replicas", replicas)
    return app


async def main(port: int, preempt_rate: float, seed: int) -> None:
    fleet = Fleet(preempt_rate, seed)
    runner = web.AppRunner(make_app(fleet), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    print(f"fakefleet: control API on 127.0.0.1:{port}", flush=True)
    await fleet.preempt_loop()


if __name__ == "__main__":
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--preempt-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    uvloop.run(main(args.port, args.preempt_rate, args.seed))
