"""--env, --env-file and --secret with the real CLI: SkyPilot's semantics (a null entry must
be given a value), secrets substituted into a probe header, present in the replica's
environment and absent from everything fleetserve shows."""

from __future__ import annotations

import json
import textwrap
import urllib.request

import psutil
import pytest

from fleetserve.core.errors import InvalidSpec
from tests.e2e.conftest import Fleet

pytestmark = pytest.mark.e2e

SECRET = "sk-planted-" + "7" * 24

# Ready only for a probe that carries the secret token (proves the substitution).
GUARDED = textwrap.dedent(
    """
    import os
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    WANT = "Bearer " + os.environ["AUTH_TOKEN"]
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == WANT
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *a):
            pass
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
    """
)

SPEC = """\
    service:
      readiness_probe:
        path: /health
        initial_delay_seconds: 30
        headers:
          Authorization: Bearer $AUTH_TOKEN
      replicas: 1
    workdir: app
    envs:
      MODEL: small
      HF_TOKEN: null
    secrets:
      AUTH_TOKEN: null
    run: python3 guarded.py
    """


def test_env_and_secret_flags_fill_nulls_reach_the_replica_and_secrets_stay_hidden(
    fleet: Fleet,
) -> None:
    (fleet.workdir / "guarded.py").write_text(GUARDED)
    spec = fleet.write_service("guarded", SPEC)
    cwd = fleet.workdir.parent  # `workdir: app` starts from the folder `up` runs in
    refused = fleet.cli("up", "-d", str(spec), "-n", "guarded", check=False, cwd=cwd)
    assert refused.returncode == 2, refused.stderr
    assert "envs.HF_TOKEN, secrets.AUTH_TOKEN" in refused.stderr
    (cwd / "app.env").write_text("# the model\nMODEL='large'\n")
    fleet.cli("server", "start")  # before HF_TOKEN is in the shell: the controller lacks it
    # The controller checks too (for API and SDK callers), and bounds what it is sent.
    client = fleet.client()
    with pytest.raises(InvalidSpec, match=r"envs\.HF_TOKEN, secrets\.AUTH_TOKEN: null"):
        client.up(spec.read_text(), "viaapi", base_dir=str(cwd))
    with pytest.raises(InvalidSpec, match="secrets") as too_many:
        client.up(
            spec.read_text(), "viaapi", str(cwd), secrets={f"S{i}": SECRET for i in range(300)}
        )
    assert SECRET not in too_many.value.message
    assert client.status() == []
    fleet.env["HF_TOKEN"] = "hf-from-the-shell"
    try:
        out = fleet.cli(
            "up",
            str(spec),
            "-n",
            "guarded",
            "--env-file",
            "app.env",
            "--env",
            "HF_TOKEN",
            "--secret",
            f"AUTH_TOKEN={SECRET}",
            cwd=cwd,
        )
    finally:
        del fleet.env["HF_TOKEN"]
    assert "is READY" in out.stdout  # the probe carried the secret bearer token
    replica = fleet.client().service("guarded").replicas[0]
    assert replica.pid is not None
    environ = psutil.Process(replica.pid).environ()
    assert environ["AUTH_TOKEN"] == SECRET
    assert environ["HF_TOKEN"] == "hf-from-the-shell"
    assert environ["MODEL"] == "large"
    assert "HF_TOKEN" not in psutil.Process(fleet.controller_pid()).environ()

    shown = [out.stdout, out.stderr]
    for args in (
        ("status", "-v"),
        ("status", "guarded", "-v"),
        ("logs", "--controller", "--no-follow"),
        ("logs", "guarded", "--load-balancer", "--no-follow"),
    ):
        done = fleet.cli(*args)
        shown += [done.stdout, done.stderr]
    for path in ("/services", "/services/guarded", "/services/guarded/events?limit=1000"):
        req = urllib.request.Request(fleet.api + path, headers=fleet.auth())
        with urllib.request.urlopen(req, timeout=10) as r:
            shown.append(json.dumps(json.loads(r.read())))
    assert all(SECRET not in text for text in shown)
    fleet.cli("down", "guarded")
