"""`python -m fleetserve.lb --config FILE`: one service's load balancer (started by the
controller, which writes FILE). With `load_balancer.workers` above 1 this process starts the
other workers itself (fleetserve.lb.workers)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from fleetserve.lb.admin import make_admin_app
from fleetserve.lb.build import make_proxy, tls_context, worker_count
from fleetserve.lb.config import LbConfig
from fleetserve.lb.handover import HandoverServer, arrange, take
from fleetserve.lb.index_share import CHANNEL_LIMIT, KEY_ENV, IndexShare, channel_full, is_share
from fleetserve.lb.messages import ReplicaPush
from fleetserve.lb.metrics import load_report
from fleetserve.lb.proxy import listening_sockets
from fleetserve.lb.rotation import FD_ENV as ROTATION_FD_ENV
from fleetserve.lb.rotation import SharedCounter
from fleetserve.lb.workers import STOP_DRAIN_SECONDS, Supervisor

log = logging.getLogger("fleetserve.lb")
LINGER_SECONDS = 5.0  # a worker whose primary was killed serves this long more


class _Signals:
    """SIGTERM, SIGINT (a stop) and SIGQUIT (a retirement: a load balancer with new settings
    replaces this one), handled from the start of the process (Python's default for SIGQUIT
    is to dump core). The first decides the drain (`drain_for`); a SIGTERM or SIGINT after a
    SIGQUIT cuts the retirement's drain to a stop's (`hurry`: `down`, an orphan sweep)."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.first: asyncio.Future[signal.Signals] = loop.create_future()
        self.hurry: list[Callable[[], None]] = []
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, self._got, sig)

    def _got(self, sig: signal.Signals) -> None:
        if not self.first.done():
            self.first.set_result(sig)
        elif sig != signal.SIGQUIT:
            for act in self.hurry:
                act()


def drain_for(config: LbConfig, sig: signal.Signals) -> float:
    """How long the requests in progress get: a retirement, the config's drain_seconds (a
    long LLM stream keeps going while the new load balancer takes the new ones); a stop, 5 s."""
    return config.drain_seconds if sig == signal.SIGQUIT else STOP_DRAIN_SECONDS


async def serve(config: LbConfig, config_path: Path) -> None:
    """The primary: serves traffic, the admin API, and supervises the other workers."""
    signals = _Signals()
    count = worker_count(config)
    proxy = make_proxy(config)
    tls = tls_context(config)
    # Every process's listening sockets, made here and kept for the LB's life: a worker that
    # dies leaves its socket, and the connections queued on it, to this process
    # (fleetserve.lb.workers). SO_REUSEPORT always: the kernel spreads connections over the
    # workers, and a load balancer with new settings starts beside the old one before the old
    # one stops (no refused connection).
    # A load balancer it replaces hands over its sockets (fleetserve.lb.handover): the same
    # queues, so that no connection waiting in them is reset when the old one stops.
    taken = take(config.service, config.host, config.port)
    listeners = arrange(
        taken[0] if taken else [], count, lambda: listening_sockets(config.host, config.port)
    )
    handover = HandoverServer(
        config.service, config.host, config.port, lambda: [listeners[i] for i in sorted(listeners)]
    )
    handover.start()
    caps = proxy.replicas.caps
    supervisor = None
    sharing: asyncio.Task[None] | None = None
    if count > 1:
        # A policy with an index (cache_aware): one for all the processes, keyed by one secret.
        shares = caps.shares_index
        key = os.urandom(32) if shares is not None else None
        # A policy that takes turns (round_robin, least_load's ties): one turn for all the
        # processes, not one each.
        turns = caps.takes_turns
        rotation = SharedCounter.create() if turns is not None else None
        if rotation is not None and turns is not None:
            turns.share_turns(rotation.take)
        supervisor = Supervisor(
            config_path,
            count,
            key,
            rotation.fd if rotation is not None else None,
            listeners,
            proxy,
            tls,
        )
        if shares is not None and key is not None:
            shares.share_keys(key)
            share = IndexShare(shares, proxy.replicas, 0, supervisor.broadcast)
            supervisor.share_index(share)
            sharing = asyncio.get_running_loop().create_task(share.run())
    admin = web.AppRunner(make_admin_app(proxy, supervisor), access_log=None)
    await admin.setup()
    await proxy.serve(config.host, config.port, tls, sockets=listeners[0])
    await web.TCPSite(admin, "127.0.0.1", config.admin_port, reuse_address=True).start()
    if supervisor is not None:
        await supervisor.start()
    log.info(
        "load balancer for %s on %s:%s (admin 127.0.0.1:%s, policy %s, %s worker%s%s%s)",
        config.service,
        config.host,
        config.port,
        config.admin_port,
        config.policy,
        count,
        "s" if count > 1 else "",
        ", TLS" if config.tls_certfile else "",
        ", API keys required" if config.options.api_keys else "",
    )
    if taken:
        log.info(
            "listening on the %s sockets of the load balancer it replaces (pid %s)",
            sum(len(g) for g in taken[0]),
            taken[1],
        )
    sig = await signals.first
    drain = drain_for(config, sig)
    signals.hurry.append(lambda: proxy.shorten_drain(STOP_DRAIN_SECONDS))
    if supervisor is not None:
        signals.hurry.append(supervisor.hurry)
    log.info(
        "%s: letting the requests in progress finish (up to %g s)",
        "retired for a new load balancer" if sig == signal.SIGQUIT else "stopping",
        drain,
    )
    handover.close()
    if sharing is not None:
        sharing.cancel()
    # The workers and this process drain at once (the controller waits for the whole stop).
    stops = [proxy.close(drain)]
    if supervisor is not None:
        stops.append(supervisor.stop(drain, retire=sig == signal.SIGQUIT))
    await asyncio.gather(*stops)
    await admin.cleanup()


