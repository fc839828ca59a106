"""`-o json|yaml`, `events [-f]`, `status -w` and name completion, against a fake SDK client:
what is printed, what is refused (before any controller is asked), and how a follow ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from fleetserve.api.models import EventInfo, Health, JobInfo, ReplicaInfo, ServiceInfo
from fleetserve.cli import completion, logs, pools, services, status
from fleetserve.cli.main import app
from fleetserve.cli.output import OutputFormat, check_interval, dumps, stream_item, to_data
from fleetserve.cli.render import event_line, events_table, when
from fleetserve.cli.safe import safe
from fleetserve.core.errors import NotFound, TransientError
from fleetserve.core.text import visible

T0 = 1_700_000_000.0
SVC = ServiceInfo(
    name="web",
    status="READY",
    endpoint="http://127.0.0.1:30001",
    active_version=1,
    serving_version=1,
    created_at=T0,
    load_balancing_policy="round_robin",
    min_replicas=1,
    max_replicas=2,
    target_replicas=1,
    replicas=[
        ReplicaInfo(
            replica_id=1,
            version=1,
            status="READY",
            endpoint="http://127.0.0.1:4000",
            pid=123,
            created_at=T0,
            launched_at=T0 + 1,
            first_ready_at=T0 + 5.25,
        )
    ],
)
POOL = SVC.model_copy(update={"name": "batch", "endpoint": None})


def event(i: int, **kw: Any) -> EventInfo:
    base: dict[str, Any] = {"event_id": i, "at": T0 + i, "kind": "replica", "message": f"m{i}"}
    return EventInfo.model_validate(base | kw)


class FakeClient:
    """The SDK's read calls, scripted per test; records nothing it is not asked for."""

    services: list[ServiceInfo] = [SVC]
    pool_list: list[ServiceInfo] = [POOL]
    jobs_list: list[JobInfo] = []
    # Each call to events() takes the next item: a list, or an exception to raise.
    script: list[Any] = []
    status_calls = 0
    processes = "cgroup v2: each replica and job in its own cgroup, under /sys/fs/cgroup/x"

    def __init__(self, *_a: object, **_kw: object) -> None:
        pass

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def status(self, name: str | None = None) -> list[ServiceInfo]:
        FakeClient.status_calls += 1
        if FakeClient.status_calls > 2:  # `status -w`: the user presses Ctrl-C
            raise KeyboardInterrupt
        return [self.service(name)] if name else list(self.services)

    def health(self) -> Health:
        return Health(
            ok=True, version="0", home_hash="x", pid=1, home="/h", processes=self.processes
        )

    def service(self, name: str) -> ServiceInfo:
        for s in self.services:
            if s.name == name:
                return s
        raise NotFound(f"service {name} not found")

    def events(self, name: str, limit: int = 50, after: int | None = None) -> list[EventInfo]:
        self.service(name)
        item = FakeClient.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, list)
        return item

    def jobs(self, pool: str | None = None, limit: int = 1000) -> list[JobInfo]:
        return list(self.jobs_list)

    def pools(self, name: str | None = None) -> list[ServiceInfo]:
        return [p for p in self.pool_list if name in (None, p.name)]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeClient]]:
    FakeClient.script = []
    FakeClient.status_calls = 0
    for module in (services, status, logs):  # the commands' modules (fleetserve/cli/main.py)
        monkeypatch.setattr(module, "Client", FakeClient)
    monkeypatch.setattr(pools, "Client", FakeClient)
    monkeypatch.setattr(status, "FOLLOW_POLL", 0.0)
    yield FakeClient


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


# -- serialisation ---------------------------------------------------------------------------


def test_json_is_the_models_json_form_indented_with_one_trailing_newline() -> None:
    text = dumps(to_data([SVC]), OutputFormat.json)
    assert text.endswith("}\n]\n") and not text.endswith("\n\n")
    assert json.loads(text) == [SVC.model_dump(mode="json")]
    assert text == json.dumps([SVC.model_dump(mode="json")], indent=2) + "\n"


def test_yaml_keeps_the_fields_order_and_parses_to_the_same_data() -> None:
    text = dumps(to_data(SVC), OutputFormat.yaml)
    assert text.startswith("name: web\nstatus: READY\n")
    assert yaml.safe_load(text) == SVC.model_dump(mode="json")
    assert dumps(to_data([]), OutputFormat.yaml) == "[]\n"
    with pytest.raises(ValueError, match="not a machine-readable"):
        dumps([], OutputFormat.table)


