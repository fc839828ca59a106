"""Real vLLM behind fleetserve: examples/vllm/service.yaml as a user runs it, on the testbed
(vLLM's CPU build in .venv-vllm and a small model made offline: ./scripts/llm/setup.sh, which
scripts/test.sh runs). One fleet of 2 replicas for the whole module (a vLLM start costs a
minute on 2 cores); the tests run in file order and the last four change the fleet (an
update, a kill, then two changes of the load balancer's settings in place)."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, endpoint_of, fleet_in
from tests.e2e.vllm_testbed import REPO, vllm_testbed

# A vLLM start is ~1 min on a quiet 2-core machine and several on a busy one; the fleet's
# start counts in the first test's time, an update's two starts in that test's.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = REPO / "examples" / "vllm" / "service.yaml"
MAX_NUM_SEQS = 4
NAME = "vllm"
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
]


def env_args(python: Path, model: str, *more: str) -> list[str]:
    args = ["--env", f"MODEL={model}", "--env", f"VLLM_PYTHON={python}"]
    # Eager mode: no torch.compile at start (a minute less per replica on 2 cores). A batch of
    # at most MAX_NUM_SEQS requests: more wait in vLLM's queue (the last test moves them).
    args += ["--env", f"VLLM_EXTRA_ARGS=--enforce-eager --max-num-seqs {MAX_NUM_SEQS}"]
    for item in more:
        args += ["--env", item]
    return args


@dataclass
class Served:
    fleet: Fleet
    endpoint: str
    python: Path
    model: str

    @property
    def hostport(self) -> tuple[str, int]:
        host, _, port = self.endpoint.removeprefix("http://").partition(":")
        return host, int(port)

    def ready(self) -> dict[int, str]:
        """READY replicas: id -> endpoint."""
        svc = self.fleet.client().service(NAME)
        return {
            r.replica_id: r.endpoint for r in svc.replicas if r.status == "READY" and r.endpoint
        }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    python, model = vllm_testbed()
    for fleet in fleet_in(tmp_path_factory.mktemp("vllm")):
        out = fleet.cli("up", str(EXAMPLE), *env_args(python, model), timeout=900, cwd=REPO)
        s = Served(fleet, endpoint_of(out.stdout), python, model)
        fleet.wait_for("both vLLM replicas READY", lambda s=s: len(s.ready()) == 2, timeout=600)
        yield s
        fleet.cli("down", NAME, timeout=120)


def chat(
    s: Served,
    messages: list[dict[str, str]],
    max_tokens: int = 8,
    timeout: float = 120,
) -> dict[str, object]:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    req = urllib.request.Request(
        s.endpoint + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


def vllm_metrics(url: str) -> dict[str, float]:
    """vLLM's own counters and gauges (summed over label sets) from a replica's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, _, _rest = line.partition("{") if "{" in line else line.partition(" ")
            number = line.rsplit(" ", 1)[1]
            try:
                out[name.strip()] = out.get(name.strip(), 0.0) + float(number)
            except ValueError:
                continue
    return out


def block_size(url: str) -> int:
    """vLLM's KV cache block size (its cache_config_info gauge's label): prefix caching keeps
    whole blocks only (16 tokens on GPUs, 128 on the CPU build)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{") and 'block_size="' in line:
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    raise AssertionError("vLLM's /metrics has no vllm:cache_config_info{block_size=...}")


def stream_chat(
    served: Served, max_tokens: int = 48, headers: dict[str, str] | None = None
) -> list[tuple[float, bytes]]:
    """One streamed chat answer of `max_tokens` tokens: each `data:` line and when it
    arrived."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me about the fleet"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        # The last chunk before [DONE] then carries the answer's token count (no choices).
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(*served.hostport, timeout=120)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Content-Type": "application/json", **(headers or {})},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert (resp.getheader("Content-Type") or "").startswith("text/event-stream")
    events: list[tuple[float, bytes]] = []
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append((time.monotonic(), line.strip()))
            if line.strip() == b"data: [DONE]":
                break
    conn.close()
    return events


