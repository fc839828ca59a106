"""`sky serve` habits and what waiting commands show, against a scripted SDK client: -y,
`logs` following by default, --tail, --version, canary and failed-rollout wording, flags
refused in the CLI's words, progress on stderr when piped and none with -o json."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fleetserve import client as sdk
from fleetserve._version import __version__
from fleetserve.api.models import Health, JobInfo, PoolApplied, ReplicaInfo, ServiceInfo
from fleetserve.cli import logs, pools, services, status
from fleetserve.cli.main import app
from fleetserve.client import Client
from fleetserve.core.errors import NotFound, ServiceFailed, TransientError

T0 = 1_700_000_000.0
YAML = "service:\n  readiness_probe: /health\n  replicas: 2\nrun: python3 server.py\n"
CAUSE = "python3: can't open file '/srv/app/server.py': [Errno 2] No such file or directory"


def replica(rid: int, status: str, version: int = 1, reason: str | None = None) -> ReplicaInfo:
    return ReplicaInfo(replica_id=rid, version=version, status=status, created_at=T0, reason=reason)


def view(status: str, replicas: list[ReplicaInfo], **kw: Any) -> ServiceInfo:
    base: dict[str, Any] = {
        "name": "web",
        "status": status,
        "endpoint": "http://127.0.0.1:30001" if status != "CONTROLLER_INIT" else None,
        "active_version": 1,
        "serving_version": 1,
        "created_at": T0,
        "load_balancing_policy": "least_load",
        "min_replicas": 2,
        "max_replicas": 2,
        "target_replicas": 2,
        "replicas": replicas,
    }
    return ServiceInfo.model_validate(base | kw)


class Fake:
    """The SDK calls these commands make; `views` are what successive service() calls see."""

    views: list[ServiceInfo] = []
    calls: list[tuple[str, Any]] = []
    log_lines: list[str] = ["a", "b"]

    def __init__(self, *_a: object, **_kw: object) -> None:
        pass

    wait_ready = Client.wait_ready
    _service_riding_outages = Client._service_riding_outages
    through_restarts = Client.through_restarts

    def health(self) -> Health:
        return Health(ok=True, version="0", home_hash="x", pid=1, home="/h", processes="cgroups")

    def service(self, name: str) -> ServiceInfo:
        return Fake.views.pop(0) if len(Fake.views) > 1 else Fake.views[0]

    def up_file(self, path: Path, name: str | None, *args: object) -> ServiceInfo:
        Fake.calls.append(("up_file", name))
        return view("CONTROLLER_INIT", [])

    def update_file(self, name: str, path: Path, mode: str, percent: int | None, *a: object) -> Any:
        Fake.calls.append(("update_file", percent))
        return view("READY", [], active_version=2, traffic_percent=percent, update_mode=mode)

    def promote(self, name: str) -> ServiceInfo:
        Fake.calls.append(("promote", name))
        return view("READY", [], active_version=2)

    def rollback(self, name: str) -> ServiceInfo:
        Fake.calls.append(("rollback", name))
        return view("READY", [], active_version=1, serving_version=1)

    def down(self, name: str, purge: bool = False) -> ServiceInfo:
        Fake.calls.append(("down", name))
        return view("SHUTTING_DOWN", [])

    def wait_gone(self, name: str, purge: bool = False) -> None:
        return None

    def replica_logs(
        self, name: str, rid: int, follow: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        Fake.calls.append(("replica_logs", (name, rid, follow, tail)))
        return iter(Fake.log_lines)

    def component_logs(
        self, which: str, service: str | None, follow: bool, tail: int | None
    ) -> Iterator[str]:
        Fake.calls.append(("component_logs", (which, service, follow, tail)))
        return iter(Fake.log_lines)

    def apply_pool(self, name: str, *a: object) -> PoolApplied:
        return PoolApplied(pool=view("READY", [], name=name, target_replicas=1), action="resized")

    def launch_jobs(self, pool: str, *a: object) -> list[JobInfo]:
        return [job(7, "PENDING"), job(8, "PENDING")]

    def job(self, job_id: int) -> JobInfo:
        return Fake.jobs.pop(0)

    jobs: list[JobInfo] = []


def job(job_id: int, status: str, reason: str | None = None) -> JobInfo:
    ended = status in ("SUCCEEDED", "FAILED")
    return JobInfo.model_validate(
        {
            "job_id": job_id,
            "pool": "batch",
            "batch": 1,
            "rank": job_id - 7,
            "num_jobs": 2,
            "status": status,
            "created_at": T0,
            "started_at": T0 + 1 if status != "PENDING" else None,
            "ended_at": T0 + 3.5 if ended else None,
            "reason": reason,
        }
    )


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    Fake.views, Fake.calls, Fake.jobs = [], [], []
    for module in (services, status, logs):  # the commands' modules (fleetserve/cli/main.py)
        monkeypatch.setattr(module, "Client", Fake)
    monkeypatch.setattr(pools, "Client", Fake)
    monkeypatch.setattr(sdk, "WAIT_POLL", 0.0)
    monkeypatch.setattr(pools, "WAIT_POLL", 0.0)
    monkeypatch.setattr(services.time, "sleep", lambda _s: None)


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "service.yaml"
    path.write_text(YAML)
    return path


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_version_prints_the_package_version() -> None:
    res = run("--version")
    assert res.exit_code == 0 and res.stdout == f"fleetserve {__version__}\n"


def test_up_with_yes_waits_and_keeps_stdout_to_the_result_when_piped(spec: Path) -> None:
    Fake.views = [
        view("REPLICA_INIT", [replica(1, "STARTING"), replica(2, "PROVISIONING")]),
        view("READY", [replica(1, "READY"), replica(2, "STARTING")]),
    ]
    res = run("up", "-y", str(spec))
    assert res.exit_code == 0, res.output
    assert res.stdout == "Service web is READY.\nEndpoint: http://127.0.0.1:30001\n"
    assert "Service web accepted: 2 replica(s)." in res.stderr
    assert "replica 1: READY" in res.stderr and "replica 2: STARTING" in res.stderr


def test_up_o_json_prints_only_the_ready_service(spec: Path) -> None:
    Fake.views = [view("REPLICA_INIT", []), view("READY", [replica(1, "READY")])]
    res = run("up", str(spec), "-o", "json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["status"] == "READY"
    assert res.stderr == ""


def test_up_that_fails_names_the_cause_and_the_command_on_one_line(spec: Path) -> None:
    reason = (
        "3 replicas of version 1 in a row failed before ever becoming READY; launches stopped. "
        "Last: replica 3: replica process exited with code 2; last log lines: "
        f"[dim]loading weights[/dim] | {CAUSE} "
        "(`fleetserve logs web 3 --no-follow` shows the rest)"
    )
    Fake.views = [view("FAILED", [replica(3, "FAILED")], failure_reason=reason)]
    res = run("up", str(spec))
    assert res.exit_code == 1
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert line == [f"Error: service web is FAILED: {reason}"]  # whole, never wrapped


def test_sdk_wait_ready_raises_with_the_reason() -> None:
    Fake.views = [view("FAILED", [], failure_reason=f"replica 1: {CAUSE}")]
    with pytest.raises(ServiceFailed, match="can't open file"):
        Fake().wait_ready("web", timeout=5)


class _Clock:
    """Time that passes only when the code sleeps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(sdk.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(sdk.time, "sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _scripted(script: list[Any]) -> Fake:
    class Scripted(Fake):
        def service(self, name: str) -> ServiceInfo:
            item = script.pop(0)
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, ServiceInfo)
            return item

    return Scripted()


def test_sdk_waits_ride_out_a_controller_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller that stops answering for a while (restarting) does not end a wait; one
    that stays away past OUTAGE_SECONDS does, with its error."""
    clock = _Clock(monkeypatch)
    down = TransientError("no fleetserve controller answers (nothing listens on port 1)")
    script: list[Any] = [down, down, view("STARTING", []), down, view("READY", [])]
    assert _scripted(script).wait_ready("web", timeout=600).status == "READY"
    assert not script
    script[:] = [down] * 1000
    clock.now = 0.0
    with pytest.raises(TransientError, match="nothing listens"):
        _scripted(script).wait_ready("web", timeout=600)
    assert clock.now == pytest.approx(sdk.OUTAGE_SECONDS, abs=1.0)  # not the 600 s timeout


def test_sdk_wait_gone_of_a_purge_is_not_ended_by_the_old_failed_cleanup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock(monkeypatch)
    failed = view("FAILED_CLEANUP", [], failure_reason="could not terminate replicas")
    script: list[Any] = [failed, failed, NotFound("service web not found")]
    assert Client.wait_gone(_scripted(script), "web", timeout=60, purge=True) is None  # type: ignore[arg-type]
    # Without --purge the status from before this `down` does not answer for it at once...
    script[:] = [failed] * 1000
    clock.now = 0.0
    left = Client.wait_gone(_scripted(script), "web", timeout=100)  # type: ignore[arg-type]
    assert left is not None and left.status == "FAILED_CLEANUP"
    assert clock.now == pytest.approx(sdk.STALE_CLEANUP_SECONDS, abs=0.5)
    # ... while a cleanup seen to fail after its service was shutting down does.
    script[:] = [view("SHUTTING_DOWN", []), failed]
    clock.now = 0.0
    left = Client.wait_gone(_scripted(script), "web", timeout=100)  # type: ignore[arg-type]
    assert left is not None and left.status == "FAILED_CLEANUP" and not script
    assert clock.now < 1


def test_down_takes_yes() -> None:
    res = run("down", "-y", "web")
    assert res.exit_code == 0, res.output
    assert ("down", "web") in Fake.calls and "Service web is down." in res.stdout


@pytest.mark.parametrize(
    ("args", "call"),
    [
        (["logs", "web", "2"], ("replica_logs", ("web", 2, True, None))),
        (["logs", "web", "2", "--no-follow"], ("replica_logs", ("web", 2, False, None))),
        (["logs", "web", "2", "--tail", "5"], ("replica_logs", ("web", 2, True, 5))),
        (["logs", "--controller", "web"], ("component_logs", ("controller", "web", True, None))),
        (
            ["logs", "web", "--load-balancer", "--no-follow", "--tail", "1"],
            ("component_logs", ("load-balancer", "web", False, 1)),
        ),
    ],
)
def test_logs_follows_by_default_as_sky_serve_logs(args: list[str], call: Any) -> None:
    res = run(*args)
    assert res.exit_code == 0, res.output
    assert Fake.calls == [call] and res.stdout == "a\nb\n"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["logs", "web", "1", "--tail", "-1"], "greater than or equal to 0"),
        (["logs", "--controller", "--load-balancer", "web"], "give one"),
        (["logs", "--controller", "web", "3"], "not a replica id"),
    ],
)
def test_logs_bad_flags_are_refused_with_exit_2(args: list[str], says: str) -> None:
    res = run(*args)
    assert res.exit_code == 2 and says in " ".join(res.output.split()) and Fake.calls == []


@pytest.mark.parametrize("percent", ["150", "0", "100"])
def test_traffic_percent_out_of_range_is_refused_in_the_clis_words(
    spec: Path, percent: str
) -> None:
    res = run("update", "web", str(spec), "--traffic-percent", percent)
    assert res.exit_code == 2
    assert f"--traffic-percent {percent}: a canary's share of requests, 1..99" in res.stderr
    assert "body.traffic_percent" not in res.output and Fake.calls == []


def test_a_canary_update_says_canary_not_rolling(spec: Path) -> None:
    Fake.views = [
        view(
            "READY",
            [replica(1, "READY"), replica(3, "READY", 2)],
            active_version=2,
            traffic_percent=10,
            update_mode="rolling",
        ),
    ]
    res = run("update", "web", str(spec), "--traffic-percent", "10", "-y")
    assert res.exit_code == 0, res.output
    assert "Canary: version 2 of web takes 10% of requests" in res.stderr
    assert "rolling" not in res.stderr
    assert "fleetserve promote web" in res.stdout


def test_a_failed_update_names_rollback_and_logs(spec: Path) -> None:
    reason = "3 replicas of version 2 in a row failed before ever becoming READY"
    Fake.views = [
        view(
            "READY",
            [replica(1, "READY"), replica(4, "FAILED", 2)],
            active_version=2,
            update_mode="rolling",
            failure_reason=reason,
        ),
    ]
    res = run("update", "web", str(spec))
    assert res.exit_code == 1
    err = res.stderr
    assert "version 2 of web failed; version 1 keeps serving" in err
    assert "`fleetserve rollback web` drops version 2" in err
    assert "`fleetserve logs web 4 --no-follow`" in err


def test_status_after_a_failed_update_says_failed_not_rolling() -> None:
    failed = view(
        "READY",
        [replica(1, "READY")],
        active_version=2,
        update_mode="rolling",
        failure_reason="launches stopped",
    )
    Fake.views = [failed]
    Fake.status = lambda self, name=None: [failed]  # type: ignore[attr-defined]
    Fake.events = lambda self, name, limit: []  # type: ignore[attr-defined]
    try:
        res = run("status")
    finally:
        del Fake.status, Fake.events  # type: ignore[attr-defined]
    assert res.exit_code == 0, res.output
    assert "1 -> 2 (failed)" in res.stdout and "(rolling)" not in res.stdout
    assert "`fleetserve rollback web` drops version 2" in res.stdout


@pytest.mark.parametrize("command", ["promote", "rollback"])
def test_promote_and_rollback_wait_with_progress(command: str) -> None:
    version = 2 if command == "promote" else 1
    Fake.views = [
        view(
            "READY",
            [replica(1, "READY", 1), replica(3, "STARTING", 2)],
            active_version=version,
            serving_version=1,
        ),
        view(
            "READY",
            [replica(1, "SHUTTING_DOWN", 1), replica(3, "READY", 2)],
            active_version=version,
            serving_version=version,
        ),
        view(
            "READY",
            [replica(3, "READY", version), replica(5, "READY", version)],
            active_version=version,
            serving_version=version,
        ),
    ]
    res = run(command, "web", "--wait")
    assert res.exit_code == 0, res.output
    assert f"Version {version} serves" in res.stdout
    assert "replica 3 (v2): READY" in res.stderr
    assert Fake.views and len(Fake.views) == 1  # it polled until the last view


def test_pool_apply_says_the_size_asked_for() -> None:
    res = pools_run("pool", "apply", "-p", "batch", "--workers", "1", "-y")
    assert res.exit_code == 0, res.output
    assert "1 worker(s) wanted" in res.stdout


def test_jobs_launch_wait_shows_each_job_ending_and_the_logs_command() -> None:
    Fake.views = [view("READY", [])]
    Fake.jobs = [
        job(7, "RUNNING"),
        job(8, "PENDING"),
        job(7, "SUCCEEDED"),
        job(8, "FAILED", "exit code 3"),
    ]
    res = pools_run("jobs", "launch", "-p", "batch", "--wait", "/dev/null")
    assert res.exit_code == 1
    assert "job 7 (rank 0): SUCCEEDED in 2.5s" in res.stderr
    assert "job 8 (rank 1): FAILED in 2.5s - exit code 3 (`fleetserve jobs logs 8`)" in res.stderr
    assert "1 succeeded, 1 did not." in res.stdout


def pools_run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_up_detach_prints_the_acceptance_on_stdout(spec: Path) -> None:
    res = run("up", "-d", str(spec))
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [
        "Service web accepted: 2 replica(s).",
        "Check it with `fleetserve status web`.",
    ]
    assert Fake.views == []  # nothing waited for


def test_progress_on_a_terminal_piped_and_quiet() -> None:
    from io import StringIO

    from rich.console import Console

    from fleetserve.cli.progress import Progress

    def consoles(terminal: bool) -> tuple[Console, Console, StringIO, StringIO]:
        o, e = StringIO(), StringIO()
        return (
            Console(file=o, force_terminal=terminal, width=100),
            Console(file=e, width=100),
            o,
            e,
        )

    out, err, o, e = consoles(True)
    with Progress(out, err) as prog:
        assert prog.live
        prog.state("web: 1 STARTING")
        prog.line("  replica 1: READY")
    assert "replica 1: READY" in o.getvalue() and e.getvalue() == ""
    out, err, o, e = consoles(False)
    with Progress(out, err) as prog:
        prog.state("web: 1 STARTING")  # no spinner off a terminal
        prog.line("  replica 1: READY")
    assert o.getvalue() == "" and e.getvalue() == "  replica 1: READY\n"
    out, err, o, e = consoles(True)
    with Progress(out, err, quiet=True) as prog:
        prog.state("x")
        prog.line("y")
    assert o.getvalue() == e.getvalue() == ""


def test_a_rollout_shows_its_own_replicas_not_an_older_versions_failed_rows(spec: Path) -> None:
    # Replica 3 failed in an earlier, abandoned rollout: history, not this rollout's progress.
    Fake.views = [
        view(
            "READY",
            [replica(1, "READY"), replica(3, "FAILED"), replica(6, "PENDING", 2)],
            active_version=2,
        ),
        view(
            "READY",
            [replica(1, "READY"), replica(3, "FAILED"), replica(6, "FAILED", 2)],
            active_version=2,
            failure_reason="launches stopped",
        ),
    ]
    res = run("update", "web", str(spec))
    assert res.exit_code == 1
    assert "replica 3 (v1)" not in res.stderr
    assert "replica 6 (v2): PENDING" in res.stderr and "replica 6 (v2): FAILED" in res.stderr


def test_pool_apply_wait_shows_workers_until_the_wanted_ones_are_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    views = [
        [view("REPLICA_INIT", [replica(1, "PROVISIONING")], name="batch", target_replicas=1)],
        [view("READY", [replica(1, "READY")], name="batch", target_replicas=1)],
    ]
    monkeypatch.setattr(Fake, "pools", lambda self, name=None: views.pop(0), raising=False)
    res = run("pool", "apply", "-p", "batch", "--workers", "1", "--wait")
    assert res.exit_code == 0, res.output
    assert "worker 1 (v1): PROVISIONING" in res.stderr and "worker 1 (v1): READY" in res.stderr
    assert "Pool batch: 1 worker(s) READY." in res.stdout and views == []


def test_pool_apply_wait_fails_with_the_pools_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = view(
        "FAILED",
        [replica(1, "FAILED_PROVISION")],
        name="batch",
        failure_reason="setup failed with exit code 7",
    )
    monkeypatch.setattr(Fake, "pools", lambda self, name=None: [broken], raising=False)
    res = run("pool", "apply", "-p", "batch", "--workers", "1", "--wait")
    assert res.exit_code == 1
    assert "pool batch cannot start workers: setup failed with exit code 7" in res.stderr
    assert "`fleetserve pool apply -p batch FILE`" in res.stderr


def test_jobs_launch_o_json_prints_the_jobs_alone() -> None:
    res = run("jobs", "launch", "-p", "batch", "-o", "json", "/dev/null")
    assert res.exit_code == 0, res.output
    assert [j["job_id"] for j in json.loads(res.stdout)] == [7, 8]
    assert res.stderr == ""


def test_jobs_launch_wait_on_a_pool_that_can_have_no_worker_says_so() -> None:
    """A pool at 0 workers with at most 0: the jobs can only wait. Before, `--wait` sat silent
    for ever (found by an outside walk-through)."""
    Fake.views = [view("READY", [], min_replicas=0, max_replicas=0, target_replicas=0)]
    Fake.jobs = [job(7, "PENDING"), job(8, "PENDING"), job(7, "CANCELLED"), job(8, "CANCELLED")]
    res = pools_run("jobs", "launch", "-p", "batch", "--wait", "/dev/null")
    assert "Pool batch has no worker and may have none" in res.stderr, res.output
    assert "fleetserve pool apply -p batch --workers N" in res.stderr
    assert res.stderr.count("has no worker") == 1  # said once, not at every poll
    Fake.views = [view("READY", [], min_replicas=1, max_replicas=2, target_replicas=1)]
    Fake.jobs = [job(7, "PENDING"), job(8, "PENDING"), job(7, "SUCCEEDED"), job(8, "SUCCEEDED")]
    res = pools_run("jobs", "launch", "-p", "batch", "--wait", "/dev/null")
    assert "has no worker" not in res.stderr


def test_an_empty_name_is_refused_not_replaced_by_the_yamls(tmp_path: Path) -> None:
    spec = tmp_path / "svc.yaml"
    spec.write_text("name: web\nservice:\n  readiness_probe: /health\nrun: python3 server.py\n")
    res = run("up", str(spec), "-n", "")
    assert res.exit_code == 2 and "-n/--name is empty" in res.stderr


def test_update_pool_and_jobs_waits_ride_out_a_restart_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """`update`, `pool apply --wait` and `jobs launch --wait` read through `through_restarts`
    (they exited 5 when the controller restarted under them, though the work went on)."""
    _Clock(monkeypatch)
    down = TransientError("no fleetserve controller answers")
    script: list[Any] = [down, down, "view"]

    def read() -> str:
        item = script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return str(item)

    assert Client.through_restarts(Fake(), read) == "view"  # type: ignore[arg-type]
    for source in (services._watch_version, pools._wait_workers, pools._wait_jobs):
        assert "through_restarts" in inspect.getsource(source), source.__name__
