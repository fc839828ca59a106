"""Reading the replicas' metrics for the autoscaler: the parser, the values refused as lies,
`ProbeClient.get` against real loopback servers that drip, never end or overflow their
answer, and a scrape round's readings (missing replicas, stale answers, partial answers)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping

import pytest

from fleetserve.controller.probe_client import ProbeClient, ProbeTimeout
from fleetserve.controller.replica_metrics import (
    MAX_METRICS_BYTES,
    MetricsClient,
    ReplicaMetrics,
    Wanted,
    parse_samples,
    signal_values,
)
from fleetserve.core.types import ReplicaKey
from fleetserve.policies.autoscaler import KV_CACHE, QUEUE, RUNNING, metric_key
from fleetserve.spec.models import ReplicaPolicy
from tests.unit.controller.test_probe_client import NO_CHECK, answering, serve

VLLM = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:num_requests_running{engine="0",model_name="m"} 9.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 12.0
gpu_busy{gpu="0",host="a b,\\"c\\"}"} 40 1712345678000
gpu_busy{gpu="1",host="x"} 60
gpu_busy{gpu="0",host="y"} 5
"""


def policy(**kw: object) -> ReplicaPolicy:
    return ReplicaPolicy.model_validate({"min_replicas": 1, "max_replicas": 4, **kw})


def test_parse_samples_reads_labels_and_only_the_names_asked() -> None:
    samples = parse_samples(VLLM, {"vllm:num_requests_waiting", "gpu_busy"})
    assert set(samples) == {"vllm:num_requests_waiting", "gpu_busy"}
    assert samples["vllm:num_requests_waiting"][1] == ((("engine", "1"), ("model_name", "m")), 4.0)
    assert samples["gpu_busy"][0] == ((("gpu", "0"), ("host", 'a b,"c"}')), 40.0)


def test_parse_samples_skips_malformed_lines_and_keeps_bad_numbers_as_nan() -> None:
    text = 'q 1\nq{a="x" 2\nq{a="x"} 3\nq{} 4\nqq 5\nq\nq abc\nq{a="1",} 6\n\x00\xff junk\n'
    got = parse_samples(text, {"q"})["q"]
    values = [v for _, v in got]
    assert values[:3] == [1.0, 3.0, 4.0] and math.isnan(values[3]) and values[4] == 6.0
    assert len(values) == 5


def test_signal_values_default_names_sum_and_mean() -> None:
    p = policy(
        target_queue_per_replica=2,
        target_kv_cache_usage=0.8,
        target_metrics=[
            {"name": "gpu_busy", "labels": {"gpu": "0"}, "target": 50},
            {"name": "absent", "target": 1},
        ],
    )
    wanted = Wanted.of(p)
    values, lies = signal_values(parse_samples(VLLM, wanted.names()), wanted)
    # the queue: summed over engines (and the running requests with it, from the same
    # scrape); the KV cache: a fraction, their mean; the gauge: the label sets that match,
    # summed; a metric the replica does not export: no key at all
    assert values == {
        QUEUE: 7.0,
        RUNNING: 9.0,
        KV_CACHE: pytest.approx(0.6),
        metric_key(0): 45.0,
    }
    assert lies == {}


@pytest.mark.parametrize(
    ("text", "lie"),
    [
        ("sglang:num_queue_reqs NaN\n", "nan"),
        ("tgi_queue_size -3\n", "-3.0"),
        ("vllm:num_requests_waiting +Inf\n", "inf"),
        ("vllm:num_requests_waiting 1e12\n", "1000000000000.0"),
        ('vllm:num_requests_waiting{e="0"} 1\nvllm:num_requests_waiting{e="1"} NaN\n', "nan"),
    ],
)
def test_a_lying_replica_is_missing_not_idle(text: str, lie: str) -> None:
    wanted = Wanted.of(policy(target_queue_per_replica=2))
    values, lies = signal_values(parse_samples(text, wanted.names()), wanted)
    assert values == {} and lie in lies[QUEUE]


