"""The `ray` infra: each replica is a detached named Ray actor that runs the replica's setup
and run on its node, so that a fleet can grow past one machine (Ray's autoscaler or KubeRay
brings the nodes).

The actor is named after the replica's launch token (`fs-<token>`, namespace `fleetserve`), so
a restarted controller finds it from the replica's row, and an actor no row knows is an orphan.
The replica command is the actor's direct child (setup, then `exec` of run): Ray kills a
worker's direct child when it kills the worker, and a node that dies takes both with it. A dead
actor or node is LOST (preempted); a process that exits is EXITED with its code.

Placement: `resources.cpus` / `accelerators` become num_cpus / num_gpus; `resources.zone`
becomes the custom resource `zone:<name>` and `use_spot` the resource `spot`, which the
cluster's nodes declare (`ray start --resources '{"zone:us-east-1a": 100, "spot": 100}'`).
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from fleetserve.core.errors import TerminalError, TransientError
from fleetserve.core.types import ReplicaId
from fleetserve.infra.base import InstanceKind, InstanceState, Launched, LaunchRequest, Location
from fleetserve.infra.jobs import JobRequest, WorkerBroken
from fleetserve.infra.missing import TAIL_BYTES, missing_commands, offline, what_is_missing
from fleetserve.infra.replica import (
    ReplicaLayout,
    create_replica_dir,
    replica_env,
    replica_layout,
)
from fleetserve.oshelpers.files import LineSplitter
from fleetserve.spec.task_env import NODE_IPS, SETUP_NODE_IPS, task_env

NAMESPACE = "fleetserve"
ACTOR_PREFIX = "fs-"


def node_env(
    req: dict[str, Any], port: int, node_ip: str, base: Mapping[str, str]
) -> dict[str, str]:
    """A replica's environment on its node (fleetserve.infra.replica.replica_env, from the Ray
    worker's own `base`), its node's address in SkyPilot's variables."""
    env = replica_env(
        base,
        envs=req["envs"],
        port=port,
        service=req["service"],
        replica_id=ReplicaId(int(req["replica_id"])),
        version=int(req["version"]),
        task=req.get("task_env", {}),
    )
    env[NODE_IPS] = env[SETUP_NODE_IPS] = node_ip
    return env


