"""`fleetserve pool ...` and `fleetserve jobs ...`: worker pools and the batch jobs run on them
(SkyPilot's `sky jobs pool` and `sky jobs launch -p`; docs/pools.md)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fleetserve.api.models import JobInfo, ServiceInfo
from fleetserve.cli.completion import complete_pool
from fleetserve.cli.envs import overrides
from fleetserve.cli.output import OutputFormat, OutputOption, emit
from fleetserve.cli.progress import Progress
from fleetserve.cli.render import ago, styled
from fleetserve.cli.safe import safe
from fleetserve.client import Client
from fleetserve.core.errors import FleetserveError, InvalidSpec, ServiceFailed

pool_app = typer.Typer(help="Worker pools: warm workers that run batch jobs.", no_args_is_help=True)
jobs_app = typer.Typer(help="Batch jobs on a worker pool.", no_args_is_help=True)
out = Console(highlight=False)
# Messages are never wrapped by rich: a long error keeps its `command` whole on one line.
err = Console(stderr=True, highlight=False, soft_wrap=True)

PoolName = Annotated[
    str, typer.Option("-p", "--pool", help="The pool's name.", autocompletion=complete_pool)
]
Envs = Annotated[
    list[str] | None,
    typer.Option("--env", help="KEY=VALUE over the YAML's envs (repeatable); KEY alone: yours"),
]


_POOL_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def _pool_name(name: str) -> str:
    if not name:
        raise InvalidSpec("name the pool with -p NAME")
    if not _POOL_NAME.fullmatch(name):
        raise InvalidSpec(
            f"pool name {name[:80]!r}: use 1-63 lowercase letters, digits and '-', starting with "
            "a letter and not ending with '-'"
        )
    return name


def _fail(e: FleetserveError) -> typer.Exit:
    err.print(f"[red]Error:[/] {safe(e.message)}")
    return typer.Exit(e.exit_code)


def pools_table(pools: list[ServiceInfo]) -> Table:
    t = Table(title="Pools", title_justify="left")
    for col in ("NAME", "VERSION", "UPTIME", "STATUS", "WORKERS", "TARGET"):
        t.add_column(col)
    for p in pools:
        ready = sum(r.status == "READY" for r in p.replicas)
        t.add_row(
            p.name,
            str(p.active_version),
            ago(p.created_at).removesuffix(" ago"),
            styled(p.status),
            f"{ready}/{len([r for r in p.replicas if 'FAIL' not in r.status])}",
            str(p.target_replicas),
        )
    return t


def workers_table(pools: list[ServiceInfo], jobs: list[JobInfo]) -> Table:
    busy = {(j.pool, j.worker_id): j.job_id for j in jobs if j.status == "RUNNING"}
    t = Table(title="Pool Workers", title_justify="left")
    for col in ("POOL_NAME", "ID", "VERSION", "LAUNCHED", "STATUS", "USED_BY", "REASON"):
        t.add_column(col)
    for p in pools:
        for r in p.replicas:
            job = busy.get((p.name, r.replica_id))
            t.add_row(
                p.name,
                str(r.replica_id),
                str(r.version),
                ago(r.launched_at),
                styled(r.status),
                f"job {job}" if job else "-",
                safe(r.reason or ""),
            )
    return t


def _job_status(status: str) -> str:
    color = {"SUCCEEDED": "green", "RUNNING": "cyan", "PENDING": "dim", "CANCELLED": "yellow"}
    return f"[{color.get(status, 'red')}]{status}[/]"


def jobs_table(jobs: list[JobInfo]) -> Table:
    t = Table(title="Jobs", title_justify="left")
    for col in (
        "ID",
        "POOL",
        "NAME",
        "RANK",
        "STATUS",
        "WORKER",
        "SUBMITTED",
        "DURATION",
        "REASON",
    ):
        t.add_column(col, no_wrap=col != "REASON", min_width=9 if col == "STATUS" else None)
    now = time.time()
    for j in jobs:
        took = "-" if j.started_at is None else f"{(j.ended_at or now) - j.started_at:.1f}s"
        t.add_row(
            str(j.job_id),
            safe(j.pool),
            safe(j.name or "-"),
            f"{j.rank}/{j.num_jobs}",
            _job_status(j.status),
            str(j.worker_id) if j.worker_id else "-",
            ago(j.created_at),
            took,
            safe(j.reason or ""),
        )
    return t


YesOption = Annotated[
    bool,
    typer.Option("--yes", "-y", help="Skip confirmation (accepted for SkyPilot habits)."),
]
WAIT_POLL = 0.5  # seconds between polls of --wait


@pool_app.command("apply")
def apply(
    file: Annotated[Path | None, typer.Argument(help="Pool YAML (top-level pool:).")] = None,
    pool: PoolName = "",
    workers: Annotated[
        int | None, typer.Option("--workers", help="A fixed number of workers.")
    ] = None,
    env: Envs = None,
    secret: Annotated[list[str] | None, typer.Option("--secret", help="KEY=VALUE")] = None,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Show progress until the wanted workers are READY."),
    ] = False,
    yes: YesOption = False,
) -> None:
    """Create a pool, or update it in place: resize it (--workers) or roll its workers to a new
    YAML (busy workers finish their jobs first)."""
    try:
        _pool_name(pool)
        if file is None and workers is None:
            raise InvalidSpec("give a pool YAML, --workers N, or both")
        envs, secrets = overrides(env, None, secret, os.environ)
        client = Client()
        done = client.apply_pool(pool, file, workers, envs, secrets)
        p = done.pool
        out.print(
            f"Pool [bold]{safe(p.name)}[/] {done.action}: {p.target_replicas} worker(s) wanted."
        )
        if done.note:
            err.print(f"Note: {safe(done.note)}.", soft_wrap=True)
        if wait:
            with Progress(out, err) as prog:
                p = _wait_workers(client, p.name, prog)
            ready = sum(r.status == "READY" for r in p.replicas)
            out.print(f"Pool {safe(p.name)}: {ready} worker(s) READY.")
    except FleetserveError as e:
        raise _fail(e) from None
    out.print(
        f"Submit jobs with `fleetserve jobs launch -p {p.name} [--num-jobs N] job.yaml`.",
        soft_wrap=True,
    )


def _wait_workers(client: Client, name: str, prog: Progress) -> ServiceInfo:
    """Until as many workers of the active version are READY as the pool wants (at least
    one of a pool that may scale to zero is not waited for), or the pool fails."""
    seen: dict[int, str] = {}
    while True:
        p = client.through_restarts(lambda: client.pools(name)[0])
        for r in p.replicas:
            if seen.get(r.replica_id) != r.status:
                seen[r.replica_id] = r.status
                why = f" - {safe(r.reason)}" if r.reason else ""
                prog.line(f"  worker {r.replica_id} (v{r.version}): {styled(r.status)}{why}")
        ready = [r for r in p.replicas if r.status == "READY" and r.version == p.active_version]
        prog.state(f"{safe(name)}: {len(ready)}/{p.target_replicas} worker(s) READY")
        if p.failure_reason and not ready:
            raise ServiceFailed(
                f"pool {name} cannot start workers: {p.failure_reason}. Fix it with "
                f"`fleetserve pool apply -p {name} FILE`"
            )
        if len(ready) >= p.target_replicas:
            return p
        time.sleep(WAIT_POLL)


PoolArg = Annotated[str, typer.Argument(help="Pool.", autocompletion=complete_pool)]


@pool_app.command("status")
def pool_status(
    name: Annotated[
        str | None, typer.Argument(help="One pool.", autocompletion=complete_pool)
    ] = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Pools and their workers (which job each runs). `-o json` prints the REST API's body
    (GET /pools, or /pools/NAME with a NAME)."""
    try:
        client = Client()
        pools = client.pools(name)
        if output is not OutputFormat.table:
            emit(pools[0] if name is not None else pools, output)
            return
        jobs = client.jobs(name) if name else client.jobs()
    except FleetserveError as e:
        raise _fail(e) from None
    if not pools:
        out.print("No pools. Create one with `fleetserve pool apply -p NAME pool.yaml`.")
        return
    out.print(pools_table(pools))
    for p in pools:
        if p.failure_reason:
            out.print(f"[red]{safe(p.name)}:[/] {safe(p.failure_reason)}")
    out.print(workers_table(pools, jobs))


