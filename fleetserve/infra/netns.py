"""A network namespace per replica, for fleets whose spec fixes the port (`ports: 8080`).

Every replica of such a fleet listens on the same port, as it would in its own container: the
replica runs in a namespace of its own, joined to this machine by a veth pair. Each pair gets a
/30 from a private range (10.231.0.0/16 unless Settings.replica_net, FLEETSERVE_REPLICA_NET,
says otherwise; a range that overlaps one of this machine's routes is refused): the
host end takes the first address, the replica's end the second, and the load balancer and the
prober reach the replica at that second address.

Names derive from the launch token (and the home's id), so terminate-by-token, recovery and
the orphan sweep find a replica's namespace with no other record. Needs root and iproute2.
A normal user gets the other way, an unprivileged user namespace per replica joined by a relay
(fleetserve.infra.userns); fleetserve.oshelpers.netcaps.kind says which one this process
can use.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil

from fleetserve.core.errors import TerminalError
from fleetserve.infra import userns
from fleetserve.oshelpers.netcaps import kind, veth_available

DEFAULT_RANGE = "10.231.0.0/16"
RANGE_ENV = "FLEETSERVE_REPLICA_NET"
_NS_PREFIX = "fleetserve-"
_HOST_PREFIX = "fsh"  # interface names are at most 15 characters
_PEER_PREFIX = "fsr"
REFUSAL = (
    "a fixed port shared by several replicas needs a network namespace per replica: as root "
    "with iproute2 (`ip netns`, veth pairs), or as a normal user where the kernel allows "
    "unprivileged user namespaces; neither is possible here"
)


# -- pure: names and addresses --------------------------------------------------------------


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def home_tag(home_id: str) -> str:
    return _digest(home_id or "-", 8)


def namespace_name(home_id: str, token: str) -> str:
    """`fleetserve-<home>-<token>`: the sweep finds this home's by the prefix."""
    return f"{_NS_PREFIX}{home_tag(home_id)}-{_digest(token, 12)}"


def veth_names(token: str) -> tuple[str, str]:
    """(host end, replica end) of the replica's veth pair."""
    tag = _digest(token, 11)
    return f"{_HOST_PREFIX}{tag}", f"{_PEER_PREFIX}{tag}"


def token_of_namespace(name: str, home_id: str) -> str | None:
    """The token digest in a namespace name of this home, or None when it is not one."""
    prefix = f"{_NS_PREFIX}{home_tag(home_id)}-"
    return name[len(prefix) :] if name.startswith(prefix) else None


def token_digest(token: str) -> str:
    return _digest(token, 12)


@dataclass(frozen=True)
class Link:
    """One replica's /30: the host's end and the replica's end."""

    host: ipaddress.IPv4Interface
    replica: ipaddress.IPv4Interface


