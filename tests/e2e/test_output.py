"""End to end: `-o json|yaml` is the REST API's body, `events [-f]`, `status -w` and name
completion, with the real CLI against a real controller and one small service (started once
for the whole module)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psutil
import pytest
import yaml

from tests.e2e.conftest import SERVER, Fleet, free_port

pytestmark = pytest.mark.e2e

NAME = "watched"
SERVICE = """\
    name: watched
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
      replicas: 1
    workdir: {workdir}
    run: python3 server.py
"""
SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "schema" / "v1"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """As conftest's `fleet`, once for the module: one controller, one service, READY."""
    root = tmp_path_factory.mktemp("output")
    home, workdir = root / "home", root / "app"
    workdir.mkdir()
    (workdir / "server.py").write_text(SERVER)
    env = dict(os.environ)
    env.update(
        {
            "FLEETSERVE_HOME": str(home),
            "FLEETSERVE_API_PORT": str(free_port()),
            "FLEETSERVE_LB_PORT_START": str(free_port()),
            "FLEETSERVE_TERMINATE_GRACE": "3",
            "FLEETSERVE_PROBE_INTERVAL": "1",
            "NO_COLOR": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    env.pop("FLEETSERVE_API_URL", None)
    env.pop("FLEETSERVE_API_TOKEN", None)
    f = Fleet(home=home, env=env, workdir=workdir)
    try:
        path = f.write_service(NAME, SERVICE.format(workdir=workdir))
        f.cli("up", str(path), timeout=90)
        yield f
    finally:
        if (home / "server.json").exists():
            f.cli("down", "--all", "--purge", check=False)
            f.cli("server", "stop", check=False)
        described = []
        for p in f.processes():
            with contextlib.suppress(psutil.Error):
                described.append((p.pid, p.cmdline()))
                p.kill()
        assert not described, f"processes left running: {described}"


def api_get(fleet: Fleet, path: str, **params: Any) -> Any:
    resp = httpx.get(
        fleet.api + path, headers=fleet.auth(), params=params, timeout=10, trust_env=False
    )
    resp.raise_for_status()
    return resp.json()


def same_as_api(fleet: Fleet, args: list[str], path: str, **params: Any) -> Any:
    """The CLI's `-o json` output, checked equal to the API's body fetched just before and just
    after it (retried if the fleet moved in between, so nothing needs to be left out)."""
    for _ in range(10):
        before = api_get(fleet, path, **params)
        printed = fleet.cli(*args, "-o", "json", timeout=30).stdout
        after = api_get(fleet, path, **params)
        if before == after:
            assert json.loads(printed) == before
            assert printed == json.dumps(json.loads(printed), indent=2) + "\n"
            return before
        time.sleep(0.5)
    raise AssertionError(f"GET {path} never held still for one CLI call")


def validate(name: str, data: Any) -> None:
    jsonschema.Draft202012Validator(json.loads((SCHEMAS / name).read_text())).validate(data)


def test_status_json_is_the_rest_api_body(fleet: Fleet) -> None:
    every = same_as_api(fleet, ["status"], "/services")
    assert [s["name"] for s in every] == [NAME]
    assert every[0]["status"] == "READY" and every[0]["replicas"][0]["status"] == "READY"
    validate("service-list.json", every)
    one = same_as_api(fleet, ["status", NAME], f"/services/{NAME}")
    assert one == every[0]
    validate("service.json", one)


def test_status_yaml_parses_to_the_same_data(fleet: Fleet) -> None:
    for _ in range(10):
        before = api_get(fleet, f"/services/{NAME}")
        printed = fleet.cli("status", NAME, "-o", "yaml").stdout
        if api_get(fleet, f"/services/{NAME}") == before:
            assert yaml.safe_load(printed) == before
            assert printed.startswith(f"name: {NAME}\n")  # the model's order, not sorted
            return
    raise AssertionError("the service never held still")


def test_events_json_has_the_replicas_ready_transition(fleet: Fleet) -> None:
    events = same_as_api(fleet, ["events", NAME, "-n", "20"], f"/services/{NAME}/events", limit=20)
    validate("events.json", events)
    assert any(e["replica_id"] == 1 and e["status_to"] == "READY" for e in events), events
    ids = [e["event_id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    table = fleet.cli("events", NAME).stdout
    assert "STARTING -> READY" in table


def test_jobs_queue_json_on_a_home_with_no_pools_is_an_empty_list(fleet: Fleet) -> None:
    done = fleet.cli("jobs", "queue", "-o", "json")
    assert done.stdout == "[]\n"
    validate("job-list.json", json.loads(done.stdout))
    assert json.loads(fleet.cli("pool", "status", "-o", "json").stdout) == []


def test_errors_with_json_exit_non_zero_with_nothing_on_stdout(fleet: Fleet) -> None:
    missing = fleet.cli("status", "nope", "-o", "json", check=False)
    assert missing.returncode == 3 and missing.stdout == ""
    assert "Error:" in missing.stderr and "nope" in missing.stderr
    refused = fleet.cli("status", "-w", "-o", "json", check=False)
    assert refused.returncode == 2 and "-w/--watch" in refused.stderr and refused.stdout == ""


def test_completion_offers_the_running_services_names(fleet: Fleet) -> None:
    env = dict(fleet.env, _FLEETSERVE_COMPLETE="complete_bash", COMP_CWORD="2")
    script = str(Path(sys.executable).parent / "fleetserve")
    for words, want in ((f"fleetserve status {NAME[:3]}", [NAME]), ("fleetserve status x", [])):
        done = subprocess.run(
            [script],
            env=dict(env, COMP_WORDS=words),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == want


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Lines:
    """A background CLI's stdout, line by line, read by a thread (every wait bounded)."""

    def __init__(self, fleet: Fleet, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetserve", *args],
            env=fleet.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # As from a terminal: a run started in the background (`cmd &`, nohup, some CI
            # runners) hands its children SIGINT ignored, and Ctrl-C would then do nothing.
            preexec_fn=_default_sigint,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def until(self, what: str, found: Any, timeout: float) -> list[str]:
        """Lines read until `found(line)` is true for one (that one included)."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            got.append(line)
            if found(line):
                return got
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; got {got}")

    def interrupt(self, timeout: float = 15) -> tuple[int, str]:
        """Ctrl-C, as a terminal sends it; the exit code and stderr."""
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()


def test_status_watch_redraws_and_ctrl_c_exits_0(fleet: Fleet) -> None:
    watch = Lines(fleet, "status", "-w", "--interval", "0.5")
    for _ in range(2):  # two views, one after another (stdout is a pipe here)
        watch.until("a view of the replicas", lambda line: "Service Replicas" in line, 30)
    code, stderr = watch.interrupt()
    assert code == 0 and "Traceback" not in stderr, stderr


def test_events_follow_prints_the_new_event_of_a_terminated_replica(fleet: Fleet) -> None:
    """Last in this module: it terminates the replica (a replacement is launched)."""
    follow = Lines(fleet, "events", NAME, "-f", "-o", "json")
    backlog = follow.until("the backlog", lambda line: '"status_to": "READY"' in line, 30)
    seen = [json.loads(line) for line in backlog]
    resp = httpx.post(
        f"{fleet.api}/services/{NAME}/replicas/1/terminate",
        headers={**fleet.auth(), "Content-Type": "application/json"},
        content=b"{}",
        timeout=10,
        trust_env=False,
    )
    assert resp.status_code == 202, resp.text
    newest = max(e["event_id"] for e in seen)
    more = follow.until(
        "an event of replica 1 after the terminate",
        lambda line: (e := json.loads(line))["event_id"] > newest and e["replica_id"] == 1,
        30,
    )
    seen += [json.loads(line) for line in more]
    code, stderr = follow.interrupt()
    assert code == 0 and "Traceback" not in stderr, stderr
    ids = [e["event_id"] for e in seen]
    assert ids == sorted(set(ids)), f"duplicated or out of order: {ids}"
    for e in seen:
        validate("event.json", e)
