"""The real model server of examples/embeddings behind fleetserve (needs the embeddings extra,
which scripts/test.sh installs)."""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, endpoint_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).parents[2] / "examples" / "embeddings" / "service.yaml"


def embed(endpoint: str, inputs: list[str]) -> dict[str, object]:
    req = urllib.request.Request(
        f"{endpoint}/v1/embeddings",
        data=json.dumps({"input": inputs}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.loads(r.read()))


def test_embeddings_served_through_the_fleet(fleet: Fleet) -> None:
    # The README runs it from the repository's root, which its `workdir` starts from.
    began = time.monotonic()
    out = fleet.cli("up", str(EXAMPLE), timeout=300, cwd=EXAMPLE.parents[2])
    first_ready = time.monotonic() - began
    endpoint = endpoint_of(out.stdout)
    body = embed(endpoint, ["a cat sat on the mat", "a kitten rested on the rug", "car insurance"])
    vectors = [d["embedding"] for d in body["data"]]  # type: ignore[attr-defined]
    assert [len(v) for v in vectors] == [384, 384, 384]
    assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-3 for v in vectors)  # normalised

    def cos(a: list[float], b: list[float]) -> float:
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2]) + 0.3

    fleet.wait_for(
        "both replicas READY",
        lambda: (
            sum(r.status == "READY" for r in fleet.client().service("embeddings").replicas) == 2
        ),
        timeout=120,
    )
    # examples/embeddings/README.md quotes these (run with -s to see them)
    print(
        f"embeddings: `up` returned (a replica READY) after {first_ready:.1f} s, "
        f"both replicas READY after {time.monotonic() - began:.1f} s"
    )
    # Both READY replicas answer (their ids: a replica that failed while the suite loaded the
    # machine is replaced by one with a new id, as it should be).
    ready = {
        str(r.replica_id)
        for r in fleet.client().service("embeddings").replicas
        if r.status == "READY"
    }
    served = Counter(str(embed(endpoint, ["hello"])["replica"]) for _ in range(6))
    assert len(ready) == 2 and set(served) == ready, (served, ready)
    fleet.cli("down", "embeddings")
