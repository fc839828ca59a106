"""A full disk (issue: log rotation could not get out of one): a log past its cap is emptied
even when there is no room to copy it first, keeping its end when it can, and the service's
events say so. On a small tmpfs each test mounts (root only) and a real SQLite store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from fleetserve.controller.controller import Controller
from fleetserve.controller.lb_manager import LbManager
from fleetserve.controller.settings import Settings
from fleetserve.core.clock import FakeClock, SystemClock
from fleetserve.core.errors import StorageFull
from fleetserve.core.types import ReplicaStatus
from fleetserve.oshelpers.files import FULL_DISK_TAIL, rotate_log

from .fakes import FakeInfra, FakeLb, create_service, handle_of, service_yaml

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

MiB = 1024 * 1024


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Write to `path` until the disk is full (bounded by the tmpfs's size)."""
    with open(path, "ab", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)


def log_lines(path: Path, n: int) -> None:
    with open(path, "ab") as f:
        for i in range(n):
            f.write(b"line %08d of the replica's output, padded to some length...........\n" % i)


def test_a_log_on_a_full_disk_is_truncated_and_keeps_its_end(small_fs: Path) -> None:
    log = small_fs / "replica-1.log"
    log_lines(log, 60_000)  # ~4.3 MB: no room left to copy it
    fill(small_fs / "filler")
    size = log.stat().st_size
    end = log.read_bytes()[-1000:]
    done = rotate_log(log, 2 * MiB)
    assert done is not None and done.full_disk and done.size == size
    assert log.stat().st_size == 0  # emptied: the disk has room again
    kept = (small_fs / "replica-1.log.1").read_bytes()
    # Half the cap, its end, from the first whole line in it.
    assert done.kept == len(kept) and min(MiB, FULL_DISK_TAIL) - 100 < done.kept <= MiB
    assert kept.startswith(b"line ")
    assert kept.endswith(end)
    with open(log, "ab") as f:  # the replica's next lines go in
        f.write(b"more\n")


