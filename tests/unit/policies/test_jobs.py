"""The pool planners: FIFO dispatch with packing, finishing and requeueing jobs, and the
queue autoscaler (tables on a fake clock)."""

from __future__ import annotations

import pytest

from fleetserve.core.types import JobRecord, JobStatus
from fleetserve.policies.jobs import (
    MAX_JOBS_PER_WORKER,
    FinishJob,
    JobExit,
    PoolScale,
    RequeueJob,
    StartJob,
    WorkerView,
    busy_workers,
    plan_dispatch,
    pool_target,
)

P, R = JobStatus.PENDING, JobStatus.RUNNING


def job(jid: int, status: JobStatus = P, worker: int | None = None, **kw: object) -> JobRecord:
    base: dict[str, object] = {
        "job_id": jid,
        "pool": "p",
        "batch": 1,
        "rank": jid - 1,
        "num_jobs": 9,
        "status": status,
        "run": "true",
        "worker_id": worker,
        "attempts": 1 if status is R else 0,
    }
    base.update(kw)
    return JobRecord(**base)  # type: ignore[arg-type]


def w(rid: int, ready: bool = True, alive: bool = True, capacity: float = 1.0) -> WorkerView:
    return WorkerView(rid, ready, alive, capacity)


def test_queued_jobs_start_in_order_on_free_workers_lowest_id_first() -> None:
    actions = plan_dispatch([w(2), w(1), w(3)], [job(5), job(4), job(6, R, 3)], {})
    assert actions == [StartJob(4, 1), StartJob(5, 2)]


def test_the_head_of_the_queue_waits_rather_than_be_overtaken() -> None:
    big, small = job(1, slots=2.0), job(2, slots=0.5)
    assert plan_dispatch([w(1, capacity=1.0)], [big, small], {}) == []


def test_jobs_pack_on_a_worker_when_they_ask_for_less() -> None:
    jobs = [job(i, slots=0.5) for i in (1, 2, 3)]
    assert plan_dispatch([w(1)], jobs, {}) == [StartJob(1, 1), StartJob(2, 1)]


def test_tiny_jobs_pack_no_more_than_the_bound_on_one_worker() -> None:
    """`cpus: 0.001` on a 1-CPU worker: 64 jobs at once (the bound), the rest wait or go to
    another worker; a running one counts against the bound."""
    tiny = [job(i, slots=0.001) for i in range(1, MAX_JOBS_PER_WORKER + 11)]
    started = plan_dispatch([w(1), w(2)], tiny, {})
    on_first = [a for a in started if isinstance(a, StartJob) and a.worker_id == 1]
    assert len(on_first) == MAX_JOBS_PER_WORKER
    assert len(started) == MAX_JOBS_PER_WORKER + 10  # the rest on worker 2
    running = [job(i, R, 1, slots=0.001) for i in range(1, MAX_JOBS_PER_WORKER + 1)]
    assert plan_dispatch([w(1)], [*running, job(100, slots=0.001)], {}) == []


def test_workers_not_ready_take_no_job() -> None:
    assert plan_dispatch([w(1, ready=False)], [job(1)], {}) == []


def test_exits_finish_jobs_and_free_their_worker_in_the_same_round() -> None:
    actions = plan_dispatch(
        [w(1), w(2)], [job(1, R, 1), job(2, R, 2), job(3)], {1: JobExit(0), 2: JobExit(3)}
    )
    assert actions == [
        FinishJob(1, JobStatus.SUCCEEDED, 0, "exited with code 0"),
        FinishJob(2, JobStatus.FAILED, 3, "exited with code 3"),
        StartJob(3, 1),
    ]


def test_a_job_killed_with_its_lost_worker_is_requeued_and_fails_after_the_limit() -> None:
    lost = [w(1, ready=False, alive=False), w(2)]
    again = plan_dispatch(lost, [job(1, R, 1, attempts=1)], {1: JobExit(-9)})
    assert again == [RequeueJob(1, "worker 1 was lost; requeued (attempt 2 next)")]
    vanished = plan_dispatch(lost, [job(1, R, 1)], {1: JobExit(-9, lost=True)})
    assert isinstance(vanished[0], RequeueJob)
    no_exit_seen = plan_dispatch(lost, [job(1, R, 1, attempts=3)], {}, max_attempts=3)
    assert isinstance(no_exit_seen[0], FinishJob) and no_exit_seen[0].status is JobStatus.FAILED
    assert "not requeued" in no_exit_seen[0].reason
    # A signal with the worker alive is the job's own end (e.g. the OOM killer): FAILED.
    own = plan_dispatch([w(1)], [job(1, R, 1)], {1: JobExit(-9)})
    assert own == [FinishJob(1, JobStatus.FAILED, -9, "killed by signal SIGKILL")]


