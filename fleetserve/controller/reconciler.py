"""One reconciler per service: observe -> plan (pure) -> act, about once a second.

Every round reads the world afresh (rows, infra state, probe results), so a missed wake-up or
a restart loses nothing: the next round sees the same facts and makes the same decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Mapping
from typing import cast

from fleetserve.controller.executor import Executor, new_launch_token
from fleetserve.controller.history import History
from fleetserve.controller.lb_manager import LbManager, upstream_payload
from fleetserve.controller.logtail import log_tail, with_tail
from fleetserve.controller.metrics import ControllerMetrics
from fleetserve.controller.pools import PoolRunner
from fleetserve.controller.prober import Prober
from fleetserve.controller.replica_metrics import MetricsClient, MetricsTransport, ReplicaMetrics
from fleetserve.controller.scaling import Scaler
from fleetserve.controller.settings import Settings
from fleetserve.controller.spot import DEFAULT_PLACER, SpotPlacement
from fleetserve.core.clock import Clock
from fleetserve.core.errors import FleetserveError, TerminalError
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import (
    Endpoint,
    ReplicaChanges,
    ReplicaId,
    ReplicaKey,
    ReplicaRecord,
    ServicePhase,
    ServiceRecord,
    TerminationCause,
    deletes_row,
)
from fleetserve.infra.base import Infra, InstanceKind
from fleetserve.infra.host import elsewhere, host_of
from fleetserve.infra.jobs import JobRunner
from fleetserve.infra.zones import NoCapacity
from fleetserve.lb.config import LbConfig
from fleetserve.lb.messages import Canary
from fleetserve.lb.wake import wake_token
from fleetserve.oshelpers.ports import free_port, port_free
from fleetserve.policies.autoscaler import (
    FallbackTargets,
    SignalReading,
    metric_key,
    per_replica_qps,
)
from fleetserve.policies.fleet import (
    Action,
    CreateReplicas,
    DeleteRow,
    FleetSettings,
    InstanceObservation,
    Observation,
    ProbeResult,
    SetStatus,
    StartLaunch,
    Terminate,
    plan_fleet,
    plan_shutdown,
    routable,
)
from fleetserve.policies.rollout import BLUE_GREEN, ROLLING, RolloutSettings
from fleetserve.spec.exposure import lb_host
from fleetserve.spec.models import ReadinessProbe, ServiceTask
from fleetserve.store import Store
from fleetserve.store.db import STORE_FAILURES, failure_text

log = logging.getLogger("fleetserve.controller")

_RUNNING = (ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.NOT_READY)
CAPACITY_BACKOFF = 1.0  # seconds before a launch of a kind that just found no capacity
CAPACITY_BACKOFF_MAX = 60.0
# A probe that cannot connect (fleetserve.controller.probe_client's label, httpx's name).
CONNECT_ERROR = "ConnectError"
LISTENERS_EVERY = 5.0  # seconds between two reads of a replica's listening ports
OBSERVE_BATCH = 250  # replicas observed between two pauses of a round (other tasks run)


def probe_interval(status: ReplicaStatus, probe: ReadinessProbe, settings: Settings) -> float:
    """Seconds between probes of one replica: the YAML's endpoint_probe_interval_seconds,
    else the controller's; a STARTING replica no less often than the starting interval."""
    steady = probe.endpoint_probe_interval_seconds or settings.probe_interval
    if status is ReplicaStatus.STARTING:
        return min(settings.starting_probe_interval, steady)
    return steady


def lb_config(
    spec: ServiceTask,
    service: str,
    port: int,
    admin_port: int,
    api_port: int,
    admin_secret: str | None = None,
    api_scheme: str = "http",
    infra: str = "local",
) -> LbConfig:
    """What a service's load balancer needs from its spec (and the secret of its admin API)."""
    lo, _hi = spec.service.replica_bounds()
    tls = spec.service.tls
    return LbConfig(
        service=service,
        host=lb_host(spec, infra),
        port=port,
        admin_port=admin_port,
        policy=spec.service.load_balancing_policy,
        options=spec.service.load_balancer,
        tls_certfile=tls.certfile if tls else None,
        tls_keyfile=tls.keyfile if tls else None,
        hold_when_empty=lo == 0,
        wake_url=f"{api_scheme}://127.0.0.1:{api_port}/api/v1/services/{service}/wake",
        admin_secret=admin_secret,
        wake_token=wake_token(admin_secret) if admin_secret else None,
    )


def _headline(reason: str | None) -> str | None:
    """A failure reason without its last part (" Last: replica N: ..."), which changes as more
    replicas fail while the failure stays the same."""
    return None if reason is None else reason.split(" Last: ", 1)[0]