def test_a_rotation_copies_only_half_the_cap(tmp_path: Path) -> None:
    log = tmp_path / "load-balancer.log"
    log_lines(log, 40_000)
    data = log.read_bytes()
    done = rotate_log(log, 1 * MiB)
    assert done is not None and not done.full_disk
    # Its end, half the cap, from the first whole line in it.
    start = data.index(b"\n", len(data) - MiB // 2 - 1) + 1
    assert (tmp_path / "load-balancer.log.1").read_bytes() == data[start:]
    assert log.stat().st_size == 0
    assert rotate_log(log, 1 * MiB) is None  # under half the cap: left alone


def test_the_full_disk_rotation_is_an_event_of_the_service(small_fs: Path) -> None:
    settings = Settings(home=small_fs / "home", log_cap_bytes=2 * MiB)
    settings.home.mkdir(mode=0o700)
    clock = FakeClock()
    ctl = Controller(settings, clock=clock, infra=FakeInfra())
    try:
        create_service(ctl.store, "web", service_yaml(), clock.now())
        log = settings.logs_dir / "web" / "replica-1.log"
        log.parent.mkdir(parents=True)
        log_lines(log, 50_000)
        fill(small_fs / "filler")
        asyncio.run(ctl.rotate_logs_once())
        assert log.stat().st_size == 0
        events = [e.message for e in ctl.store.list_events("web")]
        assert any("disk full" in m and "replica-1.log" in m for m in events), events
    finally:
        ctl.store.close()


def test_down_stops_the_processes_when_the_store_is_full_and_records_it_later(
    small_fs: Path,
) -> None:
    settings = Settings(home=small_fs / "home", reconcile_interval=0.05)
    settings.home.mkdir(mode=0o700)
    clock = FakeClock()
    infra = FakeInfra()
    ctl = Controller(settings, clock=clock, infra=infra)
    lb = FakeLb()
    ctl.lb = cast(LbManager, lb)

    async def scenario() -> None:
        create_service(ctl.store, "web", service_yaml(replicas=2), clock.now())
        rec = ctl._run("web")
        for _ in range(200):  # bounded: 10 s of rounds
            rows = ctl.store.list_replicas("web")
            svc = ctl.store.service("web")
            if len([r for r in rows if r.handle]) == 2 and svc.lb_pid is not None:
                break
            await asyncio.sleep(0.05)
        handles = {r.handle for r in ctl.store.list_replicas("web")}
        lb_pid = ctl.store.service("web").lb_pid
        assert None not in handles and lb_pid is not None
        filler = small_fs / "filler"
        fill(filler)
        with pytest.raises(StorageFull) as refused:
            await ctl.down_service("web", purge=True)
        assert "full" in refused.value.message and "were stopped" in refused.value.message
        assert handles <= {h for h, _ in infra.terminated}  # the replicas were stopped
        assert ("web", lb_pid) in lb.stopped  # and the load balancer
        launched = len(infra.launches)
        await asyncio.sleep(0.5)  # rounds run while the store stays full
        assert len(infra.launches) == launched  # nothing relaunched meanwhile
        assert rec.down_pending is True
        filler.unlink()
        for _ in range(200):  # bounded: 10 s
            if ctl.store.get_service("web") is None:
                break
            await asyncio.sleep(0.05)
        assert ctl.store.get_service("web") is None  # the down was recorded and finished
        await ctl._stop_reconcilers()

    try:
        asyncio.run(scenario())
    finally:
        ctl.store.close()


def test_a_disk_another_writer_filled_gets_room_from_logs_under_the_cap(small_fs: Path) -> None:
    settings = Settings(home=small_fs / "home")  # the default cap: 100 MB, far above the disk
    settings.home.mkdir(mode=0o700)
    clock = FakeClock()
    ctl = Controller(settings, clock=clock, infra=FakeInfra())
    try:
        create_service(ctl.store, "web", service_yaml(), clock.now())
        log = settings.logs_dir / "web" / "load-balancer.log"
        log.parent.mkdir(parents=True)
        log_lines(log, 30_000)  # ~2 MB
        small = settings.logs_dir / "web" / "replica-1.log"
        log_lines(small, 100)  # a few KB: left alone
        fill(small_fs / "filler")  # not a log: someone else's
        end = log.read_bytes()[-500:]
        asyncio.run(ctl.rotate_logs_once())
        assert log.stat().st_size == 0 and small.stat().st_size > 0
        assert (settings.logs_dir / "web" / "load-balancer.log.1").read_bytes().endswith(end)
        events = [e.message for e in ctl.store.list_events("web")]
        assert any("disk full: log load-balancer.log" in m for m in events), events
    finally:
        ctl.store.close()


def test_a_launch_the_store_cannot_record_is_stopped_and_fails_once_there_is_room(
    small_fs: Path,
) -> None:
    settings = Settings(home=small_fs / "home", reconcile_interval=0.05)
    settings.home.mkdir(mode=0o700)
    infra = FakeInfra()
    infra.gate = asyncio.Event()  # the launch waits for the test
    ctl = Controller(settings, clock=SystemClock(), infra=infra)
    ctl.lb = cast(LbManager, FakeLb())

    async def scenario() -> None:
        create_service(ctl.store, "web", service_yaml(replicas=1), ctl.clock.now())
        rec = ctl._run("web")
        for _ in range(200):  # bounded: 10 s
            if infra.launches:
                break
            await asyncio.sleep(0.05)
        assert infra.launches and rec.executor.busy(1)
        filler = small_fs / "filler"
        fill(filler)
        assert infra.gate is not None
        infra.gate.set()  # it starts; the store cannot say so
        for _ in range(100):  # bounded: 5 s
            if any(h == handle_of("web", 1) for h, _ in infra.terminated):
                break
            await asyncio.sleep(0.05)
        token = ctl.store.replica("web", 1).launch_token
        assert (handle_of("web", 1), token) in infra.terminated  # no process without a row
        assert rec.executor.busy(1)  # the launch holds its slot until the row says it failed
        filler.unlink()
        for _ in range(200):  # bounded: 10 s (the retry is every 2 s)
            if not rec.executor.busy(1):
                break
            await asyncio.sleep(0.05)
        events = [e.message for e in ctl.store.list_events("web", limit=100)]
        assert any("launch failed: the store" in m for m in events), events
        await ctl._stop_reconcilers()

    try:  # bounded: a stuck wait fails here, with its stack, not at the suite's timeout
        asyncio.run(asyncio.wait_for(scenario(), 90))
    finally:
        ctl.store.close()


def test_recovery_on_a_full_disk_waits_for_the_store_instead_of_ending_the_reconciler(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A controller restarted on a full disk: recovery cannot record what it finds (a launch
    cut short). Before, the reconciler's task ended on the store's error (a traceback, and
    nothing more for that service, a `down` included); now it retries, says so once, and
    recovers once there is room."""
    settings = Settings(home=small_fs / "home", reconcile_interval=0.05)
    settings.home.mkdir(mode=0o700)
    ctl = Controller(settings, clock=SystemClock(), infra=FakeInfra())
    ctl.lb = cast(LbManager, FakeLb())
    create_service(ctl.store, "web", service_yaml(replicas=1), ctl.clock.now())
    row = ctl.store.allocate_replica("web", 1, "local", "tok-1", ctl.clock.now())
    ctl.store.update_replica(row, ctl.clock.now(), status=ReplicaStatus.PROVISIONING)
    filler = small_fs / "filler"
    fill(filler)

    async def scenario() -> None:
        rec = ctl._run("web")
        await asyncio.sleep(1.0)  # recovery tries, and tries again
        assert not rec.finished.is_set(), "the reconciler ended on the full disk"
        filler.unlink()
        for _ in range(200):  # bounded: 10 s
            if ctl.store.replica("web", 1).status is not ReplicaStatus.PROVISIONING:
                break
            await asyncio.sleep(0.05)
        assert ctl.store.replica("web", 1).status is not ReplicaStatus.PROVISIONING
        await ctl._stop_reconcilers()

    try:
        with caplog.at_level("WARNING", logger="fleetserve.controller"):
            asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        ctl.store.close()
    said = [r.getMessage() for r in caplog.records if "recovery waits" in r.getMessage()]
    assert len(said) == 1, said
