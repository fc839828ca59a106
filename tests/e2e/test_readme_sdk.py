"""The README's Python SDK snippet, run as written against a real controller: it waits for
READY (it printed `CONTROLLER_INIT None`), and a service that cannot start raises
ServiceFailed with the cause from the replica's log and the command that shows the rest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import Fleet

ROOT = Path(__file__).resolve().parents[2]


def readme_sdk_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python SDK and REST API", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "no python block in the README's SDK section"
    return m.group(1)


def test_the_readme_sdk_snippet_waits_for_ready(fleet: Fleet) -> None:
    done = subprocess.run(
        [sys.executable, "-c", readme_sdk_snippet()],
        env=fleet.env,
        cwd=ROOT,  # the README's paths start from the repository's root
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"READY http://127\.0\.0\.1:\d+\n", done.stdout), done.stdout
    with fleet.client() as c:
        assert c.status() == []  # down and gone


def test_wait_raises_the_cause_of_a_service_that_cannot_start(fleet: Fleet) -> None:
    path = fleet.write_service(
        "missing",
        f"""
        service:
          readiness_probe: /health
          replicas: 1
        workdir: {fleet.workdir}
        run: python3 no_such_server.py
        """,
    )
    code = (
        "import fleetserve, sys\n"
        "with fleetserve.Client() as c:\n"
        "    try:\n"
        f"        c.up_file({str(path)!r}, name='missing', wait=True, timeout=90)\n"
        "    except fleetserve.ServiceFailed as e:\n"
        "        print(e.message)\n"
        "        sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=fleet.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    message = done.stdout
    assert "service missing is FAILED" in message and "launches stopped" in message
    assert "can't open file" in message and "no_such_server.py" in message
    assert "`fleetserve logs missing 3 --no-follow` shows the rest" in message
    with fleet.client() as c:
        assert [r.replica_id for r in c.service("missing").replicas] == [1, 2, 3]
