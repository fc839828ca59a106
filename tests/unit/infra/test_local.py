"""The local infra with real processes: launch, setup failure, poll, terminate, sweep."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from fleetserve.core.errors import TerminalError
from fleetserve.infra.base import InstanceKind, LaunchRequest
from fleetserve.infra.local import LocalHandle, LocalInfra, processes_with_token
from tests.unit.infra.ids import HOME_A, HOME_B, HOME_C, HOME_D

SERVER = textwrap.dedent(
    """
    import http.server, os
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (os.environ["FLEETSERVE_REPLICA_ID"] + " " + os.environ["GREETING"]).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)
    http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
    """
)


def request(tmp_path: Path, token: str = "tok-1", **kw: object) -> LaunchRequest:
    workdir = tmp_path / "src"
    workdir.mkdir(exist_ok=True)
    (workdir / "server.py").write_text(SERVER)
    base: dict[str, object] = {
        "service": "svc",
        "replica_id": 1,
        "version": 1,
        "launch_token": token,
        "run": "python3 server.py",
        "setup": "echo setting up > setup.txt",
        "envs": {"GREETING": "hi"},
        "workdir": workdir,
    }
    base.update(kw)
    return LaunchRequest(**base)  # type: ignore[arg-type]


async def get(port: int) -> str:
    for _ in range(100):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        data = await reader.read()
        writer.close()
        return data.decode().split("\r\n\r\n", 1)[1]
    raise AssertionError(f"nothing listens on {port}")


@pytest.fixture
def infra(tmp_path: Path) -> LocalInfra:
    return LocalInfra(tmp_path / "home", grace_seconds=2, home_id=HOME_A)


async def test_launch_runs_setup_then_run_with_port_env_and_copied_workdir(
    infra: LocalInfra, tmp_path: Path
) -> None:
    launched = await infra.launch(request(tmp_path))
    try:
        assert await get(launched.port) == "1 hi"
        h = LocalHandle.from_json(launched.handle)
        assert (Path(h.dir) / "workdir" / "setup.txt").read_text() == "setting up\n"
        assert not (tmp_path / "src" / "setup.txt").exists()  # the original is untouched
        assert (await infra.poll(launched.handle)).kind is InstanceKind.RUNNING
        assert os.getpgid(h.pid) == h.pid  # its own process group
    finally:
        await infra.terminate(launched.handle, "tok-1")
    assert (await infra.poll(launched.handle)).kind is not InstanceKind.RUNNING
    assert processes_with_token("tok-1") == []
    log = infra.log_path("svc", 1).read_text()
    assert "running setup" in log and "starting run on port" in log


async def test_failed_setup_raises_with_its_exit_code(infra: LocalInfra, tmp_path: Path) -> None:
    with pytest.raises(TerminalError, match="setup failed with exit code 7"):
        await infra.launch(request(tmp_path, setup="echo broken; exit 7"))
    assert "broken" in infra.log_path("svc", 1).read_text()
    assert processes_with_token("tok-1") == []


async def test_run_exit_code_is_recorded(infra: LocalInfra, tmp_path: Path) -> None:
    launched = await infra.launch(request(tmp_path, run="exit 3", setup=None))
    for _ in range(50):
        state = await infra.poll(launched.handle)
        if state.kind is not InstanceKind.RUNNING:
            break
        await asyncio.sleep(0.05)
    assert state.kind is InstanceKind.EXITED and state.exit_code == 3


async def test_a_replica_that_ends_is_reported_at_once_launched_or_adopted(
    infra: LocalInfra, tmp_path: Path
) -> None:
    """`watch_exits`: the end of a replica's process is told as it happens (no poll), for a
    replica this infra launched and for one a restarted controller adopted."""
    ended: list[tuple[str, int]] = []
    infra.watch_exits(lambda service, replica_id: ended.append((service, replica_id)))
    launched = await infra.launch(request(tmp_path, run="sleep 0.3; exit 3", setup=None))
    for _ in range(100):
        if ended:
            break
        await asyncio.sleep(0.05)
    assert ended == [("svc", 1)]
    state = await infra.poll(launched.handle)
    assert state.kind is InstanceKind.EXITED and state.exit_code == 3

    other = await infra.launch(request(tmp_path, token="tok-2", replica_id=2))
    fresh = LocalInfra(infra.home, grace_seconds=2, home_id=infra.home_id)  # a restart
    told: list[tuple[str, int]] = []
    fresh.watch_exits(lambda service, replica_id: told.append((service, replica_id)))
    try:
        assert (await fresh.poll(other.handle)).kind is InstanceKind.RUNNING  # adopted, watched
        os.killpg(json.loads(other.handle)["pid"], signal.SIGKILL)
        for _ in range(100):
            if told:
                break
            await asyncio.sleep(0.05)
        assert told == [("svc", 2)]
    finally:
        await infra.terminate(other.handle, "tok-2")


async def test_an_adopted_replica_is_polled_by_pid_and_start_time(
    infra: LocalInfra, tmp_path: Path
) -> None:
    launched = await infra.launch(request(tmp_path))
    fresh = LocalInfra(
        infra.home, grace_seconds=2, home_id=infra.home_id
    )  # restarted controller: not its child
    try:
        assert (await fresh.poll(launched.handle)).kind is InstanceKind.RUNNING
        d = json.loads(launched.handle)
        wrong_time = json.dumps({**d, "create_time": d["create_time"] - 100})
        assert (await fresh.poll(wrong_time)).kind is not InstanceKind.RUNNING  # pid reuse
        # kill -9 the whole group: no exit code recorded, the instance is LOST
        os.killpg(d["pid"], signal.SIGKILL)
        for _ in range(50):
            if (await fresh.poll(launched.handle)).kind is not InstanceKind.RUNNING:
                break
            await asyncio.sleep(0.05)
        assert (await fresh.poll(launched.handle)).kind is InstanceKind.LOST
    finally:
        await fresh.terminate(launched.handle, "tok-1")
        await infra.terminate(launched.handle, "tok-1")


async def test_terminate_kills_children_that_left_the_group_and_is_idempotent(
    infra: LocalInfra, tmp_path: Path
) -> None:
    run = "setsid sleep 300 & python3 server.py"
    launched = await infra.launch(request(tmp_path, run=run))
    await get(launched.port)
    procs = processes_with_token("tok-1")
    assert len(procs) >= 3  # wrapper, setsid'ed sleep, server
    await infra.terminate(launched.handle, "tok-1")
    assert processes_with_token("tok-1") == []
    for p in procs:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    await infra.terminate(launched.handle, "tok-1")
    await infra.terminate(None, "tok-1")


async def test_cancelling_a_launch_cleans_up(infra: LocalInfra, tmp_path: Path) -> None:
    task = asyncio.create_task(infra.launch(request(tmp_path, setup="sleep 300")))
    for _ in range(100):
        if processes_with_token("tok-1"):
            break
        await asyncio.sleep(0.05)
    assert processes_with_token("tok-1")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert processes_with_token("tok-1") == []


async def test_a_fixed_port_in_use_fails_the_launch(infra: LocalInfra, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(TerminalError, match=f"port {port}"):
            await infra.launch(request(tmp_path, port=port))


async def test_sweep_stops_only_unknown_tokens_of_this_home(
    infra: LocalInfra, tmp_path: Path
) -> None:
    # A second home id on the same home folder: what a copied or re-created database is. Its
    # replica has a token no row of ours knows, and must still be left alone.
    other = LocalInfra(infra.home, grace_seconds=2, home_id=HOME_B)
    home_env = {"GREETING": "hi", "FLEETSERVE_HOME": str(infra.home)}
    known = await infra.launch(request(tmp_path, token=f"{HOME_A}-known", envs=home_env))
    orphan = await infra.launch(
        request(tmp_path, token=f"{HOME_A}-orphan", envs=home_env, replica_id=2)
    )
    foreign = await other.launch(
        request(tmp_path, token=f"{HOME_B}-theirs", envs=home_env, replica_id=3)
    )
    try:
        started = time.monotonic()
        assert await infra.sweep({f"{HOME_A}-known"}) >= 1
        assert time.monotonic() - started < 10
        assert processes_with_token(f"{HOME_A}-orphan") == []
        assert processes_with_token(f"{HOME_A}-known")
        assert processes_with_token(f"{HOME_B}-theirs")
    finally:
        await infra.terminate(known.handle, f"{HOME_A}-known")
        await infra.terminate(orphan.handle, f"{HOME_A}-orphan")
        await other.terminate(foreign.handle, f"{HOME_B}-theirs")


async def test_a_process_of_another_home_is_neither_adopted_nor_stopped(
    infra: LocalInfra, tmp_path: Path
) -> None:
    """A database copied into a second home holds the first home's handles (pid and start
    time): polling one must not adopt it, and terminating it must not kill it."""
    owner = LocalInfra(infra.home, grace_seconds=2, home_id=HOME_B)
    theirs = await owner.launch(request(tmp_path, token=f"{HOME_B}-x"))
    try:
        state = await infra.poll(theirs.handle)  # not our child: adoption by pid
        assert state.kind is InstanceKind.LOST
        assert "another fleetserve home" in state.detail
        await infra.terminate(theirs.handle, f"{HOME_B}-x")
        assert (await owner.poll(theirs.handle)).kind is InstanceKind.RUNNING
        assert processes_with_token(f"{HOME_B}-x")
    finally:
        await owner.terminate(theirs.handle, f"{HOME_B}-x")


async def test_replica_folder_and_log_are_the_owners_only(
    infra: LocalInfra, tmp_path: Path
) -> None:
    launched = await infra.launch(request(tmp_path, token=f"{HOME_A}-p"))
    try:
        rdir = Path(json.loads(launched.handle)["dir"])
        assert rdir.stat().st_mode & 0o777 == 0o700
        assert infra.log_path("svc", 1).stat().st_mode & 0o777 == 0o600
    finally:
        await infra.terminate(launched.handle, f"{HOME_A}-p")


async def test_an_upgraded_home_adopts_the_replicas_started_before_home_ids(
    tmp_path: Path,
) -> None:
    """Replicas started by a fleetserve from before home ids carry only FLEETSERVE_HOME: the
    upgraded home (legacy_home set by the store) adopts them; any other home does not."""
    home = tmp_path / "home"
    old = LocalInfra(home, grace_seconds=2)  # no home id: the previous release
    envs = {"GREETING": "hi", "FLEETSERVE_HOME": str(home)}
    launched = await old.launch(request(tmp_path, token="legacy-1", envs=envs))
    try:
        upgraded = LocalInfra(home, grace_seconds=2, home_id=HOME_C, legacy_home=str(home))
        stranger = LocalInfra(home, grace_seconds=2, home_id=HOME_D)
        assert (await upgraded.poll(launched.handle)).kind is InstanceKind.RUNNING
        assert (await stranger.poll(launched.handle)).kind is InstanceKind.LOST
        assert await stranger.sweep(set()) == 0
        assert processes_with_token("legacy-1")
    finally:
        await old.terminate(launched.handle, "legacy-1")


def test_port_free_checks_the_address_the_listener_will_bind() -> None:
    import socket

    from fleetserve.oshelpers.ports import port_free

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_free(port, "127.0.0.1")  # another address: free there
        assert not port_free(port, "127.0.0.2")
        assert not port_free(port, "0.0.0.0")  # every address includes 127.0.0.2


def test_a_handle_without_a_namespace_reads_as_before_and_one_with_it_round_trips() -> None:
    old = '{"create_time": 1.5, "dir": "/d", "pid": 7, "port": 9}'  # from before namespaces
    assert LocalHandle.from_json(old).netns is None
    assert LocalHandle.from_json(old).to_json() == old
    h = LocalHandle(7, 1.5, 8080, "/d", netns="fleetserve-a-b", address="10.231.0.2")
    assert LocalHandle.from_json(h.to_json()) == h


async def test_setup_and_run_see_skypilots_task_variables(
    infra: LocalInfra, tmp_path: Path
) -> None:
    """SkyPilot's variables (fleetserve.spec.task_env) in both setup and run: a single node,
    this machine's loopback address, the replica's GPUs."""
    dump = "python3 -c 'import json, os; print(json.dumps(dict(os.environ)))' > {}"
    req = request(
        tmp_path, setup=dump.format("setup.json"), run=dump.format("run.json") + "; sleep 30"
    )
    launched = await infra.launch(dataclasses.replace(req, gpus=2, zone="local"))
    try:
        workdir = Path(LocalHandle.from_json(launched.handle).dir) / "workdir"
        for _ in range(100):
            if (workdir / "run.json").exists() and (workdir / "run.json").stat().st_size:
                break
            await asyncio.sleep(0.05)
        for name in ("setup.json", "run.json"):
            env = json.loads((workdir / name).read_text())
            assert env["SKYPILOT_NUM_GPUS_PER_NODE"] == "2", name
            assert env["SKYPILOT_NODE_RANK"] == "0" and env["SKYPILOT_NUM_NODES"] == "1"
            assert env["SKYPILOT_NODE_IPS"] == "127.0.0.1" == env["SKYPILOT_SETUP_NODE_IPS"]
            assert env["SKYPILOT_SERVE_REPLICA_ID"] == "1"
            assert env["SKYPILOT_TASK_ID"].endswith("_svc-1_1")
            assert json.loads(env["SKYPILOT_CLUSTER_INFO"])["cluster_name"] == "svc-1"
    finally:
        await infra.terminate(launched.handle, "tok-1")


REUSING_SERVER = textwrap.dedent(
    """
    import os, socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("0.0.0.0", int(os.environ["PORT"])))
    s.listen()
    while True:
        c, _ = s.accept()
        c.recv(1024)
        c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")
        c.close()
    """
)


def time_wait_only_port() -> int:
    """A port that only TIME_WAIT connections hold: its server (SO_REUSEPORT, no SO_REUSEADDR,
    as some servers set) closed a connection first, then stopped listening."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = int(s.getsockname()[1])
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = s.accept()
            conn.close()  # the server's end goes to TIME_WAIT
            time.sleep(0.1)
    return port