class ReplicaProcess:
    """The actor's body (wrapped by ray.remote at first use): owns one replica's process."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: Path | None = None
        self.jobs: dict[int, subprocess.Popen[bytes]] = {}  # a pool worker's jobs

    def prepare(self, req: dict[str, Any]) -> ReplicaLayout:
        """The replica's folder on this node (fleetserve.infra.replica); TerminalError for a
        workdir that is not a directory here (it is copied from the same path as on the
        controller's machine: docs/ray.md)."""
        layout = replica_layout(self.root, req["service"], ReplicaId(int(req["replica_id"])))
        # Copies of workdirs and replica logs are readable by the node's Ray user only.
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.root.chmod(0o700)
        src = req.get("workdir")
        create_replica_dir(
            layout, run=req["run"], setup=req.get("setup"), workdir=Path(src) if src else None
        )
        return layout

    def start(self, req: dict[str, Any]) -> dict[str, Any]:
        """Prepare and start the replica; {"refused": why} when its folder cannot be made
        (a plain answer: the controller raises it as the launch's TerminalError)."""
        try:
            layout = self.prepare(req)
        except TerminalError as e:
            return {"refused": e.message}
        import ray

        port = req.get("port")
        if port is None:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        env = node_env(req, port, node_ip, os.environ)
        rdir = layout.dir
        d = shlex.quote(str(rdir))
        script = (
            f"cd {shlex.quote(str(layout.workdir))} && bash {d}/setup.sh && "
            f": > {shlex.quote(str(layout.setup_done))} && exec bash {d}/run.sh"
        )
        log = os.fdopen(
            os.open(rdir / "replica.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab"
        )
        self.proc = subprocess.Popen(
            ["bash", "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        self.dir = rdir
        return {
            "pid": self.proc.pid,
            "port": port,
            "host": node_ip,
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def state(self) -> list[Any]:
        """["SETUP" | "RUNNING" | "EXITED", exit code, setup finished]."""
        assert self.proc is not None and self.dir is not None
        code = self.proc.poll()
        done = ReplicaLayout(self.dir).setup_done.exists()
        if code is not None:
            return ["EXITED", code, done]
        return ["RUNNING" if done else "SETUP", None, done]

    def stop(self, grace: float) -> None:
        for job_id in list(self.jobs):
            self.stop_job(job_id, grace)  # a worker's jobs end with it
        if self.proc is None or self.proc.poll() is not None:
            return
        import psutil

        procs = [psutil.Process(self.proc.pid)]
        with contextlib.suppress(psutil.Error):
            procs += procs[0].children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.proc.wait(5)

    # -- jobs of a pool worker: processes of their own session on this node ---------------

    def start_job(self, job: dict[str, Any]) -> int:
        assert self.dir is not None
        jdir = self.dir / "jobs" / str(job["job_id"])
        shutil.rmtree(jdir, ignore_errors=True)
        jdir.mkdir(parents=True, mode=0o700)
        (jdir / "run.sh").write_text(job["run"])
        d = shlex.quote(str(jdir))
        script = (
            f"cd {shlex.quote(str(self.dir / 'workdir'))} || exit 1; bash {d}/run.sh; "
            f"rc=$?; echo $rc > {d}/exit_code; exit $rc"
        )
        env = dict(os.environ)
        env.update(job["envs"])
        env["FLEETSERVE_JOB_TOKEN"] = job["token"]
        fd = os.open(jdir / "job.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            proc = subprocess.Popen(
                ["bash", "-c", script],
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(fd)
        self.jobs[int(job["job_id"])] = proc
        return proc.pid

    def job_state(self, job_id: int) -> list[Any]:
        """["RUNNING" | "EXITED" | "LOST", exit code]."""
        proc = self.jobs.get(int(job_id))
        if proc is not None:
            code = proc.poll()
            if code is None:
                return ["RUNNING", None]
        assert self.dir is not None
        with contextlib.suppress(OSError, ValueError):
            return ["EXITED", int((self.dir / "jobs" / str(job_id) / "exit_code").read_text())]
        return ["LOST", None] if proc is None else ["EXITED", proc.returncode]

    def stop_job(self, job_id: int, grace: float) -> None:
        proc = self.jobs.get(int(job_id))
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def read_job_log(self, job_id: int, offset: int, limit: int = 1 << 20) -> list[Any]:
        assert self.dir is not None
        path = self.dir / "jobs" / str(job_id) / "job.log"
        if not path.exists():
            return [b"", offset]
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
        return [data, offset + len(data)]

    def log_tail(self, limit: int) -> str:
        """The last `limit` bytes of the replica's log."""
        assert self.dir is not None
        path = self.dir / "replica.log"
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
        return ""

    def read_log(self, offset: int, limit: int = 1 << 20) -> list[Any]:
        assert self.dir is not None
        path = self.dir / "replica.log"
        if not path.exists():
            return [b"", offset]
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
        return [data, offset + len(data)]


def _cpus(value: object) -> float | None:
    if value is None:
        return None
    m = re.match(r"^(\d+(\.\d+)?)", str(value))
    return float(m.group(1)) if m else None


def _gpus(accelerators: object) -> float:
    if accelerators is None:
        return 0.0
    if isinstance(accelerators, dict):
        counts = [float(v or 1) for v in accelerators.values()]
        return min(counts) if counts else 0.0
    text = accelerators[0] if isinstance(accelerators, list) and accelerators else accelerators
    _, _, count = str(text).partition(":")
    return float(count or 1)


ANY_ZONE = "ray"  # a cluster whose nodes declare no zone: one zone, any node


class RayInfra:
    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        root: str = "/tmp/fleetserve-ray",
        grace_seconds: float = 10.0,
        call_timeout: float = 10.0,
        home_id: str = "",
    ) -> None:
        self.address = address or os.environ.get("FLEETSERVE_RAY_ADDRESS") or "auto"
        self.root = root
        self.grace_seconds = grace_seconds
        self.call_timeout = call_timeout
        self.home_id = home_id  # every launch token starts with it: sweep only our actors
        self._actor_cls: Any = None
        self._launch_options: dict[str, dict[str, Any]] = {}
        # ray.init is not safe to call from two threads at once (concurrent launches would
        # race: "Perhaps you called ray.init twice by accident?").
        self._connect_lock = threading.Lock()

    # -- connection ------------------------------------------------------------------------

    def _connect(self) -> Any:
        import ray

        with self._connect_lock:
            if not ray.is_initialized():
                ray.init(
                    address=self.address,
                    namespace=NAMESPACE,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
            if self._actor_cls is None:
                self._actor_cls = ray.remote(num_cpus=0)(ReplicaProcess)
        return ray

    async def _ray(self) -> Any:
        try:
            return await asyncio.to_thread(self._connect)
        except Exception as e:  # ConnectionError, RuntimeError from ray.init
            raise TransientError(f"cannot reach the Ray cluster at {self.address}: {e}") from e

    async def _call(self, ray: Any, ref: Any, limit: float | None = None) -> Any:
        return await asyncio.to_thread(ray.get, ref, timeout=limit or self.call_timeout)

    def placement(self, resources: dict[str, Any]) -> dict[str, Any]:
        """Actor options for a replica's `resources` (see the module's docstring)."""
        custom: dict[str, float] = {}
        if resources.get("zone"):
            custom[f"zone:{resources['zone']}"] = 0.001
        if resources.get("use_spot"):
            custom["spot"] = 0.001
        opts: dict[str, Any] = {"num_gpus": _gpus(resources.get("accelerators"))}
        cpus = _cpus(resources.get("cpus"))
        if cpus is not None:
            opts["num_cpus"] = cpus
        if resources.get("memory") is not None:
            gib = _cpus(resources.get("memory"))
            if gib:
                opts["memory"] = int(gib * 1024**3)
        if custom:
            opts["resources"] = custom
        return opts

    def prepare(self, service: str, resources: dict[str, Any]) -> None:
        """The resources a service's replicas ask for (the controller tells the infra)."""
        self._launch_options[service] = self.placement(resources)

    # -- the Infra protocol ----------------------------------------------------------------------

    def locations(self) -> list[Location]:
        ray = self._connect()
        zones: set[str] = set()
        spot_zones: set[str] = set()
        any_spot = False
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources") or {}
            mine = {k.split(":", 1)[1] for k in res if k.startswith("zone:")}
            zones |= mine
            if "spot" in res:  # a spot node declares the resource `spot`
                spot_zones |= mine
                any_spot = True
        return [
            Location(zone=z, region=z.rsplit("-", 1)[0], spot_capable=z in spot_zones)
            for z in sorted(zones)
        ] or [Location(zone=ANY_ZONE, region="ray", spot_capable=any_spot)]

    @staticmethod
    def start_request(request: LaunchRequest, options: dict[str, Any]) -> dict[str, Any]:
        """What the replica's actor gets to start it (`ReplicaProcess.start`)."""
        return {
            "service": request.service,
            "replica_id": request.replica_id,
            "version": request.version,
            "run": request.run,
            "setup": request.setup,
            "envs": request.envs,
            "workdir": str(request.workdir) if request.workdir else None,
            "port": request.port,
            # The GPUs Ray reserves for the actor (rounded up, as SkyPilot counts them).
            "task_env": task_env(
                "",
                math.ceil(float(options.get("num_gpus", request.gpus))),
                f"{request.service}-{request.replica_id}",
                "ray",
                None,
                request.zone,
            ),
        }

    async def launch(self, request: LaunchRequest) -> Launched:
        ray = await self._ray()
        name = ACTOR_PREFIX + request.launch_token
        options = {
            "name": name,
            "namespace": NAMESPACE,
            "lifetime": "detached",
            **self._launch_options.get(request.service, {}),
        }
        # The spot placer's zone, and spot or on-demand (a fallback replica must not wait for
        # a spot node): the per-replica choice overrides the service's resources.
        custom = dict(options.get("resources") or {})
        if request.zone is not None and request.zone != ANY_ZONE:
            custom = {k: v for k, v in custom.items() if not k.startswith("zone:")}
            custom[f"zone:{request.zone}"] = 0.001
        if request.spot:
            custom["spot"] = 0.001
        else:
            custom.pop("spot", None)
        options["resources"] = custom
        actor = self._actor_cls.options(**options).remote(self.root)
        req = self.start_request(request, options)
        try:
            # Scheduling waits for a node with the resources (Ray's autoscaler may add one).
            info = await asyncio.to_thread(ray.get, actor.start.remote(req))
            if "refused" in info:
                raise TerminalError(
                    f"{info['refused']} on the Ray node given replica {request.replica_id} "
                    "(a workdir is copied there from the same path: docs/ray.md)"
                )
            while True:
                kind, code, done = await self._call(ray, actor.state.remote())
                if kind == "RUNNING":
                    break
                if kind == "EXITED":
                    missing = ""
                    if not done:  # setup failed: a command this node lacks (conda, uv)?
                        with contextlib.suppress(Exception):
                            tail = await self._call(ray, actor.log_tail.remote(TAIL_BYTES))
                            missing = what_is_missing(missing_commands(tail)) or offline(tail)
                    raise TerminalError(
                        f"setup or run exited with code {code} on node {info['host']}"
                        f"{missing} (see `fleetserve logs {request.service} "
                        f"{request.replica_id}`)"
                    )
                await asyncio.sleep(0.2)
        except BaseException:
            await self.terminate(None, request.launch_token)
            raise
        handle = json.dumps({"actor": name, **info}, sort_keys=True)
        return Launched(handle=handle, host=info["host"], port=int(info["port"]), zone=request.zone)

    async def poll(self, handle: str) -> InstanceState:
        ray = await self._ray()
        name = json.loads(handle)["actor"]
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return InstanceState(InstanceKind.LOST, detail=f"actor {name} is gone")
        try:
            kind, code, _ = await self._call(ray, actor.state.remote(), limit=5)
        except ray.exceptions.GetTimeoutError:
            return InstanceState(InstanceKind.RUNNING, detail="no answer yet")
        except ray.exceptions.RayActorError as e:
            return InstanceState(
                InstanceKind.LOST, detail=f"actor or node died: {type(e).__name__}"
            )
        if kind == "EXITED":
            return InstanceState(
                InstanceKind.EXITED, exit_code=code, detail=f"exited with code {code}"
            )
        return InstanceState(InstanceKind.RUNNING)

    # -- jobs on pool workers (fleetserve.infra.jobs.JobRunner) -----------------------------

    async def _worker(self, handle: str) -> tuple[Any, Any]:
        ray = await self._ray()
        try:
            return ray, ray.get_actor(json.loads(handle)["actor"], namespace=NAMESPACE)
        except ValueError:
            raise WorkerBroken("the worker's actor is gone") from None

    async def start_job(self, req: JobRequest) -> str:
        ray, actor = await self._worker(req.worker_handle)
        job = {"job_id": req.job_id, "run": req.run, "envs": req.envs, "token": req.token}
        pid = await self._call(ray, actor.start_job.remote(job))
        name = json.loads(req.worker_handle)["actor"]
        return json.dumps({"actor": name, "job_id": req.job_id, "pid": pid}, sort_keys=True)

    async def poll_job(self, handle: str) -> InstanceState:
        try:
            ray, actor = await self._worker(handle)
        except WorkerBroken:
            return InstanceState(InstanceKind.LOST, detail="its worker's actor is gone")
        try:
            kind, code = await self._call(ray, actor.job_state.remote(json.loads(handle)["job_id"]))
        except ray.exceptions.GetTimeoutError:
            return InstanceState(InstanceKind.RUNNING, detail="no answer yet")
        except ray.exceptions.RayActorError:
            return InstanceState(InstanceKind.LOST, detail="its worker's node died")
        if kind == "EXITED":
            return InstanceState(InstanceKind.EXITED, exit_code=code, detail=f"exit code {code}")
        if kind == "LOST":
            return InstanceState(InstanceKind.LOST, detail="its process is unknown to the worker")
        return InstanceState(InstanceKind.RUNNING)

    async def find_job(self, pool: str, job_id: int, token: str, worker_handle: str) -> str | None:
        name = json.loads(worker_handle)["actor"]
        handle = json.dumps({"actor": name, "job_id": job_id}, sort_keys=True)
        state = await self.poll_job(handle)
        return None if state.kind is InstanceKind.LOST else handle

    async def wait_job(self, handle: str) -> None:
        while (await self.poll_job(handle)).kind is InstanceKind.RUNNING:
            await asyncio.sleep(0.2)

    async def stop_job(self, handle: str | None, token: str) -> None:
        if not handle:
            return
        with contextlib.suppress(TerminalError):
            ray, actor = await self._worker(handle)
            job_id = json.loads(handle)["job_id"]
            with contextlib.suppress(Exception):
                limit = self.grace_seconds + 10
                await self._call(ray, actor.stop_job.remote(job_id, self.grace_seconds), limit)

    async def job_logs(
        self, pool: str, job_id: int, handle: str | None, follow: bool, tail: int | None
    ) -> AsyncIterator[str]:
        if not handle:
            return
        try:
            ray, actor = await self._worker(handle)
        except TerminalError:
            return
        offset, pending = 0, ""
        last: collections.deque[str] = collections.deque(maxlen=tail or None)
        while True:
            try:
                data, offset = await self._call(ray, actor.read_job_log.remote(job_id, offset))
            except Exception:
                break
            lines = (pending + data.decode(errors="replace")).split("\n")
            pending = lines.pop()
            for line in lines:
                if tail and not follow:
                    last.append(line + "\n")
                else:
                    yield line + "\n"
            if not data:
                if not follow:
                    break
                await asyncio.sleep(0.5)
        for line in last:
            yield line
        if pending:
            yield pending

    async def terminate(self, handle: str | None, launch_token: str) -> None:
        ray = await self._ray()
        name = ACTOR_PREFIX + launch_token
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return  # never started, or already gone
        # If the node is gone or the call hangs, killing the actor is enough.
        with contextlib.suppress(Exception):
            await self._call(ray, actor.stop.remote(self.grace_seconds), self.grace_seconds + 10)
        await asyncio.to_thread(ray.kill, actor, no_restart=True)

    async def sweep(self, known_tokens: set[str]) -> int:
        """Kill actors of ours that no replica row knows (orphans)."""
        try:
            ray = await self._ray()
        except TransientError:
            return 0
        names = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        killed = 0
        for entry in names:
            name = entry["name"] if isinstance(entry, dict) else entry
            ns = entry.get("namespace") if isinstance(entry, dict) else NAMESPACE
            token = name.removeprefix(ACTOR_PREFIX)
            if (
                ns == NAMESPACE
                and name.startswith(ACTOR_PREFIX)
                and token.startswith(self.home_id)
                and token not in known_tokens
            ):
                await self.terminate(None, token)
                killed += 1
        return killed

    def forget_service(self, service: str) -> None:
        self._launch_options.pop(service, None)

    async def logs(
        self,
        service: str,
        replica_id: ReplicaId,
        follow: bool,
        handle: str | None = None,
        tail: int | None = None,
    ) -> AsyncIterator[str]:
        if tail is not None and not follow:
            last: collections.deque[str] = collections.deque(maxlen=tail)
            async for line in self.logs(service, replica_id, False, handle):
                last.append(line)
            for line in last:
                yield line
            return
        if not handle:
            return
        ray = await self._ray()
        try:
            actor = ray.get_actor(json.loads(handle)["actor"], namespace=NAMESPACE)
        except ValueError:
            return
        offset, lines = 0, LineSplitter()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # (chunks cut characters)
        while True:
            try:
                data, offset = await self._call(ray, actor.read_log.remote(offset))
            except Exception:
                return
            for line in lines.feed(utf8.decode(data)):
                yield line
            if not data:
                if not follow:
                    for line in lines.end():
                        yield line
                    return
                await asyncio.sleep(0.5)