@pool_app.command("down")
def pool_down(
    name: PoolArg,
    purge: Annotated[bool, typer.Option("--purge", help="Even if a teardown failed.")] = False,
    cancel_jobs: Annotated[
        bool, typer.Option("--cancel-jobs", help="Cancel its unfinished jobs first.")
    ] = False,
    yes: YesOption = False,
) -> None:
    """Stop a pool's workers and remove it (refused while jobs are unfinished)."""
    try:
        client = Client()
        client.down_pool(name, purge, cancel_jobs)
        left = client.wait_gone(name, purge=purge)
    except FleetserveError as e:
        raise _fail(e) from None
    if left is not None:
        raise _fail(FleetserveError(f"pool {name} is not gone: {left.failure_reason}"))
    out.print(f"Pool {name} is down.")


ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")


@jobs_app.command("launch")
def launch(
    file: Annotated[Path, typer.Argument(help="Job YAML (name, run, envs).")],
    pool: PoolName = "",
    num_jobs: Annotated[
        int, typer.Option("--num-jobs", help="Ranks 0..N-1 (SKYPILOT_JOB_RANK).")
    ] = 1,
    name: Annotated[str | None, typer.Option("-n", "--name", help="Job name.")] = None,
    env: Envs = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Show each job's end until all have ended (exit 1 if any did not succeed).",
        ),
    ] = False,
    yes: YesOption = False,
    output: Annotated[
        OutputFormat,
        typer.Option(
            "-o",
            "--output",
            case_sensitive=False,
            help="table (default), json or yaml: no progress, only the jobs (GET /jobs's body)",
        ),
    ] = OutputFormat.table,
) -> None:
    """Queue jobs on a pool; each runs on a free worker, in order."""
    quiet = output is not OutputFormat.table
    try:
        _pool_name(pool)
        envs, _ = overrides(env, None, None, os.environ)
        client = Client()
        jobs = client.launch_jobs(pool, file, num_jobs, envs, name)
        ids = [j.job_id for j in jobs]
        span = f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
        with Progress(out, err, quiet) as prog:
            prog.line(f"Queued {len(ids)} job(s) on pool {safe(pool)}: ids {span}.")
            if not wait:
                prog.line(f"Follow them with `fleetserve jobs queue -p {pool}`.")
            else:
                jobs = _wait_jobs(client, pool, ids, prog)
    except FleetserveError as e:
        raise _fail(e) from None
    if quiet:
        emit(jobs, output)
    if not wait:
        return
    failed = [j for j in jobs if j.status != "SUCCEEDED"]
    if not quiet:
        out.print(f"{len(jobs) - len(failed)} succeeded, {len(failed)} did not.")
        if failed:
            out.print(f"`fleetserve jobs logs {failed[0].job_id}` shows why.", soft_wrap=True)
    if failed:
        raise typer.Exit(1)


