"""The settings every process of a home shares, read from the environment (FLEETSERVE_*): where
the home is, where its controller's API listens and how (TLS, allowed hosts), where its store
is, and whether several controllers share it (high availability). The CLI and the SDK read
these alone (`HomeSettings`); the controller's own settings (fleetserve.controller.settings)
add the rest, which the controller checks when it starts."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fleetserve.core.errors import InvalidSpec

DEFAULT_API_PORT = 46580


def fleetserve_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("FLEETSERVE_HOME") or Path.home() / ".fleetserve").expanduser()


# A number as people write one in ASCII (Python's float() also takes '1_0', ' 5', 'inf', 'nan'
# and other scripts' digits, none of which a setting should mean).
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


def env_number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if not _NUMBER.fullmatch(raw):
        raise InvalidSpec(f"{name}={raw[:40]!r} is not a number")
    return float(raw)


def env_bounded(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    value = env_number(env, name, default)
    if not lo <= value <= hi:
        raise InvalidSpec(f"{name}={env.get(name, '')[:40]} is out of range: {lo:g} to {hi:g}")
    return value


def env_whole(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if not re.fullmatch(r"[0-9]{1,9}", raw):
        raise InvalidSpec(f"{name}={raw[:40]!r} is not a whole number")
    if not lo <= int(raw) <= hi:
        raise InvalidSpec(f"{name}={raw} is out of range: {lo} to {hi}")
    return int(raw)


def env_flag(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidSpec(f"{name}={raw!r}: use 1 or 0")


def env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of `choices` (the first when unset)."""
    raw = (env.get(name) or "").strip().lower() or choices[0]
    if raw not in choices:
        raise InvalidSpec(f"{name}={raw!r}: use {' or '.join(choices)}")
    return raw


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def home_hash(home: Path | str, token: str) -> str:
    """What the open `/api/v1/health` says of the controller's home: its path keyed with the
    API token (HMAC-SHA256), so that a client holding the token tells its own controller from
    another home's, or from a stranger's, without sending the token, and nobody without the
    token learns the path (a plain hash of `/home/<user>/.fleetserve` gives it back to a
    guess)."""
    message = b"fleetserve-home\0" + str(home).encode("utf-8", "surrogateescape")
    key = token.encode("utf-8", "surrogateescape")
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class HomeSettings:
    home: Path
    api_port: int = DEFAULT_API_PORT
    # Where the REST API listens. Anything but loopback needs TLS (a cert and key) and, like
    # every call but /health, the token.
    api_host: str = "127.0.0.1"
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted besides loopback ones
    # The store (docs/scaling.md): PostgreSQL at FLEETSERVE_DB_URL (kept out of repr: it may
    # hold a password), or at the URL in the 0600 file FLEETSERVE_DB_URL_FILE (read by the
    # controller only, see Settings.store_url); neither: SQLite at db_path.
    db_url: str | None = field(default=None, repr=False)
    db_url_file: Path | None = None
    # High availability (docs/scaling.md): several controllers on one database, one active
    # through a lease, the others standbys that take over.
    ha: bool = False
    # The API's address as others reach it (FLEETSERVE_ADVERTISE_URL): what an HA lease names
    # for standbys to send clients to. Unset: derived from api_host (`advertised_url`).
    advertise_url: str | None = None

    def __post_init__(self) -> None:
        for name in self.allowed_hosts:
            allowed_host(name)

    @classmethod
    def from_env(cls) -> HomeSettings:
        return cls(**home_fields(os.environ))

    @property
    def db_path(self) -> Path:
        return self.home / "fleetserve.db"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def server_file(self) -> Path:
        """Where the running controller says who it is. With high availability several
        controllers share a home, one API port each: one file (and lock) per port."""
        return self.home / (f"server-{self.api_port}.json" if self.ha else "server.json")

    @property
    def controller_log(self) -> Path:
        """The controller's log; one per API port with high availability."""
        name = f"controller-{self.api_port}.log" if self.ha else "controller.log"
        return self.logs_dir / name

    @property
    def lock_file(self) -> Path:
        return self.home / (f"server-{self.api_port}.lock" if self.ha else "server.lock")

    @property
    def token_file(self) -> Path:
        """The API token (0600): the CLI and SDK of this user read it."""
        return self.home / "api-token"

    @property
    def api_scheme(self) -> str:
        return "https" if self.tls_certfile else "http"

    @property
    def advertised_url(self) -> str:
        """The API's URL for others (an HA lease names it): FLEETSERVE_ADVERTISE_URL, else
        api_host, and for a wildcard host (0.0.0.0, ::), which nobody can connect to, the
        first of allowed_hosts (names clients use, which the TLS certificate covers), else
        this machine's fully qualified name."""
        if self.advertise_url:
            return self.advertise_url
        host = self.api_host
        if host in WILDCARD_HOSTS:
            host = self.allowed_hosts[0] if self.allowed_hosts else socket.getfqdn()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{self.api_scheme}://{host}:{self.api_port}"

    def check_exposure(self) -> None:
        """An API beyond loopback only with TLS: the token must not cross a network in clear."""
        if is_loopback(self.api_host):
            return
        if not (self.tls_certfile and self.tls_keyfile):
            raise InvalidSpec(
                f"listening on {self.api_host} needs TLS: pass --tls-cert and --tls-key "
                "(clients then need the token, and the CA file if the cert is private)"
            )
        for path in (self.tls_certfile, self.tls_keyfile):
            if not Path(path).is_file():
                raise InvalidSpec(f"TLS file {path} does not exist")


