"""What a selector may do besides choosing, and what the load balancer then does for it.

A selector (fleetserve.policies.lb.Selector) only chooses. It may also have any of the
capabilities below, each a small protocol; the load balancer asks once, when it installs the
selector (`capabilities`), and from then on calls what is there. It never names a policy: a new
one that implements, say, `ReadsBody` is handed each request's body without any change to
fleetserve.lb.

- `ReadsHeaders`: asks it for each request's key from the request's headers.
- `ReadsBody`: holds a request with a body until `body_limit` bytes of it (or all of it) came,
  and asks it for the key from them.
- `CompletesKeyOffLoop`: for a body where it says so, awaits `complete_key` in the request's
  task (cache_aware's precise mode tokenizes a long prompt off the event loop).
- `ForgetsReplicas`: tells it of each replica that left the routable set.
- `ReportsChoices`: gives it a callback for each choice's prefix match (the LB's metrics).
- `TakesTurns`: starts each LB process's turn at another offset, and shares one counter
  among the processes.
- `SharesIndex`: keeps one index across the LB's processes (fleetserve.lb.index_share).
- `ReadsReportedLoad`: polls the replicas' own load metrics into `reported`.
- `WeighsPrefill`: counts, per replica, the prompt blocks it still has to prefill (what the
  selector said of each request sent there, until that request's first byte).
- `TracksSends`: tells it of each attempt of a request with a prompt sent to a replica, and
  of its end (its first byte, or the attempt ending without one).
- `SharesSends`: with `SharesIndex`, the LB's processes also tell each other which prompt
  blocks each still waits to have answered, per replica.

A key reader that fails on some input (a bug) never fails the request: the load balancer
routes it without a key, and logs and counts the failure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from fleetserve.policies.lb import RequestKey, Selector


@runtime_checkable
class ReadsHeaders(Protocol):
    def header_key(self, headers: Mapping[bytes, bytes]) -> RequestKey:
        """The key of a request from its headers (names lowercased)."""
        ...


@runtime_checkable
class ReadsBody(Protocol):
    @property
    def body_limit(self) -> int:
        """How many bytes of a body the key needs: the load balancer chooses once this much
        (or the whole body, when shorter) is here."""
        ...

    def body_key(self, body: bytes, complete: bool) -> RequestKey:
        """The key of a request from its body's first `body_limit` bytes (`complete`: that
        is the whole body)."""
        ...


@runtime_checkable
class CompletesKeyOffLoop(Protocol):
    """A body key with a slow part that must not hold the event loop (cache_aware's precise
    mode tokenizes a long prompt in a thread)."""

    def completes_later(self, key: RequestKey, body: bytes, complete: bool) -> bool:
        """Whether `complete_key` must still run for this key (cheap: called inline)."""
        ...

    async def complete_key(self, key: RequestKey, body: bytes) -> RequestKey: ...


@runtime_checkable
class ForgetsReplicas(Protocol):
    def forget(self, replica: int) -> None:
        """A replica left the routable set (not a mere exclusion: a retry, a canary's side)."""
        ...


# (blocks of the prompt matched, blocks of the prompt, how many more requests the chosen
# replica had in flight than the least loaded one)
ChoiceReport = Callable[[int, int, int], None]


@runtime_checkable
class ReportsChoices(Protocol):
    on_choice: ChoiceReport | None
    # Told why each choice was made (one dict a choice, for the LB's choice log), when set.
    explain: Callable[[dict[str, object]], None] | None


@runtime_checkable
class TakesTurns(Protocol):
    def start_turn_at(self, offset: int) -> None:
        """Begin the rotation at `offset` (each LB process at another replica)."""
        ...

    def share_turns(self, take: Callable[[], int]) -> None:
        """Take each turn from `take`, a counter all the LB's processes share."""
        ...


class SharedIndex(Protocol):
    def record(self, replica: int, keys: Sequence[int]) -> None: ...

    def replicas(self) -> list[int]: ...

    def snapshot(self, most: int) -> dict[int, list[int]]: ...


@runtime_checkable
class SharesIndex(Protocol):
    """An index that the LB's processes keep as one: each hears the others' choices
    (`index.record`) and in-flight counts (`peer_inflight`), and tells its own (`on_record`)."""

    on_record: Callable[[int, tuple[int, ...]], None] | None
    peer_inflight: dict[int, int]
    peer_prefilling: dict[int, int]  # (WeighsPrefill's, of the other processes)

    @property
    def index(self) -> SharedIndex: ...

    def share_keys(self, secret: bytes) -> None:
        """Key the index with the LB's secret, which all its processes hold, so they agree."""
        ...


@runtime_checkable
class ReadsReportedLoad(Protocol):
    @property
    def reported(self) -> dict[int, int]:
        """The replicas' own running + waiting counts, filled in by the load balancer."""
        ...


@runtime_checkable
class WeighsPrefill(Protocol):
    """The selector says, after each choice, how many prompt blocks the chosen replica has to
    prefill for that request (`last_uncached`); the load balancer adds them to the replica's
    count in `prefilling` (its own dict, installed in the selector) when it sends the request
    and takes them off at the request's first byte or end. `last_missing`: the prompt blocks
    it lacks, streamed or not (None: no prompt), the hint of `engine_priority`."""

    last_uncached: int
    last_missing: int | None
    prefilling: dict[int, int]


@runtime_checkable
class TracksSends(Protocol):
    """Each attempt of a request whose key has prompt blocks: `sending` when it is sent to a
    replica; when that returns something other than None, `answered` with it (and the same
    replica and key) once, at the answer's first body byte or when the attempt ends without
    one (a retry elsewhere, a move, the client gone). A retry or a move is a new attempt."""

    def sending(self, replica: int, key: RequestKey) -> object | None: ...

    def answered(self, replica: int, key: RequestKey, token: object) -> None: ...


@runtime_checkable
class SharesSends(Protocol):
    """What a TracksSends selector still waits for, shared among the LB's processes
    (fleetserve.lb.index_share): its own pending prompt blocks per replica when they changed
    (`sent_version`), and each other process's as it says (its whole set each time)."""

    @property
    def sent_version(self) -> int: ...

    def sent_keys(self, most: int) -> list[tuple[int, list[int]]]: ...

    def take_peer_sent(self, source: int, sent: dict[int, set[int]]) -> None: ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a selector can do besides choosing, found once (`capabilities`)."""

    header_key: Callable[[Mapping[bytes, bytes]], RequestKey] | None = None
    body_limit: int = 0
    body_key: Callable[[bytes, bool], RequestKey] | None = None
    off_loop: CompletesKeyOffLoop | None = None
    forget: Callable[[int], None] | None = None
    reports_choices: ReportsChoices | None = None
    takes_turns: TakesTurns | None = None
    shares_index: SharesIndex | None = None
    reported: dict[int, int] | None = None
    weighs_prefill: WeighsPrefill | None = None
    tracks_sends: TracksSends | None = None


def capabilities(selector: Selector) -> Capabilities:
    """The capabilities of `selector` (called when it is installed, never per request)."""
    body = selector if isinstance(selector, ReadsBody) else None
    later = selector if body is not None and isinstance(selector, CompletesKeyOffLoop) else None
    return Capabilities(
        header_key=selector.header_key if isinstance(selector, ReadsHeaders) else None,
        body_limit=body.body_limit if body is not None else 0,
        body_key=body.body_key if body is not None else None,
        off_loop=later,
        forget=selector.forget if isinstance(selector, ForgetsReplicas) else None,
        reports_choices=selector if isinstance(selector, ReportsChoices) else None,
        takes_turns=selector if isinstance(selector, TakesTurns) else None,
        shares_index=selector if isinstance(selector, SharesIndex) else None,
        reported=selector.reported if isinstance(selector, ReadsReportedLoad) else None,
        weighs_prefill=selector if isinstance(selector, WeighsPrefill) else None,
        tracks_sends=selector if isinstance(selector, TracksSends) else None,
    )