def _wait_jobs(client: Client, pool: str, ids: list[int], prog: Progress) -> list[JobInfo]:
    """Poll until every job has ended: a line per job that ends (or starts, on a terminal
    the counts on the spinner line)."""
    told: dict[int, str] = {}
    hinted = False
    while True:
        now = client.through_restarts(
            lambda: [client.job(i) for i in ids] if len(ids) <= 20 else _batch(client, pool, ids)
        )
        if not hinted and any(j.status == "PENDING" for j in now):
            hinted = True
            with contextlib.suppress(FleetserveError):
                svc = client.service(pool)
                if svc.max_replicas == 0:
                    prog.line(
                        f"Pool {safe(pool)} has no worker and may have none (0 wanted, at "
                        f"most 0): the jobs wait until it has one. `fleetserve pool apply -p "
                        f"{safe(pool)} --workers N` gives it some; Ctrl-C stops waiting."
                    )
        counts: dict[str, int] = {}
        for j in now:
            counts[j.status] = counts.get(j.status, 0) + 1
            if j.status in ENDED and told.get(j.job_id) != j.status:
                told[j.job_id] = j.status
                took = (
                    f" in {j.ended_at - j.started_at:.1f}s"
                    if j.ended_at is not None and j.started_at is not None
                    else ""
                )
                why = f" - {safe(j.reason)}" if j.reason and j.status != "SUCCEEDED" else ""
                logs = f" (`fleetserve jobs logs {j.job_id}`)" if j.status == "FAILED" else ""
                prog.line(
                    f"  job {j.job_id} (rank {j.rank}): {_job_status(j.status)}{took}{why}{logs}"
                )
        prog.state(
            f"jobs on {safe(pool)}: "
            + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        )
        if all(j.status in ENDED for j in now):
            return now
        time.sleep(WAIT_POLL)