def test_chat_completions_stream_token_by_token(served: Served) -> None:
    # Token by token: the chunks reach the client as vLLM sends them, in many bursts over the
    # answer's time, not in one piece at the end (a buffering proxy delivers them all within a
    # millisecond). vLLM's API process sends a few tokens at once when the CPU is busy, so not
    # every gap is a token's time; and a test process that the rest of a parallel suite keeps
    # off the CPU for the whole answer reads it in one piece too: up to three answers, of
    # which one must come in bursts (a buffering proxy fails all three).
    tries: list[list[float]] = []
    for _ in range(3):
        events = stream_chat(served)
        assert events and events[-1][1] == b"data: [DONE]"
        chunks = [json.loads(e[6:]) for _, e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        *tokens, usage = chunks
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 48
        assert tokens[-1]["choices"][0]["finish_reason"] == "length"
        # Mostly a chunk per token: vLLM's output step puts two or more tokens in a chunk now
        # and then when the CPU is busy (47 chunks for 48 tokens seen in CI), never most.
        assert len(tokens) >= 24, len(tokens)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(events)]
        tries.append(gaps)
        if sum(g > 0.001 for g in gaps) >= 8 and events[-1][0] - events[0][0] > 0.05:
            break
    else:
        raise AssertionError(f"three answers each arrived in one piece: gaps {tries}")


def test_vllm_in_its_default_mode_answers_requests_with_a_priority_hint(served: Served) -> None:
    """load_balancer.engine_priority adds vLLM's X-Vllm-Priority header: an engine left in its
    default first-come-first-served mode answers such a request as any other (the header is
    only read in --scheduling-policy priority; bench/llm's runs used that mode)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
    for url in served.ready().values():
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            data=json.dumps({**body, "max_tokens": 4, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json", "X-Vllm-Priority": "1765000000123"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4


def test_cache_aware_sends_the_next_turn_where_vllm_has_the_prefix(served: Served) -> None:
    """Each conversation's second turn goes to the replica that served its first, where
    vLLM's own prefix cache then hits the whole first turn (vllm:prefix_cache_hits_total)."""
    rng = random.Random(22)
    replicas = served.ready()
    block = block_size(next(iter(replicas.values())))
    served_by: list[int] = []
    for conv in range(4):
        system = f"conversation {conv}: " + " ".join(rng.choice(WORDS) for _ in range(600))
        first = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
        before = {rid: vllm_metrics(url) for rid, url in replicas.items()}
        reply = chat(served, first)
        mid = {rid: vllm_metrics(url) for rid, url in replicas.items()}
        turn1 = [
            rid
            for rid in replicas
            if mid[rid]["vllm:prefix_cache_queries_total"]
            > before[rid]["vllm:prefix_cache_queries_total"]
        ]
        assert len(turn1) == 1, (before, mid)
        usage = reply["usage"]
        assert isinstance(usage, dict)
        prompt_tokens = int(usage["prompt_tokens"])
        text = reply["choices"][0]["message"]["content"]  # type: ignore[index]
        second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
        chat(served, second)
        after = {rid: vllm_metrics(url) for rid, url in replicas.items()}
        hits = {
            rid: after[rid]["vllm:prefix_cache_hits_total"]
            - mid[rid]["vllm:prefix_cache_hits_total"]
            for rid in replicas
        }
        turn2 = [
            rid
            for rid in replicas
            if after[rid]["vllm:prefix_cache_queries_total"]
            > mid[rid]["vllm:prefix_cache_queries_total"]
        ]
        assert turn2 == turn1, (conv, turn1, turn2)
        # The second turn's prompt starts with the first's: vLLM found every whole block of it.
        assert prompt_tokens >= 2 * block
        assert hits[turn1[0]] >= prompt_tokens // block * block, (conv, hits, prompt_tokens)
        served_by.append(turn1[0])
    print(f"\nconversations served by replicas {served_by}")


def lb_admin(served: Served) -> tuple[str, str]:
    cfg = json.loads((served.fleet.home / "lb" / f"{NAME}.json").read_text())
    return f"http://127.0.0.1:{cfg['admin_port']}/metrics", str(cfg["admin_secret"])