def rows_after(actions: list[Action], replicas: list[ReplicaRecord]) -> list[ReplicaRecord]:
    """The round's rows as its actions leave them, as far as the routable set goes (READY of
    a serving version): statuses set, replicas leaving (SHUTTING_DOWN) or pruned; new rows are
    PENDING, never routable. Rows written meanwhile by others (a launch or a termination
    ending, `fleetserve down --replica-id`) wake the next round. A round of a 1,000-replica
    service read every row twice, once more for this."""
    status = {a.replica_id: a.status for a in actions if isinstance(a, SetStatus)}
    leaving = {a.replica_id for a in actions if isinstance(a, Terminate | DeleteRow)}
    return [
        dataclasses.replace(r, status=status[r.replica_id]) if r.replica_id in status else r
        for r in replicas
        if r.replica_id not in leaving
    ]


class ServiceReconciler:
    def __init__(
        self,
        name: str,
        store: Store,
        infra: Infra,
        lb: LbManager,
        prober: Prober,
        settings: Settings,
        clock: Clock,
        home_id: str = "",
        metrics: ControllerMetrics | None = None,
        metrics_client: MetricsClient | None = None,
    ) -> None:
        self.name = name
        self.store = store
        self.infra = infra
        self.lb = lb
        self.prober = prober  # this service's own: results never cross services
        # replica id -> (its handle, when, the ports its processes listened on then)
        self._listeners: dict[int, tuple[str, float, list[int] | None]] = {}
        self.settings = settings
        self.clock = clock
        self.home_id = home_id
        # The controller's metrics (GET /metrics); a reconciler alone counts into its own.
        self.metrics = (metrics or ControllerMetrics()).service(name)
        if metrics is not None:
            prober.metrics = metrics  # probe latency and outcomes
        self.wake = asyncio.Event()
        self.executor = Executor(
            name,
            store,
            infra,
            clock,
            settings.home,
            self.wake.set,
            launch_timeout=settings.launch_timeout,
        )
        self.finished = asyncio.Event()
        self._specs: dict[int, ServiceTask] = {}
        self.scaler = Scaler(name, store, clock, settings.autoscale_interval)
        # The READY replicas' own metrics, for a policy that scales on them (the controller's
        # client is shared by every service; alone, one over this prober's connections).
        self.replica_metrics = ReplicaMetrics(
            name, metrics_client or MetricsClient(cast(MetricsTransport, prober.transport))
        )
        self.history = History(step=settings.history_step)  # the dashboard's charts
        self._lb_checked: tuple[int, int | None] | None = None  # (version, LB pid) compared
        self.executor.inflight_of = self.scaler.inflight_of
        self.executor.lb_retiring = lambda: self.lb.retiring(self.name)
        self.executor.on_no_capacity = self._no_capacity
        self.spot: SpotPlacement | None = None  # a spot service's placer, made on first use
        self._full_until: dict[bool, float] = {}  # spot/on-demand: no launch before this
        self._full_streak: dict[bool, int] = {}
        self._full_at: dict[bool, float] = {}
        self.pool: PoolRunner | None = None  # a worker pool's jobs (docs/pools.md)
        # A `down` whose write the store refused (a full disk): its purge flag. Its processes
        # were stopped at once; until the store records it, rounds only try to.
        self.down_pending: bool | None = None

    def spec(self, version: int) -> ServiceTask:
        if version not in self._specs:
            raw = self.store.version(self.name, version).spec_json
            self._specs[version] = ServiceTask.model_validate_json(raw)
        return self._specs[version]

    # -- the loop ------------------------------------------------------------------------

    async def _sleep_or_wake(self, delay: float) -> None:
        """Until `wake` is set or `delay` seconds pass. asyncio.timeout, not wait_for: on
        Python 3.11 a wait_for whose event fires as the task is cancelled swallows the
        cancellation, and the loop went on while the controller waited for it to stop."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self.wake.wait()
        self.wake.clear()

    async def run(self) -> None:
        failures = 0
        try:
            while True:  # a store that cannot be written (a full disk): retried, one line
                try:
                    await self.recover()
                    break
                except STORE_FAILURES as e:
                    failures += 1
                    if failures == 1:
                        log.warning(
                            "service %s: recovery waits for the store: %s",
                            self.name,
                            failure_text(e),
                        )
                    delay = self.settings.reconcile_interval * min(2**failures, 30)
                    await self._sleep_or_wake(delay)
            failures = 0
            while True:
                started = self.metrics.timer()
                try:
                    done = await self.reconcile_once()
                    failures = 0
                except FleetserveError as e:
                    failures += 1
                    log.warning("service %s: reconcile failed: %s", self.name, e.message)
                    done = False
                except STORE_FAILURES as e:  # a full disk, say: one line, not a traceback
                    failures += 1
                    text = failure_text(e)
                    log.warning("service %s: reconcile failed: the store: %s", self.name, text)
                    done = False
                except Exception:
                    failures += 1
                    log.exception("service %s: reconcile failed", self.name)
                    done = False
                if done:
                    return  # the service is gone, its series with it
                self.metrics.round(self.metrics.timer() - started, failed=failures > 0)
                delay = self.settings.reconcile_interval * min(2**failures, 30)
                await self._sleep_or_wake(delay)
        finally:
            self.finished.set()

    async def stop(self) -> None:
        await self.executor.cancel_all()
        self.prober.close()
        self.replica_metrics.close()
        if self.pool is not None:
            self.pool.close()

    def _pool_runner(self, spec: ServiceTask) -> PoolRunner | None:
        """A worker pool's job runner (pools run on the local infra)."""
        if spec.service.pool is None or not hasattr(self.infra, "start_job"):
            return None
        if self.pool is None:
            self.pool = PoolRunner(
                self.name,
                self.store,
                self.clock,
                cast(JobRunner, self.infra),
                self.settings.home,
                self.wake.set,
            )
            self.pool.on_broken = self._worker_broken
        return self.pool

    def _worker_broken(self, worker: ReplicaRecord, why: str) -> None:
        self.prober.forget(self.key(worker.replica_id))
        self.executor.terminate(worker, ReplicaStatus.FAILED, why, TerminationCause.FAILURE)

    def key(self, replica_id: ReplicaId) -> ReplicaKey:
        return ReplicaKey(self.name, replica_id)

    # -- recovery ------------------------------------------------------------------------

    def _away(self, r: ReplicaRecord) -> bool:
        """Whether the replica's processes were recorded on another host than this
        controller's (a local replica after a takeover by a controller on another host)."""
        return elsewhere(r.host, host_of(self.infra))

    async def recover(self) -> None:
        """Adopt what still runs and redo what a previous controller left half done.

        Local replicas recorded on another host are never adopted (nor probed, nor stopped)
        here: the first round takes them as lost and replaces them on this host."""
        now = self.clock.now()
        for r in self.store.list_replicas(self.name):
            if r.status is ReplicaStatus.PROVISIONING:
                if self._away(r):
                    # Cut short on another host: what it started there is not ours to stop.
                    self.store.update_replica(
                        r,
                        now,
                        message=f"launch interrupted on host {r.host}, whose controller is "
                        "gone: relaunching on this host",
                        status=ReplicaStatus.PENDING,
                        launch_token=new_launch_token(self.home_id),
                        handle=None,
                        endpoint=None,
                        port=None,
                        host=None,
                    )
                    continue
                # The launch was cut short: clean up whatever it started, then launch again.
                await self.infra.terminate(r.handle, r.launch_token)
                self.store.update_replica(
                    r,
                    now,
                    message="launch interrupted by a controller restart: relaunching",
                    status=ReplicaStatus.PENDING,
                    launch_token=new_launch_token(self.home_id),
                    handle=None,
                    endpoint=None,
                    port=None,
                )
            elif r.status is ReplicaStatus.SHUTTING_DOWN:
                # Finish what the previous controller started, for the same cause (a row
                # written before causes were recorded has one from migration 0009).
                cause = r.termination_cause or TerminationCause.FAILURE
                final: ReplicaStatus
                if deletes_row(cause):
                    final = r.status
                elif cause is TerminationCause.PREEMPTION:
                    final = ReplicaStatus.PREEMPTED  # not a failure of the replica's own
                else:
                    final = ReplicaStatus.FAILED
                self.executor.terminate(r, final, r.reason or "terminating", cause)
            elif r.status in _RUNNING and r.handle and self._away(r):
                continue  # another host's: lost (the first round replaces it)
            elif r.status in _RUNNING and r.handle:
                state = await self.infra.poll(r.handle)
                if state.kind is InstanceKind.RUNNING:
                    self.store.add_event(
                        self.name, now, "replica", "adopted after controller restart", r.replica_id
                    )

    # -- one round -----------------------------------------------------------------------

    async def reconcile_once(self) -> bool:
        """One observe-plan-act round; True when the service is gone and the loop should end."""
        if self.down_pending is not None and not self.record_down():
            return False  # nothing is launched or changed until the store takes the down
        svc = self.store.get_service(self.name)
        if svc is None:
            return True
        if svc.phase is ServicePhase.SHUTTING_DOWN:
            return await self._shutdown(svc)
        spec = self.spec(svc.active_version)
        pool = self._pool_runner(spec)
        if pool is None:
            svc = await self._ensure_lb(svc, spec)  # a pool has no endpoint
        replicas = self.store.list_replicas(self.name)
        for kind, at in list(self._full_at.items()):
            if any(r.spot is kind and (r.started_at or 0.0) > at for r in replicas):
                del self._full_at[kind]  # a launch of that kind went through: no more back-off
                self._full_streak.pop(kind, None)
                self._full_until.pop(kind, None)
        observations = await self._observe(replicas, spec)
        probe = spec.service.readiness_probe
        wanted = svc.lb_pid is not None and self._wants_load(spec)
        report = await self.lb.load(svc) if wanted else None
        self.scaler.observe(report)
        if pool is None:
            target = self.scaler.target(spec, self._replica_signals(spec, replicas))
            self._show_signals(spec)
        else:
            target = pool.target(spec, replicas)
        self.history.observe(
            self.clock.now(),
            report,
            ready=sum(r.status is ReplicaStatus.READY for r in replicas),
            target=target,
            versions={r.replica_id: r.version for r in replicas if r.terminated_at is None},
        )
        lo, _hi = spec.service.replica_bounds()
        split = self._spot_split(spec, svc.active_version, target, replicas)
        if split is not None:
            target = split.spot + split.on_demand
        settings = FleetSettings(
            target_replicas=target,
            version=svc.active_version,
            initial_delay_seconds=probe.initial_delay_seconds if probe else 0,
            failure_window_seconds=(
                probe.consecutive_failure_threshold_timeout
                if probe and probe.consecutive_failure_threshold_timeout is not None
                else self.settings.failure_window
            ),
            max_concurrent_launches=self.settings.max_concurrent_launches,
            rollout=RolloutSettings(
                target=target,
                version=svc.active_version,
                mode=svc.update_mode or ROLLING,
                max_surge=spec.service.max_surge,
                max_unavailable=spec.service.max_unavailable,
                switch_ready=max(1, lo),
                canary_percent=svc.traffic_percent,
            ),
            spot=split,
            ready_when_alive=pool is not None,
            protected=pool.busy() if pool is not None else frozenset(),
        )
        plan = plan_fleet(replicas, observations, settings, self.clock.now())
        by_id = {r.replica_id: r for r in replicas}
        self._apply(plan.actions, by_id, svc, spec)
        if any(isinstance(a, SetStatus) for a in plan.actions):
            # A status changed (READY, NOT_READY): plan again at once with it, e.g. a rollout
            # retires an old replica now that a new one is READY, not a reconcile interval
            # later (no longer hastened by a wake-up after every probe).
            self.wake.set()
        svc = self._advance_rollout(svc, plan.rollout_complete, plan.switch_traffic)
        if pool is not None:
            workers = self.store.list_replicas(self.name)
            if plan.failure_reason and not any(r.status is ReplicaStatus.READY for r in workers):
                pool.fail_queue(plan.failure_reason)
            await pool.dispatch(self.spec, workers)
        if plan.failure_reason != svc.launch_stop:
            svc_reason_before = svc.launch_stop
            svc = self.store.update_service(
                self.name, self.clock.now(), launch_stop=plan.failure_reason
            )
            if plan.failure_reason and _headline(plan.failure_reason) != _headline(
                svc_reason_before
            ):
                # One event when launches stop, not one more per replica failing after.
                self.store.add_event(self.name, self.clock.now(), "service", plan.failure_reason)
        await self._push(svc, rows_after(plan.actions, replicas))
        return False

    def _replica_signals(
        self, spec: ServiceTask, replicas: list[ReplicaRecord]
    ) -> dict[str, SignalReading] | None:
        """Start a scrape of the READY replicas' metrics when one is due (in the background),
        and what their latest scrapes said; None when the policy reads none."""
        policy = spec.service.replica_policy
        if policy is None or not policy.scrapes_replicas:
            if self.replica_metrics.latest:
                self.replica_metrics.close()
            return None
        ready = [
            (r.replica_id, r.endpoint)
            for r in replicas
            if r.status is ReplicaStatus.READY and r.endpoint and not self._away(r)
        ]
        probe = spec.service.readiness_probe
        now = self.clock.now()
        self.replica_metrics.maybe_start(ready, policy, probe.headers if probe else {}, now)
        return self.replica_metrics.readings([rid for rid, _ in ready], policy, now)

    def _show_signals(self, spec: ServiceTask) -> None:
        """The autoscaler's last readings in the controller's metrics (GET /metrics)."""
        policy = spec.service.replica_policy
        if policy is None:
            return
        for key, reading in self.scaler.signals.items():
            metric = next(
                (m for i, m in enumerate(policy.target_metrics or ()) if metric_key(i) == key),
                None,
            )
            peak = metric is not None and metric.aggregation == "max"
            self.metrics.signal(key, reading.peak if peak else reading.mean, reading.answered)
        if policy.latency_target_ms is not None:
            self.metrics.signal("latency_ms", self.scaler.latency_ms)

    def _wants_load(self, spec: ServiceTask) -> bool:
        """Whether this round reads the LB's load report: every round when a decision rests on
        it (an autoscaled fleet; a drain waiting for in-flight requests), else when the
        dashboard's history takes its next point. A fixed fleet's read every round was half
        of an idle controller's CPU with ten services (docs/scaling.md)."""
        policy = spec.service.replica_policy
        if policy is not None and policy.autoscaled:
            return True
        return bool(self.executor.terminations) or self.history.due(self.clock.now())

    def _advance_rollout(self, svc: ServiceRecord, complete: bool, switch: bool) -> ServiceRecord:
        """A rollout ends when only the active version is left (rolling), or when traffic moves
        to it (blue-green): it becomes the serving version."""
        if not svc.rolling_out or not (complete or switch):
            return svc
        now = self.clock.now()
        old = svc.serving_version
        message = f"version {svc.active_version} serves" + (
            f" (was {old}); `fleetserve rollback {self.name}` returns to {old}" if old else ""
        )
        self.store.add_event(self.name, now, "rollout", message)
        log.info("service %s: %s", self.name, message)
        return self.store.update_service(
            self.name,
            now,
            stable_version=svc.active_version,
            previous_version=old,
            update_mode=None,
            traffic_percent=None,
        )

    # -- spot ----------------------------------------------------------------------------

    def _placement(self, spec: ServiceTask) -> SpotPlacement | None:
        """The spot placer of a spot service (None for on-demand services and for infras
        that declare no zone)."""
        if not spec.uses_spot:
            return None
        policy = spec.service.replica_policy
        name = (policy.spot_placer if policy else None) or DEFAULT_PLACER
        if self.spot is None or self.spot.name != name:
            try:
                self.spot = SpotPlacement(
                    self.name, self.store, self.clock, name, self.infra.locations()
                )
            except ValueError as e:
                log.warning("service %s: no spot placement: %s", self.name, e)
                return None
        return self.spot

    def _spot_split(
        self, spec: ServiceTask, version: int, target: int, replicas: list[ReplicaRecord]
    ) -> FallbackTargets | None:
        """A spot service's spot and on-demand counts for `target` (the autoscaler's target
        counts num_overprovision already; the placer decides the spares here instead)."""
        placement = self._placement(spec)
        if placement is None:
            return None
        policy = spec.service.replica_policy
        if policy is not None and policy.autoscaled and target > 0:
            target = max(0, target - (policy.num_overprovision or 0))
        current = [
            r
            for r in replicas
            if r.version == version
            and not r.status.is_terminal
            and r.status is not ReplicaStatus.SHUTTING_DOWN
        ]
        return placement.targets(policy, target, current)

    def _no_capacity(self, rec: ReplicaRecord, e: NoCapacity) -> None:
        if not e.preempted:
            # No capacity of that kind: its next launch waits, 1 s doubling to a minute, rather
            # than fail again at once (a launch-fail-create loop, found by an outside tester).
            streak = self._full_streak.get(rec.spot, 0)
            self._full_streak[rec.spot] = streak + 1
            delay = min(CAPACITY_BACKOFF_MAX, CAPACITY_BACKOFF * 2 ** min(streak, 16))
            self._full_until[rec.spot] = self.clock.now() + delay
            self._full_at[rec.spot] = self.clock.now()
        if self.spot is None or not rec.spot:
            return
        if e.preempted:
            self.spot.preempted(rec.replica_id, e.zone)
        else:
            self.spot.launch_failed(rec.replica_id, e.zone, e.message)

    async def _observe(
        self, replicas: list[ReplicaRecord], spec: ServiceTask
    ) -> Mapping[ReplicaId, Observation]:
        now = self.clock.now()
        out: dict[ReplicaId, Observation] = {}
        for i, r in enumerate(replicas):
            if i % OBSERVE_BATCH == OBSERVE_BATCH - 1:
                # Let API calls and probe results in between: a thousand replicas observed
                # without a pause held every API call for tens of milliseconds.
                await asyncio.sleep(0)
            if r.status not in _RUNNING or not r.handle or self.executor.busy(r.replica_id):
                self.prober.forget(self.key(r.replica_id))
                continue
            if self._away(r):
                # Its processes run on another host, whose controller is gone (this one took
                # over): never probed by pid here, lost, and replaced on this host.
                self.prober.forget(self.key(r.replica_id))
                lost = InstanceObservation(
                    alive=False,
                    lost=True,
                    detail=f"it ran on host {r.host}, whose controller is gone, and this "
                    f"controller runs on {host_of(self.infra)}: replaced on this host",
                )
                out[r.replica_id] = Observation(instance=lost, probe=None)
                continue
            state = await self.infra.poll(r.handle)
            detail = state.detail
            if state.kind is InstanceKind.EXITED:
                # Its cause is in its log (a missing file, a traceback): in the reason too.
                tail = await log_tail(self.infra, self.name, r.replica_id, r.handle)
                detail = with_tail(detail, tail)
            inst = InstanceObservation(
                alive=state.kind is InstanceKind.RUNNING,
                lost=state.kind is InstanceKind.LOST,
                exit_code=state.exit_code,
                detail=detail,
            )
            result = None
            probe = self.spec(r.version).service.readiness_probe  # each version's own probe
            if inst.alive and probe is not None and r.endpoint:
                result = self.prober.take(self.key(r.replica_id))
                if result is not None and not result.ok and CONNECT_ERROR in result.detail:
                    result = await self._with_listeners(r, result, now)
                interval = probe_interval(r.status, probe, self.settings)
                self.prober.maybe_start(
                    self.key(r.replica_id),
                    r.endpoint,
                    probe,
                    now,
                    interval,
                    on_done=self.wake.set,
                    quiet_if_ok=r.status is ReplicaStatus.READY,
                )
            out[r.replica_id] = Observation(instance=inst, probe=result)
        return out

    async def _with_listeners(
        self, r: ReplicaRecord, result: ProbeResult, now: float
    ) -> ProbeResult:
        """A probe that could not connect, with the ports the replica's processes do listen
        on (an infra that can say: ReportsListeners): a server on another port than the one
        probed shows at once. Read at most every LISTENERS_EVERY seconds per replica."""
        ports_of = getattr(self.infra, "listening_ports", None)
        if ports_of is None or not r.handle:
            return result
        seen = self._listeners.get(r.replica_id)
        if seen is None or seen[0] != r.handle or now - seen[1] >= LISTENERS_EVERY:
            try:
                ports = await asyncio.to_thread(ports_of, r.handle)
            except Exception:  # a hint only: never fail the round for it
                return result
            self._listeners[r.replica_id] = seen = (r.handle, now, ports)
        ports = seen[2]
        if ports is None:
            return result
        where = f"listen on {', '.join(map(str, ports))}" if ports else "listen on no TCP port yet"
        return ProbeResult(False, f"{result.detail}; the replica's processes {where}")

    def _apply(
        self,
        actions: list[Action],
        by_id: dict[ReplicaId, ReplicaRecord],
        svc: ServiceRecord,
        spec: ServiceTask,
    ) -> None:
        now = self.clock.now()
        placed: list[ReplicaRecord] = list(by_id.values())  # spot zones chosen this round too
        for action in actions:
            if isinstance(action, SetStatus):
                rec = by_id[action.replica_id]
                changes: ReplicaChanges = {
                    **action.fields,
                    "status": action.status,
                    "reason": action.reason,
                }
                self.store.update_replica(rec, now, action.message, **changes)
            elif isinstance(action, Terminate):
                self.prober.forget(self.key(action.replica_id))
                rec = by_id[action.replica_id]
                away = self._away(rec)
                if (
                    action.final_status is ReplicaStatus.PREEMPTED
                    and rec.spot
                    and rec.zone
                    and self.spot is not None
                    and not away  # a lost host, not a preempted zone
                ):
                    self.spot.preempted(rec.replica_id, rec.zone)
                cause = action.cause
                if away and not deletes_row(cause):
                    # Another host's replica: its row goes, so that its processes, if that
                    # host's controller comes back, are orphans there and stopped.
                    cause = TerminationCause.HOST_LOST
                self.executor.terminate(
                    by_id[action.replica_id],
                    action.final_status,
                    action.reason,
                    cause,
                    action.exit_code,
                    drain_seconds=self.settings.drain_seconds if action.drain else 0.0,
                )
            elif isinstance(action, CreateReplicas):
                for _ in range(action.count):
                    self.store.allocate_replica(
                        self.name,
                        svc.active_version,
                        self.infra.name,
                        new_launch_token(self.home_id),
                        now,
                        spot=action.spot,
                    )
                self.wake.set()
            elif isinstance(action, StartLaunch):
                rec = by_id[action.replica_id]
                if now < self._full_until.get(rec.spot, 0.0):
                    continue  # that kind found no capacity just now: wait out the back-off
                zone: str | None = None
                if rec.spot and self.spot is not None:
                    zone = self.spot.zone_for(placed)
                    if zone is None:
                        continue  # every zone is backing off: it waits for the next round
                    placed.append(dataclasses.replace(rec, zone=zone))
                self.executor.launch(rec, spec, zone)
            elif isinstance(action, DeleteRow):
                self.store.delete_replica(
                    self.name, action.replica_id, now, "old failed replica row pruned"
                )

    # -- load balancer ---------------------------------------------------------------------

    def _lb_outdated(self, svc: ServiceRecord, spec: ServiceTask) -> bool:
        """Whether the running LB's settings differ from the active version's (an update
        changed the policy or the load_balancer section). Checked once per version and LB."""
        key = (svc.active_version, svc.lb_pid)
        if key == self._lb_checked:
            return False
        self._lb_checked = key
        running = self.lb.running_config(svc.name)
        if running is None:
            return False
        wanted = lb_config(
            spec,
            svc.name,
            running.port,
            running.admin_port,
            self.settings.api_port,
            running.admin_secret,
            self.settings.api_scheme,
            self.infra.name,
        )
        # The wake URL names the controller that started the LB: after a takeover (or a
        # restart on another port) the LB stays, and held requests still reach the fleet
        # through the load report that every round reads.
        # (Its drain is the controller's setting when it started: not a reason to replace it.)
        ignore = {"replicas", "admin_port", "wake_url", "drain_seconds"}
        return running.model_dump(exclude=ignore) != wanted.model_dump(exclude=ignore)

    async def _ensure_lb(self, svc: ServiceRecord, spec: ServiceTask) -> ServiceRecord:
        old: tuple[int | None, float | None] | None = None
        old_drain: float | None = None  # the old one's own bound, if it can be retired
        running: LbConfig | None = None  # the old one's config, as its file said
        host = lb_host(spec, self.infra.name)
        if self.lb.is_running(svc):
            if not self._lb_outdated(svc, spec):
                return svc
            # New settings: start a new load balancer beside the old one (on its sockets),
            # then retire the old one, which finishes its requests.
            old = (svc.lb_pid, svc.lb_create_time)
            # Read before the new one's start rewrites the file. One started by an older
            # fleetserve (no drain_seconds in its config) has no SIGQUIT handler: stopped.
            running = self.lb.running_config(svc.name)
            if running is not None and "drain_seconds" in running.model_fields_set:
                old_drain = running.drain_seconds
            self.store.add_event(
                self.name,
                self.clock.now(),
                "service",
                "load balancer settings changed: replacing it",
            )
        elif elsewhere(svc.lb_host, self.lb.host):
            # Its LB runs (or ran) on another host, whose controller is gone: that process is
            # not touched; this controller starts one of its own, on the same port if it is
            # free here. The endpoint moves to this host.
            if svc.lb_pid is not None:
                self.store.add_event(
                    self.name,
                    self.clock.now(),
                    "service",
                    f"load balancer recorded on host {svc.lb_host}; this controller runs on "
                    f"{self.lb.host}: starting one here",
                )
            if svc.lb_port is not None and not port_free(svc.lb_port, host):
                self.store.add_event(
                    self.name,
                    self.clock.now(),
                    "service",
                    f"load balancer port {svc.lb_port} is taken on this host: choosing another",
                )
                svc = self.store.update_service(self.name, self.clock.now(), lb_port=None)
        elif svc.lb_pid is not None:
            self.store.add_event(
                self.name, self.clock.now(), "service", "load balancer not running: restarting it"
            )
        try:
            # The port (and the admin secret) are the service's in the store before the LB
            # starts: two services started at once never share an endpoint.
            svc = self.store.reserve_lb_port(
                self.name, self.settings.lb_port_start, lambda p: port_free(p, host)
            )
            port = svc.lb_port
            if port is None or not svc.lb_secret:
                raise TerminalError("no port or admin secret was reserved")
            admin_port = free_port()
            config = lb_config(
                spec,
                svc.name,
                port,
                admin_port,
                self.settings.api_port,
                svc.lb_secret,
                self.settings.api_scheme,
                self.infra.name,
            )
            config = config.model_copy(
                update={
                    "replicas": upstream_payload(self._endpoints(svc)),
                    "drain_seconds": self.settings.drain_seconds,
                }
            )
            pid, create_time = await self.lb.start(svc, config)
        except FleetserveError as e:
            if old is not None:
                # The old one serves on, recorded (else it would run on unseen, with its old
                # settings, beside the next one); its config file back as it was, and the
                # replacement tried again next round.
                if running is not None:
                    self.lb.restore_config(svc.name, running)
                self._lb_checked = None
                return self.store.update_service(
                    self.name,
                    self.clock.now(),
                    lb_error=f"load balancer (new settings, the old one still serves): {e.message}",
                )
            return self.store.update_service(
                self.name,
                self.clock.now(),
                lb_pid=None,
                lb_error=f"load balancer: {e.message}",
            )
        self.store.add_event(
            self.name, self.clock.now(), "service", f"load balancer started on port {port}"
        )
        if old is not None and old_drain is not None:
            # The old one stops accepting at once and finishes its requests in the background
            # (up to its drain_seconds: a long stream is not cut); replicas' drains wait for it.
            self.lb.retire(self.name, *old, old_drain)
        elif old is not None:
            await self.lb.stop_process(*old)
        return self.store.update_service(
            self.name,
            self.clock.now(),
            lb_pid=pid,
            lb_create_time=create_time,
            lb_port=port,
            lb_admin_port=admin_port,
            lb_host=self.lb.host,
            lb_error=None,
        )

    def _endpoints(
        self, svc: ServiceRecord, replicas: list[ReplicaRecord] | None = None
    ) -> list[Endpoint]:
        if replicas is None:
            replicas = self.store.list_replicas(self.name)
        if svc.rolling_out and svc.update_mode == BLUE_GREEN:
            versions = {svc.serving_version}  # blue-green: the old version until the switch
        else:
            versions = {r.version for r in replicas}  # rolling and canary: versions mix
        ready = routable(replicas, versions)
        return [
            Endpoint(r.replica_id, r.endpoint or "", r.version, self._weight(r.version))
            for r in ready
        ]

    def _weight(self, version: int) -> float:
        """instance_aware_least_load: a replica counts by its accelerator's target QPS."""
        spec = self.spec(version)
        policy = spec.service.replica_policy
        if policy is None or not isinstance(policy.target_qps_per_replica, dict):
            return 1.0
        return per_replica_qps(policy, spec.accelerator()) or 1.0

    def _canary(self, svc: ServiceRecord) -> Canary | None:
        if svc.traffic_percent is None or not svc.rolling_out:
            return None
        return Canary(version=svc.active_version, percent=svc.traffic_percent)

    async def _push(self, svc: ServiceRecord, replicas: list[ReplicaRecord] | None = None) -> None:
        if svc.lb_pid is None:
            return
        endpoints = self._endpoints(svc, replicas)
        await self.lb.push(svc, endpoints, self.clock.now(), canary=self._canary(svc))

    # -- down ------------------------------------------------------------------------------

    async def stop_processes(self) -> None:
        """Stop the service's processes (launches under way, replicas, the load balancer)
        writing nothing to the store: a `down` it could not record (a full disk) still stops
        them. The rows stay as they were until `record_down` succeeds; the shutdown that
        follows then finds the processes gone."""
        await self.executor.cancel_all()
        svc = self.store.get_service(self.name)
        if svc is None:
            return
        stops = []  # all at once: each may wait its grace period
        for r in self.store.list_replicas(self.name):
            self.prober.forget(self.key(r.replica_id))
            if not self._away(r) and not r.status.is_terminal:
                stops.append(self.infra.terminate(r.handle, r.launch_token))
        if not elsewhere(svc.lb_host, self.lb.host):
            stops.append(self.lb.stop(self.name, svc.lb_pid, svc.lb_create_time))
        for failed in await asyncio.gather(*stops, return_exceptions=True):
            if isinstance(failed, Exception):
                log.warning("service %s: a process was not stopped: %s", self.name, failed)

    def record_down(self) -> bool:
        """Record a pending `down` (see `stop_processes`); False while the store refuses."""
        purge = bool(self.down_pending)
        try:
            svc = self.store.get_service(self.name)
            if svc is not None:
                self.store.update_service(
                    self.name,
                    self.clock.now(),
                    phase=ServicePhase.SHUTTING_DOWN,
                    purge=purge or svc.purge,
                )
                self.store.add_event(
                    self.name,
                    self.clock.now(),
                    "service",
                    "down requested while the database could not be written: its processes "
                    "were stopped then, the down is recorded now",
                )
        except STORE_FAILURES as e:
            text = failure_text(e)
            log.warning("service %s: the down waits for the database: %s", self.name, text)
            return False
        self.down_pending = None
        log.info("service %s: the down that waited for the database is recorded", self.name)
        return True

    async def _shutdown(self, svc: ServiceRecord) -> bool:
        replicas = self.store.list_replicas(self.name)
        if svc.lb_pid is not None and self.lb.is_running(svc):
            # Nothing is routable any more: stop sending traffic before stopping replicas.
            await self.lb.push(svc, [], self.clock.now(), force=True)
        self.executor.cut_drains()  # a scale-down's drain must not hold the down
        by_id = {r.replica_id: r for r in replicas}
        for action in plan_shutdown(replicas, self.executor.busy):
            self.prober.forget(self.key(action.replica_id))
            self.executor.terminate(
                by_id[action.replica_id], action.final_status, action.reason, action.cause
            )
        await self.executor.wait_idle()
        left = self.store.list_replicas(self.name)
        if any(r.status is not ReplicaStatus.FAILED_CLEANUP for r in left):
            return False  # a termination that was under way ended with a row: next round
        if left and not svc.purge:
            bad = ", ".join(f"{r.replica_id} ({r.reason})" for r in left)
            self.store.update_service(
                self.name,
                self.clock.now(),
                cleanup_error=f"could not terminate replicas {bad}; "
                f"`fleetserve down {self.name} --purge` removes the service anyway",
            )
            return True
        if elsewhere(svc.lb_host, self.lb.host):
            await self.lb.stop(self.name, None, None)  # another host's process: not stopped
        else:
            await self.lb.stop(self.name, svc.lb_pid, svc.lb_create_time)
        pool = self._pool_runner(self.spec(svc.active_version))
        if pool is not None:
            pool.end_all("the pool was taken down")
        self.store.delete_service(self.name)
        self.metrics.forget()  # its counters go with it (the scrape-time gauges read the store)
        self.infra.forget_service(self.name)
        # Its logs go with it (replica and load-balancer logs, rotated halves too).
        shutil.rmtree(self.settings.logs_dir / self.name, ignore_errors=True)
        log.info("service %s is down", self.name)
        return True