def test_a_followed_stream_is_json_lines_or_yaml_documents() -> None:
    items = [to_data(event(1)), to_data(event(2, replica_id=3))]
    lines = "".join(stream_item(i, OutputFormat.json) for i in items)
    assert [json.loads(line) for line in lines.splitlines()] == items
    docs = "".join(stream_item(i, OutputFormat.yaml) for i in items)
    assert list(yaml.safe_load_all(docs)) == items


@pytest.mark.parametrize("value", [0.5, 2.0, 3600.0, None])
def test_interval_within_bounds_is_taken(value: float | None) -> None:
    assert check_interval(value) == value


@pytest.mark.parametrize("value", [0.49, 0.0, -1.0, 3600.5, float("nan"), float("inf")])
def test_interval_out_of_bounds_is_refused(value: float) -> None:
    import typer

    with pytest.raises(typer.BadParameter, match=r"0\.5\.\.3600"):
        check_interval(value)


# -- option parsing: refused before any controller is asked ----------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["status", "-o", "xml"], "'xml' is not one of 'table', 'json', 'yaml'"),
        (["events", "web", "--output", "csv"], "'csv' is not one of"),
        (["jobs", "queue", "-o", "jsonl"], "is not one of"),
        (["status", "-w", "--interval", "0.1"], "0.1: seconds between refreshes, 0.5..3600"),
        (["status", "-w", "--interval", "nan"], "nan: seconds between refreshes"),
        (["status", "-w", "--interval", "1e6"], "seconds between refreshes, 0.5..3600"),
        (["events", "web", "-n", "0"], "'-n' / '--limit'"),
        (["events", "web", "-n", "1001"], "'-n' / '--limit'"),
    ],
)
def test_bad_option_values_name_the_option_and_exit_2(
    fake: type[FakeClient], args: list[str], says: str
) -> None:
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert says in " ".join(res.output.replace("│", " ").split()), res.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["status", "-w", "-o", "json"], "-w/--watch refreshes a table: it takes no -o json"),
        (["status", "-w", "-o", "yaml"], "no -o yaml"),
        (["status", "-v", "-o", "json"], "fleetserve events NAME -o json"),
        (["status", "web", "--endpoint", "-o", "json"], "--endpoint prints the endpoint alone"),
        (["status", "--interval", "5"], "--interval goes with -w/--watch"),
        (["status", "web", "-w", "--endpoint"], "no -w/--watch"),
        (["simulate", "--burst", "1:2:60:10", "--json", "-o", "yaml"], "--json and -o yaml"),
        (["pool", "simulate", "--json", "-o", "yaml"], "--json and -o yaml"),
    ],
)
def test_contradictory_options_are_refused_with_exit_2(
    fake: type[FakeClient], args: list[str], says: str
) -> None:
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert says in res.stderr and res.stdout == "", res.output
    assert FakeClient.status_calls == 0


# -- what each read command prints -----------------------------------------------------------


def test_status_json_is_the_list_and_status_name_the_object(fake: type[FakeClient]) -> None:
    res = run("status", "-o", "json")
    assert res.exit_code == 0 and res.stderr == ""
    assert json.loads(res.stdout) == [SVC.model_dump(mode="json")]
    one = run("status", "web", "--output", "JSON")  # the value's case does not matter
    assert json.loads(one.stdout) == SVC.model_dump(mode="json")
    as_yaml = run("status", "web", "-o", "yaml")
    assert yaml.safe_load(as_yaml.stdout) == SVC.model_dump(mode="json")


def test_status_json_of_a_missing_service_fails_on_stderr(fake: type[FakeClient]) -> None:
    res = run("status", "nope", "-o", "json")
    assert res.exit_code == 3 and res.stdout == ""
    assert "service nope not found" in res.stderr


def test_status_of_no_services_is_an_empty_list(fake: type[FakeClient]) -> None:
    FakeClient.services = []
    try:
        assert run("status", "-o", "json").stdout == "[]\n"
        assert "No services" in run("status").stdout
    finally:
        FakeClient.services = [SVC]


def test_status_says_when_the_token_scan_alone_stops_local_processes(
    fake: type[FakeClient],
) -> None:
    assert "token scan" not in run("status").stdout  # cgroups: nothing to say
    before = FakeClient.processes
    FakeClient.processes = "token scan only (FLEETSERVE_CGROUPS=off): a process can outlive"
    try:
        FakeClient.status_calls = 0
        with_services = run("status").stdout
        FakeClient.services = []
        without = run("status").stdout
    finally:
        FakeClient.processes = before
        FakeClient.services = [SVC]
    for out in (with_services, without):
        assert "Local replicas and jobs: stopped by token scan only" in " ".join(out.split())
    assert "No services" in without


