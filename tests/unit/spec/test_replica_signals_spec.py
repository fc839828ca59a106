"""replica_policy's replica-metric and latency targets: bounds and the errors that name them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleetserve.spec.models import ReplicaPolicy


def validate(**kw: object) -> ReplicaPolicy:
    return ReplicaPolicy.model_validate({"min_replicas": 1, "max_replicas": 4, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        {"target_queue_per_replica": 2},
        {"target_kv_cache_usage": 0.8},
        {"target_kv_cache_usage": 1},
        {"target_metrics": [{"name": "vllm:num_requests_running", "target": 8}]},
        {
            "target_metrics": [
                {"name": "gpu_util", "labels": {"gpu": "0"}, "target": 0.9, "aggregation": "max"}
            ]
        },
        {"target_ttft_ms": 500, "latency_percentile": 99},
        {"target_latency_ms": 2000},
    ],
)
def test_each_new_target_autoscales(kw: dict[str, object]) -> None:
    p = validate(**kw)
    assert p.autoscaled
    with pytest.raises(ValidationError, match=f"max_replicas is required when {next(iter(kw))}"):
        ReplicaPolicy.model_validate({"min_replicas": 1, **kw})


def test_defaults() -> None:
    p = validate(target_queue_per_replica=1)
    assert (p.metrics_scrape_seconds, p.metrics_path, p.latency_percentile) == (5, "/metrics", 90)
    assert p.scrapes_replicas and p.latency_target_ms is None
    q = validate(target_ttft_ms=300)
    assert not q.scrapes_replicas and q.latency_target_ms == 300


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"target_kv_cache_usage": 80}, "fraction of the KV cache in use, in (0, 1]"),
        ({"target_kv_cache_usage": 0}, "in (0, 1]"),
        ({"target_queue_per_replica": 0}, "greater than 0"),
        ({"target_ttft_ms": 500, "target_latency_ms": 900}, "set one latency target"),
        ({"target_ttft_ms": 4_000_000}, "less than or equal to 3600000"),
        ({"target_latency_ms": 100, "latency_percentile": 99.99}, "less than or equal to 99.9"),
        ({"target_latency_ms": 100, "latency_percentile": 10}, "greater than or equal to 50"),
        ({"target_queue_per_replica": 1, "metrics_scrape_seconds": 0.5}, "greater than or equal"),
        ({"target_queue_per_replica": 1, "metrics_path": "metrics"}, "must start with '/'"),
        ({"target_queue_per_replica": 1, "metrics_path": "/a b"}, "without spaces"),
        ({"target_queue_per_replica": 1, "metrics_path": "/" + "a" * 300}, "256 characters"),
        ({"target_metrics": []}, "at least one metric"),
        ({"target_metrics": [{"name": "x", "target": 1}] * 9}, "at most 8 metrics"),
        ({"target_metrics": [{"name": "9lives", "target": 1}]}, "not a Prometheus metric name"),
        ({"target_metrics": [{"name": "a-b", "target": 1}]}, "not a Prometheus metric name"),
        ({"target_metrics": [{"name": "x" * 201, "target": 1}]}, "at most 200 characters"),
        (
            {
                "target_metrics": [
                    {"name": "x", "target": 1, "labels": {f"l{i}": "v" for i in range(9)}}
                ]
            },
            "at most 8 labels",
        ),
        ({"target_metrics": [{"name": "x", "target": 1, "labels": {"a-b": "v"}}]}, "label name"),
        ({"target_metrics": [{"name": "x", "target": -1}]}, "greater than 0"),
        ({"target_metrics": [{"name": "x", "target": 1, "aggregation": "sum"}]}, "'mean' or 'max'"),
        ({"target_metrics": [{"name": "x", "target": 1, "match": {}}]}, "Extra inputs"),
    ],
)
def test_bad_values_are_named(kw: dict[str, object], error: str) -> None:
    with pytest.raises(ValidationError) as e:
        validate(**kw)
    assert error in str(e.value), str(e.value)


def test_without_any_target_max_must_equal_min_and_the_error_lists_the_new_keys() -> None:
    with pytest.raises(ValidationError, match="target_queue_per_replica, target_kv_cache_usage"):
        validate()


@pytest.mark.parametrize("path", ["/\U0001f600", "/metrics\u00fc", "/metrics#x"])
def test_metrics_path_that_cannot_be_sent_is_refused(path: str) -> None:
    # atk26: '/😀' validated and then every scrape failed with UnicodeEncodeError ('/ü' went
    # out as a raw latin-1 byte; '#x' was silently dropped).
    with pytest.raises(ValueError, match=r"ASCII|fragment"):
        ReplicaPolicy.model_validate(
            {
                "min_replicas": 1,
                "max_replicas": 2,
                "target_queue_per_replica": 2,
                "metrics_path": path,
            }
        )
