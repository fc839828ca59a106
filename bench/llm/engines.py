"""Real engines and other routers for bench/llm (`run.py --engine vllm`).

vLLM replicas: its OpenAI-compatible server (the CPU build of scripts/llm/setup.sh, on the small
model it makes offline), one process per replica on a loopback port, with prefix caching and
its real metrics. The bench reads each replica's Prometheus page for what the fake replicas
report on /-/stats (running and waiting requests, prompt tokens queried and hit in the prefix
cache, finished requests), and restarts them between targets so that each one starts cold.

Routers: SGLang's (`sglang-router launch`) and vLLM's (`vllm-router`), both Rust, both from
scripts/llm/setup.sh's venv, put in front of the same replicas as fleetserve's load balancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import psutil

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("FLEETSERVE_VLLM_VENV", REPO / ".venv-vllm"))
SERVED_NAME = "fake"  # the name the workloads' bodies carry
ROUTERS = ("sglang-router", "vllm-router")
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$")


class Starter(Protocol):
    def start(
        self, cmd: list[str], log: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]: ...

    def stop(self, proc: subprocess.Popen[bytes]) -> None: ...

    def tail(self, log: str, lines: int = 6) -> str: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def testbed_python() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        sys.exit(f"no vLLM testbed at {VLLM_VENV}: run ./scripts/llm/setup.sh first")
    return python


def testbed_model() -> str:
    """The testbed's model folder (made once, offline, by scripts/llm/make_model.py)."""
    out = subprocess.run(
        [str(testbed_python()), str(REPO / "scripts" / "llm" / "make_model.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        sys.exit(f"making the testbed model failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(200 <= r.status < 300)
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """vLLM's counters and gauges that the bench reads, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(2) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


class _PortTaken(Exception):
    def __init__(self, replica: int) -> None:
        super().__init__(replica)
        self.replica = replica


@dataclass
class VllmFleet:
    """`count` vLLM replicas on loopback ports, started (and restarted) together."""

    procs: Starter
    count: int
    model: str
    kv_cache_gib: float = 1.0
    max_model_len: int = 4096
    kv_blocks: int | None = None  # exact KV cache blocks per replica (small: evictions)
    kv_events: bool = False  # publish KV cache events (ZMQ) at port + 1, replay at port + 2
    extra_args: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    running: list[subprocess.Popen[bytes]] = field(default_factory=list)
    starts: int = 0

    def command(self, port: int) -> list[str]:
        cmd = [
            str(testbed_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if self.kv_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        if self.kv_events:
            # Where fleetserve's infras say a replica publishes (FLEETSERVE_KV_EVENTS_PORT and
            # _REPLAY_PORT), and so where the LB's precise mode subscribes. vLLM binds only a
            # wildcard endpoint (given 127.0.0.1 it connects instead, and nobody hears it).
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{port + 1}",
                "replay_endpoint": f"tcp://*:{port + 2}",
                "topic": "kv-events",
            }
            cmd += ["--kv-events-config", json.dumps(config)]
        return cmd + self.extra_args

    def start(
        self, log: Callable[[str], None] = print, timeout: float = 900, tries: int = 3
    ) -> float:
        """Start every replica and wait until each answers /v1/models; the seconds it took.
        A replica that could not bind a port it was given (free when chosen, taken by another
        process on the machine before vLLM bound it, a minute later: KV events' ports) has
        every replica started again on new ports, up to `tries` times in all."""
        for attempt in range(1, tries + 1):
            try:
                return self._start_once(log, timeout)
            except _PortTaken as e:
                if attempt == tries:
                    sys.exit(f"vLLM replica {e.replica} exited: a port was taken, {tries} times")
                log(
                    f"  vLLM replica {e.replica}: a port it was given was taken meanwhile; "
                    "starting every replica again on new ports"
                )
        raise AssertionError("unreachable")

    def _start_once(self, log: Callable[[str], None], timeout: float) -> float:
        t0 = time.monotonic()
        self.ports = [self._port() for _ in range(self.count)]
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # replicas share the machine's cores
                "OMP_NUM_THREADS": "1",
                # The model in the engine process: no worker process spinning on shared
                # memory for a second after each step (examples/vllm/README.md).
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache, for resets between loads
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )
        self.starts += 1
        self.running = []
        for i, port in enumerate(self.ports):
            log_name = f"vllm-{i + 1}-{self.starts}.log"
            self.running.append(self.procs.start(self.command(port), log_name, env))
        waiting = set(range(self.count))
        last_note = t0
        while waiting:
            for i in sorted(waiting):
                proc = self.running[i]
                if proc.poll() is not None:
                    name = f"vllm-{i + 1}-{self.starts}.log"
                    if "Address already in use" in self.procs.tail(name, 400):
                        self.stop()
                        raise _PortTaken(i + 1)
                    tail = self.procs.tail(name, 8)
                    self.stop()
                    sys.exit(f"vLLM replica {i + 1} exited ({proc.returncode}): {tail}")
                if http_ok(f"http://127.0.0.1:{self.ports[i]}/v1/models"):
                    waiting.discard(i)
            if time.monotonic() - t0 > timeout:
                self.stop()
                sys.exit(f"vLLM replicas not up after {timeout:.0f} s")
            if waiting and time.monotonic() - last_note > 15:
                last_note = time.monotonic()
                log(
                    f"  vLLM: {self.count - len(waiting)}/{self.count} replicas up "
                    f"({time.monotonic() - t0:.0f} s)"
                )
            time.sleep(0.5)
        return time.monotonic() - t0

    def _port(self) -> int:
        """A free port (and, with KV events, the next two free too)."""
        while True:
            port = free_port()
            if not self.kv_events or all(port_free(port + k) for k in (1, 2)):
                return port

    def stop(self) -> None:
        """Stop every replica and what it started (vLLM's engine core and workers), by pid."""
        for proc in self.running:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                children = []
            self.procs.stop(proc)
            for child in children:
                with contextlib.suppress(psutil.Error):
                    child.kill()
        self.running = []

    def restart(self, log: Callable[[str], None] = print) -> float:
        self.stop()
        return self.start(log)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    async def stats(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        """Each replica's figures in the shape of the fake replicas' /-/stats."""

        async def one(i: int, url: str) -> dict[str, Any]:
            async with http.get(url + "/metrics") as r:
                m = parse_vllm_metrics(await r.text())
            return {
                "replica": str(i + 1),
                "running": int(m.get("vllm:num_requests_running", 0)),
                "waiting": int(m.get("vllm:num_requests_waiting", 0)),
                "prefix_cache_queries": m.get("vllm:prefix_cache_queries_total", 0.0),
                "prefix_cache_hits": m.get("vllm:prefix_cache_hits_total", 0.0),
                "requests": m.get("vllm:request_success_total", 0.0),
                # Requests vLLM took out of a running batch for want of KV cache (recomputed
                # later): a cache that cannot hold what runs, not only what is reused.
                "preemptions": m.get("vllm:num_preemptions_total", 0.0),
            }

        return list(await asyncio.gather(*(one(i, u) for i, u in enumerate(self.urls))))

    async def reset(self, http: aiohttp.ClientSession) -> None:
        """Empty every replica's prefix cache (vLLM's dev-mode endpoint)."""
        for url in self.urls:
            async with http.post(url + "/reset_prefix_cache") as r:
                await r.read()


@dataclass
class Router:
    name: str
    port: int
    proc: subprocess.Popen[bytes]


def router_command(
    kind: str, policy: str, port: int, workers: list[str], metrics_port: int
) -> list[str]:
    """The command line of SGLang's or vLLM's router in front of `workers` (both take the
    same flags but for the subcommand and the log level's spelling). Their Prometheus
    exporters on loopback and a port of their own: SGLang's binds 0.0.0.0:29000 by default,
    and exits at start when something else holds that port."""
    if kind not in ROUTERS:
        raise ValueError(f"no router {kind!r}: {', '.join(ROUTERS)}")
    head = [str(VLLM_VENV / "bin" / kind)] + (["launch"] if kind == "sglang-router" else [])
    level = "warn" if kind == "sglang-router" else "warning"
    return [
        *head,
        *("--worker-urls", *workers),
        *("--policy", policy, "--host", "127.0.0.1", "--port", str(port)),
        *("--log-level", level),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
    ]


def start_router(
    procs: Starter, kind: str, policy: str, workers: list[str], timeout: float = 90
) -> Router | str:
    """A router in front of `workers`, once it serves /v1/models; or why it did not start."""
    port = free_port()
    cmd = router_command(kind, policy, port, workers, free_port())
    if not Path(cmd[0]).exists():
        return f"{cmd[0]} is missing: run ./scripts/llm/setup.sh"
    log = f"{kind}-{policy}.log"
    proc = procs.start(cmd, log)
    deadline = time.monotonic() + timeout
    while not http_ok(f"http://127.0.0.1:{port}/v1/models"):
        if proc.poll() is not None or time.monotonic() > deadline:
            procs.stop(proc)
            return f"{kind} did not start: {procs.tail(log, 4) or 'no output'}"
        time.sleep(0.3)
    return Router(kind, port, proc)