def test_pool_status_and_jobs_queue_print_the_api_bodies(fake: type[FakeClient]) -> None:
    assert json.loads(run("pool", "status", "-o", "json").stdout) == [POOL.model_dump(mode="json")]
    one = run("pool", "status", "batch", "-o", "yaml")
    assert yaml.safe_load(one.stdout) == POOL.model_dump(mode="json")
    res = run("jobs", "queue", "-o", "json")
    assert res.exit_code == 0 and res.stdout == "[]\n"


def test_events_table_json_and_yaml(fake: type[FakeClient]) -> None:
    evs = [event(1), event(2, replica_id=1, status_from="STARTING", status_to="READY")]
    FakeClient.script = [evs, evs, evs]
    table = run("events", "web")
    assert "STARTING -> READY" in table.stdout and "KIND" in table.stdout
    assert json.loads(run("events", "web", "-o", "json").stdout) == to_data(evs)
    assert yaml.safe_load(run("events", "web", "-o", "yaml").stdout) == to_data(evs)
    FakeClient.script = [[]]
    assert "No events for web" in run("events", "web").stdout


def test_events_follow_prints_each_event_once_as_json_lines_and_a_deletion_exits_1(
    fake: type[FakeClient],
) -> None:
    FakeClient.script = [
        [event(1), event(2)],  # the backlog
        [],
        TransientError("controller at x is unreachable"),  # a restart: said once, retried
        TransientError("controller at x is unreachable"),
        [event(3, status_to="READY")],
        NotFound("service web not found"),
    ]
    res = run("events", "web", "-f", "-o", "json")
    assert res.exit_code == 1, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [e["event_id"] for e in got] == [1, 2, 3]
    assert res.stderr.count("unreachable") == 1
    assert "Service web was deleted" in res.stderr