def test_busy_workers_are_those_running_a_job() -> None:
    assert busy_workers([job(1, R, 2), job(2), job(3, JobStatus.SUCCEEDED, 1)]) == {2}


def scale(
    state: PoolScale, queued: int, running: float, now: float, lo: int = 0, hi: int = 10
) -> PoolScale:
    return pool_target(lo, hi, 2, 5.0, 60.0, state, queued, running, 1.0, now)


def test_a_fixed_pool_keeps_its_size() -> None:
    assert pool_target(3, 3, 1, 0, 0, PoolScale(0), 50, 3, 1.0, 0.0).target == 3


def test_from_zero_at_once_and_straight_to_what_the_queue_fills() -> None:
    s = scale(PoolScale(0), queued=1, running=0, now=0.0)
    assert s.target == 1  # any job wakes a pool at zero, with no delay
    s = scale(PoolScale(1), queued=7, running=1, now=10.0)
    assert s.target == 1 and s.queue_long_since == 10.0  # waits out the upscale delay
    s = scale(s, queued=7, running=1, now=15.0)
    assert s.target == 8  # one step to running + queued, not one worker per delay
    assert scale(PoolScale(1), queued=50, running=1, now=0.0, hi=10).target == 1
    assert scale(PoolScale(1, 0.0), queued=50, running=1, now=5.0, hi=10).target == 10


def test_a_short_queue_below_the_threshold_adds_nobody() -> None:
    assert scale(PoolScale(2), queued=1, running=2, now=100.0).target == 2


def test_down_to_the_busy_workers_after_the_idle_delay_never_below_min() -> None:
    s = scale(PoolScale(6), queued=0, running=2, now=0.0, lo=1)
    assert s.target == 6 and s.idle_since == 0.0
    s = scale(s, queued=0, running=2, now=59.0, lo=1)
    assert s.target == 6
    assert scale(s, queued=0, running=2, now=60.0, lo=1).target == 2
    assert scale(PoolScale(6, None, 0.0), 0, 0, 60.0, lo=1).target == 1


@pytest.mark.parametrize("raw", [{}, {"target": -1}, {"target": "x", "idle_since": "nan"}])
def test_stored_scale_state_that_is_junk_reads_as_a_fresh_one(raw: dict[str, object]) -> None:
    s = PoolScale.from_json(raw)
    assert s.target == 0 and s.idle_since is None and s.queue_long_since is None


def test_job_slots_pack_by_the_largest_share_and_refuse_what_does_not_fit() -> None:
    from fleetserve.policies.jobs import job_slots

    assert job_slots(4, None, 1, None) == 0.25  # four 1-CPU jobs on a 4-CPU worker
    assert job_slots(8, 2, 2, 1) == 0.5  # the accelerators are the tighter share
    assert job_slots(None, None, 1, None) == 1.0  # the pool does not say: a worker each
    assert job_slots(4, None, 0.001, None) == 1 / MAX_JOBS_PER_WORKER  # at least 1/64
    assert job_slots(4, 1, None, None) == 1.0  # the job does not say: a worker each
    with pytest.raises(ValueError, match="asks for 8 CPUs, a worker has 4"):
        job_slots(4, None, 8, None)


def test_packed_jobs_need_fewer_workers() -> None:
    s = pool_target(0, 10, 1, 0.0, 60.0, PoolScale(0), 8, 0.0, 1.0, 0.0, queued_slots=2.0)
    assert s.target == 2  # eight quarter-worker jobs: two workers


def test_bash_signal_codes_count_as_signals() -> None:
    lost = [w(1, ready=False, alive=False), w(2)]
    assert isinstance(plan_dispatch(lost, [job(1, R, 1)], {1: JobExit(137)})[0], RequeueJob)
    own = plan_dispatch([w(1)], [job(1, R, 1)], {1: JobExit(137)})
    assert own == [FinishJob(1, JobStatus.FAILED, 137, "killed by signal SIGKILL (exit code 137)")]
