"""The last lines of a replica's log, for the reason of a replica that failed: the cause
(`can't open file ...`, a traceback's last line) shows in `status`, the event and `up`'s error,
with the command that shows the rest (issue: failure reasons hid the cause)."""

from __future__ import annotations

import asyncio
import contextlib

from fleetserve.core.text import visible
from fleetserve.core.types import ReplicaId
from fleetserve.infra.base import Infra

TAIL_LINES = 3  # of the replica's own output
LINE_CHARS = 200
READ_SECONDS = 3.0  # a log on another node (Ray) that does not answer is left out
_OWN = "[fleetserve] "  # the wrapper's lines (setup started, run exited): no cause in them


async def log_tail(infra: Infra, service: str, replica_id: ReplicaId, handle: str | None) -> str:
    """`last log lines: "a" | "b"; `fleetserve logs S N --no-follow` shows the rest`, or ""
    when the log cannot be read or has no line of the replica's own."""
    lines: list[str] = []

    async def read() -> None:
        async for line in infra.logs(service, replica_id, False, handle, TAIL_LINES + 8):
            lines.append(line)

    with contextlib.suppress(Exception):
        await asyncio.wait_for(read(), READ_SECONDS)
    # (escaped: a replica's output must not drive the terminal of whoever reads the reason)
    own = [visible(ln.strip()) for ln in lines if ln.strip() and not ln.startswith(_OWN)]
    own = own[-TAIL_LINES:]
    if not own:
        return ""
    shown = " | ".join(ln if len(ln) <= LINE_CHARS else ln[: LINE_CHARS - 3] + "..." for ln in own)
    return (
        f"last log lines: {shown} (`fleetserve logs {service} {replica_id} --no-follow` "
        "shows the rest)"
    )


def with_tail(reason: str, tail: str) -> str:
    """The reason with the log's tail; a reason that named the `fleetserve logs` command
    already keeps just the lines."""
    if not tail:
        return reason
    if "fleetserve logs" in reason:
        tail = tail.split(" (`fleetserve logs", 1)[0]
    return f"{reason}; {tail}"
