"""Replicas and jobs in cgroups of their own (fleetserve.infra.cgroups), with real processes:
children that clear their environment and leave the session (setsid, a double fork, nohup, a
daemon) are stopped with their replica or job, on every launch path, after a controller
restart, by the orphan sweep; names never collide; and the token scan stays where cgroups
cannot be made, which the description says."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from fleetserve.infra import cgroups as cgroups_module
from fleetserve.infra.base import InstanceKind, LaunchRequest
from fleetserve.infra.cgroups import Cgroups, own_cgroup, replica_name
from fleetserve.infra.jobs import JobHandle, JobRequest
from fleetserve.infra.local import TOKEN_ENV, LocalHandle, LocalInfra, processes_with_token
from fleetserve.oshelpers.procs import find_process, started
from tests.escapees import SHAPES, Escapees, escapees, escaping

__all__ = ["escapees"]  # the fixture

HOME_ID = "c9c9c9c9c9c9"


def request(tmp_path: Path, run: str, token: str, **kw: object) -> LaunchRequest:
    base: dict[str, object] = {
        "service": "svc",
        "replica_id": 1,
        "version": 1,
        "launch_token": token,
        "run": run,
    }
    base.update(kw)
    return LaunchRequest(**base)  # type: ignore[arg-type]


def cgroup_of(pid: int) -> str:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line[3:] for line in lines if line.startswith("0::"))


def assert_escaped_the_token_scan(procs: list[psutil.Process], token: str, cgroup: Path) -> None:
    """The shape escapes what stopped processes before cgroups: no token in its environment,
    another session than its replica's, yet it is in the replica's cgroup."""
    scanned = {p.pid for p in processes_with_token(token)}
    for p in procs:
        assert TOKEN_ENV not in p.environ() and p.pid not in scanned
        assert str(cgroup).endswith(cgroup_of(p.pid))


@contextlib.asynccontextmanager
async def launched(infra: LocalInfra, req: LaunchRequest) -> AsyncIterator[LocalHandle]:
    out = await infra.launch(req)
    try:
        yield LocalHandle.from_json(out.handle)
    finally:
        await infra.terminate(out.handle, req.launch_token)


@pytest.fixture
def infra(tmp_path: Path) -> LocalInfra:
    return LocalInfra(tmp_path / "home", grace_seconds=2, home_id=HOME_ID)


def test_this_machine_lets_the_tests_make_cgroups(infra: LocalInfra) -> None:
    """The CI machine (root, cgroup v2): the tests below exercise cgroups, not the fallback."""
    assert infra.cgroups.home is not None, infra.cgroups.describe()
    assert infra.cgroups.describe().startswith("cgroup v2")
    assert not infra.cgroups.home.exists()  # the probe left nothing behind


@pytest.mark.parametrize("path", ["plain", "veth", "userns"])
async def test_escaped_children_of_a_replica_are_stopped_with_it_on_every_launch_path(
    tmp_path: Path, escapees: Escapees, path: str
) -> None:
    infra = LocalInfra(
        tmp_path / "home",
        grace_seconds=2,
        home_id=HOME_ID,
        replica_netns=path.replace("plain", "auto"),
    )
    token = f"{HOME_ID}-{path}"
    own = {"port": 8080, "own_network": True} if path != "plain" else {}
    req = request(tmp_path, escaping(tmp_path / "pids"), token, **own)
    async with launched(infra, req) as h:
        assert h.cgroup is not None and Path(h.cgroup).name == replica_name("svc", 1, token)
        procs = escapees.collect(tmp_path / "pids")
        assert_escaped_the_token_scan(procs, token, Path(h.cgroup))
        await infra.terminate(h.to_json(), token)
        assert escapees.wait_gone() == []
        assert not Path(h.cgroup).exists()
        assert infra.cgroups.home is not None and not infra.cgroups.home.exists()


async def test_a_restarted_controller_stops_the_cgroup_by_handle_by_token_and_as_an_orphan(
    tmp_path: Path, escapees: Escapees
) -> None:
    home = tmp_path / "home"
    first = LocalInfra(home, grace_seconds=2, home_id=HOME_ID)
    a = await first.launch(request(tmp_path, escaping(tmp_path / "a"), f"{HOME_ID}-a"))
    b = await first.launch(
        request(tmp_path, escaping(tmp_path / "b"), f"{HOME_ID}-b", replica_id=2)
    )
    c = await first.launch(
        request(tmp_path, escaping(tmp_path / "c"), f"{HOME_ID}-c", service="other")
    )
    try:
        # The controller restarts: a new infra, none of them its child, nothing in memory.
        restarted = LocalInfra(home, grace_seconds=2, home_id=HOME_ID)
        escapees.collect(tmp_path / "a")
        seen_a = dict(escapees.seen)
        escapees.collect(tmp_path / "b")
        escapees.collect(tmp_path / "c")
        await restarted.terminate(a.handle, f"{HOME_ID}-a")  # by the handle's path
        assert all(find_process(pid, t) is None for pid, t in seen_a.items())
        assert not Path(LocalHandle.from_json(a.handle).cgroup or "/nonexistent").exists()
        assert len(escapees.alive()) == 2 * len(SHAPES)
        # A launch cut short: no handle, found by its token.
        await restarted.terminate(None, f"{HOME_ID}-b")
        assert not Path(LocalHandle.from_json(b.handle).cgroup or "/nonexistent").exists()
        assert len(escapees.alive()) == len(SHAPES)
        # A replica no row knows any more: the orphan sweep stops its cgroup whole.
        assert await restarted.sweep({f"{HOME_ID}-a", f"{HOME_ID}-b"}) >= 1
        assert escapees.wait_gone() == []
        assert restarted.cgroups.home is not None and not restarted.cgroups.home.exists()
    finally:
        for out, token in ((a, "a"), (b, "b"), (c, "c")):
            await first.terminate(out.handle, f"{HOME_ID}-{token}")


async def test_jobs_escapees_go_at_cancel_and_at_their_workers_stop(
    infra: LocalInfra, tmp_path: Path, escapees: Escapees
) -> None:
    token = f"{HOME_ID}-worker"
    worker = await infra.launch(request(tmp_path, "exec sleep 300", token, service="pool"))
    try:

        def job(job_id: int, pids: Path) -> JobRequest:
            return JobRequest(
                pool="pool",
                job_id=job_id,
                token=f"{HOME_ID}-job{job_id}",
                worker_token=token,
                worker_handle=worker.handle,
                run=escaping(pids),
            )

        worker_cgroup = Path(LocalHandle.from_json(worker.handle).cgroup or "/nonexistent")
        # `jobs cancel`: the job's cgroup is killed whole, its worker goes on.
        first = await infra.start_job(job(1, tmp_path / "j1"))
        first_cgroup = Path(JobHandle.from_json(first).cgroup or "/nonexistent")
        assert first_cgroup.parent == worker_cgroup
        procs = escapees.collect(tmp_path / "j1")
        assert_escaped_the_token_scan(procs, f"{HOME_ID}-job1", first_cgroup)
        await infra.stop_job(first, f"{HOME_ID}-job1")
        assert escapees.wait_gone() == []
        assert not first_cgroup.exists() and worker_cgroup.exists()
        assert (await infra.poll(worker.handle)).kind is InstanceKind.RUNNING
        # `pool down`: stopping the worker stops the job running on it, escapees and all.
        second = await infra.start_job(job(2, tmp_path / "j2"))
        escapees.collect(tmp_path / "j2")
        await infra.terminate(worker.handle, token)
        assert escapees.wait_gone() == []
        assert not worker_cgroup.exists()
        assert (await infra.poll_job(second)).kind is not InstanceKind.RUNNING
    finally:
        await infra.terminate(worker.handle, token)


def test_names_are_per_home_service_replica_and_token_and_foreign_paths_are_refused(
    tmp_path: Path,
) -> None:
    one = Cgroups("aaaa", tmp_path / "a")
    two = Cgroups("bbbb", tmp_path / "b")
    assert one.name != two.name
    names = {
        replica_name("svc", 1, "t1"),
        replica_name("svc", 2, "t1"),
        replica_name("other", 1, "t1"),
        replica_name("svc", 1, "t2"),
    }
    assert len(names) == 4
    with pytest.raises(ValueError):
        replica_name("../x", 1, "t")
    assert one.ours(f"/sys/fs/cgroup/{one.name}/r.svc.1.t1") is not None
    assert one.ours(f"/sys/fs/cgroup/{one.name}/r.svc.1.t1/job.3.t3") is not None
    assert one.ours(f"/sys/fs/cgroup/{two.name}/r.svc.1.t1") is None  # another home's
    assert one.ours("/sys/fs/cgroup/system.slice") is None


async def test_without_cgroups_the_token_scan_stops_a_replica_and_says_what_escapes(
    tmp_path: Path, escapees: Escapees
) -> None:
    off = LocalInfra(tmp_path / "home", grace_seconds=2, home_id=HOME_ID, cgroups="off")
    assert off.cgroups.home is None
    assert off.cgroups.describe().startswith("token scan only (FLEETSERVE_CGROUPS=off)")
    token = f"{HOME_ID}-off"
    async with launched(off, request(tmp_path, "setsid sleep 300 & exec sleep 300", token)) as h:
        assert h.cgroup is None
        for _ in range(100):  # the wrapper, then the two sleeps of `run`
            if len(processes_with_token(token)) >= 3:
                break
            await asyncio.sleep(0.05)
        assert len(processes_with_token(token)) >= 3
        await off.terminate(h.to_json(), token)
        assert processes_with_token(token) == []
    # What the description says escapes the token scan does (today's behaviour without
    # cgroups); the test kills them by pid.
    token = f"{HOME_ID}-off-escaping"
    async with launched(off, request(tmp_path, escaping(tmp_path / "pids"), token)) as h:
        escapees.collect(tmp_path / "pids")
        await off.terminate(h.to_json(), token)
        assert len(escapees.alive()) == len(SHAPES)
    # A folder that is not in a cgroup v2 hierarchy: not used, and nothing left in it.
    plain = Cgroups(HOME_ID, tmp_path / "home", base=tmp_path / "not-cgroupfs")
    (tmp_path / "not-cgroupfs").mkdir()
    assert plain.home is None and "not in a cgroup v2 hierarchy" in plain.describe()
    assert list((tmp_path / "not-cgroupfs").iterdir()) == []


def test_a_user_who_may_not_make_cgroups_falls_back_to_the_token_scan() -> None:
    """As `nobody` (the machine's cgroups are root's), the probe fails with its reason."""
    base, why = own_cgroup()
    assert base is not None, why
    # The module as `nobody` runs it: its source on stdin (it needs the standard library only),
    # so that neither the checkout nor the project's interpreter must be readable by nobody.
    source = Path(cgroups_module.__file__).read_text()
    script = source + "\nprint(Cgroups('e0e0e0e0e0e0', Path('/nonexistent')).describe())\n"
    done = subprocess.run(
        ["/usr/bin/python3", "-"],
        input=script,
        user="nobody",
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("token scan only (cannot create cgroup"), done.stdout
    assert "Permission denied" in done.stdout
    assert not (base / "fleetserve-e0e0e0e0e0e0").exists()


async def test_a_cgroup_path_not_of_this_home_in_a_handle_is_not_touched(
    infra: LocalInfra, tmp_path: Path
) -> None:
    """A handle (from the database) naming some other cgroup: the replica's own is stopped,
    never that one."""
    base, why = own_cgroup()
    assert base is not None, why
    other = base / f"fleetserve-test-stranger-{os.getpid()}"
    other.mkdir()
    stranger = subprocess.Popen(
        ["/bin/sh", "-c", 'echo $$ > "$0"; exec sleep 60', str(other / "cgroup.procs")]
    )
    token = f"{HOME_ID}-forged"
    try:
        async with launched(infra, request(tmp_path, "exec sleep 300", token)) as h:
            for forged in (str(other), str(base), f"{h.cgroup}/../../{other.name}"):
                assert infra.cgroups.ours(forged) is None
                with pytest.raises(ValueError):
                    infra.cgroups.kill(Path(forged))
            handle = LocalHandle(**{**h.__dict__, "cgroup": str(other)})
            await infra.terminate(handle.to_json(), token)
            assert h.cgroup is not None and not Path(h.cgroup).exists()  # found by its token
            assert stranger.poll() is None  # never killed
    finally:
        stranger.kill()
        stranger.wait()
        for _ in range(50):
            with contextlib.suppress(OSError):
                other.rmdir()
            if not other.exists():
                break
            await asyncio.sleep(0.05)


async def test_a_replica_that_exited_leaves_its_escapees_until_terminate_kills_them(
    infra: LocalInfra, tmp_path: Path, escapees: Escapees
) -> None:
    """The controller terminates an EXITED replica: what it left running goes then."""
    token = f"{HOME_ID}-exits"
    async with launched(infra, request(tmp_path, escaping(tmp_path / "p", "exit 3"), token)) as h:
        escapees.collect(tmp_path / "p")
        for _ in range(100):
            state = await infra.poll(h.to_json())
            if state.kind is not InstanceKind.RUNNING:
                break
            await asyncio.sleep(0.05)
        assert (state.kind, state.exit_code) == (InstanceKind.EXITED, 3)
        assert len(escapees.alive()) == len(SHAPES)
        await infra.terminate(h.to_json(), token)
        assert escapees.wait_gone() == []
        assert h.cgroup is not None and not Path(h.cgroup).exists()


async def test_an_escapee_that_ignores_sigterm_and_keeps_forking_is_killed_whole(
    infra: LocalInfra, tmp_path: Path, escapees: Escapees
) -> None:
    pids = tmp_path / "p"
    pids.mkdir()
    stubborn = (
        f'(setsid env -i /bin/sh -c \'trap "" TERM HUP; echo $$ > {pids}/stubborn; '
        "while :; do sleep 0.05 & wait; done' &)\nexec sleep 300"
    )
    token = f"{HOME_ID}-stubborn"
    async with launched(infra, request(tmp_path, stubborn, token)) as h:
        for _ in range(200):
            if (pids / "stubborn").exists() and (pids / "stubborn").read_text().endswith("\n"):
                break
            await asyncio.sleep(0.05)
        p = psutil.Process(int((pids / "stubborn").read_text()))
        escapees.seen[p.pid] = started(p)
        started_at = time.monotonic()
        await infra.terminate(h.to_json(), token)
        assert escapees.alive() == []
        assert time.monotonic() - started_at < 10  # the grace (2 s), then killed at once
        assert h.cgroup is not None and not Path(h.cgroup).exists()


async def test_a_controller_restarted_in_another_cgroup_still_sweeps_the_first_ones(
    tmp_path: Path, escapees: Escapees
) -> None:
    """The home records where its cgroups were made: a controller started again from another
    cgroup (another login session) finds and sweeps those too."""
    own, why = own_cgroup()
    assert own is not None, why
    bases = [own / f"fleetserve-test-base{i}-{os.getpid()}" for i in (1, 2)]
    home = tmp_path / "home"

    def infra_in(base: Path) -> LocalInfra:
        infra = LocalInfra(home, grace_seconds=2, home_id=HOME_ID)
        infra.cgroups = infra.jobs.cgroups = Cgroups(HOME_ID, home, base=base)
        return infra

    for base in bases:
        base.mkdir()
    token = f"{HOME_ID}-moved"
    first = infra_in(bases[0])
    out = await first.launch(request(tmp_path, escaping(tmp_path / "p"), token))
    try:
        escapees.collect(tmp_path / "p")
        h = LocalHandle.from_json(out.handle)
        assert h.cgroup is not None and Path(h.cgroup).parent.parent == bases[0]
        assert (home / "cgroup").read_text() == f"{bases[0] / first.cgroups.name}\n"
        restarted = infra_in(bases[1])
        assert restarted.cgroups.find(token) == Path(h.cgroup)
        assert await restarted.sweep(set()) >= 1
        assert escapees.wait_gone() == []
        assert not (bases[0] / first.cgroups.name).exists()
    finally:
        await first.terminate(out.handle, token)
        for base in bases:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    base.rmdir()
                if not base.exists():
                    break
                await asyncio.sleep(0.05)


async def test_without_cgroup_kill_a_forking_cgroup_is_frozen_and_killed_member_by_member(
    infra: LocalInfra, tmp_path: Path, escapees: Escapees
) -> None:
    """Kernels before 5.14 have no cgroup.kill: the same end, one SIGKILL at a time."""
    pids = tmp_path / "p"
    pids.mkdir()
    forking = (
        f"(setsid env -i /bin/sh -c 'echo $$ > {pids}/forker; "
        "while :; do sleep 0.05 & sleep 0.01; done' &)\nexec sleep 300"
    )
    token = f"{HOME_ID}-forking"
    async with launched(infra, request(tmp_path, forking, token)) as h:
        for _ in range(200):
            if (pids / "forker").exists() and (pids / "forker").read_text().endswith("\n"):
                break
            await asyncio.sleep(0.05)
        p = psutil.Process(int((pids / "forker").read_text()))
        escapees.seen[p.pid] = started(p)
        assert h.cgroup is not None
        cgroup = Path(h.cgroup)
        assert len(infra.cgroups.pids(cgroup)) >= 3  # the wrapper's sleep, the loop, its sleeps
        await asyncio.to_thread(infra.cgroups.kill_each, cgroup)
        assert infra.cgroups.pids(cgroup) == [] and escapees.alive() == []


async def test_a_preempted_replicas_escapees_die_with_it(
    infra: LocalInfra, tmp_path: Path, escapees: Escapees
) -> None:
    """`chaos preempt` (a lost host): the whole cgroup is killed at once, no grace."""
    token = f"{HOME_ID}-spot"
    async with launched(infra, request(tmp_path, escaping(tmp_path / "p"), token, spot=True)) as h:
        escapees.collect(tmp_path / "p")
        assert [held.replica_id for held in infra.preempt("svc", 1)] == [1]
        assert escapees.wait_gone(timeout=5) == []
        assert (await infra.poll(h.to_json())).kind is InstanceKind.LOST
