"""The bench's fake infra: fleetserve's `Infra` protocol over bench/controller/fakefleet.py.

It runs inside the real controller (bench/controller/fake_controller.py hands it to
`fleetserve.api.server.main(infra=...)`), under the name `bench`, which no service YAML can
ask for. A launch asks fakefleet for a replica (a listener answering 200 on a loopback port),
after an optional delay and with an optional failure rate; `poll` reads an in-memory state
that a watcher keeps up to date from fakefleet's death events (the way a cloud infra's
instance events would), so a poll costs a dict lookup, like the local infra's
`Popen.poll()` of its own children; each death is also reported at once (`watch_exits`,
fleetserve's `WatchesExits`), as the local infra reports a replica process's exit.

Configured from the environment (the bench sets it):
  BENCH_FLEET_URL       fakefleet's control API, e.g. http://127.0.0.1:40123
  BENCH_LAUNCH_DELAY    seconds a launch takes (default 0: instant)
  BENCH_FAIL_RATE       the share of launches that fail (FAILED_PROVISION), 0..1
  BENCH_SEED            the random seed of the failures
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from fleetserve.core.errors import TerminalError, TransientError
from fleetserve.infra.base import InstanceKind, InstanceState, Launched, LaunchRequest, Location

log = logging.getLogger("fleetserve.bench")
RUNNING = InstanceState(InstanceKind.RUNNING)


def token_of(handle: str) -> str:
    """A handle is `bench/<launch token>/<port>`."""
    return handle.split("/", 2)[1]


class BenchInfra:
    name = "bench"

    def __init__(
        self, fleet_url: str, launch_delay: float = 0.0, fail_rate: float = 0.0, seed: int = 1
    ) -> None:
        self.fleet_url = fleet_url.rstrip("/")
        self.launch_delay = launch_delay
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.states: dict[str, InstanceState] = {}  # launch token -> state
        self.owners: dict[str, tuple[str, int]] = {}  # launch token -> (service, replica id)
        self._on_exit: Callable[[str, int], None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    @classmethod
    def from_env(cls) -> BenchInfra:
        env = os.environ
        return cls(
            env["BENCH_FLEET_URL"],
            float(env.get("BENCH_LAUNCH_DELAY") or 0),
            float(env.get("BENCH_FAIL_RATE") or 0),
            int(env.get("BENCH_SEED") or 1),
        )

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.fleet_url, trust_env=False, timeout=30.0)
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="bench-infra-watch")
        return self._client

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = await self._http().post(path, json=body)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise TransientError(f"fakefleet {path}: {type(e).__name__}: {e}") from None
        return dict(r.json())

    async def _watch(self) -> None:
        """Keep `states` in step with fakefleet: what runs at start, then each death."""
        client = self._http()
        after = 0
        while True:
            try:
                if not self._synced.is_set():
                    live = (await client.get("/replicas")).json()
                    for r in live["replicas"]:
                        self.states.setdefault(str(r["token"]), RUNNING)
                        self.owners[str(r["token"])] = (str(r["service"]), int(r["replica_id"]))
                    after = int(live["last"])  # deaths from here on
                    self._synced.set()
                r = await client.get("/events", params={"after": after}, timeout=20.0)
                body = r.json()
                for e in body["events"]:
                    after = max(after, int(e["seq"]))
                    kind = InstanceKind(e["kind"])
                    if kind is InstanceKind.LOST:
                        state = InstanceState(kind, None, "bench: instance preempted")
                    else:
                        state = InstanceState(kind, 1, "exited with code 1 (bench: killed)")
                    self.states[str(e["token"])] = state
                    owner = self.owners.get(str(e["token"]))
                    if owner is not None and self._on_exit is not None:
                        self._on_exit(*owner)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # fakefleet restarting: try again shortly
                log.warning("bench infra watcher: %s", e)
                await asyncio.sleep(0.5)

    def watch_exits(self, callback: Callable[[str, int], None]) -> None:
        """fleetserve's `WatchesExits`: each death event is reported as it arrives."""
        self._on_exit = callback

    def locations(self) -> list[Location]:
        return [Location(zone="bench-a", region="bench", spot_capable=True)]

    def prepare(self, service: str, resources: dict[str, Any]) -> None:
        return None

    async def launch(self, request: LaunchRequest) -> Launched:
        self._http()
        if self.launch_delay > 0:
            await asyncio.sleep(self.launch_delay)
        if self.fail_rate > 0 and self.rng.random() < self.fail_rate:
            raise TerminalError("bench: simulated launch failure (BENCH_FAIL_RATE)")
        body = await self._post(
            "/spawn",
            {
                "token": request.launch_token,
                "service": request.service,
                "replica_id": request.replica_id,
            },
        )
        self.states[request.launch_token] = RUNNING
        self.owners[request.launch_token] = (request.service, request.replica_id)
        return Launched(str(body["handle"]), "127.0.0.1", int(body["port"]), zone="bench-a")

    async def terminate(self, handle: str | None, launch_token: str) -> None:
        await self._post("/stop", {"token": launch_token})
        self.states.pop(launch_token, None)
        self.owners.pop(launch_token, None)

    async def poll(self, handle: str) -> InstanceState:
        token = token_of(handle)
        state = self.states.get(token)
        if state is not None:
            return state
        self._http()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), 10.0)
        return self.states.get(token) or InstanceState(
            InstanceKind.LOST, None, "bench: fakefleet does not know this replica"
        )

    async def sweep(self, known_tokens: set[str]) -> int:
        body = await self._post("/sweep", {"known": sorted(known_tokens)})
        return int(body["stopped"])

    def forget_service(self, service: str) -> None:
        return None

    async def logs(
        self,
        service: str,
        replica_id: int,
        follow: bool,
        handle: str | None = None,
        tail: int | None = None,
    ) -> AsyncIterator[str]:
        yield f"bench replica {service}/{replica_id}: fake replicas keep no logs\n"
