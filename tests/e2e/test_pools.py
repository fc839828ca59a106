"""Worker pools through the real CLI, controller and job processes: every rank once, a
controller killed mid-run loses and repeats nothing, cancel and down rules, a lost worker's
job requeued, and autoscaling from zero (docs/pools.md)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from fleetserve.api.models import JobInfo

from .conftest import Fleet

POOL = """\
pool:
  workers: {workers}
setup: echo preparing the worker; sleep 0.3
workdir: {workdir}
envs:
  GREETING: hello
"""
AUTOSCALED = """\
pool:
  min_workers: 0
  max_workers: 3
  upscale_delay_seconds: 0
  downscale_delay_seconds: 2
workdir: {workdir}
"""
JOB = """\
name: ranks
run: |
  echo "rank $SKYPILOT_JOB_RANK of $SKYPILOT_NUM_JOBS on worker $FLEETSERVE_WORKER_ID: $GREETING"
  sleep {seconds}
  echo "$SKYPILOT_JOB_RANK $SKYPILOT_NUM_JOBS" >> {out}
"""


def write(fleet: Fleet, name: str, text: str) -> Path:
    path = fleet.home.parent / name
    path.write_text(text)
    return path


def apply(fleet: Fleet, workers: int = 3, name: str = "batch") -> None:
    pool = write(fleet, f"{name}.yaml", POOL.format(workers=workers, workdir=fleet.workdir))
    fleet.cli("pool", "apply", "-p", name, str(pool))
    client = fleet.client()
    fleet.wait_for(
        f"{workers} READY workers",
        lambda: sum(r.status == "READY" for r in client.pools(name)[0].replicas) == workers,
        timeout=60,
    )


def job_file(fleet: Fleet, seconds: float, out: Path) -> Path:
    return write(fleet, "job.yaml", JOB.format(seconds=seconds, out=out))


def ranks(out: Path) -> list[str]:
    return sorted(out.read_text().split("\n")[:-1], key=lambda line: int(line.split()[0]))


def jobs_done(fleet: Fleet, pool: str, count: int) -> list[JobInfo]:
    jobs = fleet.client().jobs(pool)
    return (
        jobs
        if len(jobs) >= count and all(j.status != "PENDING" and j.status != "RUNNING" for j in jobs)
        else []
    )


def test_a_pool_of_three_runs_thirty_jobs_each_rank_once(fleet: Fleet) -> None:
    apply(fleet)
    out = fleet.home.parent / "ranks.txt"
    proc = fleet.cli(
        "jobs",
        "launch",
        "-p",
        "batch",
        "--num-jobs",
        "30",
        "--wait",
        str(job_file(fleet, 1, out)),
        timeout=120,
    )
    assert "30 succeeded, 0 did not" in proc.stdout
    assert ranks(out) == [f"{i} 30" for i in range(30)]  # every rank, once
    jobs = fleet.client().jobs("batch")
    assert [j.rank for j in jobs] == list(range(30)) and {j.attempts for j in jobs} == {1}
    assert {j.worker_id for j in jobs} == {1, 2, 3}  # all three workers took jobs
    log = fleet.cli("jobs", "logs", str(jobs[4].job_id)).stdout
    assert f"rank 4 of 30 on worker {jobs[4].worker_id}: hello" in log
    queue = fleet.cli("jobs", "queue", "-p", "batch").stdout
    assert "SUCCEEDED" in queue and "PENDING" not in queue


def test_a_controller_killed_mid_run_loses_no_job_and_repeats_none(fleet: Fleet) -> None:
    apply(fleet)
    out = fleet.home.parent / "ranks.txt"
    fleet.cli("jobs", "launch", "-p", "batch", "--num-jobs", "12", str(job_file(fleet, 1.5, out)))
    client = fleet.client()
    fleet.wait_for(
        "a job finished", lambda: any(j.status == "SUCCEEDED" for j in client.jobs("batch"))
    )
    os.kill(fleet.controller_pid(), signal.SIGKILL)
    time.sleep(1.5)  # jobs keep running and finishing while no controller is there
    fleet.cli("server", "start")
    fleet.wait_for("all 12 jobs ended", lambda: jobs_done(fleet, "batch", 12), timeout=60)
    jobs = client.jobs("batch")
    assert [j.status for j in jobs] == ["SUCCEEDED"] * 12
    assert {j.attempts for j in jobs} == {1}  # none started twice
    assert ranks(out) == [f"{i} 12" for i in range(12)]


def test_cancel_stops_a_running_job_and_down_waits_for_unfinished_jobs(fleet: Fleet) -> None:
    apply(fleet, workers=1)
    marker = "fleetserve-test-long-job"
    long_job = write(fleet, "long.yaml", f"run: exec -a {marker} sleep 60\n")
    fleet.cli("jobs", "launch", "-p", "batch", "--num-jobs", "3", str(long_job))
    client = fleet.client()
    fleet.wait_for("job 1 running", lambda: client.jobs("batch")[0].status == "RUNNING")
    first = client.jobs("batch")[0]

    def running_marker() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if p.info["cmdline"] and p.info["cmdline"][0] == marker:
                found.append(p)
        return found

    assert len(running_marker()) == 1
    fleet.cli("jobs", "cancel", str(first.job_id))
    fleet.wait_for("the next job running", lambda: client.jobs("batch")[1].status == "RUNNING")
    assert client.job(first.job_id).status == "CANCELLED"
    assert len(running_marker()) == 1  # the cancelled one's process is gone, the next runs
    refused = fleet.cli("pool", "down", "batch", check=False)
    assert refused.returncode == 4 and "2 unfinished jobs" in refused.stderr
    fleet.cli("pool", "down", "batch", "--cancel-jobs")
    assert [j.status for j in client.jobs("batch")] == ["CANCELLED"] * 3
    fleet.wait_for("no job process left", lambda: not running_marker(), timeout=20)


def test_a_job_whose_worker_is_lost_is_requeued_and_succeeds(fleet: Fleet) -> None:
    apply(fleet, workers=2)
    out = fleet.home.parent / "ranks.txt"
    fleet.cli("jobs", "launch", "-p", "batch", str(job_file(fleet, 4, out)))
    client = fleet.client()
    fleet.wait_for("the job running", lambda: client.jobs("batch")[0].status == "RUNNING")
    worker = client.jobs("batch")[0].worker_id
    fleet.cli("chaos", "preempt", "batch", "--replica", str(worker))
    fleet.wait_for("the job ended", lambda: jobs_done(fleet, "batch", 1), timeout=60)
    job = client.jobs("batch")[0]
    assert job.status == "SUCCEEDED" and job.attempts == 2 and job.worker_id != worker
    assert ranks(out) == ["0 1"]  # the lost run never got to write
    events = [e.message for e in client.events("batch", limit=200)]
    assert any(f"worker {worker} was lost; requeued" in m for m in events)


def test_an_autoscaled_pool_grows_from_zero_with_the_queue_and_shrinks_back(fleet: Fleet) -> None:
    pool = write(fleet, "auto.yaml", AUTOSCALED.format(workdir=fleet.workdir))
    fleet.cli("pool", "apply", "-p", "auto", str(pool))
    client = fleet.client()
    time.sleep(2)
    assert client.pools("auto")[0].replicas == []  # nothing queued: no worker
    out = fleet.home.parent / "ranks.txt"
    fleet.cli("jobs", "launch", "-p", "auto", "--num-jobs", "6", str(job_file(fleet, 2, out)))
    fleet.wait_for("3 workers", lambda: len(client.pools("auto")[0].replicas) == 3, timeout=30)
    fleet.wait_for("all 6 jobs ended", lambda: jobs_done(fleet, "auto", 6), timeout=90)
    assert [j.status for j in client.jobs("auto")] == ["SUCCEEDED"] * 6
    fleet.wait_for(
        "back to zero workers",
        lambda: not [r for r in client.pools("auto")[0].replicas if r.status == "READY"],
        timeout=30,
    )
    events = [e.message for e in client.events("auto", limit=300)]
    assert any("workers 0 -> 3" in m for m in events), events


def test_bad_pool_and_job_input_is_refused_with_a_line(fleet: Fleet) -> None:
    apply(fleet, workers=1)
    service = write(fleet, "svc.yaml", "service: {readiness_probe: /}\nrun: echo\n")
    no_run = write(fleet, "norun.yaml", "name: x\nenvs: {A: 1}\n")
    good = write(fleet, "ok.yaml", "run: echo hi\n")
    for args, code, words in (
        (("pool", "apply", "-p", "x", str(service)), 2, "not a pool YAML"),
        (("pool", "apply", str(service)), 2, "-p NAME"),
        (("jobs", "launch", "-p", "batch", str(no_run)), 2, "run"),
        (("jobs", "launch", "-p", "batch", "--num-jobs", "0", str(good)), 2, "num"),
        (("jobs", "launch", "-p", "nope", str(good)), 3, "nope"),
        (("jobs", "launch", "-p", "batch", str(service)), 2, "no service section"),
        (("jobs", "cancel"), 2, "-p POOL"),
        (("jobs", "logs", "999"), 3, "999"),
        (("pool", "down", "nope"), 3, "nope"),
    ):
        proc = fleet.cli(*args, check=False)
        assert proc.returncode == code, (args, proc.returncode, proc.stderr)
        assert words in proc.stderr, (args, proc.stderr)


def test_apply_resizes_in_place_and_rolls_workers_without_killing_a_running_job(
    fleet: Fleet,
) -> None:
    apply(fleet, workers=2)
    out = fleet.home.parent / "ranks.txt"
    fleet.cli("jobs", "launch", "-p", "batch", str(job_file(fleet, 6, out)))
    client = fleet.client()
    fleet.wait_for("the job running", lambda: client.jobs("batch")[0].status == "RUNNING")
    busy = client.jobs("batch")[0].worker_id
    # A new version (other envs): the idle worker rolls at once, the busy one after its job.
    v2 = write(
        fleet, "v2.yaml", POOL.format(workers=2, workdir=fleet.workdir).replace("hello", "v2")
    )
    assert "updated" in fleet.cli("pool", "apply", "-p", "batch", str(v2)).stdout
    fleet.wait_for("the job ended", lambda: jobs_done(fleet, "batch", 1), timeout=60)
    job = client.jobs("batch")[0]
    assert job.status == "SUCCEEDED" and job.attempts == 1 and job.worker_id == busy
    fleet.wait_for(
        "2 READY workers of version 2",
        lambda: (
            [r.version for r in client.pools("batch")[0].replicas if r.status == "READY"] == [2, 2]
        ),
        timeout=60,
    )
    before = {r.replica_id for r in client.pools("batch")[0].replicas if r.status == "READY"}
    resized = fleet.cli("pool", "apply", "-p", "batch", "--workers", "1").stdout
    assert "resized in place: 1 worker(s) wanted" in resized  # the new size, not the old 3
    fleet.wait_for(
        "1 worker",
        lambda: len([r for r in client.pools("batch")[0].replicas if r.status == "READY"]) == 1,
        timeout=60,
    )
    left = [r for r in client.pools("batch")[0].replicas if r.status == "READY"]
    assert left[0].replica_id in before and left[0].version == 3  # kept, moved in place
    assert client.pools("batch")[0].target_replicas == 1


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "skypilot_pools"


@pytest.mark.slow  # about 70 s on a busy machine
def test_skypilots_batch_job_runs_unchanged_and_small_jobs_pack_on_a_worker(
    fleet: Fleet,
) -> None:
    pool = write(
        fleet,
        "cpu4.yaml",
        f"pool:\n  workers: 1\nresources:\n  cpus: 4\nworkdir: {fleet.workdir}\n",
    )
    fleet.cli("pool", "apply", "-p", "cpu4", str(pool))
    # SkyPilot's own example (tests/fixtures/skypilot_pools), unchanged: one job per worker.
    proc = fleet.cli(
        "jobs",
        "launch",
        "-p",
        "cpu4",
        "--num-jobs",
        "3",
        "--wait",
        str(FIXTURES / "batch-job.yaml"),
        timeout=120,
    )
    assert "3 succeeded" in proc.stdout
    client = fleet.client()
    jobs = client.jobs("cpu4")
    assert [j.name for j in jobs] == ["batch-workload"] * 3
    log = fleet.cli("jobs", "logs", str(jobs[2].job_id)).stdout
    assert "Job rank: 2 out of 3" in log and "Processing prompts from 200 to 300" in log
    # Four 1-CPU jobs on one 4-CPU worker run at once (SkyPilot runs one job per worker).
    small = write(fleet, "small.yaml", "resources: {cpus: 1}\nrun: sleep 3\n")
    fleet.cli("jobs", "launch", "-p", "cpu4", "--num-jobs", "4", "--wait", str(small), timeout=120)
    packed = client.jobs("cpu4")[3:]
    starts = [j.started_at or 0 for j in packed]
    assert {j.worker_id for j in packed} == {jobs[0].worker_id}
    assert max(starts) - min(starts) < 2.5  # all four started before the first ended
    too_big = write(fleet, "big.yaml", "resources: {cpus: 8}\nrun: echo big\n")
    refused = fleet.cli("jobs", "launch", "-p", "cpu4", str(too_big), check=False)
    assert refused.returncode == 2 and "asks for 8 CPUs, a worker has 4" in refused.stderr
    # SkyPilot's pool example is valid, and refused here with one line (an s3 bucket mount).
    assert fleet.cli("validate", str(FIXTURES / "pool.yaml")).returncode == 0
    s3 = fleet.cli("pool", "apply", "-p", "s3", str(FIXTURES / "pool.yaml"), check=False)
    assert s3.returncode == 2 and "file_mounts./my-data" in s3.stderr
    # SkyPilot's examples/batch pool YAML with a `run`: applied, `run` ignored with a warning
    # (as `sky jobs pool apply` does), its workers come up.
    fmt = fleet.cli("pool", "apply", "-p", "fmt", str(FIXTURES / "custom_formats_pool.yaml"))
    assert fmt.returncode == 0
    fleet.wait_for(
        "2 READY workers",
        lambda: sum(r.status == "READY" for r in client.pools("fmt")[0].replicas) == 2,
        timeout=60,
    )
    assert any("run: ignored in a pool" in e.message for e in client.events("fmt"))


def test_service_commands_keep_pool_rules_and_a_broken_pool_fails_its_queue(fleet: Fleet) -> None:
    apply(fleet, workers=1)
    pool_yaml = fleet.home.parent / "batch.yaml"
    up = fleet.cli("up", str(pool_yaml), "-n", "other", check=False)
    assert up.returncode == 2 and "pool apply" in up.stderr
    svc = write(fleet, "svc.yaml", "service: {readiness_probe: /health}\nrun: python3 server.py\n")
    changed = fleet.cli("update", "batch", str(svc), check=False)
    assert changed.returncode == 4 and "is a pool" in changed.stderr
    long_job = write(fleet, "long.yaml", "run: sleep 30\n")
    fleet.cli("jobs", "launch", "-p", "batch", str(long_job))
    down = fleet.cli("down", "batch", check=False)
    assert down.returncode == 4 and "unfinished jobs" in down.stderr
    fleet.cli("pool", "down", "batch", "--cancel-jobs")
    assert [j.status for j in fleet.client().jobs("batch")] == ["CANCELLED"]
    # A pool whose setup fails: its queued jobs fail with the reason, new ones are refused.
    # Its setup fails only once the jobs are queued (on a loaded machine three quick failures
    # could stop the pool's launches before `jobs launch` ran, which then refuses the jobs).
    go = fleet.home.parent / "bad-go"
    setup = f"while [ ! -e {go} ]; do sleep 0.2; done; exit 7"
    bad = write(fleet, "bad.yaml", f"pool: {{workers: 1}}\nsetup: {setup}\n")
    fleet.cli("pool", "apply", "-p", "bad", str(bad))
    fleet.cli("jobs", "launch", "-p", "bad", "--num-jobs", "2", str(long_job))
    go.touch()
    fleet.wait_for("the queue failed", lambda: jobs_done(fleet, "bad", 2), timeout=60)
    jobs = fleet.client().jobs("bad")
    assert {j.status for j in jobs} == {"FAILED"}
    assert "setup failed with exit code 7" in (jobs[0].reason or "")
    refused = fleet.cli("jobs", "launch", "-p", "bad", str(long_job), check=False)
    assert refused.returncode == 4 and "cannot start workers" in refused.stderr


def test_a_job_cannot_break_its_worker_for_the_next_ones(fleet: Fleet) -> None:
    apply(fleet, workers=1)
    marker = "fleetserve-test-leftover"
    leftover = write(fleet, "bg.yaml", f"run: (exec -a {marker} sleep 300 &) ; echo started\n")
    fleet.cli("jobs", "launch", "-p", "batch", "--wait", str(leftover))

    def leftovers() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and p.info["cmdline"][0] == marker
        ]

    fleet.wait_for("the ended job's background child stopped", lambda: not leftovers(), 20)
    # A job that deletes its worker's folder: the worker is replaced, later jobs still run.
    wipe = write(fleet, "wipe.yaml", 'run: rm -rf "$PWD"\n')
    fleet.cli("jobs", "launch", "-p", "batch", "--wait", str(wipe))
    out = fleet.home.parent / "ranks.txt"
    done = fleet.cli(
        "jobs",
        "launch",
        "-p",
        "batch",
        "--num-jobs",
        "3",
        "--wait",
        str(job_file(fleet, 0.2, out)),
        timeout=120,
    )
    assert "3 succeeded" in done.stdout
    workers = fleet.client().pools("batch")[0].replicas
    assert any(r.status == "FAILED" and "cannot take jobs" in (r.reason or "") for r in workers)
    # A followed log ends when its job does.
    fleet.cli(
        "jobs",
        "launch",
        "-p",
        "batch",
        str(write(fleet, "tick.yaml", "run: echo a; sleep 2; echo b\n")),
    )
    last = fleet.client().jobs("batch")[-1]
    started = time.monotonic()
    followed = fleet.cli("jobs", "logs", str(last.job_id), "-f", timeout=30).stdout
    assert followed.split() == ["a", "b"] and time.monotonic() - started < 15
