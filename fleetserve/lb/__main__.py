"""`python -m fleetserve.lb --config FILE`: one service's load balancer (started by the
controller, which writes FILE)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import ssl
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from fleetserve.lb.admin import make_admin_app
from fleetserve.lb.config import LbConfig
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.replica_set import ReplicaSet
from fleetserve.policies.lb import make_selector

log = logging.getLogger("fleetserve.lb")


def _tls(config: LbConfig) -> ssl.SSLContext | None:
    if not config.tls_certfile or not config.tls_keyfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_certfile, config.tls_keyfile)
    return ctx


async def serve(config: LbConfig) -> None:
    replicas = ReplicaSet(make_selector("least_load"))
    # instance_aware_least_load reads the per-replica weights that each push installs.
    replicas.selector = make_selector(
        config.policy, weights=replicas.weights, max_extra_load=config.options.max_extra_load
    )
    last_wake = 0.0
    wake_session: aiohttp.ClientSession | None = None

    async def wake() -> None:
        # Tell the controller at once that a request waits (at most once a second).
        nonlocal last_wake, wake_session
        if config.wake_url is None or time.monotonic() - last_wake < 1.0:
            return
        last_wake = time.monotonic()
        if wake_session is None:
            wake_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        try:
            async with wake_session.post(config.wake_url) as r:
                if r.status >= 400:
                    log.warning("controller answered %s to a wake-up", r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("could not wake the controller: %s", e)

    proxy = Proxy(config, replicas, wake=wake)
    admin = web.AppRunner(make_admin_app(proxy), access_log=None)
    await admin.setup()
    await proxy.serve(config.host, config.port, _tls(config))
    await web.TCPSite(admin, "127.0.0.1", config.admin_port, reuse_address=True).start()
    log.info(
        "load balancer for %s on %s:%s (admin 127.0.0.1:%s, policy %s%s%s)",
        config.service,
        config.host,
        config.port,
        config.admin_port,
        config.policy,
        ", TLS" if config.tls_certfile else "",
        ", API keys required" if config.options.api_keys else "",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.close()
    await admin.cleanup()
    if wake_session is not None:
        await wake_session.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.lb")
    parser.add_argument("--config", required=True, type=Path, help="LB config (JSON)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = LbConfig.read(args.config)
    # Requests leave short-lived reference cycles (exchange <-> task); with the default
    # thresholds the collector runs every few hundred requests and its full passes show up
    # as latency spikes. Objects alive at start are frozen out of every collection.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))


if __name__ == "__main__":
    main()
