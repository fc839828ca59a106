"""SkyServe's streaming smoke test, its service YAML byte for byte, run from the folder its
usage line names (`sky serve up tests/skyserve/streaming/streaming.yaml` at SkyPilot's root):
`resources.ports: 8080`, a workdir relative to the current folder, `pip install fastapi
uvicorn` as setup, and a response streamed chunk by chunk through the load balancer."""

from __future__ import annotations

import http.client
import shutil
import textwrap
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, endpoint_of

pytestmark = pytest.mark.e2e

CORPUS = Path(__file__).parent.parent / "fixtures" / "skyserve" / "corpus"
WORDS = [f"word{i}" for i in range(12)]

# Our own stand-in for SkyPilot's tests/skyserve/streaming/server.py (its code is not ours to
# copy): the same contract, a FastAPI app on 8080 whose `/` streams words with pauses between.
SERVER = textwrap.dedent(
    f"""
    import asyncio
    import fastapi, uvicorn
    from fastapi.responses import StreamingResponse
    app = fastapi.FastAPI()
    WORDS = {WORDS!r}
    async def words():
        for w in WORDS:
            yield w + " "
            await asyncio.sleep(0.15)
    @app.get("/")
    async def root():
        return StreamingResponse(words(), media_type="text/plain")
    uvicorn.run(app, host="0.0.0.0", port=8080, log_level="warning")
    """
)


def test_skyserves_streaming_test_runs_unchanged_and_streams(fleet: Fleet, tmp_path: Path) -> None:
    repo = tmp_path / "skypilot"
    example = repo / "tests" / "skyserve" / "streaming"
    example.mkdir(parents=True)
    shutil.copy(CORPUS / "tests" / "skyserve" / "streaming" / "streaming.yaml", example)
    (example / "server.py").write_text(SERVER)
    out = fleet.cli(
        "up", "-n", "streaming", "tests/skyserve/streaming/streaming.yaml", cwd=repo, timeout=180
    )
    endpoint = endpoint_of(out.stdout)
    client = fleet.client()
    fleet.wait_for(
        "the replica READY",
        lambda: [r.status for r in client.service("streaming").replicas] == ["READY"],
        timeout=60,
    )
    url = urllib.parse.urlsplit(endpoint)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    t0 = time.monotonic()
    conn.request("GET", "/")
    resp = conn.getresponse()
    assert resp.status == 200
    arrivals: list[tuple[float, bytes]] = []
    while chunk := resp.read1(65536):
        arrivals.append((time.monotonic() - t0, chunk))
    conn.close()
    text = b"".join(c for _, c in arrivals).decode()
    assert text.split() == WORDS  # SkyServe's own check: the whole text, in order
    # Streamed, not buffered: the first words arrive long before the last one is written.
    first, last = arrivals[0][0], arrivals[-1][0]
    assert len(arrivals) >= 4 and last - first >= 1.0, [round(t, 2) for t, _ in arrivals]
    assert (
        "running setup" in fleet.cli("logs", "--no-follow", "streaming", "1").stdout
    )  # pip ran first
    fleet.cli("down", "streaming", timeout=120)
