"""Tables and lines the CLI prints."""

from __future__ import annotations

import time

from rich.table import Table

from fleetserve.api.models import EventInfo, ServiceInfo
from fleetserve.cli.safe import safe

_STYLE = {
    "READY": "green",
    "STARTING": "cyan",
    "PROVISIONING": "cyan",
    "PENDING": "dim",
    "NOT_READY": "yellow",
    "SHUTTING_DOWN": "yellow",
    "REPLICA_INIT": "cyan",
    "CONTROLLER_INIT": "cyan",
    "NO_REPLICA": "yellow",
}


def styled(status: str) -> str:
    style = _STYLE.get(status, "red" if "FAIL" in status or status == "PREEMPTED" else "")
    return f"[{style}]{status}[/]" if style else status


def ago(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "-"
    secs = max(0, int((now or time.time()) - ts))
    if secs < 60:
        return f"{secs}s ago"
    if secs < 3600:
        return f"{secs // 60}m {secs % 60}s ago"
    return f"{secs // 3600}h {(secs % 3600) // 60}m ago"


def services_table(services: list[ServiceInfo]) -> Table:
    t = Table(title="Services", title_justify="left")
    for col in ("NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "TARGET", "ENDPOINT", "POLICY"):
        t.add_column(col)
    for s in services:
        ready = sum(1 for r in s.replicas if r.status == "READY")
        alive = sum(1 for r in s.replicas if "FAIL" not in r.status and r.status != "PREEMPTED")
        version = str(s.serving_version or s.active_version)
        if s.serving_version and s.serving_version != s.active_version:
            how = f"canary {s.traffic_percent}%" if s.traffic_percent else s.update_mode
            if s.failure_reason:  # the new version's launches stopped: no longer rolling
                how = "failed"
            version += f" -> {s.active_version} ({how})"
        t.add_row(
            s.name,
            version,
            ago(s.created_at).removesuffix(" ago"),
            styled(s.status),
            f"{ready}/{alive}",
            f"{s.target_replicas} ({s.min_replicas}-{s.max_replicas})",
            s.endpoint or "-",
            s.load_balancing_policy,
        )
    return t


def replicas_table(services: list[ServiceInfo]) -> Table:
    t = Table(title="Service Replicas", title_justify="left")
    cols = ["SERVICE_NAME", "ID", "VERSION", "ENDPOINT", "PID", "LAUNCHED", "STATUS", "REASON"]
    zoned = any(r.spot or (r.zone and r.zone != "local") for s in services for r in s.replicas)
    if zoned:
        cols[4:4] = ["ZONE", "SPOT"]
    for col in cols:
        t.add_column(col)
    for s in services:
        for r in s.replicas:
            where = [r.zone or "-", "spot" if r.spot else "on-demand"] if zoned else []
            t.add_row(
                s.name,
                str(r.replica_id),
                str(r.version),
                r.endpoint or "-",
                *where,
                str(r.pid) if r.pid else "-",
                ago(r.launched_at),
                styled(r.status),
                safe(r.reason or ""),
            )
    return t


def when(at: float, now: float | None = None) -> str:
    """An event's local time: HH:MM:SS today, with the date on other days."""
    day = time.localtime(now if now is not None else time.time())[:3]
    fmt = "%H:%M:%S" if time.localtime(at)[:3] == day else "%Y-%m-%d %H:%M:%S"
    return time.strftime(fmt, time.localtime(at))


def _change(e: EventInfo) -> str:
    if not e.status_to:
        return ""
    before = f"{styled(e.status_from)} -> " if e.status_from else "-> "
    return before + styled(e.status_to)


def events_table(name: str, events: list[EventInfo], kinds: bool = False) -> Table:
    t = Table(title=f"Recent events of {name}", title_justify="left")
    cols = ("TIME", "KIND", "REPLICA", "CHANGE", "MESSAGE")
    for col in cols if kinds else (c for c in cols if c != "KIND"):
        t.add_column(col)
    for e in events:
        t.add_row(
            when(e.at),
            *([e.kind] if kinds else []),
            str(e.replica_id) if e.replica_id is not None else "",
            _change(e),
            safe(e.message),
        )
    return t


def event_line(e: EventInfo) -> str:
    """One event as a line (rich markup), for `fleetserve events -f`."""
    replica = f"replica {e.replica_id}" if e.replica_id is not None else "-"
    change = _change(e)
    parts = [when(e.at), f"{e.kind:<10}", f"{replica:<11}"]
    if change:
        parts.append(change)
    parts.append(safe(e.message))
    return "  ".join(parts)