def home_fields(env: Mapping[str, str]) -> dict[str, Any]:
    """HomeSettings' fields from an environment (the controller's Settings reads them so too)."""
    return {
        "home": fleetserve_home(env),
        "api_port": int(env_number(env, "FLEETSERVE_API_PORT", DEFAULT_API_PORT)),
        "api_host": env.get("FLEETSERVE_API_HOST") or "127.0.0.1",
        "tls_certfile": env.get("FLEETSERVE_TLS_CERTFILE") or None,
        "tls_keyfile": env.get("FLEETSERVE_TLS_KEYFILE") or None,
        "allowed_hosts": tuple(
            h.strip() for h in env.get("FLEETSERVE_ALLOWED_HOSTS", "").split(",") if h.strip()
        ),
        "db_url": env.get("FLEETSERVE_DB_URL") or None,
        "db_url_file": Path(env["FLEETSERVE_DB_URL_FILE"])
        if env.get("FLEETSERVE_DB_URL_FILE")
        else None,
        "ha": env_flag(env, "FLEETSERVE_HA"),
        "advertise_url": advertise_url(env.get("FLEETSERVE_ADVERTISE_URL", "")),
    }


_HOSTNAME = r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?"  # a DNS name or an IPv4 address
_ALLOWED_HOST = re.compile(rf"\[[0-9A-Fa-f:.]+\]|{_HOSTNAME}")


def allowed_host(name: str) -> str:
    """An allowed host (FLEETSERVE_ALLOWED_HOSTS, --allowed-host) checked: a name or address
    as the Host header carries it, without its port (the API compares names only, so a port
    here would never match) or a scheme; an IPv6 address in brackets."""
    what = f"allowed host {name[:200]!r}"
    if _ALLOWED_HOST.fullmatch(name):
        return name
    if name.count(":") >= 2 and not name.startswith("["):
        raise InvalidSpec(f"{what}: write an IPv6 address in brackets, as [{name[:200]}]")
    if "://" in name or ":" in name or "/" in name:
        raise InvalidSpec(
            f"{what}: a host name or address only, without a scheme, port or path "
            "(the API accepts any port of an allowed name)"
        )
    raise InvalidSpec(f"{what}: not a host name or an IP address")


def advertise_url(raw: str) -> str | None:
    """FLEETSERVE_ADVERTISE_URL checked: http(s)://HOST[:PORT], nothing else (it is handed
    to clients as the active controller's address)."""
    raw = raw.strip()
    if not raw:
        return None
    what = f"FLEETSERVE_ADVERTISE_URL={raw[:200]!r}"
    if len(raw) > 300 or not raw.isascii() or not raw.isprintable():
        raise InvalidSpec(f"{what}: use http(s)://HOST:PORT in ASCII, at most 300 characters")
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as e:
        raise InvalidSpec(f"{what}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidSpec(f"{what}: use http(s)://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise InvalidSpec(f"{what}: only a scheme, a host and a port (no path, query or user)")
    host = parts.hostname
    if host in WILDCARD_HOSTS:
        raise InvalidSpec(f"{what}: {host} is every address, not one others can reach")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not re.fullmatch(_HOSTNAME, host):
            raise InvalidSpec(f"{what}: {host!r} is not a host name or an IP address") from None
    netloc = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{netloc}" + (f":{port}" if port is not None else "")