@pytest.mark.parametrize(
    ("text", "queue", "running"),
    [
        ('vllm:num_requests_waiting{e="0"} 2\nvllm:num_requests_running{e="0"} 4\n', 2.0, 4.0),
        ("sglang:num_queue_reqs 0\nsglang:num_running_reqs 7\n", 0.0, 7.0),
        ("tgi_queue_size 1\ntgi_batch_current_size 3\n", 1.0, 3.0),
    ],
)
def test_the_queue_comes_with_the_running_requests_of_each_server(
    text: str, queue: float, running: float
) -> None:
    wanted = Wanted.of(policy(target_queue_per_replica=2))
    assert wanted.signals() == [QUEUE, RUNNING]
    values, lies = signal_values(parse_samples(text, wanted.names()), wanted)
    assert values == {QUEUE: queue, RUNNING: running} and lies == {}
    # no running gauge: the queue alone (the autoscaler then shrinks on the queue's own rule)
    values, _ = signal_values(parse_samples(text.split("\n")[0] + "\n", wanted.names()), wanted)
    assert values == {QUEUE: queue}
    # a lying running gauge is missing, the queue still read
    values, lies = signal_values(
        parse_samples(text.split("\n")[0] + "\nvllm:num_requests_running NaN\n", wanted.names()),
        wanted,
    )
    assert values == {QUEUE: queue} and "nan" in lies[RUNNING]


def test_kv_cache_above_one_is_a_lie_and_older_vllm_and_sglang_names_are_known() -> None:
    wanted = Wanted.of(policy(target_kv_cache_usage=0.8))
    for text, expected in [
        ("vllm:gpu_cache_usage_perc 0.25\n", 0.25),
        ("sglang:token_usage 0.5\n", 0.5),
    ]:
        assert signal_values(parse_samples(text, wanted.names()), wanted)[0] == {KV_CACHE: expected}
    values, lies = signal_values(
        parse_samples("vllm:kv_cache_usage_perc 85\n", wanted.names()), wanted
    )
    assert values == {} and KV_CACHE in lies


# -- ProbeClient.get against real servers ---------------------------------------------------


def drip(head: bytes, every: float, forever: bool = False) -> object:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        while True:
            writer.write(b"x 1\n" if forever else b"x")
            await writer.drain()
            await asyncio.sleep(every)

    return handle


async def test_get_reads_a_body_of_every_framing() -> None:
    client = ProbeClient(check_listener=NO_CHECK)
    body = b"q 1\nq 2\n"
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\nq 1\n\r\n4\r\nq 2\n\r\n0\r\n\r\n"
    )
    for answer in (
        b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n" + body,
        chunked,
        b"HTTP/1.0 200 OK\r\n\r\n" + body,
    ):
        async with serve(answering(answer, close_after=b"1.0" in answer[:9])) as (url, heads):
            assert await client.get(url + "/metrics", {"Authorization": "Bearer k"}, 2) == (
                200,
                body,
                False,
            )
            assert heads[0].startswith(b"GET /metrics HTTP/1.1") and b"Bearer k" in heads[0]
    await client.aclose()


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_get_cuts_a_huge_body_at_the_limit(framing: str) -> None:
    big = b"junk junk junk\n" * (3 * MAX_METRICS_BYTES // 15)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if framing == "length":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
        elif framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(big), 100_000):
                part = big[i : i + 100_000]
                writer.write(b"%x\r\n" % len(part) + part + b"\r\n")
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.0 200 OK\r\n\r\n" + big)
        await writer.drain()

    client = ProbeClient(check_listener=NO_CHECK)
    async with serve(handle) as (url, _):
        status, body, cut = await client.get(url + "/metrics", {}, 2, MAX_METRICS_BYTES)
    assert status == 200 and cut and len(body) == MAX_METRICS_BYTES
    assert body == big[:MAX_METRICS_BYTES]
    await client.aclose()


@pytest.mark.parametrize("forever", [False, True])
async def test_get_gives_up_on_a_dripping_or_endless_body_at_its_timeout(forever: bool) -> None:
    client = ProbeClient(check_listener=NO_CHECK)
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n"
        if not forever
        else (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    )
    if forever:

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head)
            while True:  # small chunks, without end, fast: never past the size limit in 0.5 s
                writer.write(b"4\r\nq 1\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)

        handler = handle
    else:
        handler = drip(head, 0.05)  # type: ignore[assignment]
    async with serve(handler) as (url, _):  # type: ignore[arg-type]
        started = time.monotonic()
        with pytest.raises(ProbeTimeout):
            await client.get(url + "/metrics", {}, 0.5)
        assert time.monotonic() - started < 1.0
    await client.aclose()


# -- a scrape round -----------------------------------------------------------------------


class FakeTransport:
    """Answers per URL: bytes (200), an int status, an exception, or None (hangs)."""

    def __init__(self, answers: Mapping[str, object]) -> None:
        self.answers = dict(answers)
        self.asked: list[tuple[str, float]] = []

    async def get(
        self, url: str, headers: Mapping[str, str], timeout_seconds: float, max_bytes: int = 0
    ) -> tuple[int, bytes, bool]:
        self.asked.append((url, timeout_seconds))
        answer = self.answers[url]
        if answer is None:
            async with asyncio.timeout(timeout_seconds):
                await asyncio.Event().wait()
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, int):
            return answer, b"", False
        assert isinstance(answer, bytes)
        return 200, answer, False


