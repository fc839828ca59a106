"""Applies launch and terminate actions as bounded, cancellable background tasks.

One executor per service owns every task that touches its replicas, so a terminate can cancel a
launch still in progress (and the launch cleans up what it had started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from pathlib import Path

from fleetserve.controller.logtail import log_tail, with_tail
from fleetserve.controller.pools import WORKER_RUN
from fleetserve.core.clock import Clock
from fleetserve.core.errors import FleetserveError, TerminalError, TransientError
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import (
    ReplicaChanges,
    ReplicaId,
    ReplicaRecord,
    TerminationCause,
    deletes_row,
)
from fleetserve.infra.base import FileMount, Infra, Launched, LaunchRequest
from fleetserve.infra.git import GitSource
from fleetserve.infra.host import elsewhere, host_of
from fleetserve.infra.zones import NoCapacity
from fleetserve.spec.models import ServiceTask, WorkdirGit
from fleetserve.spec.task_env import spec_gpus
from fleetserve.store import Store
from fleetserve.store.db import STORE_FAILURES, failure_text

log = logging.getLogger("fleetserve.controller")


# Transient infra errors (a cluster that does not answer yet) retry the launch after these
# delays, in seconds, before the replica counts as FAILED_PROVISION.
TRANSIENT_RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STORE_RETRY_SECONDS = 2.0  # a failed launch whose row the store refused (a full disk)


def new_launch_token(home_id: str = "") -> str:
    """A replica's launch token: the home's id, then a random part. Every process (or Ray
    actor) of the replica carries it, so a controller finds, adopts and stops only its own."""
    return f"{home_id}-{uuid.uuid4().hex}" if home_id else uuid.uuid4().hex


def uses_own_network(spec: ServiceTask) -> bool:
    """A fixed port and several replicas: each replica in a network namespace of its own
    (fleetserve.infra.netns), so that all of them can listen on that port."""
    return spec.replica_port() is not None and spec.service.replica_bounds()[1] > 1


def launch_request(spec: ServiceTask, rec: ReplicaRecord, home: Path) -> LaunchRequest:
    envs = {k: "" if v is None else str(v) for k, v in {**spec.envs, **spec.secrets}.items()}
    envs["FLEETSERVE_HOME"] = str(home)
    mounts = tuple(
        FileMount(dest=dest, source=Path(src))
        for dest, src in spec.file_mounts.items()
        if isinstance(src, str)
    )
    return LaunchRequest(
        service=rec.service,
        replica_id=rec.replica_id,
        version=rec.version,
        launch_token=rec.launch_token,
        run=WORKER_RUN if spec.service.pool is not None else spec.run or "",
        setup=spec.setup,
        envs=envs,
        workdir=Path(spec.workdir) if isinstance(spec.workdir, str) and spec.workdir else None,
        workdir_git=(
            GitSource(spec.workdir.url, spec.workdir.ref)
            if isinstance(spec.workdir, WorkdirGit)
            else None
        ),
        file_mounts=mounts,
        port=spec.replica_port(),
        own_network=uses_own_network(spec),
        spot=rec.spot,
        zone=rec.zone,
        gpus=spec_gpus(spec),
    )


class Executor:
    def __init__(
        self,
        service: str,
        store: Store,
        infra: Infra,
        clock: Clock,
        home: Path,
        on_change: Callable[[], None],
        launch_timeout: float = 1800.0,
    ) -> None:
        self.service = service
        self.store = store
        self.infra = infra
        self.clock = clock
        self.home = home
        self.on_change = on_change
        self.launch_timeout = launch_timeout  # setup and start, all tries together
        self.launches: dict[ReplicaId, asyncio.Task[None]] = {}
        self.terminations: dict[ReplicaId, asyncio.Task[None]] = {}
        self.inflight_of: Callable[[ReplicaId], int] = lambda _rid: 0  # from the LB's load report
        # `down`: drains under way end at once (the LB is told to route nothing and its load
        # is no longer read, so a request in flight in the last report would hold the down for
        # the whole drain).
        self.drains_cut = False
        # A load balancer replaced by a newer one still finishing requests: its requests are
        # in no load report, so a drain waits for it to be done (within its bound).
        self.lb_retiring: Callable[[], bool] = lambda: False
        # A launch that found its zone full (or lost its host during setup): the row goes and
        # the spot placer hears of it (the planner creates another replica).
        self.on_no_capacity: Callable[[ReplicaRecord, NoCapacity], None] = lambda _r, _e: None

    def busy(self, replica_id: ReplicaId) -> bool:
        return replica_id in self.launches or replica_id in self.terminations

    def launch(self, rec: ReplicaRecord, spec: ServiceTask, zone: str | None = None) -> None:
        if self.busy(rec.replica_id):
            return
        where = f" (spot, zone {zone})" if rec.spot and zone else " (spot)" if rec.spot else ""
        rec = self.store.update_replica(
            rec,
            self.clock.now(),
            f"launching on the {self.infra.name} infra{where} (setup, then run)",
            status=ReplicaStatus.PROVISIONING,
            launched_at=self.clock.now(),
            zone=zone,
            host=host_of(self.infra),  # before it acts: its processes will be this host's
        )
        task = asyncio.create_task(self._launch(rec, spec), name=f"launch-{rec.replica_id}")
        self.launches[rec.replica_id] = task
        task.add_done_callback(lambda _t: self._done(self.launches, rec.replica_id))

    async def _launch_retrying(self, rec: ReplicaRecord, spec: ServiceTask) -> Launched:
        """The infra's launch; a transient error (the cluster does not answer yet) is retried
        with backoff instead of failing the replica."""
        timeout = spec.service.launch_timeout_seconds or self.launch_timeout
        deadline = self.clock.now() + timeout  # the injected clock's time
        for delay in (*TRANSIENT_RETRY_DELAYS, None):
            try:
                return await asyncio.wait_for(
                    self.infra.launch(launch_request(spec, rec, self.home)),
                    timeout=max(0.0, deadline - self.clock.now()),
                )
            except TimeoutError:
                raise TerminalError(
                    f"setup did not finish within {timeout:g} s (the launch "
                    f"timeout; see `fleetserve logs {rec.service} {rec.replica_id}`)"
                ) from None
            except TransientError as e:
                if delay is None:
                    raise
                self.store.update_replica(
                    rec, self.clock.now(), f"{e.message}; retrying the launch in {delay:g} s"
                )
                await self.clock.sleep(delay)
        raise AssertionError("unreachable")

    async def _launch(self, rec: ReplicaRecord, spec: ServiceTask) -> None:
        try:
            launched = await self._launch_retrying(rec, spec)
        except asyncio.CancelledError:
            raise
        except NoCapacity as e:
            # Not the replica's fault: no failed row (it would count towards a crash loop).
            self.store.delete_replica(rec.service, rec.replica_id, self.clock.now(), e.message)
            self.on_no_capacity(rec, e)
            return
        except FleetserveError as e:
            tail = await log_tail(self.infra, rec.service, rec.replica_id, None)
            await self._record_failed(rec, with_tail(e.message, tail))
            return
        except STORE_FAILURES as e:  # a full disk (the workdir's copy, say): one line
            log.warning(
                "launch of replica %s/%s failed: %s", rec.service, rec.replica_id, failure_text(e)
            )
            with contextlib.suppress(Exception):
                await self.infra.terminate(None, rec.launch_token)
            await self._record_failed(rec, f"launch failed: {failure_text(e)}")
            return
        except Exception as e:
            log.exception("launch of replica %s/%s failed", rec.service, rec.replica_id)
            with contextlib.suppress(Exception):
                await self.infra.terminate(None, rec.launch_token)
            await self._record_failed(rec, f"launch failed: {type(e).__name__}: {e}")
            return
        try:
            self.store.update_replica(
                rec,
                self.clock.now(),
                f"run started at {launched.endpoint}; waiting for the readiness probe",
                status=ReplicaStatus.STARTING,
                handle=launched.handle,
                endpoint=launched.endpoint,
                port=launched.port,
                started_at=self.clock.now(),
                zone=launched.zone or rec.zone,
            )
        except STORE_FAILURES as e:
            # Started, but the store cannot say so (a full disk): a process no row names
            # must not run, so it is stopped, and the launch fails once that can be written.
            log.warning(
                "replica %s/%s started but not recorded, stopped: %s",
                rec.service,
                rec.replica_id,
                failure_text(e),
            )
            with contextlib.suppress(Exception):
                await self.infra.terminate(launched.handle, rec.launch_token)
            await self._record_failed(rec, f"launch failed: the store: {failure_text(e)}")

    async def _record_failed(self, rec: ReplicaRecord, reason: str) -> None:
        """FAILED_PROVISION, once the store takes the write: retried while it refuses (a full
        disk), the launch keeping its slot meanwhile, so the row never stays PROVISIONING
        with nothing behind it."""
        said = False
        while True:
            try:
                self.store.update_replica(
                    rec, self.clock.now(), status=ReplicaStatus.FAILED_PROVISION, reason=reason
                )
                return
            except STORE_FAILURES as e:
                if not said:
                    log.warning(
                        "replica %s/%s: its failed launch waits for the store: %s",
                        rec.service,
                        rec.replica_id,
                        failure_text(e),
                    )
                    said = True
                await self.clock.sleep(STORE_RETRY_SECONDS)

    def terminate(
        self,
        rec: ReplicaRecord,
        final_status: ReplicaStatus,
        reason: str,
        cause: TerminationCause,
        exit_code: int | None = None,
        drain_seconds: float = 0.0,
        purge: bool = False,
    ) -> None:
        """Mark SHUTTING_DOWN with its `cause` (out of the LB set at once), let its in-flight
        requests finish (up to `drain_seconds`), stop it, then record how it ended: its row
        goes if the cause says so (`deletes_row`) or it is to be purged (`purge`: written
        with SHUTTING_DOWN, in one write, so no live row ever carries it), even if its
        teardown fails; else it takes `final_status`."""
        if rec.replica_id in self.terminations:
            return
        changes: ReplicaChanges = {
            "status": ReplicaStatus.SHUTTING_DOWN,
            "reason": reason,
            "termination_cause": cause,
            "exit_code": exit_code,
        }
        if purge:
            changes["purge"] = True
        rec = self.store.update_replica(
            rec, self.clock.now(), message=f"terminating: {reason}", **changes
        )
        task = asyncio.create_task(
            self._terminate(rec, final_status, reason, drain_seconds),
            name=f"term-{rec.replica_id}",
        )
        self.terminations[rec.replica_id] = task
        task.add_done_callback(lambda _t: self._done(self.terminations, rec.replica_id))

    async def _drain(self, replica_id: ReplicaId, seconds: float) -> None:
        """Wait until the LB reports no request in flight to the replica, and no replaced LB
        is still finishing requests (bounded). The first second lets the push that removes it
        from the LB's set land."""
        deadline = self.clock.now() + seconds
        await self.clock.sleep(min(1.0, seconds))
        while (
            not self.drains_cut
            and self.clock.now() < deadline
            and (self.inflight_of(replica_id) > 0 or self.lb_retiring())
        ):
            await self.clock.sleep(0.2)

    def cut_drains(self) -> None:
        """The service goes down: replicas being drained stop waiting for their requests."""
        self.drains_cut = True

    async def _terminate(
        self,
        rec: ReplicaRecord,
        final_status: ReplicaStatus,
        reason: str,
        drain_seconds: float = 0.0,
    ) -> None:
        cause = rec.termination_cause  # as written by terminate(): a cancelled launch keeps it
        launch = self.launches.get(rec.replica_id)
        if launch is not None:
            launch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await launch
            fresh = self.store.get_replica(rec.service, rec.replica_id)
            rec = fresh or rec
        elif drain_seconds > 0 and rec.handle:
            await self._drain(rec.replica_id, drain_seconds)
        try:
            if elsewhere(rec.host, host_of(self.infra)):
                # Processes of another host: nothing of them is ours to stop here (their
                # host's controller is gone; a pid or a folder of this host is not theirs).
                log.info(
                    "replica %s/%s ran on host %s: nothing to stop on this host",
                    rec.service,
                    rec.replica_id,
                    rec.host,
                )
            else:
                await self.infra.terminate(rec.handle, rec.launch_token)
        except Exception as e:
            if self._purged(rec):  # the row goes all the same
                self.store.delete_replica(
                    rec.service,
                    rec.replica_id,
                    self.clock.now(),
                    f"replica row purged ({reason}); its teardown failed: {e}",
                )
                return
            self.store.update_replica(
                rec,
                self.clock.now(),
                status=ReplicaStatus.FAILED_CLEANUP,
                reason=f"{reason}; teardown failed: {e}",
            )
            return
        if deletes_row(cause) or self._purged(rec):
            self.store.delete_replica(
                rec.service, rec.replica_id, self.clock.now(), f"replica removed ({reason})"
            )
        else:
            final = ReplicaStatus.FAILED if final_status.is_launching else final_status
            self.store.update_replica(
                rec, self.clock.now(), status=final, reason=reason, terminated_at=self.clock.now()
            )

    def _purged(self, rec: ReplicaRecord) -> bool:
        """Whether the user asked for the replica's row to go (`down NAME --replica-id N
        --purge`), before its teardown began or while it ran: read again from the store."""
        fresh = self.store.get_replica(rec.service, rec.replica_id)
        return (fresh or rec).purge

    def _done(self, tasks: dict[ReplicaId, asyncio.Task[None]], replica_id: ReplicaId) -> None:
        tasks.pop(replica_id, None)
        self.on_change()

    async def cancel_all(self) -> None:
        tasks = list(self.launches.values()) + list(self.terminations.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def wait_idle(self) -> None:
        tasks = list(self.launches.values()) + list(self.terminations.values())
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
