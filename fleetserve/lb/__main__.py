"""`python -m fleetserve.lb`: run one service's load balancer (started by the controller)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from aiohttp import web

from fleetserve.lb.admin import make_admin_app
from fleetserve.lb.proxy import Proxy, make_app
from fleetserve.lb.replica_set import ReplicaSet
from fleetserve.policies.lb import make_selector


async def serve(args: argparse.Namespace) -> None:
    replicas = ReplicaSet(make_selector(args.policy))
    proxy = Proxy(args.service, replicas)
    runner = web.AppRunner(make_app(proxy), handler_cancellation=True, access_log=None)
    admin = web.AppRunner(make_admin_app(args.service, replicas), access_log=None)
    await runner.setup()
    await admin.setup()
    await web.TCPSite(runner, args.host, args.port, backlog=2048, reuse_address=True).start()
    await web.TCPSite(admin, "127.0.0.1", args.admin_port, reuse_address=True).start()
    logging.getLogger("fleetserve.lb").info(
        "load balancer for %s on %s:%s (admin 127.0.0.1:%s, policy %s)",
        args.service,
        args.host,
        args.port,
        args.admin_port,
        args.policy,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await admin.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.lb")
    parser.add_argument("--service", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--admin-port", type=int, required=True)
    parser.add_argument("--policy", default="least_load")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