async def scrape(
    rm: ReplicaMetrics, ready: list[tuple[int, str]], p: ReplicaPolicy, now: float
) -> None:
    rm.maybe_start(ready, p, {}, now)
    assert rm._task is not None
    await rm._task


async def test_a_round_reads_each_ready_replica_and_counts_the_silent_ones_as_missing() -> None:
    p = policy(target_queue_per_replica=2, metrics_scrape_seconds=1)
    transport = FakeTransport(
        {
            "http://r1/metrics": b"vllm:num_requests_waiting 6\nvllm:num_requests_running 8\n",
            "http://r2/metrics": b"sglang:num_queue_reqs 2\n",
            "http://r3/metrics": None,  # hangs
            "http://r4/metrics": 500,
            "http://r5/metrics": b"tgi_queue_size NaN\n",  # lies
            "http://r6/metrics": ConnectionRefusedError("refused"),
        }
    )
    rm = ReplicaMetrics("svc", MetricsClient(transport))
    ready = [(i, f"http://r{i}") for i in range(1, 7)]
    started = time.monotonic()
    await scrape(rm, ready, p, 100.0)
    assert time.monotonic() - started < 1.5  # the hanging one: its timeout, min(2 s, interval)
    assert {t for _, t in transport.asked} == {1.0}
    reading = rm.readings([i for i, _ in ready], p, 100.5)[QUEUE]
    assert (reading.mean, reading.peak, reading.answered, reading.ready) == (4.0, 6.0, 2, 6)
    running = rm.readings([i for i, _ in ready], p, 100.5)[RUNNING]
    assert (running.mean, running.answered, running.ready) == (8.0, 1, 6)
    assert rm.latest[ReplicaKey("svc", 3)].error is not None


async def test_no_answer_at_all_is_no_reading_and_old_answers_go_stale() -> None:
    p = policy(target_kv_cache_usage=0.5, metrics_scrape_seconds=2)
    transport = FakeTransport({"http://r1/metrics": b"vllm:kv_cache_usage_perc 0.4\n"})
    rm = ReplicaMetrics("svc", MetricsClient(transport))
    await scrape(rm, [(1, "http://r1")], p, 100.0)
    assert rm.readings([1], p, 101.0)[KV_CACHE].mean == 0.4
    # a READY replica never scraped (just became READY): missing
    assert rm.readings([1, 2], p, 101.0)[KV_CACHE].answered == 1
    # three intervals and a timeout later with no new answer: nothing
    stale = rm.readings([1], p, 100.0 + 3 * 2 + 2 + 0.1)[KV_CACHE]
    assert stale.mean is None and stale.answered == 0 and stale.ready == 1


async def test_rounds_are_bounded_by_the_interval_and_forget_gone_replicas() -> None:
    p = policy(target_queue_per_replica=1, metrics_scrape_seconds=5)
    transport = FakeTransport(
        {"http://r1/metrics": b"tgi_queue_size 1\n", "http://r2/metrics": b"tgi_queue_size 1\n"}
    )
    rm = ReplicaMetrics("svc", MetricsClient(transport))
    await scrape(rm, [(1, "http://r1"), (2, "http://r2")], p, 100.0)
    rm.maybe_start([(1, "http://r1")], p, {}, 103.0)  # too soon: nothing
    assert len(transport.asked) == 2
    await scrape(rm, [(1, "http://r1")], p, 105.0)
    assert len(transport.asked) == 3 and set(rm.latest) == {ReplicaKey("svc", 1)}


async def test_the_metrics_client_bounds_concurrency() -> None:
    running = 0
    most = 0

    class Slow:
        async def get(
            self, url: str, headers: Mapping[str, str], timeout_seconds: float, max_bytes: int = 0
        ) -> tuple[int, bytes, bool]:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await asyncio.sleep(0.01)
            running -= 1
            return 200, b"", False

    client = MetricsClient(Slow(), max_concurrent=3)
    await asyncio.gather(*(client.get(f"http://r{i}/m", {}, 1) for i in range(20)))
    assert most == 3
