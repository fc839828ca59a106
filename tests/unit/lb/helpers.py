"""Starting real load-balancer processes in tests, and service specs for LB options."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import psutil
import trustme

from fleetserve.lb.config import LbConfig


async def start_lb_process(
    config: LbConfig, tmp_path: Path, module: str = "fleetserve.lb", new_session: bool = False
) -> subprocess.Popen[bytes]:
    """`python -m MODULE --config FILE`, returned once its admin API answers; with
    `new_session`, in a session of its own, as the controller starts it."""
    path = tmp_path / "lb.json"
    config.write(path)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--config", str(path)], start_new_session=new_session
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            try:
                async with s.get(f"http://127.0.0.1:{config.admin_port}/-/health") as r:
                    if r.status == 200:
                        return proc
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    proc.kill()
    raise AssertionError(f"{module} did not answer on its admin port")


def tls_files(folder: Path) -> tuple[trustme.CA, Path, Path]:
    """A test CA, and a certificate for "localhost" and its key written into `folder`."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    return ca, certfile, keyfile


def workers_of(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The live extra workers a load balancer started."""
    found = []
    for c in psutil.Process(proc.pid).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "--worker" in c.cmdline():
                found.append(c)
        except psutil.Error:
            continue
    return found


async def wait_workers(
    proc: subprocess.Popen[bytes], exclude: int | None = None
) -> list[psutil.Process]:
    """Wait (5 s at most) for a worker other than `exclude` to be up."""
    for _ in range(50):
        found = [w for w in workers_of(proc) if w.pid != exclude]
        if found:
            return found
        await asyncio.sleep(0.1)
    return []


def spec_with_lb(policy: str, plane: str, **options: str) -> str:
    """A service YAML with `policy`, `data_plane: plane` and these `load_balancer` options
    (values as YAML writes them)."""
    lines = "".join(f"    {name}: {value}\n" for name, value in options.items())
    return (
        f"service:\n  readiness_probe: /\n  replicas: 1\n  load_balancing_policy: {policy}\n"
        f"  load_balancer:\n{lines}    data_plane: {plane}\n"
        "run: python -m http.server $PORT\n"
    )
