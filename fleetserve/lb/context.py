"""What the proxy's parts need of each other, as protocols: a replica connection
(fleetserve.lb.upstream) drives its exchange through `ExchangeSide`, without importing
fleetserve.lb.exchange, which imports it. The proxy's parts import downwards only
(proxy -> client -> exchange -> upstream -> context; the contract in pyproject.toml)."""

from __future__ import annotations

from typing import Protocol


class ExchangeSide(Protocol):
    """One request as its replica connection sees it (fleetserve.lb.exchange.Exchange)."""

    method: bytes
    http10: bool  # the client speaks HTTP/1.0: no chunked framing towards it
    wants_upgrade: bool
    keep_alive: bool  # the client's connection stays open after this response
    sent_at: float  # when the request was sent to the replica (monotonic seconds)
    activity: float  # when the replica last sent a byte
    first_byte: float | None  # seconds from sent_at to the answer's first body byte
    # move_waiting_requests: the response head held until the first body byte (else None)
    held_head: list[bytes] | None

    def to_client(self, data: bytes) -> None: ...

    def response_complete(self, upstream_keep_alive: bool) -> None: ...

    def upgraded(self) -> None: ...

    def closes_client(self) -> bool:
        """The client connection closes after this answer (a stopping load balancer, nothing
        pipelined behind it): its head is to say `Connection: close`."""
        ...

    def prefilled(self) -> None:
        """The answer's first byte came: the prompt is no longer waiting to be prefilled."""
        ...

    def upstream_lost(self, got_bytes: bool, tunnel: bool) -> None: ...

    def upstream_failed(self, why: str) -> None: ...

    def pause_client(self) -> None:
        """The replica reads slower than the client sends: stop reading the client."""
        ...

    def resume_client(self) -> None: ...
