"""`plan_fleet`: the replica lifecycle and fleet size as a pure function.

Given the replicas' rows, what was observed of them this round (instance state, readiness
probe) and `now`, it returns the actions that move every replica along its lifecycle and keep
the fleet at its target size. It does no I/O; the reconciler applies the actions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from fleetserve.core.status import FAILED_STATUSES, ReplicaStatus
from fleetserve.core.types import (
    ReplicaChanges,
    ReplicaId,
    ReplicaRecord,
    TerminationCause,
    deletes_row,
)
from fleetserve.policies.autoscaler import FallbackTargets
from fleetserve.policies.rollout import RolloutSettings, RolloutStep, plan_rollout, scale_down_order


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class InstanceObservation:
    """What polling the infra said: alive, or gone with a reason (the infra's own words)."""

    alive: bool
    lost: bool = False  # gone with no exit status (preempted)
    exit_code: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Observation:
    instance: InstanceObservation | None = None
    probe: ProbeResult | None = None


@dataclass(frozen=True)
class FleetSettings:
    target_replicas: int
    version: int
    initial_delay_seconds: float
    failure_window_seconds: float = 180.0
    max_concurrent_launches: int = 4
    crash_loop_limit: int = 3  # consecutive never-ready failures of a version that stop launches
    keep_terminal_rows: int = 20  # failed rows kept for debugging, newest first
    rollout: RolloutSettings | None = None  # how replicas of older versions give way
    # A spot fleet: how many spot and on-demand replicas it wants (`spot_split`); None: every
    # replica on demand.
    spot: FallbackTargets | None = None
    # A pool's workers: READY once alive after setup (no readiness probe), and the busy ones
    # (running a job) are never retired by a scale-down.
    ready_when_alive: bool = False
    protected: frozenset[ReplicaId] = frozenset()


@dataclass(frozen=True)
class SetStatus:
    replica_id: ReplicaId
    status: ReplicaStatus
    reason: str | None
    fields: ReplicaChanges = field(default_factory=lambda: ReplicaChanges())  # other columns
    message: str | None = None  # what the event says, when `reason` is empty


@dataclass(frozen=True)
class Terminate:
    """Take the replica out of rotation, stop it, then mark it `final_status`, or drop its row
    if its `cause` says so (`deletes_row`)."""

    replica_id: ReplicaId
    final_status: ReplicaStatus
    reason: str
    cause: TerminationCause
    exit_code: int | None = None
    drain: bool = False  # wait (bounded) for its in-flight requests after leaving the LB set


@dataclass(frozen=True)
class CreateReplicas:
    count: int
    spot: bool = False


@dataclass(frozen=True)
class StartLaunch:
    replica_id: ReplicaId


@dataclass(frozen=True)
class DeleteRow:
    replica_id: ReplicaId


Action = SetStatus | Terminate | CreateReplicas | StartLaunch | DeleteRow


@dataclass(frozen=True)
class FleetPlan:
    actions: list[Action]
    # Set when launches stopped (a crash loop): why, shown as the service's failure reason.
    failure_reason: str | None = None
    rollout_complete: bool = True  # only the active version is left
    switch_traffic: bool = False  # blue-green: the active version takes all traffic now


def _lifecycle(
    r: ReplicaRecord, obs: Observation, s: FleetSettings, now: float
) -> SetStatus | Terminate | None:
    """The next step of one running replica (STARTING, READY or NOT_READY)."""
    inst = obs.instance
    if inst is not None and not inst.alive:
        if inst.lost:
            return Terminate(
                r.replica_id,
                ReplicaStatus.PREEMPTED,
                f"instance lost: {inst.detail}",
                TerminationCause.PREEMPTION,
            )
        return Terminate(
            r.replica_id,
            ReplicaStatus.FAILED,
            f"replica process {inst.detail}",
            TerminationCause.FAILURE,
            exit_code=inst.exit_code,
        )
    if s.ready_when_alive and r.status is ReplicaStatus.STARTING and inst is not None:
        return SetStatus(
            r.replica_id,
            ReplicaStatus.READY,
            None,
            {"first_ready_at": now},
            "setup done: takes jobs",
        )
    probe = obs.probe
    if probe is None:
        return None
    if r.status is ReplicaStatus.STARTING:
        if probe.ok:
            return SetStatus(
                r.replica_id,
                ReplicaStatus.READY,
                None,
                {"first_ready_at": now},
                f"readiness probe passed: {probe.detail}",
            )
        launched = r.launched_at if r.launched_at is not None else r.created_at
        if now - launched >= s.initial_delay_seconds:
            return Terminate(
                r.replica_id,
                ReplicaStatus.FAILED_INITIAL_DELAY,
                f"readiness probe did not pass within initial_delay_seconds="
                f"{s.initial_delay_seconds:g} of launch (last probe: {probe.detail})",
                TerminationCause.FAILURE,
            )
        return None
    if r.status is ReplicaStatus.READY:
        if probe.ok:
            return None
        return SetStatus(
            r.replica_id,
            ReplicaStatus.NOT_READY,
            f"readiness probe failed: {probe.detail}",
            {"probe_failing_since": now},
        )
    # NOT_READY
    if probe.ok:
        return SetStatus(
            r.replica_id,
            ReplicaStatus.READY,
            None,
            {"probe_failing_since": None},
            f"readiness probe passes again: {probe.detail}",
        )
    since = r.probe_failing_since if r.probe_failing_since is not None else now
    if now - since >= s.failure_window_seconds:
        return Terminate(
            r.replica_id,
            ReplicaStatus.FAILED_PROBING,
            f"readiness probe failed for {now - since:.0f} s (window "
            f"{s.failure_window_seconds:g} s): {probe.detail}",
            TerminationCause.FAILURE,
        )
    return None


def _never_ready_failures(
    replicas: list[ReplicaRecord], s: FleetSettings, failing_now: Mapping[ReplicaId, str]
) -> list[ReplicaRecord] | None:
    """The version's replicas that failed without ever becoming READY, by id; None once one
    of its replicas has been READY (the version works: failures are not a crash loop)."""
    of_version = [r for r in replicas if r.version == s.version]
    if s.crash_loop_limit <= 0 or any(r.first_ready_at is not None for r in of_version):
        return None
    return sorted(
        (
            r
            for r in of_version
            if (r.status.is_failed and r.status is not ReplicaStatus.FAILED_CLEANUP)
            or (r.status is ReplicaStatus.SHUTTING_DOWN and not deletes_row(r.termination_cause))
            or r.replica_id in failing_now
        ),
        key=lambda r: r.replica_id,
    )


def crash_loop_reason(
    replicas: list[ReplicaRecord],
    s: FleetSettings,
    failing_now: Mapping[ReplicaId, str] | None = None,
) -> str | None:
    """Why launching should stop: the newest finished replicas of the version all failed
    without ever becoming READY (a broken command would otherwise relaunch forever).

    Replicas being torn down after a failure (SHUTTING_DOWN, not a scale-down) and those this
    round fails (`failing_now`) count as failed already. The text up to "Last:" stays the
    same while more of them fail (one event, not one per failure).
    """
    failing_now = failing_now or {}
    ended = _never_ready_failures(replicas, s, failing_now)
    if ended is None or len(ended) < s.crash_loop_limit:
        return None
    last = ended[-1]
    return (
        f"{s.crash_loop_limit} replicas of version {s.version} in a row failed before ever "
        f"becoming READY; launches stopped. Last: replica {last.replica_id}: "
        f"{failing_now.get(last.replica_id) or last.reason or last.status}"
    )


def replacement_budget(
    replicas: list[ReplicaRecord],
    alive: list[ReplicaRecord],
    s: FleetSettings,
    failing_now: Mapping[ReplicaId, str],
) -> int | None:
    """How many replicas may still be created for the version while it has failures and no
    READY replica yet: the crash-loop limit, less the failures and the launches still under
    way, so that a broken version launches exactly `crash_loop_limit` replicas past its
    first ones, not a round's worth more. None: no bound (no failure yet, or it works)."""
    ended = _never_ready_failures(replicas, s, failing_now)
    if not ended:
        return None
    launching = sum(1 for r in alive if r.version == s.version)
    return max(0, s.crash_loop_limit - len(ended) - launching)


def plan_fleet(
    replicas: list[ReplicaRecord],
    observations: Mapping[ReplicaId, Observation],
    settings: FleetSettings,
    now: float,
) -> FleetPlan:
    actions: list[Action] = []
    ending: set[ReplicaId] = set()
    for r in replicas:
        if r.status in (ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.NOT_READY):
            step = _lifecycle(r, observations.get(r.replica_id, Observation()), settings, now)
            if step is not None:
                actions.append(step)
                if isinstance(step, Terminate):
                    ending.add(r.replica_id)

    alive = [
        r
        for r in replicas
        if not r.status.is_terminal
        and r.status is not ReplicaStatus.SHUTTING_DOWN
        and r.replica_id not in ending
    ]
    failing_now = {
        a.replica_id: a.reason
        for a in actions
        if isinstance(a, Terminate) and a.final_status in FAILED_STATUSES
    }
    reason = crash_loop_reason(replicas, settings, failing_now)
    stopped = reason is not None
    rollout = settings.rollout or RolloutSettings(settings.target_replicas, settings.version)
    rs = plan_rollout(alive, rollout, stopped)
    launching = sum(1 for r in alive if r.status is ReplicaStatus.PROVISIONING)
    pending = sum(1 for r in alive if r.status is ReplicaStatus.PENDING)
    # Rows are written only as launch slots free up: a target of thousands never writes
    # thousands of rows in one round (the next rounds write more as launches finish).
    room = settings.max_concurrent_launches - launching - pending
    budget = replacement_budget(replicas, alive, settings, failing_now)
    if budget is not None:
        room = min(room, budget)
    creates: list[CreateReplicas] = [CreateReplicas(rs.create)]
    if settings.spot is not None:
        rs, creates = _spot_step(alive, rs, settings.spot, settings.version, stopped)
    for c in creates:
        if c.count > 0 and room > 0:
            actions.append(CreateReplicas(min(c.count, room), c.spot))
            room -= min(c.count, room)
    for r in rs.retire:
        if r.replica_id in settings.protected:
            continue  # a busy worker: it goes (or rolls to the new version) once its job ends
        cause = TerminationCause.SCALE_DOWN
        if r.version != settings.version:
            why, cause = f"replaced by version {settings.version}", TerminationCause.ROLLOUT
        elif settings.spot is not None and not r.spot:
            why = "on-demand fallback retired: enough spot replicas are READY"
        else:
            why = "scaled down"
        actions.append(Terminate(r.replica_id, r.status, why, cause, drain=True))
        ending.add(r.replica_id)

    slots = settings.max_concurrent_launches - launching
    for r in alive:
        if slots <= 0:
            break
        if r.status is ReplicaStatus.PENDING and r.replica_id not in ending:
            actions.append(StartLaunch(r.replica_id))
            slots -= 1

    finished = sorted(
        (r for r in replicas if r.status.is_terminal), key=lambda r: r.replica_id, reverse=True
    )
    for r in finished[settings.keep_terminal_rows :]:
        actions.append(DeleteRow(r.replica_id))
    return FleetPlan(
        actions,
        failure_reason=reason,
        rollout_complete=rs.complete,
        switch_traffic=rs.switch,
    )


def _spot_step(
    alive: list[ReplicaRecord],
    rs: RolloutStep,
    want: FallbackTargets,
    version: int,
    stopped: bool,
) -> tuple[RolloutStep, list[CreateReplicas]]:
    """A spot fleet's creations and retirements, per kind. At rest, each kind is brought to
    its count (extra on-demand fallbacks retire once enough spot replicas are READY: `want`
    shrinks as they come up); during a rollout, the rollout's new replicas fill the spot
    count first."""
    new = [r for r in alive if r.version == version]
    spot = [r for r in new if r.spot]
    od = [r for r in new if not r.spot]
    if len(new) < len(alive):  # a rollout: the rollout planner sizes it
        n_spot = min(rs.create, max(0, want.spot - len(spot)))
        return rs, [CreateReplicas(n_spot, True), CreateReplicas(rs.create - n_spot)]
    if stopped:
        create_spot = create_od = 0
    else:
        create_spot = max(0, want.spot - len(spot))
        create_od = max(0, want.on_demand - len(od))
    retire = tuple(
        scale_down_order(spot)[: max(0, len(spot) - want.spot)]
        + scale_down_order(od)[: max(0, len(od) - want.on_demand)]
    )
    step = RolloutStep(create_spot + create_od, retire, rs.complete, rs.switch)
    return step, [CreateReplicas(create_spot, True), CreateReplicas(create_od)]


def plan_shutdown(
    replicas: list[ReplicaRecord], stopping: Callable[[ReplicaId], bool] = lambda _rid: True
) -> list[Terminate]:
    """`down`: stop every replica that may still have processes, and drop every row. A row
    SHUTTING_DOWN is left to the stop under way (`stopping`); one whose stop ended without
    removing it (cancelled, or its store write refused on a full disk) is stopped again."""
    return [
        Terminate(r.replica_id, r.status, "service shutting down", TerminationCause.SERVICE_DOWN)
        for r in replicas
        if r.status is not ReplicaStatus.SHUTTING_DOWN or not stopping(r.replica_id)
    ]


def routable(replicas: Iterable[ReplicaRecord], versions: Iterable[int]) -> list[ReplicaRecord]:
    """The replicas the load balancer may send traffic to: READY, of an active version."""
    active = set(versions)
    return [
        r
        for r in replicas
        if r.status is ReplicaStatus.READY and r.version in active and r.endpoint
    ]