async def serve_worker(
    config: LbConfig,
    control_fd: int,
    worker: int,
    listen_fds: list[int] | None = None,
    primary_fds: list[int] | None = None,
) -> None:
    """An extra worker: serves traffic (on the sockets `listen_fds` the primary made for it);
    takes pushes and answers report requests on its control channel; exits when the channel
    closes, after serving the primary's sockets (`primary_fds`) a while if it was killed."""
    from prometheus_client import generate_latest

    proxy = make_proxy(config, worker)
    caps = proxy.replicas.caps
    key = os.environ.get(KEY_ENV)  # set by the primary: the policy shares its index
    shares = caps.shares_index if key else None
    rotation_fd = os.environ.get(ROTATION_FD_ENV)  # set by the primary: the shared turn
    if rotation_fd is not None and caps.takes_turns is not None:
        caps.takes_turns.share_turns(SharedCounter(int(rotation_fd)).take)
    if shares is not None and key:
        shares.share_keys(bytes.fromhex(key))
    reader, writer = await asyncio.open_connection(
        sock=socket.socket(fileno=control_fd), limit=CHANNEL_LIMIT
    )
    loop = asyncio.get_running_loop()
    share: IndexShare | None = None
    sharing: asyncio.Task[None] | None = None
    if shares is not None:

        def send(line: bytes) -> None:
            if not channel_full(writer):
                writer.write(line)
            elif share is not None:
                share.dropped_batches += 1

        share = IndexShare(shares, proxy.replicas, worker, send)
        sharing = loop.create_task(share.run())
    tls = tls_context(config)
    own = [socket.socket(fileno=fd) for fd in listen_fds or []]
    primary = [socket.socket(fileno=fd) for fd in primary_fds or []]

    async def listen() -> None:
        """Once the primary's replica set and index are applied ("start"): until then the
        primary serves this worker's sockets itself, so no request meets an empty set."""
        if own:
            await proxy.serve(config.host, config.port, tls, sockets=own)
        else:
            await proxy.serve(config.host, config.port, tls, reuse_port=True)
        writer.write(json.dumps({"op": "ready"}).encode() + b"\n")  # the primary stops covering

    serving = False
    stopping = False
    drain = STOP_DRAIN_SECONDS

    def stop(sig: signal.Signals) -> None:
        nonlocal stopping, drain
        if not stopping:
            stopping = True
            drain = drain_for(config, sig)
            writer.close()
        elif sig != signal.SIGQUIT:  # retiring, then told to stop: a stop's drain
            proxy.shorten_drain(STOP_DRAIN_SECONDS)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        loop.add_signal_handler(sig, stop, sig)

    async def next_line() -> bytes:
        # A primary killed with bytes of ours unread resets the channel: that is its end too.
        try:
            return await reader.readline()
        except ConnectionError:
            return b""

    while line := await next_line():
        msg = json.loads(line)
        if msg.get("op") == "replicas":
            push = ReplicaPush.model_validate(
                {"replicas": msg["replicas"], "canary": msg.get("canary")}
            )
            proxy.replicas.apply(push)
        elif is_share(msg):
            if share is not None:
                share.apply(msg)
        elif msg.get("op") == "stop":  # the primary stops (or retires) us: not its death
            if not stopping:
                stopping = True
                drain = drain_for(config, signal.SIGQUIT if msg.get("retire") else signal.SIGTERM)
            break
        elif msg.get("op") == "start" and not serving:
            serving = True
            await listen()
        elif msg.get("op") == "report":
            proxy.metrics.sync_inflight(proxy.replicas.inflight, set(proxy.replicas.upstreams))
            proxy.metrics.set_queued(proxy.queued)
            answer = {
                "load": load_report(
                    proxy.load, proxy.metrics, dict(proxy.replicas.inflight), proxy.queued
                ).model_dump(mode="json"),
                "metrics": generate_latest(proxy.metrics.registry).decode(),
            }
            writer.write(json.dumps(answer).encode() + b"\n")
            try:
                await writer.drain()
            except ConnectionError:
                break
    if sharing is not None:
        sharing.cancel()
    # The channel closed: the primary is gone, or stops us. If it was killed, serve the last
    # replica set a few seconds more, while the controller starts a new primary beside us
    # (SO_REUSEPORT), so that no connection is refused meanwhile. Then stop listening and let
    # the requests in progress finish.
    # The connections queued on the dead primary's socket, and those the kernel still sends
    # it, are served here too meanwhile (every worker holds that socket).
    if not stopping and serving:
        if primary:
            await proxy.listen_on(primary, tls)
        await asyncio.sleep(LINGER_SECONDS)
    else:
        for sock in (*primary, *([] if serving else own)):
            sock.close()
    await proxy.close(drain)


def _fds(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.lb")
    parser.add_argument("--config", required=True, type=Path, help="LB config (JSON)")
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--control-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--listen-fds", type=_fds, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--primary-fds", type=_fds, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [w{args.worker}] %(message)s"
    )
    config = LbConfig.read(args.config)
    # Requests leave short-lived reference cycles; objects alive at start are frozen out of
    # every collection and collections run less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    if args.control_fd is not None:
        main_coro = serve_worker(
            config, args.control_fd, args.worker, args.listen_fds, args.primary_fds
        )
    else:
        main_coro = serve(config, args.config)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
    else:
        uvloop.run(main_coro)


if __name__ == "__main__":
    main()
