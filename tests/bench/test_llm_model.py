"""bench/llm: the fake LLM replica's model (KV cache, prefix sharing, LRU, batching, prefill
time), the workload generators, and one short socket test of the replicas process."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

LLM = Path(__file__).resolve().parents[2] / "bench" / "llm"


def _load(name: str) -> ModuleType:
    """bench/llm is a folder of scripts (they import each other as top-level modules)."""
    spec = importlib.util.spec_from_file_location(f"bench_llm_{name}", LLM / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


model = _load("model")
workloads = _load("workloads")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(**kw: object) -> tuple[object, Clock]:
    defaults: dict[str, object] = {
        "block_tokens": 4,
        "cache_blocks": 64,
        "max_batch": 8,
        "max_waiting": 8,
        "prefill_ms_per_token": 1.0,
        "decode_ms_per_step": 10.0,
        "max_prefill_tokens": 1000,
    }
    clock = Clock()
    return model.Scheduler(model.ModelConfig(**{**defaults, **kw}), clock), clock


def step(s: object, clock: Clock) -> object:
    st = s.schedule()  # type: ignore[attr-defined]
    assert st is not None
    clock.now += st.duration
    s.complete(st)  # type: ignore[attr-defined]
    return st


def run_all(s: object, clock: Clock, limit: int = 10_000) -> list[object]:
    steps = []
    for _ in range(limit):
        st = s.schedule()  # type: ignore[attr-defined]
        if st is None:
            return steps
        clock.now += st.duration
        s.complete(st)  # type: ignore[attr-defined]
        steps.append(st)
    raise AssertionError("the scheduler never went idle")


def words(n_chars: int, seed: str = "a") -> str:
    text = ""
    i = 0
    while len(text) < n_chars:
        text += f"{seed}{i} "
        i += 1
    return text[:n_chars]


# ---------------------------------------------------------------- tokens and cache


def test_tokens_are_four_characters_from_the_start() -> None:
    assert model.tokenize("abcdefghij") == ["abcd", "efgh", "ij"]
    assert model.count_tokens("abcdefghij") == 3
    # An extension shares every full token of the earlier text, not its partial last one.
    assert model.tokenize("abcdefghijkl")[:2] == model.tokenize("abcdefghij")[:2]
    text = words(40)
    keys = model.block_keys(text, 4)  # 10 tokens: 2 full blocks
    assert len(keys) == 2
    assert model.block_keys(text[:32], 4) == keys
    # 31 characters: 8 tokens, the last one partial; its second block is another block.
    assert model.block_keys(text[:31], 4)[0] == keys[0]
    assert model.block_keys(text[:31], 4)[1] != keys[1]


def test_a_repeated_prompt_hits_the_cache_for_its_full_blocks() -> None:
    s, clock = make()
    prompt = words(86)  # 22 tokens: 5 full blocks of 4, 2 tokens left over
    first = s.submit(prompt, 3)
    run_all(s, clock)
    assert first.cached_tokens == 0 and first.done
    again = s.submit(prompt, 3)
    step(s, clock)
    assert again.cached_tokens == 20  # the 5 full blocks
    assert s.counters.prefix_cache_queries == 44
    assert s.counters.prefix_cache_hits == 20


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    s, clock = make()
    prompt = words(64)  # 16 tokens: exactly 4 blocks
    s.submit(prompt, 2)
    run_all(s, clock)
    again = s.submit(prompt, 2)
    st = step(s, clock)
    # vLLM's rule: hits stop before the last token, so the last block is computed again.
    assert again.cached_tokens == 12
    assert st.prefill == [(again, 4)]


def test_an_extension_hits_the_earlier_prompts_blocks() -> None:
    s, clock = make()
    base = words(80)  # 20 tokens, 5 blocks
    s.submit(base, 2)
    run_all(s, clock)
    longer = s.submit(base + words(50, "b"), 2)
    step(s, clock)
    assert longer.cached_tokens == 20
    other = s.submit(words(130, "c"), 2)
    step(s, clock)
    assert other.cached_tokens == 0


def test_the_next_chat_turn_hits_the_prompt_and_the_reply() -> None:
    s, clock = make(cache_blocks=256)
    turn1 = [{"role": "system", "content": words(101)}, {"role": "user", "content": "hi there"}]
    first = s.submit(model.render_chat(turn1), 9)
    run_all(s, clock)
    assert first.reply == model.reply_text(model.render_chat(turn1), 9)  # deterministic
    turn2 = [*turn1, {"role": "assistant", "content": first.reply}]
    turn2.append({"role": "user", "content": "and then?"})
    second = s.submit(model.render_chat(turn2), 2)
    step(s, clock)
    # Every full block of the first prompt and its reply, cut into tokens again.
    full_tokens = len(model.render_chat(turn1) + first.reply) // 4
    assert second.cached_tokens == full_tokens // 4 * 4
    assert second.cached_tokens > model.count_tokens(model.render_chat(turn1))


def test_lru_evicts_the_least_recently_used_unreferenced_block() -> None:
    cache = model.KvCache(3)
    for key in (1, 2, 3):
        cache.reserve(1)
        cache.publish(key)
        cache.release(key)  # all unreferenced, 1 the least recently used
    cache.acquire(1)
    cache.release(1)  # 1 used again: now 2 is the least recently used
    assert cache.add(4)  # evicts 2
    assert set(cache.refs) == {1, 3, 4}
    cache.release(4)
    assert list(cache.lru) == [3, 1, 4]
    cache.acquire(3)  # referenced: never evicted, although the least recently used
    for key in (5, 6):
        assert cache.add(key)
        cache.release(key)
    assert set(cache.refs) == {3, 5, 6} and cache.evictions == 3
    cache.acquire(5)
    cache.acquire(6)
    assert not cache.can_take([], 1)  # every block referenced: no room
    assert not cache.add(7)
    assert set(cache.refs) == {3, 5, 6}


def test_a_running_requests_blocks_are_never_evicted() -> None:
    s, clock = make(cache_blocks=10)
    a = s.submit(words(24), 4)  # 6 + 4 tokens: 3 blocks
    b = s.submit(words(24, "b"), 4)
    step(s, clock)
    assert a in s.running and b in s.running  # 6 blocks reserved
    c = s.submit(words(40, "c"), 4)  # 10 + 4 tokens: 4 blocks, the last 4 free
    d = s.submit(words(60, "d"), 4)  # 15 + 4 tokens: 5 blocks; a's and b's are in use: waits
    step(s, clock)
    assert c in s.running and d in s.waiting
    assert s.cache.used <= 10
    run_all(s, clock)
    assert d.done and s.cache.used <= 10


def test_the_cache_makes_room_by_evicting_finished_requests_blocks() -> None:
    s, clock = make(cache_blocks=12)
    old = words(40, "old")  # 10 tokens + 2 out: 3 blocks, 2 of them full prompt blocks
    s.submit(old, 2)
    run_all(s, clock)
    assert s.cache.used > 0 and not s.running
    for i in range(4):  # 4 x 3 blocks: the old prompt's blocks must go
        s.submit(words(40, f"n{i}"), 2)
    run_all(s, clock)
    again = s.submit(old, 2)
    step(s, clock)
    assert again.cached_tokens == 0
    assert s.cache.evictions > 0


# ---------------------------------------------------------------- time and batching


def test_prefill_time_grows_with_uncached_tokens() -> None:
    s, clock = make(cache_blocks=256)
    short = s.submit(words(40), 1)
    st1 = step(s, clock)
    long = s.submit(words(400, "x"), 1)
    st2 = step(s, clock)
    assert short.done and long.done
    assert st1.duration == pytest.approx((10 + 1.0 * 10) / 1000)
    assert st2.duration == pytest.approx((10 + 1.0 * 100) / 1000)
    again = s.submit(words(400, "x"), 1)  # cached but the last block
    st3 = step(s, clock)
    assert again.cached_tokens == 96
    assert st3.duration == pytest.approx((10 + 1.0 * 4) / 1000)


def test_chunked_prefill_and_one_token_per_step() -> None:
    s, clock = make(max_prefill_tokens=40, cache_blocks=256)
    req = s.submit(words(400), 3)  # 100 tokens: 40 + 40 + 20
    durations = [step(s, clock).duration for _ in range(5)]
    # Two steps of prefill only (no token yet), the last chunk with the first token, then
    # one token per decode step.
    assert durations == pytest.approx([0.04, 0.04, 0.03, 0.01, 0.01])
    assert req.done and req.generated == 3
    assert req.first_token_at == pytest.approx(0.11)
    assert req.finished_at == pytest.approx(0.13)
    assert s.schedule() is None


def test_batch_bound_and_fifo_queue() -> None:
    s, clock = make(max_batch=2, max_waiting=3)
    reqs = [s.submit(words(20, f"r{i}"), 3) for i in range(2)]
    step(s, clock)
    reqs += [s.submit(words(20, f"r{i}"), 2) for i in range(2, 5)]
    with pytest.raises(model.Rejected) as e:
        s.submit(words(20, "z"), 2)  # 3 already waiting
    assert e.value.status == 503
    assert s.running == reqs[:2] and list(s.waiting) == reqs[2:]
    order = list(s.running)
    for _ in range(100):
        st = s.schedule()
        if st is None:
            break
        assert len(s.running) <= 2
        order += [r for r in s.running if r not in order]
        clock.now += st.duration
        s.complete(st)
    assert order == reqs and all(r.done for r in reqs)


def test_fifo_head_blocks_smaller_requests_behind_it() -> None:
    s, clock = make(cache_blocks=10, max_batch=8)
    s.submit(words(100), 4)  # 25 + 4 tokens: 8 blocks
    step(s, clock)
    big = s.submit(words(40, "big"), 4)  # 14 tokens: 4 blocks, does not fit beside `first`
    small = s.submit(words(4, "s"), 1)  # 1 block: would fit, but waits its turn
    step(s, clock)
    assert list(s.waiting) == [big, small]
    run_all(s, clock)
    assert big.admitted is not None and small.admitted is not None
    assert big.admitted <= small.admitted


def test_too_big_requests_and_aborts() -> None:
    s, clock = make(cache_blocks=4)
    with pytest.raises(model.Rejected) as e:
        s.submit(words(100), 4)
    assert e.value.status == 400
    req = s.submit(words(20), 4)
    step(s, clock)
    s.abort(req)
    assert not s.running and s.cache.in_use == 0
    assert s.schedule() is None


def test_reset_empties_cache_and_counters() -> None:
    s, clock = make()
    s.submit(words(40), 2)
    run_all(s, clock)
    busy = s.submit(words(40, "b"), 2)
    assert s.reset() == [busy] and busy.aborted
    assert s.cache.used == 0 and s.counters.requests == 0 and s.schedule() is None


# ---------------------------------------------------------------- workloads


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_workloads_are_deterministic_per_seed(name: str) -> None:
    gen = workloads.WORKLOADS[name]
    a = list(gen(10.0, 1, 5.0, 200))
    assert a == list(gen(10.0, 1, 5.0, 200))
    assert a != list(gen(10.0, 2, 5.0, 200))
    assert a != list(gen(10.0, 1, 5.0, 200, traffic=1))
    assert 0 < sum(len(s.turns) for s in a) <= 200
    assert all(0 <= s.start_s < 5.0 for s in a)
    assert [s.start_s for s in a] == sorted(s.start_s for s in a)
    # The same sessions at another rate, only sooner.
    slow, fast = list(gen(10.0, 1, 5.0, 10_000)), list(gen(20.0, 1, 5.0, 10_000))
    assert [s.turns for s in fast[: len(slow)]] == [s.turns for s in slow]
    assert fast[0].start_s == pytest.approx(slow[0].start_s / 2)


def test_workload_bounds_in_requests() -> None:
    sessions = list(workloads.chat(50.0, 0, 10.0, 30))
    assert sum(len(s.turns) for s in sessions) == 30


def test_a_chat_turn_extends_its_history() -> None:
    session = next(s for s in workloads.chat(5.0, 3, 10.0, 100) if len(s.turns) >= 3)
    history: list[dict[str, str]] = []
    previous = None
    for turn in session.turns:
        path, body = workloads.request_body(session, history, turn)
        assert path == "/v1/chat/completions"
        text = model.render_chat(body["messages"])
        if previous is not None:
            prev_text, reply = previous
            assert text.startswith(prev_text + reply)
            assert body["messages"][-2] == {"role": "assistant", "content": reply}
        reply = model.reply_text(text, turn.max_tokens)
        previous = (text, reply)
        history += [
            {"role": "user", "content": turn.user},
            {"role": "assistant", "content": reply},
        ]
    assert body["messages"][0] == {"role": "system", "content": session.system}


def test_shared_and_skewed_share_prefixes_and_unique_does_not() -> None:
    def prompts(name: str) -> list[str]:
        out = []
        for s in workloads.WORKLOADS[name](20.0, 0, 5.0, 60):
            _, body = workloads.request_body(s, [], s.turns[0])
            out.append(
                model.render_chat(body["messages"]) if "messages" in body else body["prompt"]
            )
        return out

    def first_block(p: str) -> str:
        return p[:64]

    shared = prompts("shared")
    assert len({first_block(p) for p in shared}) <= 8 < len(shared)
    skewed = prompts("skewed")
    hot = max({first_block(p) for p in skewed}, key=[first_block(p) for p in skewed].count)
    assert sum(first_block(p) == hot for p in skewed) / len(skewed) > 0.75
    unique = prompts("unique")
    assert len({first_block(p) for p in unique}) == len(unique)
    sizes = [model.count_tokens(p) for p in shared + unique]
    assert min(sizes) >= 100 and max(sizes) <= 5000


# ---------------------------------------------------------------- the replicas process


def test_replicas_process_streams_a_chat_and_exports_metrics(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    log = open(tmp_path / "replicas.log", "wb")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(
        [
            *(sys.executable, str(LLM / "replica.py"), "--replicas", "2"),
            *("--ready-file", str(ready), "--decode-ms-per-step", "2"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 15
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / "replicas.log").read_text()
            assert time.monotonic() < deadline, "the replicas did not start in 15 s"
            time.sleep(0.05)
        ports = json.loads(ready.read_text())["ports"]
        assert len(ports) == 2 and all(isinstance(p, int) for p in ports)
        base = f"http://127.0.0.1:{ports[1]}"
        messages = [
            {"role": "system", "content": "You answer in five words. " * 8},
            {"role": "user", "content": "What is a KV cache?"},
        ]
        body = {"model": "fake", "messages": messages, "max_tokens": 5, "stream": True}
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = [
                line[6:].strip()
                for line in resp.read().decode().splitlines()
                if line.startswith("data: ")
            ]
        assert events[-1] == "[DONE]"
        pieces = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
        assert len(pieces) == 5
        assert "".join(pieces) == model.reply_text(model.render_chat(messages), 5)
        # OpenAI's newer name for the answer's length, the only one SGLang's router forwards
        # (it rewrites max_tokens), wins over the older one.
        newer = {**body, "max_completion_tokens": 3, "max_tokens": 9, "stream": False}
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps(newer).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            whole = json.loads(resp.read())
        assert whole["usage"]["completion_tokens"] == 3, whole

        with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:")
        }
        prompt_tokens = model.count_tokens(model.render_chat(messages))
        assert values["vllm:request_success_total"] == 2
        assert values["vllm:prompt_tokens_total"] == 2 * prompt_tokens
        assert values["vllm:prefix_cache_queries_total"] == 2 * prompt_tokens
        assert values["vllm:prefix_cache_hits_total"] > 0  # the second one's, cached
        assert values["vllm:generation_tokens_total"] == 5 + 3
        assert values["vllm:num_requests_running"] == 0
        assert values["vllm:num_requests_waiting"] == 0
        assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1
        assert "vllm:gpu_cache_usage_perc" in values

        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/-/stats", timeout=10) as r:
            stats = json.loads(r.read())["replicas"]
        assert [s["requests"] for s in stats] == [0, 2]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_bench_runs_cache_aware_at_its_defaults_whatever_the_replicas_cache() -> None:
    """The bench passes no cache geometry to the LB (an index sized to the fake replicas'
    cache forgot conversations they still partly held: results-2026-12-05c.md); only an
    --lb-option sets cache_blocks, and only for the policy it names."""
    import argparse

    sys.path.insert(0, str(LLM))  # run.py imports its neighbours as top-level modules
    try:
        run = _load("run")
    finally:
        sys.path.remove(str(LLM))
    args = argparse.Namespace(
        lb_workers=2, lb_option=[], engine="fake", cache_blocks=1024, block_tokens=16
    )
    assert run.lb_options(args, "cache_aware") == {"workers": 2}
    args.lb_option = ["cache_aware:cache_blocks=4096", "least_load:retries=1"]
    assert run.lb_options(args, "cache_aware") == {"workers": 2, "cache_blocks": 4096}
    assert run.lb_options(args, "least_load") == {"workers": 2, "retries": 1}


def test_bench_counts_the_logged_choices_of_each_run(tmp_path: Path) -> None:
    """bench/llm reads an LB's choice log (`log_choices`) from where its run began: the lines
    of an earlier run in the same log, other lines and a damaged one are not counted."""
    sys.path.insert(0, str(LLM))
    try:
        run = _load("run")
    finally:
        sys.path.remove(str(LLM))
    procs = run.Procs(tmp_path)
    path = tmp_path / "lb-cache_aware.log"

    def line(why: str) -> str:
        rec = {"replica": 1, "blocks": 9, "why": why, "replicas": {"1": [9, 0, 0, 0.0]}}
        return f"2026-12-05 11:44:35,167 INFO [w1] choice {json.dumps(rec)}\n"

    path.write_text(line("cost") * 3)  # an earlier run's
    start = run.log_size(procs, "cache_aware")
    with path.open("a") as f:
        f.write(line("new") + line("match") * 4 + line("cost") * 2 + line("bound"))
        f.write("2026-12-05 11:44:36,000 INFO [w0] replicas: 2 routable\n")
        f.write('2026-12-05 11:44:36,001 INFO [w0] choice {"replica": 1, "bl\n')
        deep = '{"a": ' + "[" * 100_000
        for odd in ('{"why": [1]}', '{"why": "choices"}', deep, '{"why": null}'):
            f.write(f"2026-12-05 11:44:36,002 INFO [w0] choice {odd}\n")
    assert run.choice_counts(procs, "cache_aware", start) == {
        "choices": 8,
        "match": 4,
        "new": 1,
        "cost": 2,
        "bound": 1,
    }
    assert run.log_size(procs, "nothing-yet") == 0
    assert run.choice_counts(procs, "nothing-yet", 0)["choices"] == 0  # no log: none


def _run_module() -> ModuleType:
    sys.path.insert(0, str(LLM))  # run.py imports its neighbours as top-level modules
    try:
        return _load("run")
    finally:
        sys.path.remove(str(LLM))


def test_each_round_draws_new_traffic_that_every_target_of_the_round_replays() -> None:
    """`--traffic per-round` (the default): a round's sessions differ from the last round's
    (the rounds sample the traffic), the same for every target of a round and every run of
    the bench; `--traffic same` replays one traffic in every round, `--traffic 100` the
    second round's."""
    import argparse

    run = _run_module()

    def sessions(args: argparse.Namespace, round_no: int) -> list[object]:
        seed = run.traffic_of(args, 0, round_no)
        return list(workloads.chat(1.9, 30, 50.0, 1000, seed, scale=0.45))

    per_round = argparse.Namespace(traffic="per-round")
    first, second = sessions(per_round, 0), sessions(per_round, 1)
    assert first != second
    assert [s.start_s for s in first] != [s.start_s for s in second]
    assert sessions(per_round, 1) == second  # another target of round 2: the same sessions
    same = argparse.Namespace(traffic="same")
    assert sessions(same, 0) == sessions(same, 1) == first
    # A number: one round's traffic of a per-round run, replayed in every round.
    second_only = argparse.Namespace(traffic="100")
    assert sessions(second_only, 0) == sessions(second_only, 3) == second
    # Two loads of one round stay apart, as before.
    assert run.traffic_of(per_round, 1, 0) != run.traffic_of(per_round, 0, 1)


