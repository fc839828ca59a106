"""service.load_balancer.kv_events and tokenizer: validated with errors that say what to do."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from fleetserve.spec.models import ServiceSection


def section(**lb: Any) -> dict[str, Any]:
    return {
        "readiness_probe": "/health",
        "load_balancing_policy": "cache_aware",
        "load_balancer": lb,
    }


def test_precise_mode_takes_defaults() -> None:
    s = ServiceSection.model_validate(section(kv_events={}, tokenizer="/models/m"))
    assert s.load_balancer.kv_events is not None
    assert s.load_balancer.kv_events.silence_seconds == 10


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        (section(kv_events={}), "needs load_balancer.tokenizer"),
        (
            {**section(kv_events={}, tokenizer="/m"), "load_balancing_policy": "least_load"},
            "requires load_balancing_policy: cache_aware",
        ),
        (section(kv_events={"max_blocks": 5}, tokenizer="/m"), "max_blocks"),
        (section(kv_events={"topic": "a b"}, tokenizer="/m"), "topic"),
        (section(kv_events={"typo": 1}, tokenizer="/m"), "typo"),
    ],
)
def test_mistakes_are_named(doc: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ServiceSection.model_validate(doc)
