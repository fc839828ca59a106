"""Where the store lives: SQLite under FLEETSERVE_HOME (the default), or PostgreSQL given as
`FLEETSERVE_DB_URL` or in the file `FLEETSERVE_DB_URL_FILE` (docs/scaling.md).

A URL's password is never shown: `mask_url` replaces it in every message and log line.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from fleetserve.core.errors import FleetserveError, InvalidSpec

POSTGRES_DRIVER = "postgresql+psycopg"  # psycopg 3, whatever driver the URL named
_POSTGRES_SCHEMES = ("postgresql", "postgres", POSTGRES_DRIVER)
MAX_URL_FILE_BYTES = 64 * 1024
# user:password@ after the scheme; the password runs to the last @ (over-masking an odd URL
# rather than ever showing part of a password that holds an unencoded @).
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<password>\S*)@")


class UnsafeUrlFile(FleetserveError):
    """FLEETSERVE_DB_URL_FILE cannot be trusted or read: the controller does not start."""

    kind = "unusable_store"
    exit_code = 6  # as an unusable database (fleetserve.store.db.UnusableStore)


def mask_url(url: str) -> str:
    """The URL with its password (if any) replaced by ***, for messages and logs."""
    return _USERINFO.sub(lambda m: f"{m['head']}:***@", url)


def url_password(url: str) -> str | None:
    """The URL's password, decoded (to scrub it out of any driver message)."""
    try:
        password = make_url(url).password
    except (ArgumentError, ValueError):
        m = _USERINFO.search(url)
        password = unquote(m["password"]) if m else None
    return str(password) if password else None


def is_postgres(url: str) -> bool:
    return url.split("://", 1)[0].lower() in _POSTGRES_SCHEMES


def normalize_db_url(raw: str, source: str = "FLEETSERVE_DB_URL") -> str:
    """`postgresql://user[:password]@host[:port]/dbname` (or `postgresql+psycopg://`,
    `postgres://`) as SQLAlchemy's `postgresql+psycopg://` URL; anything else is refused."""
    url = raw.strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _POSTGRES_SCHEMES:
        shown = f"{scheme}://" if scheme else "the value"  # never echoed: it may be a password
        raise InvalidSpec(
            f"{source}: {shown} is not a PostgreSQL URL: use "
            "postgresql://user:password@host:port/dbname (unset it for SQLite in FLEETSERVE_HOME)"
        )
    url = POSTGRES_DRIVER + url[len(scheme) :]
    try:
        parsed = make_url(url)
        port = parsed.port  # a port that is not a number raises here
    except (ArgumentError, ValueError):
        raise InvalidSpec(
            f"{source}: {mask_url(url)} is not a valid URL: "
            "postgresql://user:password@host:port/dbname (percent-encode @ : / in the password)"
        ) from None
    if "@" in (parsed.host or ""):
        raise InvalidSpec(f"{source}: percent-encode an @ in the password as %40")
    if not parsed.database:
        raise InvalidSpec(f"{source}: {mask_url(url)} names no database (.../dbname)")
    if port is not None and not 0 < port < 65536:
        raise InvalidSpec(f"{source}: port {port} is out of range")
    return url


def read_url_file(path: Path) -> str:
    """The URL in `path`: a regular file of this user that no group or other user may read
    or write (like ~/.pgpass), holding one URL (surrounding whitespace ignored)."""
    where = f"FLEETSERVE_DB_URL_FILE {path}"
    try:
        st = os.stat(path)
    except OSError as e:
        raise UnsafeUrlFile(f"{where}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeUrlFile(f"{where} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise UnsafeUrlFile(
            f"{where} is open to group or others (mode {mode:04o}) and holds the database "
            f"password: chmod 600 {path}"
        )
    if st.st_size > MAX_URL_FILE_BYTES:
        raise UnsafeUrlFile(f"{where} is larger than {MAX_URL_FILE_BYTES} bytes: not a URL")
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise UnsafeUrlFile(f"{where}: cannot be read ({why})") from None
    if not text or "\n" in text:
        raise UnsafeUrlFile(f"{where} must hold one URL on one line")
    return text


def resolve_db_url(url: str | None, url_file: Path | None) -> str | None:
    """The PostgreSQL URL to use (normalised), or None for SQLite in FLEETSERVE_HOME."""
    if url and url_file:
        raise InvalidSpec("set FLEETSERVE_DB_URL or FLEETSERVE_DB_URL_FILE, not both")
    if url_file is not None:
        return normalize_db_url(read_url_file(url_file), f"FLEETSERVE_DB_URL_FILE {url_file}")
    return normalize_db_url(url) if url else None
