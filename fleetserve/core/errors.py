"""The small error hierarchy of fleetserve, mapped once to HTTP codes and CLI exit codes."""

from __future__ import annotations


class FleetserveError(Exception):
    """Base class. `http_status` and `exit_code` say how the edges report it."""

    http_status = 500
    exit_code = 1
    kind = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidSpec(FleetserveError):
    """A service YAML, API payload or argument that breaks a rule."""

    http_status = 422
    exit_code = 2
    kind = "invalid_spec"


class NotFound(FleetserveError):
    http_status = 404
    exit_code = 3
    kind = "not_found"


class Conflict(FleetserveError):
    http_status = 409
    exit_code = 4
    kind = "conflict"


class Unauthorized(FleetserveError):
    """A call without the API token, or with a wrong one."""

    http_status = 401
    exit_code = 7
    kind = "unauthorized"


class TransientError(FleetserveError):
    """Worth retrying after `retry_after` seconds."""

    http_status = 503
    exit_code = 5
    kind = "transient"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Standby(TransientError):
    """This controller is not the active one (docs/scaling.md, high availability): it serves
    reads; writes go to the active controller, whose API address the message names."""

    kind = "standby"

    def __init__(self, message: str, active: str | None = None) -> None:
        super().__init__(message, retry_after=1.0)
        self.active = active


class Fenced(Standby):
    """A write by a controller that has lost its lease: refused inside the write's own
    transaction, so a paused old leader changes nothing after a standby took over."""

    kind = "fenced"


class StorageFull(FleetserveError):
    """A write the database or the disk had no room for (or that the database refused)."""

    http_status = 507
    exit_code = 1
    kind = "storage"


class TerminalError(FleetserveError):
    """Retrying will not help (a launch whose setup failed, say)."""

    http_status = 500
    exit_code = 1
    kind = "terminal"


class ServiceFailed(FleetserveError):
    """A service (or rollout) that was waited for failed: the message is its failure reason
    and the command that shows more (`Client.wait_ready`, `up_file(..., wait=True)`)."""

    exit_code = 1
    kind = "service_failed"


class WaitTimeout(TransientError):
    """A wait (`Client.wait_ready`) ran out of time; the service may still get there."""

    kind = "wait_timeout"


ERROR_KINDS: dict[str, type[FleetserveError]] = {
    cls.kind: cls
    for cls in (
        FleetserveError,
        InvalidSpec,
        NotFound,
        Conflict,
        Unauthorized,
        TransientError,
        Standby,
        Fenced,
        TerminalError,
        ServiceFailed,
        WaitTimeout,
    )
}
