"""Building a load balancer from its config: the proxy (with its wake-up call to the
controller), the TLS context, the number of worker processes."""

from __future__ import annotations

import logging
import os
import ssl
import time

import aiohttp

from fleetserve.lb.config import LbConfig
from fleetserve.lb.proxy import Proxy
from fleetserve.lb.replica_set import ReplicaSet, Upstream
from fleetserve.policies.lb import LeastLoad, RoundRobin, make_selector

log = logging.getLogger("fleetserve.lb")


def tls_context(config: LbConfig) -> ssl.SSLContext | None:
    if not config.tls_certfile or not config.tls_keyfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_certfile, config.tls_keyfile)
    return ctx


def worker_count(config: LbConfig) -> int:
    wanted = config.options.workers
    return wanted if wanted is not None else max(1, min(os.cpu_count() or 1, 4))


def make_proxy(config: LbConfig, worker: int = 0) -> Proxy:
    replicas = ReplicaSet(make_selector("least_load"))
    # instance_aware_least_load reads the per-replica weights that each push installs.
    replicas.selector = make_selector(
        config.policy, weights=replicas.weights, max_extra_load=config.options.max_extra_load
    )
    # Workers take connections independently: each starts its rotation at another replica,
    # so that a few requests on new connections still spread.
    if isinstance(replicas.selector, RoundRobin):
        replicas.selector.next_index = worker
    elif isinstance(replicas.selector, LeastLoad):
        replicas.selector.tie_break = worker
    last_wake = 0.0
    wake_session: aiohttp.ClientSession | None = None

    async def wake() -> None:
        # Tell the controller at once that a request waits (at most once a second).
        nonlocal last_wake, wake_session
        if config.wake_url is None or time.monotonic() - last_wake < 1.0:
            return
        last_wake = time.monotonic()
        if wake_session is None:
            headers = {"Content-Type": "application/json"}
            if config.admin_secret:
                headers["Authorization"] = f"Bearer {config.admin_secret}"
            # The controller is on loopback: its certificate (if it serves TLS for remote
            # clients) names its public host, so the wake-up call does not verify it.
            wake_session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=5),
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=False),
            )
        try:
            async with wake_session.post(config.wake_url, data=b"{}") as r:
                if r.status >= 400:
                    log.warning("controller answered %s to a wake-up", r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("could not wake the controller: %s", e)

    replicas.replace(
        [
            Upstream(r["replica_id"], r["url"], r.get("version", 1), r.get("weight", 1.0))
            for r in config.replicas
        ]
    )
    return Proxy(config, replicas, wake=wake)
