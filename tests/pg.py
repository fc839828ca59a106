"""A real PostgreSQL server for the tests: one private cluster per test session.

Debian's `postgresql` package (scripts/test.sh installs it): `initdb` into a fresh temporary
folder, `pg_ctl start` on a free port of 127.0.0.1 (its unix socket in that folder too), a new
database per test, and `pg_ctl stop -m fast` on that folder at the end. The Debian cluster
service is never used. initdb refuses to run as root, so as root the server runs as the
`postgres` system user (`runuser`), in a folder that user owns.

Without PostgreSQL installed, the tests that need it fail and say how to install it: they are
never skipped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ADMIN = "fleet_admin"  # the cluster's superuser (creates the databases)
USER = "fleet"  # owns each test database: what a deployment gives fleetserve
# Characters that must be percent-encoded in a URL, so that masking is tested on the real thing.
PASSWORD = "pw-Zq9/x:7@secret"
ADMIN_PASSWORD = "admin-Kf3-secret"


def _quote(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


def find_bin() -> Path:
    """The folder of initdb / pg_ctl: Debian's newest, else whatever PATH has."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1].parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    pytest.fail(
        "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): the PostgreSQL store "
        "tests need it. Install Debian's package: apt-get install postgresql (scripts/test.sh "
        "does it when run as root)",
        pytrace=False,
    )


def _server_env() -> dict[str, str]:
    """The environment of the server's tools: ours without fleetserve's variables, so that no
    test that looks for a home's processes (by FLEETSERVE_HOME or its id) finds the server."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEETSERVE_")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgCluster:
    bin: Path
    root: Path  # the private folder: data/, the socket, the log
    port: int
    as_user: list[str]  # the prefix that runs the server's tools as its owner
    _names: Iterator[int]

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str, password: str = PASSWORD, user: str = USER) -> str:
        return f"postgresql://{user}:{_quote(password)}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        """Run statements as the superuser, each in autocommit (CREATE DATABASE needs it)."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=ADMIN,
            password=ADMIN_PASSWORD,
            dbname="postgres",
            autocommit=True,
        ) as conn:
            conn.execute(sql.encode())

    def new_database(self, prefix: str = "t") -> str:
        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        self.admin(f'CREATE DATABASE "{name}" OWNER {USER}')
        return name

    def stop(self) -> None:
        subprocess.run(
            # this cluster's own data folder: only the server it started stops
            [
                *self.as_user,
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.data),
                "-m",
                "fast",
                "-w",
                "stop",
            ],
            capture_output=True,
            timeout=60,
            check=False,
            env=_server_env(),
        )


def _tool(cmd: list[str], as_user: list[str], what: str, log: Path | None = None) -> None:
    proc = subprocess.run(
        [*as_user, *cmd],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=_server_env(),
    )
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
        pytest.fail(f"{what} failed ({proc.returncode}): {proc.stderr[-2000:]}\n{tail}")


def start_cluster() -> PgCluster:
    bindir = find_bin()
    # Under /tmp: short enough for the unix socket's path (at most 107 bytes), and reachable
    # by the postgres user when we are root (a TMPDIR under /root would not be).
    root = Path(
        tempfile.mkdtemp(prefix="fleetserve-pg-", dir="/tmp" if Path("/tmp").is_dir() else None)
    )
    as_user: list[str] = []
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail(
                "running as root, the test PostgreSQL server needs the `postgres` system user "
                "(Debian's postgresql package creates it): apt-get install postgresql",
                pytrace=False,
            )
        os.chown(root, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    root.chmod(0o700)
    pwfile = root / "pwfile"
    pwfile.write_text(ADMIN_PASSWORD + "\n")
    if as_user:
        os.chown(pwfile, pwd.getpwnam("postgres").pw_uid, -1)
    pwfile.chmod(0o600)
    _tool(
        [
            str(bindir / "initdb"),
            "-D",
            str(root / "data"),
            "-U",
            ADMIN,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",  # TCP logins need the right password
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ],
        as_user,
        "initdb",
    )
    pwfile.unlink()
    log = root / "server.log"
    for _attempt in range(3):  # a free port can be taken before the server binds it
        port = _free_port()
        options = (
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
        )
        proc = subprocess.run(
            [
                *as_user,
                str(bindir / "pg_ctl"),
                "-D",
                str(root / "data"),
                "-l",
                str(log),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
            env=_server_env(),
        )
        if proc.returncode == 0:
            break
    else:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        pytest.fail(f"pg_ctl start failed: {proc.stderr}\n{tail}")
    cluster = PgCluster(bindir, root, port, as_user, itertools.count(1))
    try:
        cluster.admin(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(cluster.root)


@pytest.fixture
def pg_url(pg_cluster: PgCluster) -> str:
    """The URL of a new, empty database of its own (owned by the `fleet` role)."""
    return pg_cluster.url(pg_cluster.new_database())
