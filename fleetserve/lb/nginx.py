"""`python -m fleetserve.lb.nginx --config FILE`: the optional native data plane.

For `load_balancer.data_plane: nginx`. This driver serves the same admin API as the Python
load balancer (the controller cannot tell them apart), runs an nginx master as its child, and on
every replica-set push rewrites nginx's upstream block and reloads it gracefully (SIGHUP: old
workers finish their requests). It tails nginx's access log into the same load report and
Prometheus metrics. An embedded Python proxy on an internal port is nginx's fallback server:
with no READY replica it answers 503, or holds requests while the service scales from zero.

What nginx does not do here (documented): prefix_affinity and cache_aware (it falls back to
least_conn), per-replica in-flight counts in the load report, and instance_aware weights beyond
nginx's own `weight=`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from aiohttp import web

from fleetserve.lb.admin import make_admin_app
from fleetserve.lb.build import make_proxy, tls_context
from fleetserve.lb.config import PARENT_ENV, LbConfig
from fleetserve.lb.messages import ReplicaPush
from fleetserve.lb.nginx_stale import stop_stale_nginx
from fleetserve.lb.proxy import Proxy

log = logging.getLogger("fleetserve.lb")
# Fields apart by "|" (a retried request's upstream fields list every try, ", " apart).
_LOG_FORMAT = "fleetserve '$msec|$upstream_addr|$status|$request_time|$upstream_header_time'"


def _seconds(text: str) -> float | None:
    try:
        return float(text.split(":")[-1])  # " : " joins the tries of an internal redirect
    except ValueError:
        return None


def _ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _balance(policy: str, session_header: str | None, session_cookie: str | None) -> str:
    if policy == "round_robin":
        return ""
    if policy == "sticky":
        if session_cookie and not session_header:
            return f"hash $cookie_{session_cookie} consistent;"
        header = (session_header or "X-Session-Id").lower().replace("-", "_")
        return f"hash $http_{header} consistent;"
    return "least_conn;"  # least_load, power_of_two, instance_aware, prefix_affinity, cache_aware


def render(config: LbConfig, replicas: list[dict[str, Any]], fallback_port: int, home: Path) -> str:
    opts = config.options
    servers = [
        f"server {u['url'].removeprefix('http://').rstrip('/')} "
        f"weight={max(1, round(float(u.get('weight', 1.0))))} max_fails=1 fail_timeout=1s;"
        for u in replicas
    ]
    fallback = f"server 127.0.0.1:{fallback_port}{' backup' if servers else ''};"
    listen = f"{config.host}:{config.port}"
    tls = ""
    if config.tls_certfile and config.tls_keyfile:
        listen += " ssl"
        tls = (
            f"ssl_certificate {config.tls_certfile};\n    ssl_certificate_key {config.tls_keyfile};"
        )
    auth_map = ""
    auth_check = ""
    if opts.api_keys:
        keys = "\n".join(f'    "Bearer {k}" 1;' for k in opts.api_keys)
        auth_map = f"map $http_authorization $fs_authorized {{\n    default 0;\n{keys}\n  }}"
        auth_check = (
            "if ($fs_authorized = 0) { add_header WWW-Authenticate Bearer always; return 401 "
            '\'{"error": "unauthorized", "message": "a valid API key is required: '
            'Authorization: Bearer <key>"}\\n\'; }\n      proxy_set_header Authorization "";'
        )
    return f"""# fleetserve: service {config.service}; rewritten on every replica change.