def lb_metrics_text(served: Served) -> str:
    """The load balancer's /metrics (waiting up to 30 s for one that new settings just
    replaced to answer)."""
    deadline = time.monotonic() + 30
    while True:
        url, secret = lb_admin(served)
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {secret}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return str(r.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def update_in_place(served: Served, path: Path, yaml: str) -> None:
    """`fleetserve update` with `yaml` (the example with other load-balancer settings),
    applied in place: the vLLM replicas stay."""
    current = served.fleet.client().service(NAME)
    envs = ["SERVED_MODEL_NAME=tiny"] + (["ROLLOUT=2"] if current.active_version > 1 else [])
    path.write_text(yaml)
    out = served.fleet.cli(
        "update",
        NAME,
        str(path),
        *env_args(served.python, served.model, *envs),
        timeout=300,
        cwd=REPO,
    )
    assert "the replicas moved to it in place" in out.stdout, out.stdout  # vLLM not restarted


def reported_loads(served: Served) -> dict[str, float]:
    text = lb_metrics_text(served)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("fleetserve_lb_replica_reported_load{"):
            labels, value = line.rsplit(" ", 1)
            rid = labels.split('replica="', 1)[1].split('"', 1)[0]
            out[rid] = float(value)
    return out


def test_replica_metrics_read_vllm_running_and_waiting(served: Served) -> None:
    """`replica_metrics_seconds: 1` (the example's): the LB reads each replica's running +
    waiting requests from vLLM's /metrics; it shows them as fleetserve_lb_replica_reported_load."""
    replicas = served.ready()
    errors: list[BaseException] = []

    def long_stream() -> None:
        try:
            chat(served, [{"role": "user", "content": "write a long answer"}], max_tokens=400)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=long_stream) for _ in range(6)]
    for t in threads:
        t.start()
    seen: list[tuple[dict[str, float], dict[str, float]]] = []
    deadline = time.monotonic() + 60
    matched = False
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        own = {
            str(rid): (
                (m := vllm_metrics(url))["vllm:num_requests_running"]
                + m["vllm:num_requests_waiting"]
            )
            for rid, url in replicas.items()
        }
        lb = reported_loads(served)
        seen.append((own, lb))
        # The LB's reading (at most a second old) agrees with vLLM's own while both are busy.
        if sum(own.values()) >= 2 and all(abs(lb.get(rid, -99) - n) <= 2 for rid, n in own.items()):
            matched = True
            break
        time.sleep(0.3)
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert matched, seen[-5:]
    # Once idle, the readings fall back to 0 within a few polls.
    served.fleet.wait_for(
        "reported loads back to 0",
        lambda: (r := reported_loads(served)) and all(v == 0 for v in r.values()),
        timeout=20,
    )


@dataclass
class Load:
    """Requests in a loop from `threads` clients until stopped (bounded in count and time),
    each client pausing `pause` seconds between its requests: steady traffic through the LB,
    not a saturated engine (whose CPU would slow the new replicas an update starts and the
    rest of a parallel suite)."""

    served: Served
    threads: int = 2
    pause: float = 0.2
    max_requests: int = 3000
    max_seconds: float = 600
    ok: int = 0
    failures: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, why)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self) -> None:
        end = time.monotonic() + self.max_seconds
        while not self._stop.is_set() and time.monotonic() < end:
            with self._lock:
                if self.ok + len(self.failures) >= self.max_requests:
                    return
            start = time.monotonic()
            try:
                chat(self.served, [{"role": "user", "content": "ping"}], max_tokens=4, timeout=60)
                with self._lock:
                    self.ok += 1
            except Exception as e:
                with self._lock:
                    self.failures.append((start, time.monotonic(), repr(e)[:200]))
            self._stop.wait(self.pause)

    def __enter__(self) -> Load:
        self._workers = [threading.Thread(target=self._run) for _ in range(self.threads)]
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(120)


def test_rolling_update_under_load_fails_no_request(served: Served) -> None:
    with Load(served) as load:
        time.sleep(2)
        served.fleet.cli(
            "update",
            NAME,
            str(EXAMPLE),
            *env_args(served.python, served.model, "SERVED_MODEL_NAME=tiny", "ROLLOUT=2"),
            timeout=900,
            cwd=REPO,
        )
        served.fleet.wait_for(
            "2 READY replicas of version 2 only",
            lambda: (
                sorted(
                    r.version
                    for r in served.fleet.client().service(NAME).replicas
                    if r.status == "READY"
                )
                == [2, 2]
            ),
            timeout=600,
        )
        time.sleep(2)
    assert load.ok >= 10
    assert load.failures == [], load.failures


def test_a_replica_killed_under_load_loses_only_its_requests_in_flight(served: Served) -> None:
    """kill -9 of a replica: what it had in flight is lost (vLLM had the request; a POST is
    not replayed once sent), every request sent after the kill succeeds (the LB retries a
    refused connection on the other replica until the controller drops the dead one)."""
    replicas = served.ready()
    victim = min(replicas)
    pid = next(
        r.pid for r in served.fleet.client().service(NAME).replicas if r.replica_id == victim
    )
    assert pid
    with Load(served, threads=3) as load:
        time.sleep(3)
        killed_at = time.monotonic()
        os.killpg(pid, signal.SIGKILL)  # the replica's process group: vLLM and its engine
        time.sleep(10)
    assert load.ok >= 10
    late = [f for f in load.failures if f[0] > killed_at]
    assert late == [], late
    assert len(load.failures) <= load.threads, load.failures  # at most one in flight per client


