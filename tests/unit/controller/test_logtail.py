"""The log tail a failed replica's reason carries: the replica's last lines, escaped."""

from __future__ import annotations

from fleetserve.controller.logtail import log_tail
from tests.unit.controller.fakes import FakeInfra, handle_of


async def test_the_tail_shows_the_replicas_last_lines_with_control_characters_escaped() -> None:
    infra = FakeInfra()
    infra.log_lines[handle_of("svc", 1)] = [
        "[fleetserve] setup started",
        "loading",
        "error: model dir [/mnt/models/llama] is empty \x1b]0;PWNED\x07\x1b[2J",
        "[fleetserve] run exited with code 4",
    ]
    tail = await log_tail(infra, "svc", 1, None)
    assert tail.startswith("last log lines: loading | error: model dir [/mnt/models/llama]")
    assert "\\x1b]0;PWNED\\x07\\x1b[2J" in tail and "\x1b" not in tail
    assert "fleetserve logs svc 1 --no-follow" in tail
    assert await log_tail(infra, "svc", 2, None) == ""  # no log: no tail