worker_processes {opts.workers or "auto"};
daemon off;
pid {home}/nginx.pid;
error_log {home}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  log_format {_LOG_FORMAT};
  access_log {home}/access.log fleetserve;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' ''; }}
  {auth_map}
  upstream replicas {{
    zone fleetserve_replicas 1m;  # one round-robin turn, one least_conn count: all workers
    {_balance(config.policy, opts.session_header, opts.session_cookie)}
    {" ".join(servers)}
    {fallback}
    keepalive 256;
  }}
  server {{
    listen {listen} backlog=2048 reuseport;
    {tls}
    client_max_body_size 0;
    location / {{
      {auth_check}
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Host $host;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_connect_timeout {_ms(opts.connect_timeout_seconds)};
      proxy_read_timeout {_ms(opts.read_timeout_seconds)};
      proxy_send_timeout {_ms(opts.read_timeout_seconds)};
      proxy_next_upstream error timeout;
      proxy_next_upstream_tries {opts.max_attempts};
    }}
  }}
}}
"""


class Nginx:
    """The nginx master this driver owns; `push` rewrites its upstreams and reloads it."""

    def __init__(self, config: LbConfig, home: Path, fallback: Proxy) -> None:
        self.config = config
        self.home = home
        self.fallback = fallback
        self.proc: subprocess.Popen[bytes] | None = None
        self.replicas: list[dict[str, Any]] = []
        self._by_addr: dict[str, str] = {}

    @property
    def conf(self) -> Path:
        return self.home / "nginx.conf"

    def _write(self) -> None:
        text = render(self.config, self.replicas, self.fallback.port, self.home)
        tmp = self.conf.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(text)
        tmp.replace(self.conf)

    def _stop_stale(self) -> None:
        stop_stale_nginx(self.home)

    async def start(self) -> None:
        if shutil.which("nginx") is None:
            raise SystemExit("data_plane nginx: no nginx on PATH (apt-get install nginx-light)")
        self.home.mkdir(parents=True, exist_ok=True)
        self._stop_stale()
        self._write()
        env = dict(os.environ)
        env[PARENT_ENV] = str(os.getpid())
        log_file = open(self.home / "nginx.out", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            ["nginx", "-c", str(self.conf), "-p", str(self.home)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
        await asyncio.sleep(0.3)
        if self.proc.poll() is not None:
            raise SystemExit(f"nginx exited at start: see {self.home / 'error.log'}")

    async def push(self, push: ReplicaPush) -> None:
        """Canary splits are not applied by nginx here: both versions share by its policy
        (the Python fallback applies them only to requests it serves)."""
        replicas = self.replicas = [u.model_dump() for u in push.replicas]
        self._by_addr = {
            u["url"].removeprefix("http://").rstrip("/"): str(u["replica_id"]) for u in replicas
        }
        self._write()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)  # graceful reload

    async def reports(self) -> list[dict[str, Any]]:
        return []

    async def tail_access_log(self) -> None:
        """Feed nginx's access log into the load report and the metrics."""
        path = self.home / "access.log"
        path.touch()
        with open(path) as f:
            f.seek(0, os.SEEK_END)
            while True:
                line = f.readline()
                if not line:
                    await asyncio.sleep(0.2)
                    continue
                parts = line.rstrip("\n").split("|")
                if len(parts) < 5:
                    continue
                _msec, addr, status, seconds, header = parts[:5]
                last = addr.split(",")[-1].strip()
                replica = self._by_addr.get(last, "none")
                if last.endswith(f":{self.fallback.port}"):
                    continue  # the fallback proxy counts its own requests
                # The answering try's time to its head ("-": none came).
                first_byte = _seconds(header.split(",")[-1]) if replica != "none" else None
                with contextlib.suppress(ValueError):
                    self.fallback.load.record(replica)
                    self.fallback.metrics.done(replica, int(status), float(seconds), first_byte)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful stop
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def serve(config: LbConfig, config_path: Path) -> None:
    home = config_path.with_suffix(".nginx")
    # nginx checks API keys and strips them: the fallback behind it must not ask again.
    no_keys = config.options.model_copy(update={"api_keys": []})
    fallback = make_proxy(config.model_copy(update={"options": no_keys}))
    await fallback.serve("127.0.0.1", 0)
    nginx = Nginx(config, home, fallback)
    await nginx.start()
    admin = web.AppRunner(make_admin_app(fallback, nginx), access_log=None)
    await admin.setup()
    await web.TCPSite(admin, "127.0.0.1", config.admin_port, reuse_address=True).start()
    tail = asyncio.get_running_loop().create_task(nginx.tail_access_log())
    log.info(
        "load balancer for %s on %s:%s: nginx data plane (pid %s), admin 127.0.0.1:%s%s",
        config.service,
        config.host,
        config.port,
        nginx.proc.pid if nginx.proc else "?",
        config.admin_port,
        ", TLS" if tls_context(config) is not None else "",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGQUIT (retired for a load balancer with new settings) stops nginx gracefully too.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    tail.cancel()
    await nginx.stop()
    await fallback.close()
    await admin.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.lb.nginx")
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(LbConfig.read(args.config), args.config))


if __name__ == "__main__":
    main()