async def test_a_fixed_port_held_only_by_time_wait_connections_is_free_for_the_next_server(
    infra: LocalInfra, tmp_path: Path
) -> None:
    """A service on a fixed port taken down, then another on it at once: no listener is
    left, only TIME_WAIT connections, and a server that binds as servers do gets the port."""
    from fleetserve.oshelpers.ports import fixed_port_taken, listeners_on, port_free

    port = time_wait_only_port()
    assert not port_free(port, "0.0.0.0") and listeners_on(port) == []  # the situation
    assert fixed_port_taken(port) is None
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "reuse.py").write_text(REUSING_SERVER)
    launched = await infra.launch(request(tmp_path, port=port, run="python3 reuse.py", setup=None))
    try:
        assert await get(port) == "ok"
    finally:
        await infra.terminate(launched.handle, "tok-1")


def test_a_listener_on_another_address_still_takes_a_fixed_port() -> None:
    from fleetserve.oshelpers.ports import fixed_port_taken

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))  # the server would bind 0.0.0.0, which includes it
        s.listen()
        port = s.getsockname()[1]
        why = fixed_port_taken(port)
        assert why is not None and f"port {port} (fixed by the spec) is already in use" in why
        assert f"pid {os.getpid()}" in why


async def test_the_ports_a_replicas_processes_listen_on_are_read_from_proc(
    infra: LocalInfra, tmp_path: Path
) -> None:
    """A server listening on another port than $PORT: the infra says which one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        other = int(s.getsockname()[1])
    server = "import socket, time\ns = socket.socket()\n"
    server += f"s.bind(('0.0.0.0', {other}))\ns.listen()\ntime.sleep(60)\n"
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "other.py").write_text(server)
    launched = await infra.launch(request(tmp_path, run="python3 other.py", setup=None))
    try:
        ports: list[int] | None = []
        for _ in range(100):
            ports = infra.listening_ports(launched.handle)
            if ports:
                break
            await asyncio.sleep(0.05)
        assert ports == [other] and other != launched.port
    finally:
        await infra.terminate(launched.handle, "tok-1")
    assert infra.listening_ports(launched.handle) is None  # gone