def test_events_follow_polls_after_the_last_id_and_ctrl_c_exits_0(
    fake: type[FakeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    afters: list[int | None] = []
    original = FakeClient.events

    def events(self: FakeClient, name: str, limit: int = 50, after: int | None = None) -> Any:
        afters.append(after)
        return original(self, name, limit, after)

    monkeypatch.setattr(FakeClient, "events", events)
    FakeClient.script = [[event(4)], [event(5), event(6)], KeyboardInterrupt()]
    res = run("events", "web", "--follow")
    assert res.exit_code == 0, res.output
    assert afters == [None, 4, 6]
    assert [line.split()[-1] for line in res.stdout.splitlines()] == ["m4", "m5", "m6"]
    assert "Ctrl-C stops" in res.stderr


def test_events_follow_ends_quietly_when_the_reader_goes_away(
    fake: type[FakeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    def gone(_text: str) -> None:
        raise BrokenPipeError

    monkeypatch.setattr(status, "write", gone)
    FakeClient.script = [[event(1)]]
    res = run("events", "web", "-f", "-o", "json")
    assert res.exit_code == 0 and res.stderr == "", res.output


def test_events_follow_refuses_a_controller_without_event_ids(fake: type[FakeClient]) -> None:
    FakeClient.script = [[event(0)]]
    res = run("events", "web", "-f")
    assert res.exit_code == 1 and "gives no event ids" in res.stderr


def test_status_watch_redraws_until_ctrl_c_and_exits_0(
    fake: type[FakeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(status.time, "sleep", slept.append)
    res = run("status", "-w", "--interval", "0.5")
    assert res.exit_code == 0, res.output
    assert res.stdout.count("Every 0.5 s: fleetserve status") == 2
    assert res.stdout.count("Service Replicas") == 2
    assert slept == [0.5, 0.5]


def test_simulate_json_yaml_and_the_json_alias_agree(tmp_path: Path) -> None:
    args = ["simulate", "--burst", "2:30:900:300", "--duration", "1800"]
    as_json = run(*args, "-o", "json")
    assert as_json.exit_code == 0 and as_json.stderr == ""
    doc = json.loads(as_json.stdout)
    assert doc["kind"] == "autoscaling"
    assert [p["policy"] for p in doc["policies"]] == ["request_rate", "in_flight", "skyserve"]
    assert 1 <= len(doc["samples"]) <= 13
    assert run(*args, "--json").stdout == as_json.stdout
    assert yaml.safe_load(run(*args, "-o", "yaml").stdout) == doc
    pool = json.loads(run("pool", "simulate", "--burst-jobs", "5", "-o", "json").stdout)
    assert pool["kind"] == "pool" and pool["jobs"] == 10
    assert [p["policy"] for p in pool["policies"]] == ["fleetserve", "skyserve"]


# -- rendering ----------------------------------------------------------------------------------


def test_event_lines_and_table_show_kind_replica_change_and_escaped_message() -> None:
    e = event(7, replica_id=2, status_from="STARTING", status_to="READY", message="[b]x[/b]")
    console = Console(width=200, no_color=True)
    with console.capture() as cap:
        console.print(event_line(e))
        console.print(events_table("web", [e], kinds=True))
    text = cap.get()
    assert "replica replica 2 STARTING -> READY [b]x[/b]" in " ".join(text.split())
    assert "KIND" in text and "[b]x[/b]" in text


def test_when_shows_the_date_only_for_other_days() -> None:
    now = time.time()
    assert len(when(now, now)) == len("12:00:00")
    assert len(when(now - 3 * 86400, now)) == len("2024-01-01 12:00:00")


# -- completion -----------------------------------------------------------------------------------


def test_completion_asks_a_running_controller_and_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completion, "Client", FakeClient)
    FakeClient.status_calls = 0
    FakeClient.services = [SVC, SVC.model_copy(update={"name": "api"})]
    try:
        assert completion.complete_service("") == ["api", "web"]
        assert completion.complete_service("w") == ["web"]
        assert completion.complete_pool("b") == ["batch"]
    finally:
        FakeClient.services = [SVC]


def test_completion_without_a_controller_is_empty_fast_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    monkeypatch.setenv("FLEETSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLEETSERVE_API_PORT", str(port))
    monkeypatch.delenv("FLEETSERVE_API_URL", raising=False)
    started = time.monotonic()
    assert completion.complete_service("") == []
    assert completion.complete_pool("x") == []
    assert time.monotonic() - started < 5
    assert not (tmp_path / "home" / "server.json").exists()


def test_completion_is_installable_from_the_cli() -> None:
    res = run("--help")
    assert "--install-completion" in res.stdout and "--show-completion" in res.stdout


# Text a replica wrote: rich markup in brackets (vLLM's `[api_server.py:1024]`), a closing tag
# that matches nothing, and escape sequences that would set the terminal's title and clear it.
HOSTILE = (
    "INFO [api_server.py:1024] model dir [/mnt/models/llama] is empty "
    "\x1b]0;PWNED\x07 \x1b[2J cleared\r done \u202e"
)


def test_a_replicas_text_is_shown_as_it_is_never_as_markup_or_terminal_control(
    fake: type[FakeClient],
) -> None:
    """A replica's failure reason, a pool worker's and a job's, an event's message and an
    error's: brackets are shown, control characters as escapes, and no command fails on them
    (`status` used to fail for every service while one reason held a stray closing tag)."""
    replica = SVC.replicas[0].model_copy(update={"status": "FAILED", "reason": HOSTILE})
    bad = SVC.model_copy(update={"replicas": [replica], "failure_reason": HOSTILE})
    job = JobInfo.model_validate(
        {
            "job_id": 1,
            "pool": "batch",
            "batch": 1,
            "rank": 0,
            "num_jobs": 1,
            "status": "FAILED",
            "created_at": T0,
            "reason": HOSTILE,
        }
    )
    FakeClient.services, FakeClient.pool_list, FakeClient.jobs_list = (
        [bad],
        [POOL.model_copy(update={"replicas": [replica], "failure_reason": HOSTILE})],
        [job],
    )
    FakeClient.script = [[event(1, message=HOSTILE)]]
    try:
        outputs = [
            run("status"),
            run("status", "web"),
            run("pool", "status"),
            run("jobs", "queue"),
            run("events", "web"),
        ]
    finally:
        FakeClient.services, FakeClient.pool_list, FakeClient.jobs_list = [SVC], [POOL], []
    for i, res in enumerate(outputs):
        assert res.exit_code == 0, res.output
        assert "\x1b" not in res.output and "\x07" not in res.output and "\r" not in res.output
        if i == 3:
            continue  # (the jobs table is too narrow here to show its reasons)
        text = "".join(res.output.split())  # (the tables wrap the cells' words)
        assert "[/mnt/models/llama]" in text and "[api_server.py:1024]" in text, i
        assert "\\x1b]0;PWNED\\x07" in text and "\\u202e" in text, i
    error = Console(record=True, width=300)
    error.print(f"Error: {safe(HOSTILE)}", soft_wrap=True)
    assert "[/mnt/models/llama]" in error.export_text() and "\x1b" not in error.export_text()


def test_visible_keeps_printable_text_and_escapes_the_rest() -> None:
    assert visible("plain, ümlaut [x] 日本") == "plain, ümlaut [x] 日本"
    assert visible("a\x1b[2Jb\x07\x00\x7f\x9b") == "a\\x1b[2Jb\\x07\\x00\\x7f\\x9b"
    assert visible("one\ntwo\tthree") == "one\\x0atwo\\x09three"
    assert visible("one\ntwo", "\n") == "one\ntwo"
    assert visible("\u202eevil\U000e0001") == "\\u202eevil\\U000e0001"