def test_the_timeline_shows_where_a_runs_slow_requests_were_sent() -> None:
    """A run's timeline: per 10 s of sending (from the warm-up's end), the requests, the new
    prompt characters (a later turn counts only what its conversation had not sent) and the
    TTFT p50/p90; the warm-up's requests are left out but still count as a conversation's
    earlier prompt."""
    run = _run_module()
    plan = run.Plan(warmup=10.0, seconds=20.0, drain=5.0, max_requests=100)
    R = run.Record
    records = [
        R(sent=5.0, measured=False, max_tokens=4, session=0, prompt_chars=1000, ttft=0.05),
        R(sent=12.0, measured=True, max_tokens=4, session=0, prompt_chars=1600, ttft=0.1),
        R(sent=13.0, measured=True, max_tokens=4, session=1, prompt_chars=500, ttft=0.2),
        R(sent=22.0, measured=True, max_tokens=4, session=1, prompt_chars=2500, ttft=3.0),
        R(sent=25.0, measured=True, max_tokens=4, session=2, prompt_chars=700, ttft=None),
        R(sent=29.0, measured=True, max_tokens=4, session=0, prompt_chars=2000, ttft=2.0),
    ]
    lines = run.timeline(records, plan)
    assert lines == [
        [10.0, 2, 600 + 500, 100.0, 200.0],
        [20.0, 3, 2000 + 700 + 400, 2000.0, 3000.0],
    ]
    replica = {"replica": 0, "requests": 6, "running": 0, "waiting": 0}
    replica |= {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
    end = [(30.0, [replica])]
    assert run.summarize(records, end, {"replicas": []}, plan)["timeline"] == lines


def test_rounds_are_compared_pair_by_pair_on_the_same_traffic() -> None:
    """The report's round-by-round comparison: a target against least_load, each router and
    (a variant of cache_aware) cache_aware, in the rounds both ran (the same traffic),
    counting the rounds it did as well or better and the geometric mean of its ratios; then
    only the rounds where least_load queued (TTFT p50 >= 3x that round's unloaded one)."""
    run = _run_module()

    def r(policy: str, n: int, p50: float, p99: float, rps: float = 5.0) -> dict[str, object]:
        return {
            "policy": f"{policy} #{n + 1}",
            "round": n,
            "workload": "chat",
            "load": 2.0,
            "ttft_p50_ms": p50,
            "ttft_p99_ms": p99,
            "ttft_mean_ms": p50 * 2,
            "throughput_rps": rps,
        }

    runs = [
        r("least_load", 0, 400, 4000),
        r("cache_aware", 0, 200, 2000, 5.5),
        r("sglang:cache_aware", 0, 100, 4000),
        r("least_load", 1, 100, 1000),  # round 2: least_load under 3x unloaded
        r("cache_aware", 1, 200, 500),
        r("sglang:cache_aware", 1, 400, 1000),
        r("cache_aware", 2, 100, 100),  # round 3: no reference ran
    ]
    unloaded = [{"chat": {"ttft_p50_ms": 100.0}}, {"chat": {"ttft_p50_ms": 100.0}}]
    got = {(c["target"], c["reference"], c["rounds"]): c for c in run.paired(runs, unloaded)}
    assert set(got) == {
        ("cache_aware", "least_load", "all"),
        ("cache_aware", "least_load", "queueing"),
        ("cache_aware", "sglang:cache_aware", "all"),
        ("cache_aware", "sglang:cache_aware", "queueing"),
        ("sglang:cache_aware", "least_load", "all"),
        ("sglang:cache_aware", "least_load", "queueing"),
    }
    ca_sg = got[("cache_aware", "sglang:cache_aware", "all")]
    assert ca_sg["count"] == 2
    p50 = ca_sg["figures"]["ttft_p50_ms"]
    assert p50["better"] == 1  # 2.0x in round 1, 0.5x in round 2
    assert p50["geomean"] == pytest.approx(1.0)
    assert (p50["low"], p50["high"]) == (0.5, 2.0)
    assert ca_sg["figures"]["ttft_p99_ms"]["better"] == 2  # 0.5x both
    rps = ca_sg["figures"]["throughput_rps"]
    assert rps["better"] == 2 and rps["geomean"] == pytest.approx(math.sqrt(1.1))
    queued = got[("cache_aware", "sglang:cache_aware", "queueing")]
    assert queued["count"] == 1
    assert queued["figures"]["ttft_p50_ms"]["better"] == 0  # round 1 only: 2.0x
    lines = run.paired_lines([ca_sg, queued])
    assert lines[0].startswith("cache_aware / sglang:cache_aware, chat 2, 2 rounds: TTFT p50")
    assert "where least_load >= 3x unloaded" in lines[1]
    # A round where a target completed nothing (0 req/s, NaN or null times) gives no ratio
    # of those figures and breaks nothing.
    dead = r("cache_aware", 3, math.nan, math.nan, 0.0)
    dead["ttft_mean_ms"] = None
    with_dead = [*runs, dead, r("sglang:cache_aware", 3, 100, 1000)]
    got_dead = {(c["target"], c["reference"], c["rounds"]): c for c in run.paired(with_dead)}
    figures = got_dead[("cache_aware", "sglang:cache_aware", "all")]["figures"]
    assert figures == ca_sg["figures"]
    # A variant of cache_aware is compared with cache_aware too (a router is not).
    variant = [r("cache_aware_precise", 0, 100, 1000), r("cache_aware_precise", 1, 100, 1000)]
    got = {(c["target"], c["reference"], c["rounds"]): c for c in run.paired(runs + variant)}
    precise = got[("cache_aware_precise", "cache_aware", "all")]
    assert precise["count"] == 2 and precise["figures"]["ttft_p50_ms"]["better"] == 2
    assert precise["figures"]["ttft_p99_ms"]["better"] == 1  # 0.5x, then 2.0x
    assert ("sglang:cache_aware", "cache_aware", "all") not in got
    # Without least_load's rounds nothing says where it queued: all rounds only.
    no_ll = [x for x in runs if not str(x["policy"]).startswith("least_load")]
    assert {c["rounds"] for c in run.paired(no_ll, unloaded)} == {"all"}


def test_a_load_balancer_that_lost_its_port_to_another_process_is_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bench finds an LB's ports free just before the LB binds them; when another process
    took one in between, the LB is started again on new ports (a real run lost cache_aware's
    first round to this), up to 3 times; any other refusal is reported at once."""
    run = _run_module()
    taken = "the load balancer exited: OSError: [Errno 98] Address already in use"
    answers: list[object] = [taken, taken, "started"]
    calls = []

    def fake(*args: object) -> object:
        calls.append(args)
        return answers.pop(0)

    monkeypatch.setattr(run, "_start_lb", fake)
    assert run.start_lb(None, "cache_aware", {}, [1]) == "started"
    assert len(calls) == 3
    answers[:] = [taken] * 4
    assert run.start_lb(None, "cache_aware", {}, [1]) == taken  # gives up after 3
    assert not answers[1:] and len(answers) == 1
    answers[:] = ["the load balancer's config refuses it: workers: too many", "started"]
    assert run.start_lb(None, "cache_aware", {}, [1]).startswith("the load balancer's config")


@pytest.mark.parametrize("value", ["1.5", "x", "-100", "\u00b2", "1234567"])
def test_a_traffic_that_is_no_round_number_is_refused_before_anything_starts(value: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(LLM / "run.py"), "--traffic", value, "--quick"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "--traffic must be per-round, same or a number" in proc.stderr


def test_requests_past_the_models_context_are_counted_apart_from_failures() -> None:
    """vLLM's 400 for a prompt longer than its context and an answer cut by a full context
    (finish_reason "length" short of max_tokens, EOS ignored) are no router's doing: the
    bench counts them as `past_context`, not `failed`; any other 400 or a stream that stops
    early is still a failure."""
    import asyncio

    import aiohttp
    from aiohttp import web

    run = _run_module()

    def sse(tokens: int, reason: str | None, done: bool = True, usage: bool = True) -> bytes:
        out = b""
        for i in range(tokens):
            last = i == tokens - 1
            choice = {"delta": {"content": "t"}, "finish_reason": reason if last else None}
            out += f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
        if usage:
            counts = {"choices": [], "usage": {"completion_tokens": tokens}}
            out += f"data: {json.dumps(counts)}\n\n".encode()
        return out + (b"data: [DONE]\n\n" if done else b"")

    replies = {
        "/ok": (200, sse(4, "length")),
        "/long": (400, b'{"message":"This model\'s maximum context length is 4096 tokens."}'),
        "/bad": (400, b'{"message":"temperature must be positive"}'),
        "/full": (200, sse(2, "length")),
        "/cut": (200, sse(2, None, done=False)),
        "/uncounted": (200, sse(2, "length", usage=False)),  # no usage: the chunks can't say
    }

    async def handler(request: web.Request) -> web.Response:
        status, body = replies[request.path]
        return web.Response(status=status, body=body, content_type="text/event-stream")

    async def main() -> list[object]:
        app = web.Application()
        app.router.add_post("/{name}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        records = []
        try:
            async with aiohttp.ClientSession() as http:
                for path in replies:
                    rec = run.Record(sent=0.0, measured=True, max_tokens=4)
                    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
                    await run.stream(http, f"http://127.0.0.1:{port}{path}", body, rec, True)
                    records.append(rec)
        finally:
            await runner.cleanup()
        return records

    records = asyncio.run(main())
    errors = [r.error for r in records]  # type: ignore[attr-defined]
    assert errors == [
        None,
        "context: prompt too long (HTTP 400)",
        "HTTP 400",
        "context: full after 2 of 4 tokens",
        "short stream: 2 of 4 tokens",
        "short stream: 2 of 4 tokens",
    ]
    plan = run.Plan(0.0, 10.0, 1.0, 100)
    stats = [{"replica": "r", "requests": 5, "prefix_cache_queries": 0, "prefix_cache_hits": 0}]
    stats[0].update(running=0, waiting=0)
    got = run.summarize(records, [(10.0, stats)], {"replicas": stats}, plan)  # type: ignore[arg-type]
    assert (got["requests"], got["completed"], got["failed"], got["past_context"]) == (6, 1, 3, 2)


def test_calibration_finds_the_load_where_least_load_queues_the_target_multiple() -> None:
    """--calibrate: trials go up from the start while least_load's TTFT is under the target
    multiple of the unloaded one, down while over twice it, then between the two nearest;
    the lowest load tried that reached the target is kept."""
    import asyncio

    run = _run_module()

    def knee(at: float) -> object:
        async def measure(load: float) -> float:  # a fleet that queues past `at`
            return 1.0 + max(0.0, load - at) * 40

        return measure

    # From below: 0.5, 0.65, 0.845 (1.0x), 1.0985 (4.9x: in [4, 8]).
    load, tried = asyncio.run(run.calibrated_load(knee(1.0), 0.5, 4.0))
    assert [round(x, 3) for x, _ in tried] == [0.5, 0.65, 0.845, 1.099]
    assert load == tried[-1][0] and 4.0 <= tried[-1][1] <= 8.0
    # From far above: down by the step until under 8x, then bracketed.
    load, tried = asyncio.run(run.calibrated_load(knee(1.0), 3.0, 4.0))
    assert tried[0][1] > 8.0 and tried[1][0] < tried[0][0]
    assert dict(tried)[load] >= 4.0 and load == min(x for x, r in tried if r >= 4.0)
    # A fleet that never queues that much: the highest load tried, after every try.
    load, tried = asyncio.run(run.calibrated_load(knee(100.0), 1.0, 4.0, tries=3))
    assert len(tried) == 3 and load == max(x for x, _ in tried)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--calibrate", "4"], "--calibrate is for --engine vllm"),
        (["--engine", "vllm", "--calibrate", "1.2"], "--calibrate must be in [1.5, 100]"),
    ],
)
def test_a_calibration_that_cannot_apply_is_refused_before_anything_starts(
    extra: list[str], says: str
) -> None:
    proc = subprocess.run(
        [sys.executable, str(LLM / "run.py"), "--quick", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert says in proc.stderr
