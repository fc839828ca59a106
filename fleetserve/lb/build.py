"""Building a load balancer from its config: the proxy (with its wake-up call to the
controller), the TLS context, the number of worker processes, its connection limit."""

from __future__ import annotations

import json
import logging
import os
import resource
import ssl

import aiohttp

from fleetserve.core.clock import Monotonic, SystemClock
from fleetserve.lb.config import LbConfig
from fleetserve.lb.kv_events import KvEventsCollector, KvEventsFollower, precise_mode
from fleetserve.lb.messages import ReplicaPush
from fleetserve.lb.proxy import DEFAULT_MAX_CONNECTIONS, Proxy
from fleetserve.lb.replica_set import ReplicaSet
from fleetserve.lb.wake import may_send_to
from fleetserve.policies.cache_aware_precise import PreciseCacheAware
from fleetserve.policies.factory import PreciseParts, make_selector, selector_for
from fleetserve.spec.models import LoadBalancerOptions

log = logging.getLogger("fleetserve.lb")
choices_log = logging.getLogger("fleetserve.lb.choices")


def log_choice(why: dict[str, object]) -> None:
    """One line of the choice log (`load_balancer.log_choices`)."""
    choices_log.info("choice %s", json.dumps(why, separators=(",", ":")))


# File descriptors kept out of the connection budget: listening sockets, the admin API, logs,
# the workers' channels, and idle pooled replica connections (up to 256 per replica).
FD_RESERVE = 1024
MIN_CONNECTIONS = 64


def tls_context(config: LbConfig) -> ssl.SSLContext | None:
    if not config.tls_certfile or not config.tls_keyfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_certfile, config.tls_keyfile)
    return ctx


def worker_count(config: LbConfig) -> int:
    wanted = config.options.workers
    return wanted if wanted is not None else max(1, min(os.cpu_count() or 1, 4))


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as e:
            log.warning("could not raise the file-descriptor limit to %s: %s", hard, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_limit(options: LoadBalancerOptions, fd_limit: int) -> int:
    """Client connections one process takes. Each may hold a replica connection too, so the
    budget is half the descriptors left after a reserve; `max_connections` may lower it, not
    raise it past what the process can open (past it a new client would get nothing at all)."""
    budget = max(MIN_CONNECTIONS, (fd_limit - FD_RESERVE) // 2)
    wanted = options.max_connections
    if wanted is None:
        return min(budget, DEFAULT_MAX_CONNECTIONS)
    if wanted > budget:
        log.warning(
            "max_connections %s is more than %s file descriptors allow: %s",
            wanted,
            fd_limit,
            budget,
        )
        return budget
    return wanted


def make_proxy(config: LbConfig, worker: int = 0, clock: Monotonic | None = None) -> Proxy:
    clock = clock or SystemClock()
    monotonic = clock.monotonic
    replicas = ReplicaSet(make_selector("least_load"), monotonic)
    # instance_aware_least_load reads the per-replica weights that each push installs.
    opts = config.options
    # The engines' KV cache events (the spec allows them with cache_aware only: its precise mode).
    precise = None if opts.kv_events is None else precise_mode(opts, config.service)
    parts = None if precise is None else PreciseParts(precise[0], precise[2])
    replicas.selector = selector_for(config.policy, opts, replicas.weights, parts)
    caps = replicas.caps
    # Workers take connections independently: each starts its tie-break (and round_robin,
    # until the primary hands it the shared rotation, fleetserve.lb.rotation) at another
    # replica, so that a few requests on new connections still spread.
    if caps.takes_turns is not None:
        caps.takes_turns.start_turn_at(worker)
    last_wake = 0.0
    wake_session: aiohttp.ClientSession | None = None

    async def wake() -> None:
        # Tell the controller at once that a request waits (at most once a second).
        nonlocal last_wake, wake_session
        if config.wake_url is None or monotonic() - last_wake < 1.0:
            return
        last_wake = monotonic()
        if not may_send_to(config.wake_url):
            log.warning("not waking the controller: its port is not held by this user")
            return
        if wake_session is None:
            headers = {"Content-Type": "application/json"}
            if config.wake_token:  # never the admin secret (fleetserve.lb.wake)
                headers["Authorization"] = f"Bearer {config.wake_token}"
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

    replicas.apply(ReplicaPush(replicas=config.replicas))
    limit = connection_limit(config.options, raise_fd_limit())
    proxy = Proxy(config, replicas, wake=wake, max_connections=limit, clock=clock)
    if caps.reports_choices is not None:
        caps.reports_choices.on_choice = proxy.metrics.prompt_blocks
        if config.options.log_choices:
            caps.reports_choices.explain = log_choice
    if precise is not None:
        if isinstance(replicas.selector, PreciseCacheAware):
            replicas.selector.blended.on_precise = proxy.metrics.precise_tokens
        upstreams = replicas  # its set is replaced by each push: read it each round
        proxy.kv_events = KvEventsFollower(
            precise[0],
            precise[1],
            lambda: [(rid, u.url) for rid, u in upstreams.upstreams.items()],
        )
        proxy.metrics.registry.register(KvEventsCollector(proxy.kv_events, config.service))
    return proxy
