"""`Controller`: owns the store, the infra, the load-balancer manager and one reconciler per
service, and offers the operations the REST API exposes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import httpx

from fleetserve.controller import updates
from fleetserve.controller.executor import uses_own_network
from fleetserve.controller.history import History
from fleetserve.controller.lb_manager import LbManager
from fleetserve.controller.leadership import Leadership
from fleetserve.controller.metrics import ControllerMetrics
from fleetserve.controller.pools import STATE_KEY as POOL_STATE_KEY
from fleetserve.controller.probe_client import ProbeClient
from fleetserve.controller.prober import Prober
from fleetserve.controller.reconciler import ServiceReconciler
from fleetserve.controller.replica_metrics import MetricsClient
from fleetserve.controller.scaling import STATE_KEY
from fleetserve.controller.settings import Settings
from fleetserve.controller.spot import STATE_KEY as SPOT_STATE_KEY
from fleetserve.controller.spot import zone_marks
from fleetserve.core.clock import Clock, SystemClock
from fleetserve.core.errors import Conflict, InvalidSpec, NotFound, Standby, StorageFull
from fleetserve.core.service_status import service_status
from fleetserve.core.status import ReplicaStatus, ServiceStatus
from fleetserve.core.types import (
    JobRecord,
    JobStatus,
    ReplicaId,
    ReplicaRecord,
    ServicePhase,
    ServiceRecord,
    TerminationCause,
)
from fleetserve.infra.base import Infra, WatchesExits
from fleetserve.infra.host import elsewhere, host_id
from fleetserve.infra.jobs import JobRunner
from fleetserve.infra.local import LocalInfra
from fleetserve.infra.zones import Held
from fleetserve.lb.messages import LoadReport
from fleetserve.oshelpers.files import disk_full, rotate_log, while_alive
from fleetserve.spec.admission import check_deployable, resolve_paths, service_name
from fleetserve.spec.exposure import exposure_warning, override_host
from fleetserve.spec.loader import parse_spec
from fleetserve.spec.models import FLEETSERVE_INFRAS, ServiceTask
from fleetserve.store import Store
from fleetserve.store.db import MAX_JOBS_PER_LAUNCH, STORE_FAILURES, failure_text

log = logging.getLogger("fleetserve.controller")
LOG_CHECK_SECONDS = 5.0  # how often log sizes are checked against the cap
LOG_RECHECK_SECONDS = 1.0  # ... while a log grows past the whole cap between two checks
LOG_EVENTS_KEPT = 100  # disk-full events waiting for the database to take writes again
MAX_CACHED_SPECS = 4096  # parsed specs kept (each a few KiB); past it the cache starts anew


def _base_dir(given: str | None) -> Path:
    """The folder a spec's relative paths start from: the caller's (the API refuses a relative
    one), else this controller's current folder, which may have been removed since it
    started."""
    if given:
        return Path(given)
    try:
        return Path.cwd()
    except FileNotFoundError:
        raise InvalidSpec(
            "base_dir: not given, and the controller's current folder no longer exists: "
            "send base_dir (the absolute folder relative paths start from)"
        ) from None


class Controller:
    def __init__(
        self,
        settings: Settings,
        clock: Clock | None = None,
        infra: Infra | None = None,
        store: Store | None = None,
        replica_umask: int | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        # Refuses an empty, corrupt, foreign or newer database before anything is touched.
        self.store = store or Store.open(settings.db_path, settings.store_url())
        # With high availability on PostgreSQL, controllers of other homes (other hosts) join
        # the database's home id; each touches only the processes of its own host.
        self.home_id = self.store.claim_home(settings.home, join=settings.ha)
        self.host = host_id()
        legacy = self.store.legacy_home()
        self.infra: Infra = infra or LocalInfra(
            settings.home,
            grace_seconds=settings.terminate_grace,
            home_id=self.home_id,
            umask=replica_umask,
            legacy_home=legacy,
            replica_net=settings.replica_net,
            replica_netns=settings.replica_netns,
            zones=list(settings.local_zones),
            host=self.host,
            cgroups=settings.cgroups,
        )
        self.infras: dict[str, Infra] = {self.infra.name: self.infra}  # more made on first use
        self._watch_exits(self.infra)
        self.http = httpx.AsyncClient(trust_env=False)
        # Every service's readiness probes: kept-alive connections, bounded concurrency.
        self.probes = ProbeClient()
        # Every service's reads of its replicas' metrics (autoscaling): the same connections.
        self.replica_metrics = MetricsClient(self.probes)
        self.lb = LbManager(settings, self.http, self.home_id, legacy, host=self.host)
        # GET /metrics (docs/metrics.md): counts the store's replica transitions from now on.
        self.metrics = ControllerMetrics(self.store, active=lambda: self.role == "active")
        self.reconcilers: dict[str, ServiceReconciler] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._housekeeping: asyncio.Task[None] | None = None
        self._log_events: list[tuple[str, float, str]] = []  # (service, at, message) to record
        self._specs: dict[tuple[str, float, int], ServiceTask] = {}  # parsed, by version
        # With FLEETSERVE_HA: the lease that decides whether this controller acts.
        self.leadership: Leadership | None = None
        self._leading: asyncio.Task[None] | None = None

    def infra_for(self, name: str) -> Infra:
        """The infra of that name: local, or ray (connected on first use)."""
        kind = name.split("/")[0]
        if kind not in self.infras:
            if kind != "ray":
                raise InvalidSpec(f"resources.infra: no infra called {name!r}")
            from fleetserve.infra.ray import RayInfra

            self.infras[kind] = RayInfra(
                grace_seconds=self.settings.terminate_grace, home_id=self.home_id
            )
            self._watch_exits(self.infras[kind])
        return self.infras[kind]

    def _watch_exits(self, infra: Infra) -> None:
        """An infra that reports a replica's end at once (`WatchesExits`) wakes the service's
        reconciler: the replica leaves the LB's set within a round, not a reconcile interval."""
        if hasattr(infra, "watch_exits"):
            cast(WatchesExits, infra).watch_exits(self._replica_ended)

    def _replica_ended(self, service: str, replica_id: ReplicaId) -> None:
        rec = self.reconcilers.get(service)
        if rec is not None:
            rec.wake.set()

    def service_infra(self, name: str) -> Infra:
        """The infra a service's replicas run on (its spec's `resources.infra`)."""
        spec = self.spec_of(self.store.service(name))
        infra = self.infra_for(spec.requested_infra() or self.infra.name)
        infra.prepare(name, spec.resources.candidates()[0].model_dump(exclude_none=True))
        return infra

    @property
    def role(self) -> str:
        """The role of this controller: "active" (the only one, or the lease holder) or
        "standby"."""
        if self.leadership is None or self.leadership.active:
            return "active"
        return "standby"

    def check_active(self) -> None:
        """Raise Standby, naming where writes go, unless this controller acts."""
        if self.leadership is None or self.leadership.active:
            return
        active = self.leadership.active_address()
        raise Standby(
            "this controller is a standby; "
            + (
                f"the active controller is at {active}"
                if active
                else "no controller is active right now (a standby takes over within seconds)"
            ),
            active=active,
        )

    async def start(self) -> None:
        if not self.settings.ha:
            await self._take_over()
            return
        self.leadership = Leadership(
            self.store,
            self.clock,
            self.settings.advertised_url,
            ttl=self.settings.lease_ttl,
        )
        self._leading = asyncio.create_task(
            self.leadership.run(self._take_over, self._step_down), name="leadership"
        )

    async def _step_down(self) -> None:
        """The lease is lost: stop acting (replicas and load balancers keep running for the
        controller that holds it now)."""
        await self._stop_reconcilers()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            self._housekeeping = None

    async def _stop_reconcilers(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for name, task in list(self._tasks.items()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            await self.reconcilers[name].stop()
        self._tasks.clear()
        self.reconcilers.clear()

    async def _take_over(self) -> None:
        """Start acting: what a restart does (adopt what the store names, sweep the rest).

        Only as the active controller: processes of this home on this host that the rows
        record on another host (this host's controller lost a takeover while they ran) are
        stale, and stopped with the orphans; another host's processes are never touched."""
        services = self.store.list_services()
        rows = [r for s in services for r in self.store.list_replicas(s.name)]
        tokens = {r.launch_token for r in rows if not elsewhere(r.host, self.host)}
        kinds = {self.infra.name} | {r.infra for r in rows}
        orphans = 0
        for kind in sorted(kinds):
            orphans += await self.infra_for(kind).sweep(tokens)
        stray_lbs = await self.lb.sweep(services)
        if orphans or stray_lbs:
            log.warning("stopped %s orphaned replica and %s stray LB processes", orphans, stray_lbs)
        for svc in services:
            self._run(svc.name)
        self._housekeeping = asyncio.create_task(self._rotate_logs(), name="housekeeping")

    async def _rotate_logs(self) -> None:
        """Every log of this home (replicas, load balancers, the controller's own) stays under
        the cap, keeping its newest lines; checked again sooner while one outgrows it."""
        while True:
            busy = False
            try:
                busy = await self.rotate_logs_once()
            except Exception as e:  # never let housekeeping end the controller
                log.warning("log rotation failed: %s", failure_text(e))
            await asyncio.sleep(LOG_RECHECK_SECONDS if busy else LOG_CHECK_SECONDS)

    async def rotate_logs_once(self) -> bool:
        """One pass over the logs; True if one was past the whole cap (it grows fast).

        A log rotated on a full disk (no room to copy it first) is emptied in place: the
        service it belongs to gets an event that says so and how much of its end was kept.
        While the disk is full, whoever filled it, logs under the cap are rotated too."""
        cap = self.settings.log_cap_bytes
        logs_dir = self.settings.logs_dir
        busy = False
        logs = await asyncio.to_thread(
            lambda: sorted(p for p in logs_dir.rglob("*.log") if not p.is_symlink())
        )
        full = await asyncio.to_thread(disk_full, logs_dir)  # whoever filled it
        for path in logs:
            try:
                done = await asyncio.to_thread(rotate_log, path, cap, full)
            except OSError as e:
                log.warning("cannot rotate %s: %s", path, e.strerror or e)
                continue
            if done is None:
                continue
            busy = busy or done.size > cap or full
            if not done.full_disk:
                log.info(
                    "rotated %s (%s bytes, %s kept in %s.1)", path, done.size, done.kept, path.name
                )
                continue
            kept = (
                f"its last {done.kept} bytes are in {path.name}.1"
                if done.kept
                else "nothing of it could be kept"
            )
            message = (
                f"disk full: log {path.name} ({done.size} bytes) was truncated without a "
                f"copy; {kept}"
            )
            log.warning("%s: %s", path, message)
            parts = path.relative_to(logs_dir).parts
            if len(parts) == 2:
                self._log_events.append((parts[0], self.clock.now(), message))
        self._record_log_events()
        return busy

    def _record_log_events(self) -> None:
        """The disk-full events not recorded yet (the room a truncation freed can go to
        another writer first): kept, at most LOG_EVENTS_KEPT, and tried again each pass."""
        del self._log_events[:-LOG_EVENTS_KEPT]
        while self._log_events:
            service, at, message = self._log_events[0]
            try:
                if self.store.get_service(service) is not None:
                    self.store.add_event(service, at, "service", message)
            except Exception as e:
                log.warning(
                    "service %s: an event waits for the database: %s", service, failure_text(e)
                )
                return
            self._log_events.pop(0)

    async def stop(self) -> None:
        if self._leading is not None:
            self._leading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._leading
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        await self._stop_reconcilers()
        if self.leadership is not None:
            await asyncio.to_thread(self.leadership.release)  # a standby takes over at once
        await self.http.aclose()
        await self.probes.aclose()
        self.store.close()

    def _run(self, name: str) -> ServiceReconciler:
        task = self._tasks.get(name)
        if task is not None and not task.done():
            return self.reconcilers[name]
        rec = ServiceReconciler(
            name,
            self.store,
            self.service_infra(name),
            self.lb,
            Prober(self.probes),  # one per service: probe results never cross services
            self.settings,
            self.clock,
            self.home_id,
            metrics=self.metrics,
            metrics_client=self.replica_metrics,
        )
        self.reconcilers[name] = rec
        self._tasks[name] = asyncio.create_task(rec.run(), name=f"reconcile-{name}")
        return rec

    # -- operations ------------------------------------------------------------------------

    def create_service(
        self,
        yaml_text: str,
        name: str | None = None,
        base_dir: str | None = None,
        infra: str | None = None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
        host: str | None = None,
        pool: bool = False,
    ) -> ServiceRecord:
        spec = parse_spec(yaml_text, envs=envs, secrets=secrets)
        if (spec.service.pool is not None) != pool:
            raise InvalidSpec(
                "this is a pool YAML (top-level pool:): create it with `fleetserve pool apply "
                "-p NAME FILE`"
                if spec.service.pool is not None
                else "not a pool YAML: it needs a top-level `pool:` section"
            )
        if infra is not None and infra.split("/")[0] not in FLEETSERVE_INFRAS:
            raise InvalidSpec(
                f"infra {infra!r} is not available; supported: {', '.join(FLEETSERVE_INFRAS)}"
            )
        if infra is not None:  # `up --infra NAME` overrides the YAML's resources.infra
            spec = spec.model_copy(
                update={"resources": spec.resources.model_copy(update={"infra": infra})}
            )
        if host is not None:  # `up --host ADDRESS` overrides service.load_balancer.host
            spec = override_host(spec, host)
        check_deployable(spec, self.infra.name, self.settings.replica_netns)
        spec = resolve_paths(spec, _base_dir(base_dir))
        svc_name = service_name(name, spec)
        self.check_fixed_port(svc_name, spec)
        existing = self.store.get_service(svc_name)
        if existing is not None:
            hint = (
                "it is still shutting down"
                if existing.phase is ServicePhase.SHUTTING_DOWN
                else "choose another name with -n, or `fleetserve down` it first"
            )
            raise Conflict(f"service {svc_name!r} already exists: {hint}")
        svc = self.store.create_service(
            svc_name, yaml_text, spec.model_dump_json(), self.clock.now()
        )
        warning = exposure_warning(spec, self.infra.name)
        if spec.service.pool is not None and spec.run is not None:
            # As `sky jobs pool apply` does: its workers run the jobs' commands.
            warning = "run: ignored in a pool (its jobs bring their own `run`)"
        if warning is not None:
            log.warning("service %s: %s", svc_name, warning)
            self.store.add_event(svc_name, self.clock.now(), "service", warning)
        self._run(svc_name)
        return svc

    def check_fixed_port(self, name: str, spec: ServiceTask) -> None:
        """A fixed replica port (`service.ports`) belongs to one service: a second one would
        probe, and send traffic to, the first one's replica."""
        port = spec.replica_port()
        if port is None or uses_own_network(spec):
            return  # a replica in a network namespace of its own binds no host port
        for other in self.store.list_services():
            if other.name == name:
                continue
            theirs = self.spec_of(other)
            if theirs.replica_port() == port and not uses_own_network(theirs):
                raise Conflict(
                    f"port {port} (service.ports) is already the fixed port of service "
                    f"{other.name!r}: give this service another port, or none ($PORT)"
                )

    def update_service(
        self,
        name: str,
        yaml_text: str,
        base_dir: str | None = None,
        mode: str = "rolling",
        traffic_percent: int | None = None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
        force_in_place: bool = False,
    ) -> ServiceRecord:
        svc = self.store.service(name)
        current = self.spec_of(svc)
        new = parse_spec(yaml_text, envs=envs, secrets=secrets)
        if (new.service.pool is None) != (current.service.pool is None):
            kind = "a pool" if current.service.pool is not None else "a service"
            raise Conflict(
                f"{name!r} is {kind}; an update cannot make it a "
                f"{'service' if current.service.pool is not None else 'pool'} "
                "(take it down and create the other kind under another name)"
            )
        self.check_fixed_port(name, new)
        svc, _in_place = updates.apply_update(
            self.store,
            svc,
            current,
            yaml_text,
            _base_dir(base_dir),
            mode,
            traffic_percent,
            self.infra.name,
            self.clock.now(),
            netns_mode=self.settings.replica_netns,
            envs=envs,
            secrets=secrets,
            force_in_place=force_in_place,
        )
        self._run(name).wake.set()
        return svc

    def rollback(self, name: str) -> ServiceRecord:
        svc = updates.rollback(self.store, self.store.service(name), self.clock.now())
        self._run(name).wake.set()
        return svc

    def promote(self, name: str) -> ServiceRecord:
        svc = updates.promote(self.store, self.store.service(name), self.clock.now())
        self._run(name).wake.set()
        return svc

    async def delete_pool(
        self, name: str, purge: bool = False, cancel: bool = False
    ) -> ServiceRecord:
        """`pool down`: refused while jobs are queued or running, unless `cancel`."""
        self.pool(name)
        if cancel:
            await self.cancel_jobs(pool=name)
        return self.delete_service(name, purge)

    def _refuse_with_jobs(self, name: str) -> None:
        """A pool with queued or running jobs is not taken down (`pool down --cancel-jobs`)."""
        active = self.store.list_jobs(pool=name, statuses=(JobStatus.PENDING, JobStatus.RUNNING))
        if active:
            ids = ", ".join(str(j.job_id) for j in active[:10])
            more = f" and {len(active) - 10} more" if len(active) > 10 else ""
            raise Conflict(
                f"pool {name!r} has {len(active)} unfinished jobs ({ids}{more}): wait for them, "
                f"cancel them (`fleetserve jobs cancel -p {name}`), or "
                f"`fleetserve pool down {name} --cancel-jobs`"
            )

    async def down_service(self, name: str, purge: bool = False) -> ServiceRecord:
        """`down`: recorded in the store, the reconciler then stops and removes everything.
        When the store refuses the write (a full disk), the service's processes are stopped
        anyway, now, and the down is recorded once the store takes writes again; the caller
        is told so (StorageFull)."""
        try:
            return self.delete_service(name, purge)
        except STORE_FAILURES as e:
            failure = e
        svc = self.store.service(name)  # reads work on a full disk
        rec = self._run(name)
        rec.down_pending = bool(rec.down_pending) or purge or svc.purge
        await rec.stop_processes()
        rec.wake.set()
        problem = self.storage_problem(failure)
        log.warning("service %s: down not recorded (%s): its processes were stopped", name, problem)
        raise StorageFull(
            f"{problem}: the processes of {name} were stopped (replicas, "
            "load balancer); its removal is recorded once the database can be written"
        ) from None

    def storage_problem(self, e: Exception) -> str:
        """What a refused write says, in one line."""
        if isinstance(e, OSError):
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return f"disk is full: {e.filename or self.settings.home}"
            return f"{e.strerror or e}: {e.filename or self.settings.home}"
        text = failure_text(e)
        if "full" in text or "No space left" in text:  # SQLite's words; PostgreSQL's
            return f"database or disk is full: {self.store.where}"
        return f"the database failed: {text}"

    def delete_service(self, name: str, purge: bool = False) -> ServiceRecord:
        svc = self.store.service(name)
        if self.spec_of(svc).service.pool is not None:
            self._refuse_with_jobs(name)
        svc = self.store.update_service(
            name, self.clock.now(), phase=ServicePhase.SHUTTING_DOWN, purge=purge or svc.purge
        )
        self.store.add_event(name, self.clock.now(), "service", "down requested")
        self._run(name).wake.set()
        return svc

    def terminate_replica(self, name: str, replica_id: ReplicaId, purge: bool = False) -> None:
        self.store.service(name)
        rec = self.store.replica(name, replica_id)
        reconciler = self._run(name)
        if rec.status.is_terminal and rec.status is not ReplicaStatus.FAILED_CLEANUP:
            if not purge:
                raise Conflict(
                    f"replica {replica_id} has already ended ({rec.status}); add --purge to "
                    "remove its row"
                )
            self.store.delete_replica(name, replica_id, self.clock.now(), "replica row purged")
            return
        if rec.status is ReplicaStatus.SHUTTING_DOWN:
            if purge and not rec.purge:  # its teardown, under way, reads it (executor)
                self.store.update_replica(rec, self.clock.now(), purge=True)
            return
        reconciler.executor.terminate(
            rec,
            rec.status,
            "terminated by user",
            TerminationCause.USER,
            drain_seconds=self.settings.drain_seconds,
            purge=purge,  # its row goes even if its teardown fails
        )
        reconciler.wake.set()

    # -- chaos (the local infra's fault injection) ------------------------------------------

    def _local(self) -> LocalInfra:
        if not isinstance(self.infra, LocalInfra):
            raise Conflict(f"chaos needs the local infra (this controller's is {self.infra.name})")
        return self.infra

    def _woken_by(self, lost: list[Held]) -> list[dict[str, object]]:
        """Wake the reconcilers of the services that lost replicas: PREEMPTED and out of the
        load balancer's set within a round."""
        for held in lost:
            rec = self.reconcilers.get(held.service)
            if rec is not None:
                rec.wake.set()
        return [
            {"service": h.service, "replica_id": h.replica_id, "zone": h.zone, "spot": h.spot}
            for h in lost
        ]

    def chaos_preempt(
        self, name: str, replica_id: ReplicaId | None = None, zone: str | None = None
    ) -> list[dict[str, object]]:
        """Preempt one replica of a service, or every spot replica it has in a zone."""
        infra = self._local()
        self.store.service(name)
        if replica_id is not None:
            self.store.replica(name, replica_id)
        lost = infra.preempt(name, replica_id, zone)
        for held in lost:
            self.store.add_event(
                name,
                self.clock.now(),
                "chaos",
                f"replica {held.replica_id} preempted by `fleetserve chaos` (zone {held.zone})",
                held.replica_id,
            )
        return self._woken_by(lost)

    def chaos_capacity(self, capacity: dict[str, int | None]) -> list[dict[str, object]]:
        """New spot capacity for zones (a replayed trace): zones below what they hold preempt
        their newest spot replicas; full zones refuse spot launches."""
        infra = self._local()
        for zone in capacity:
            infra.zones.config(zone)  # every zone is checked before any changes
        lost: list[Held] = []
        for zone, n in capacity.items():
            lost += infra.set_spot_capacity(zone, n)
        for held in lost:
            if self.store.get_service(held.service) is not None:
                self.store.add_event(
                    held.service,
                    self.clock.now(),
                    "chaos",
                    f"replica {held.replica_id} preempted: zone {held.zone}'s spot capacity "
                    f"fell to {capacity[held.zone]}",
                    held.replica_id,
                )
        return self._woken_by(lost)

    def zones(self) -> list[dict[str, object]]:
        """The infra's zones: capacity, what is held, prices (local infra)."""
        if isinstance(self.infra, LocalInfra):
            return self.infra.zones.describe()
        return [
            {"zone": loc.zone, "spot_capable": loc.spot_capable} for loc in self.infra.locations()
        ]

    def placer_of(self, name: str) -> dict[str, object] | None:
        """A spot service's placer and its zone marks (from the store: what a restart keeps)."""
        saved = self.store.get_policy_state(name, SPOT_STATE_KEY)
        if not saved:
            return None
        state = saved.get("state") if isinstance(saved.get("state"), dict) else {}
        placer = str(saved.get("placer", ""))
        return {"placer": placer, "state": state, "summary": zone_marks(placer, state or {})}

    # -- pools and jobs (docs/pools.md) -----------------------------------------------------

    def pool(self, name: str) -> ServiceRecord:
        svc = self.store.get_service(name)
        if svc is None or self.spec_of(svc).service.pool is None:
            raise NotFound(f"no pool called {name!r}")
        return svc

    def apply_pool(
        self,
        name: str,
        yaml_text: str | None,
        workers: int | None = None,
        base_dir: str | None = None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> tuple[ServiceRecord, str, str | None]:
        """Create a pool, or update one in place: a new size (`workers`), or a new YAML whose
        workers roll over as they finish their jobs. Returns the pool, what was done and a
        note for the user (a resize that ended the pool's autoscaling), if any."""
        existing = self.store.get_service(name)
        resized_from = None
        if yaml_text is None:
            if existing is None:
                raise NotFound(f"no pool called {name!r}: give a pool YAML to create it")
            yaml_text = self.store.version(name, existing.active_version).yaml_text
            resized_from = existing.active_version
        data_spec = parse_spec(yaml_text, envs=envs, secrets=secrets)
        if data_spec.service.pool is None:
            raise InvalidSpec("not a pool YAML: it needs a top-level `pool:` section")
        fixed_from: str | None = None
        if workers is not None:
            if not 0 <= workers <= 1000:
                raise InvalidSpec(f"--workers {workers}: within 0..1000")
            lo, hi = data_spec.service.fleet_bounds()
            if lo != hi:  # said, not done silently: the YAML's range gives way to a fixed size
                fixed_from = (
                    f"--workers {workers} fixes the pool's size: it no longer autoscales "
                    f"between {lo} and {hi} workers (apply a YAML with min_workers and "
                    "max_workers to bring that back)"
                )
            yaml_text = _with_workers(yaml_text, workers)
        if existing is None:
            svc = self.create_service(
                yaml_text, name, base_dir, envs=envs, secrets=secrets, pool=True
            )
            return svc, "created", fixed_from
        if self.spec_of(existing).service.pool is None:
            raise Conflict(f"{name!r} is a service, not a pool")
        resize_only = resized_from is not None
        svc = self.update_service(
            name, yaml_text, base_dir, envs=envs, secrets=secrets, force_in_place=resize_only
        )
        return svc, "resized in place" if resize_only else "updated", fixed_from

    def launch_jobs(
        self,
        pool: str,
        yaml_text: str,
        num_jobs: int = 1,
        envs: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> list[JobRecord]:
        from fleetserve.controller.executor import new_launch_token
        from fleetserve.policies.jobs import job_slots
        from fleetserve.spec.jobs import amount, parse_job

        svc = self.pool(pool)
        if svc.phase is ServicePhase.SHUTTING_DOWN:
            raise Conflict(f"pool {pool!r} is shutting down")
        ready = any(r.status is ReplicaStatus.READY for r in self.store.list_replicas(pool))
        if svc.launch_stop and not ready:
            raise Conflict(
                f"pool {pool!r} cannot start workers ({svc.launch_stop}); fix it with "
                f"`fleetserve pool apply -p {pool} FILE`"
            )
        if not 1 <= num_jobs <= MAX_JOBS_PER_LAUNCH:
            raise InvalidSpec(f"--num-jobs {num_jobs}: within 1..{MAX_JOBS_PER_LAUNCH}")
        job = parse_job(yaml_text, envs)
        worker = self.spec_of(svc).resources.candidates()[0]
        try:
            slots = job_slots(
                amount(worker.cpus), amount(worker.accelerators), job.cpus, job.accelerators
            )
        except ValueError as e:
            raise InvalidSpec(f"job YAML: resources: {e}") from None
        tokens = [new_launch_token(self.home_id) for _ in range(num_jobs)]
        jobs = self.store.add_jobs(
            pool, name or job.name, job.run, job.envs, num_jobs, slots, tokens, self.clock.now()
        )
        for note in job.notes:
            self.store.add_event(pool, self.clock.now(), "jobs", f"job YAML: {note}")
        self._run(pool).wake.set()
        return jobs

    async def cancel_jobs(
        self, ids: list[int] | None = None, pool: str | None = None
    ) -> list[JobRecord]:
        """Cancel jobs by id, or every unfinished job of a pool. A job is CANCELLED first (a
        finish racing with it loses), then its processes are stopped. Returns the jobs
        cancelled (those already finished are left as they are)."""
        if ids is None and pool is None:
            raise InvalidSpec("name job ids, or a pool with --all")
        if ids is not None:
            jobs = [self.store.get_job(i) for i in ids]
        else:
            self.pool(pool or "")
            active = (JobStatus.PENDING, JobStatus.RUNNING)
            jobs = self.store.list_jobs(pool=pool, statuses=active)
        done = []
        # Queued ones first, so that none of them starts on a worker a cancel frees.
        for job in sorted(jobs, key=lambda j: j.status is not JobStatus.PENDING):
            new = None
            for _ in range(3):  # it may start (or end) between the read and the write
                if job.status.is_terminal:
                    break
                now = self.clock.now()
                new = self.store.update_job(
                    job,
                    now,
                    expect=job.status,
                    status=JobStatus.CANCELLED,
                    reason="cancelled by user",
                    ended_at=now,
                )
                if new is not None:
                    break
                job = self.store.get_job(job.job_id)
            if new is None:
                continue  # it ended meanwhile
            done.append(new)
            if job.status is JobStatus.RUNNING:
                runner = self.service_infra(job.pool) if self.store.get_service(job.pool) else None
                if runner is not None and hasattr(runner, "stop_job"):
                    await cast(JobRunner, runner).stop_job(job.handle, job.launch_token)
            rec = self.reconcilers.get(job.pool)
            if rec is not None:
                rec.wake.set()
        return done

    def job_logs(self, job_id: int, follow: bool, tail: int | None = None) -> AsyncIterator[str]:
        job = self.store.get_job(job_id)
        if job.status is JobStatus.PENDING and not follow:
            raise Conflict(f"job {job_id} has not started yet (PENDING)")
        runner: Infra = self.infra
        if self.store.get_service(job.pool) is not None:
            runner = self.service_infra(job.pool)
        if not hasattr(runner, "job_logs"):
            raise Conflict(f"the {runner.name} infra keeps no job logs")
        lines = cast(JobRunner, runner).job_logs(job.pool, job.job_id, job.handle, follow, tail)
        return self._until_job_ends(job_id, lines) if follow else lines

    async def _until_job_ends(self, job_id: int, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """A followed job log ends once the job has ended and its last lines are read."""
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1000)

        async def pump() -> None:
            try:
                async for line in lines:
                    await queue.put(line)
            finally:
                await queue.put(None)

        task = asyncio.create_task(pump())
        try:
            quiet = 0
            while True:
                try:
                    line = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    ended = self.store.get_job(job_id).status.is_terminal
                    quiet = quiet + 1 if ended else 0
                    if quiet >= 2:  # ended, and a second with nothing more to read
                        return
                    continue
                if line is None:
                    return
                yield line
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def wake(self, name: str) -> None:
        """The load balancer holds a request and no replica is ready: scale up from zero now."""
        self.store.service(name)
        self._run(name).wake.set()  # its next round reads the held request in the LB's report

    def target_of(
        self, name: str, default: int, states: Mapping[str, dict[str, Any]] | None = None
    ) -> int:
        """The autoscaler's target; `states`: every service's, read at once by the caller."""
        state = self.store.get_policy_state(name, STATE_KEY) if states is None else states.get(name)
        return int(state["target"]) if state else default

    def pool_target_of(
        self, name: str, default: int, states: Mapping[str, dict[str, Any]] | None = None
    ) -> int:
        if states is None:
            state = self.store.get_policy_state(name, POOL_STATE_KEY)
        else:
            state = states.get(name)
        return int(state["target"]) if state and isinstance(state.get("target"), int) else default

    def history_of(self, name: str) -> History | None:
        """The service's last hour for the dashboard's charts (None before its first round)."""
        rec = self.reconcilers.get(name)
        return None if rec is None else rec.history

    def load_report(self, name: str) -> LoadReport | None:
        self.store.service(name)
        rec = self.reconcilers.get(name)
        return None if rec is None else rec.scaler.load

    # -- views -----------------------------------------------------------------------------

    def spec_of(self, svc: ServiceRecord) -> ServiceTask:
        """The active version's spec. A version never changes once stored, so each is read
        and parsed once (keyed with the service's creation time: a service taken down and
        made again under its name starts its versions anew)."""
        key = (svc.name, svc.created_at, svc.active_version)
        spec = self._specs.get(key)
        if spec is None:
            raw = self.store.version(svc.name, svc.active_version).spec_json
            spec = ServiceTask.model_validate_json(raw)
            if len(self._specs) >= MAX_CACHED_SPECS:
                self._specs.clear()
            self._specs[key] = spec
        return spec

    def status_of(self, svc: ServiceRecord, replicas: list[ReplicaRecord]) -> ServiceStatus:
        return service_status(svc, replicas, self.spec_of(svc))

    def replica_logs(
        self, name: str, replica_id: ReplicaId, follow: bool, tail: int | None = None
    ) -> AsyncIterator[str]:
        self.store.service(name)
        if self.store.get_replica(name, replica_id) is None and not self._log_exists(
            name, f"replica-{replica_id}.log"
        ):
            raise NotFound(f"service {name!r} has no replica {replica_id}")
        row = self.store.get_replica(name, replica_id)
        infra = self.infra_for(row.infra) if row else self.infra
        if row is None or row.status.is_terminal:
            follow = False  # it has ended: its log will not grow (`logs` follows by default)
        lines = infra.logs(name, replica_id, follow, row.handle if row else None, tail)
        if not follow:
            return lines

        def alive() -> bool:  # (a follow ends with its replica, terminated or taken down)
            now = self.store.get_replica(name, replica_id)
            return now is not None and not now.status.is_terminal

        return while_alive(lines, alive)

    def service_alive(self, name: str) -> Callable[[], bool]:
        """Whether the service still exists, for a follow of its logs to end with it."""
        return lambda: self.store.get_service(name) is not None

    def _log_exists(self, name: str, file: str) -> bool:
        return (self.settings.logs_dir / name / file).exists()

    def log_file(self, which: str, name: str | None) -> Path:
        if which == "controller":
            return self.settings.controller_log
        if name is None:
            raise InvalidSpec("a service name is needed for its load-balancer log")
        self.store.service(name)
        return self.settings.logs_dir / name / "load-balancer.log"


def _with_workers(yaml_text: str, workers: int) -> str:
    """The pool YAML with `pool.workers` set (`pool apply --workers N`): the fixed form."""
    from fleetserve.spec.yaml_bounded import read_yaml

    data = read_yaml(yaml_text, "pool YAML")
    import yaml as _yaml

    pool = {"workers": workers}
    if isinstance(data, dict) and isinstance(data.get("pool"), dict):
        data["pool"] = pool
    elif isinstance(data, dict) and isinstance(data.get("service"), dict):
        data["service"]["pool"] = pool
    return str(_yaml.safe_dump(data, sort_keys=False))