def test_new_lb_settings_do_not_cut_streams_in_progress(served: Served, tmp_path: Path) -> None:
    """An update of the load balancer's settings only (applied in place: the vLLM replicas
    stay) while long answers stream: the old load balancer is retired and finishes them
    (up to FLEETSERVE_DRAIN_SECONDS), past the 5 s that a stop gives; the new one serves."""
    changed = EXAMPLE.read_text().replace(
        "    replica_metrics_seconds: 1",
        "    replica_metrics_seconds: 1\n    max_extra_load: 6",
    )
    results: list[list[tuple[float, bytes]]] = []
    errors: list[str] = []

    def one() -> None:
        try:
            results.append(stream_chat(served, max_tokens=1500))
        except Exception as e:  # the test fails on it below
            errors.append(repr(e))

    streams = [threading.Thread(target=one) for _ in range(2)]
    began = time.monotonic()
    for t in streams:
        t.start()
    time.sleep(2)
    update_in_place(served, tmp_path / "service.yaml", changed)
    for t in streams:
        t.join(300)
    assert errors == [], errors
    assert len(results) == 2
    for events in results:
        assert events[-1][1] == b"data: [DONE]"
        # The whole answer: its last token chunk ends it at max_tokens, and vLLM's usage chunk
        # counts them all (vLLM sends a few tokens a chunk when the CPU is busy).
        assert json.loads(events[-3][1][6:])["choices"][0]["finish_reason"] == "length"
        assert json.loads(events[-2][1][6:])["usage"]["completion_tokens"] == 1500
    assert max(e[-1][0] for e in results) - began > 8  # they outlived a stop's 5 s drain
    log = served.fleet.cli("logs", "--no-follow", NAME, "--load-balancer").stdout
    assert "retired for a new load balancer" in log
    assert chat(served, [{"role": "user", "content": "after"}])["choices"]


def lb_moved(served: Served) -> float:
    """fleetserve_lb_requests_moved_total, all replicas."""
    text = lb_metrics_text(served)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fleetserve_lb_requests_moved_total{")
    )


def test_requests_waiting_in_vllms_queue_move_to_the_replica_with_room(
    served: Served, tmp_path: Path
) -> None:
    """`move_waiting_requests` on real vLLM: the sticky policy sends one session's requests
    to one replica, whose batch holds MAX_NUM_SEQS of them; the others wait in vLLM's queue
    (vllm:num_requests_waiting) while the other replica has none. The LB moves waiting ones
    there: both replicas answer some, every answer is whole, none fails."""
    served.fleet.wait_for("both vLLM replicas READY", lambda: len(served.ready()) == 2, 600)
    changed = (
        EXAMPLE.read_text()
        .replace("load_balancing_policy: cache_aware", "load_balancing_policy: sticky")
        .replace(
            "    replica_metrics_seconds: 1",
            "    replica_metrics_seconds: 1\n    move_waiting_requests: true",
        )
    )

    def retired() -> int:
        log = served.fleet.cli("logs", "--no-follow", NAME, "--load-balancer").stdout
        return log.count("retired for a new load balancer")

    before = retired()
    update_in_place(served, tmp_path / "service.yaml", changed)
    # Until the old load balancer stops accepting, a request may still reach it (cache_aware).
    served.fleet.wait_for("the old load balancer retired", lambda: retired() > before, 60)
    replicas = served.ready()
    done = {rid: vllm_metrics(url)["vllm:request_success_total"] for rid, url in replicas.items()}
    moved = lb_moved(served)
    results: list[list[tuple[float, bytes]]] = []
    errors: list[str] = []
    session = {"X-Session-Id": "one-session"}

    def one() -> None:
        try:
            results.append(stream_chat(served, max_tokens=300, headers=session))
        except Exception as e:  # the test fails on it below
            errors.append(repr(e))

    clients = [threading.Thread(target=one) for _ in range(2 * MAX_NUM_SEQS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(300)
    assert errors == [], errors
    assert len(results) == 2 * MAX_NUM_SEQS
    for events in results:
        assert events[-1][1] == b"data: [DONE]"
        assert json.loads(events[-2][1][6:])["usage"]["completion_tokens"] == 300
    served_by = {
        rid: vllm_metrics(url)["vllm:request_success_total"] - done[rid]
        for rid, url in replicas.items()
    }
    assert sum(served_by.values()) == 2 * MAX_NUM_SEQS, served_by
    assert min(served_by.values()) >= 1, served_by  # sticky alone would give one replica all
    log = served.fleet.cli("logs", "--no-follow", NAME, "--load-balancer").stdout
    assert lb_moved(served) - moved >= 1, (served_by, log[-3000:])