def _batch(client: Client, pool: str, ids: list[int]) -> list[JobInfo]:
    wanted = set(ids)
    return [j for j in client.jobs(pool, limit=10_000) if j.job_id in wanted]


@jobs_app.command("queue")
def queue(
    pool: Annotated[str | None, typer.Option("-p", "--pool", help="One pool.")] = None,
    limit: Annotated[int, typer.Option(help="The newest N jobs.")] = 100,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Jobs, newest last: status, worker, duration, reason. `-o json` prints the REST API's
    body (GET /jobs)."""
    try:
        jobs = Client().jobs(pool, limit)
    except FleetserveError as e:
        raise _fail(e) from None
    if output is not OutputFormat.table:
        emit(jobs, output)
        return
    if not jobs:
        out.print("No jobs.")
        return
    out.print(jobs_table(jobs))


@jobs_app.command("logs")
def logs(
    job_id: Annotated[int, typer.Argument(help="Job id.")],
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep streaming.")] = False,
) -> None:
    """A job's output."""
    try:
        for line in Client().job_logs(job_id, follow):
            print(line)
    except FleetserveError as e:
        raise _fail(e) from None
    except KeyboardInterrupt:
        return


@jobs_app.command("cancel")
def cancel(
    job_ids: Annotated[list[int] | None, typer.Argument(help="Job ids.")] = None,
    all_jobs: Annotated[bool, typer.Option("--all", help="Every unfinished job of -p.")] = False,
    pool: Annotated[
        str | None, typer.Option("-p", "--pool", help="Every unfinished job of this pool.")
    ] = None,
) -> None:
    """Cancel jobs: queued ones never start, running ones are stopped. `-p POOL` (with or
    without --all, as SkyPilot's `sky jobs cancel -p`) cancels all of a pool's."""
    try:
        if bool(job_ids) == bool(pool) or (all_jobs and not pool):
            raise InvalidSpec("name job ids, or -p POOL [--all] (every unfinished job of it)")
        done = Client().cancel_jobs(job_ids or None, pool)
    except FleetserveError as e:
        raise _fail(e) from None
    ids = ", ".join(str(j.job_id) for j in done)
    out.print(f"Cancelled {len(done)} job(s)" + (f": {ids}" if done else "."))


MAX_SIM_JOBS = 200_000


@pool_app.command("simulate")
def simulate(
    trace: Annotated[
        str | None,
        typer.Option(
            help="Jobs arrive as Poisson arrivals following this request trace (maf1 or a CSV)."
        ),
    ] = None,
    jobs_per_request: Annotated[float, typer.Option(help="With --trace: jobs per request.")] = 2e-5,
    duration: Annotated[float, typer.Option(help="With --trace: seconds of it.")] = 86400.0,
    burst_jobs: Annotated[int, typer.Option(help="Without --trace: jobs per burst.")] = 60,
    bursts: Annotated[int, typer.Option(help="Without --trace: bursts.")] = 2,
    burst_gap: Annotated[float, typer.Option(help="Seconds between bursts.")] = 3600.0,
    job_seconds: Annotated[float, typer.Option(help="Each job's run time.")] = 60.0,
    min_workers: Annotated[int, typer.Option()] = 0,
    max_workers: Annotated[int, typer.Option()] = 10,
    threshold: Annotated[int, typer.Option(help="queue_length_threshold")] = 1,
    upscale_delay: Annotated[float, typer.Option()] = 60.0,
    downscale_delay: Annotated[float, typer.Option()] = 300.0,
    cold_start: Annotated[
        float, typer.Option(help="Seconds from launch to a READY worker.")
    ] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="The same as -o json")] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Compare fleetserve's pool autoscaler with SkyServe's queue-length one on a job-arrival
    trace: the jobs' wait, the makespan, worker-hours. `-o json|yaml` prints the result as data
    (docs/output.md)."""
    from fleetserve.sim.pools import (
        POOL_POLICIES,
        burst_arrivals,
        format_pool_table,
        simulate_pool,
        trace_arrivals,
    )
    from fleetserve.sim.results import pool_simulation
    from fleetserve.sim.simulator import load_trace

    try:
        if as_json and output is OutputFormat.yaml:
            raise ValueError("--json and -o yaml ask for two formats: give one")
        if as_json:
            output = OutputFormat.json
        numbers = (jobs_per_request, duration, burst_gap, job_seconds, upscale_delay)
        if not all(math.isfinite(v) and v >= 0 for v in (*numbers, downscale_delay, cold_start)):
            raise ValueError("times and rates must be finite numbers >= 0")
        if not 0 <= min_workers <= max_workers <= 1000 or max_workers < 1:
            raise ValueError("--min-workers <= --max-workers, within 0..1000 (max >= 1)")
        if job_seconds <= 0 or threshold < 1:
            raise ValueError("--job-seconds > 0 and --threshold >= 1")
        if trace is not None:
            tr = load_trace(trace, duration=duration)
            expected = sum(tr.qps) * tr.step * jobs_per_request
            if expected > MAX_SIM_JOBS:
                raise ValueError(
                    f"about {expected:.0f} jobs: at most {MAX_SIM_JOBS} (lower --jobs-per-request)"
                )
            arrivals = trace_arrivals(tr, jobs_per_request)
        else:
            if not 1 <= burst_jobs * bursts <= MAX_SIM_JOBS:
                raise ValueError(f"--burst-jobs x --bursts within 1..{MAX_SIM_JOBS}")
            arrivals = burst_arrivals(burst_jobs, bursts, burst_gap)
        if not 1 <= len(arrivals) <= MAX_SIM_JOBS:
            raise ValueError(
                f"{len(arrivals)} jobs: within 1..{MAX_SIM_JOBS} (lower --jobs-per-request)"
            )
        runs = [
            simulate_pool(
                arrivals,
                p,
                job_seconds,
                min_workers,
                max_workers,
                threshold,
                upscale_delay,
                downscale_delay,
                cold_start,
            )
            for p in POOL_POLICIES
        ]
    except ValueError as e:
        raise _fail(InvalidSpec(str(e))) from None
    if output is not OutputFormat.table:
        emit(pool_simulation(runs, len(arrivals), job_seconds), output)
        return
    print(format_pool_table(runs))