def parse_range(text: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as e:
        raise TerminalError(f"{RANGE_ENV}={text!r} is not an IPv4 network: {e}") from e
    if not net.is_private or net.prefixlen > 29:
        raise TerminalError(f"{RANGE_ENV}={text!r}: give a private range of /29 or larger")
    return net


def allocate_link(net: ipaddress.IPv4Network, used: set[ipaddress.IPv4Address]) -> Link:
    """The first /30 of `net` none of whose addresses is in `used` (addresses already on
    interfaces of this machine, or handed out and not yet there)."""
    for sub in net.subnets(new_prefix=30):
        if any(a in used for a in (sub.network_address, *sub.hosts(), sub.broadcast_address)):
            continue
        first, second = list(sub.hosts())
        return Link(
            host=ipaddress.IPv4Interface(f"{first}/30"),
            replica=ipaddress.IPv4Interface(f"{second}/30"),
        )
    raise TerminalError(f"no free /30 is left in {net} for another replica's network")


# iproute2 names an interface it can no longer name (gone between its route and link dumps:
# a replica's veth being removed) `if<index>`.
_UNNAMED = re.compile(r"if\d+")
# A route that overlaps the range may be on an interface being removed that second (a
# sibling replica's, or any that goes away): the routes are read again after these pauses
# before the range is refused.
COLLISION_RECHECKS = (0.2, 0.5, 1.0)


def collisions(
    net: ipaddress.IPv4Network, routes: list[tuple[ipaddress.IPv4Network, str]]
) -> list[str]:
    """Routes of this machine that overlap `net` and are not ours (not on one of our veths,
    nor on an interface gone while the routes were read); the default route (0.0.0.0/0)
    never counts."""
    return [
        f"{dest} dev {dev}"
        for dest, dev in routes
        if dest.prefixlen > 0
        and dest.overlaps(net)
        and not dev.startswith((_HOST_PREFIX, _PEER_PREFIX))
        and not _UNNAMED.fullmatch(dev)
    ]


def lasting_collisions(
    net: ipaddress.IPv4Network,
    routes: Callable[[], list[tuple[ipaddress.IPv4Network, str]]],
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """`collisions` that outlast COLLISION_RECHECKS: an interface removed in the same second
    (a sibling replica's teardown racing this launch) does not refuse the range."""
    bad = collisions(net, routes())
    for pause in COLLISION_RECHECKS:
        if not bad:
            break
        sleep(pause)
        bad = collisions(net, routes())
    return bad


# -- I/O: iproute2 -----------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise TerminalError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def _addresses_in_use() -> set[ipaddress.IPv4Address]:
    used = set()
    for line in _ip("-o", "-4", "addr", "show").splitlines():
        parts = line.split()
        if "inet" in parts:
            used.add(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).ip)
    return used


def _routes() -> list[tuple[ipaddress.IPv4Network, str]]:
    out = []
    for line in _ip("-o", "-4", "route", "show", "table", "all").splitlines():
        parts = line.split()
        if not parts or parts[0] in ("broadcast", "local", "unreachable", "blackhole"):
            parts = parts[1:] if parts else parts
        if not parts:
            continue
        dest = "0.0.0.0/0" if parts[0] == "default" else parts[0]
        dev = parts[parts.index("dev") + 1] if "dev" in parts else ""
        try:
            out.append((ipaddress.IPv4Network(dest, strict=False), dev))
        except ValueError:
            continue
    return out


def start_outbound(name: str, env: Mapping[str, str] | None) -> bool:
    """slirp4netns for the named namespace, detached (stopped with the replica, by its
    token: it runs with `env`); False when it is not installed or did not start."""
    link = userns.start_slirp(
        ["--netns-type=path", f"/run/netns/{name}", "tap0"],
        env=dict(env) if env is not None else None,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return link is not None


def _stop_outbound(name: str) -> None:
    """Kill, by pid, the slirp4netns of this user that serves exactly this namespace (one left
    by a launch cut short; a stopped replica's went with its token)."""
    target = f"/run/netns/{name}"
    for p in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmd = p.info["cmdline"] or []
            mine = p.info["uids"] is not None and p.info["uids"].real == os.getuid()
            if mine and target in cmd and cmd[0].endswith("slirp4netns"):
                p.kill()
        except psutil.Error:
            continue


def namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


class ReplicaNetworks:
    """Makes and removes replicas' namespaces; one lock orders this controller's allocations."""

    def __init__(self, home_id: str, net: str | None = None, mode: str = "auto") -> None:
        self.home_id = home_id
        self.range_text = net or DEFAULT_RANGE
        self.mode = mode
        self._lock = threading.Lock()
        self._pending: set[ipaddress.IPv4Address] = set()

    def may_exist(self) -> bool:
        """Whether this controller could have made named namespaces at all."""
        return veth_available()

    def kind(self) -> str | None:
        return kind(self.mode)

    def create(self, token: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
        """Make the replica's namespace (loopback up, a veth to this machine); returns its name
        and the replica's address. Outbound traffic goes through slirp4netns when installed
        (started with `env`, the replica's, so that stopping the replica by its token stops it
        too), else through the veth (routed only as far as this machine forwards it). Anything
        half made is removed on failure."""
        if not veth_available():
            raise TerminalError(REFUSAL)
        net = parse_range(self.range_text)
        bad = lasting_collisions(net, _routes)
        if bad:
            raise TerminalError(
                f"the replica network {net} overlaps this machine's routes ({', '.join(bad)}): "
                f"set {RANGE_ENV} to a free private range"
            )
        name = namespace_name(self.home_id, token)
        outer, inner = veth_names(token)
        self.remove(token)  # left by an earlier, cut-short launch with this token
        with self._lock:
            link = allocate_link(net, _addresses_in_use() | self._pending)
            self._pending |= {link.host.ip, link.replica.ip}
        try:
            _ip("netns", "add", name)
            _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", name)
            _ip("addr", "add", str(link.host), "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("netns", "exec", name, "ip", "addr", "add", str(link.replica), "dev", inner)
            _ip("netns", "exec", name, "ip", "link", "set", inner, "up")
            if not start_outbound(name, env):
                gateway = str(link.host.ip)
                _ip("netns", "exec", name, "ip", "route", "add", "default", "via", gateway)
        except BaseException:
            self.remove(token)
            raise
        finally:
            with self._lock:
                self._pending -= {link.host.ip, link.replica.ip}
        return name, str(link.replica.ip)

    def remove(self, token: str) -> None:
        """Remove the replica's namespace and veth, if they exist (idempotent)."""
        self._remove(namespace_name(self.home_id, token), veth_names(token)[0])

    def _remove(self, name: str, outer: str | None) -> None:
        _stop_outbound(name)
        if name in namespaces():
            for pid in _ip("netns", "pids", name, check=False).split():
                # Only what our token-matched stop left (it ran first); never outside it.
                subprocess.run(["kill", "-9", pid], capture_output=True, timeout=10)
            _ip("netns", "del", name, check=False)
        if outer is not None:
            _ip("link", "del", outer, check=False)  # gone with the namespace, usually

    def sweep(self, known_tokens: set[str]) -> int:
        """Remove this home's namespaces whose token no row knows; returns how many."""
        known = {token_digest(t) for t in known_tokens}
        removed = 0
        for name in namespaces():
            digest = token_of_namespace(name, self.home_id)
            if digest is not None and digest not in known:
                self._remove(name, None)
                removed += 1
        return removed
