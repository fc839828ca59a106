"""The Python SDK: `fleetserve.client.Client` talks to the controller's REST API.

The CLI is built on it. With `auto_start` (the default) the first call starts the controller
in the background if none answers for this FLEETSERVE_HOME.

Every call but /health carries the API token: the `token` argument, else FLEETSERVE_API_TOKEN,
else the home's token file (which only its owner can read). A controller on another machine is
reached with FLEETSERVE_API_URL (https), the token, and FLEETSERVE_API_CA when its certificate
is signed by a private CA.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import psutil

from fleetserve.api.models import EventInfo, Health, JobInfo, PoolApplied, Preempted, ServiceInfo
from fleetserve.core.errors import (
    ERROR_KINDS,
    FleetserveError,
    InvalidSpec,
    NotFound,
    ServiceFailed,
    TransientError,
    Unauthorized,
    WaitTimeout,
)
from fleetserve.core.sockets import listener_uids
from fleetserve.home.folder import (
    RunningController,
    local_url,
    running_controllers,
    secure_home,
)
from fleetserve.home.settings import HomeSettings, home_hash
from fleetserve.oshelpers.files import open_private

_TOKEN = re.compile(r"[\x21-\x7e]{1,4096}")  # what any API token is made of
_WRITES = ("POST", "PUT", "PATCH", "DELETE")
FAILED_SERVICE_STATUSES = ("FAILED", "CONTROLLER_FAILED", "FAILED_CLEANUP")
_T = TypeVar("_T")
WAIT_POLL = 0.5  # seconds between polls of a wait
# A wait rides out a controller that does not answer (restarting) for this long in a row.
OUTAGE_SECONDS = 60.0
# `down` of a service already FAILED_CLEANUP: its old status is not taken for the new try's.
STALE_CLEANUP_SECONDS = 15.0
BUSY_WAIT_SECONDS = 10.0  # for a controller whose port is open but that does not answer yet


def _read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidSpec(f"{path}: cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise InvalidSpec(f"{path}: not UTF-8 text (byte {e.start}); a YAML is text") from None


def _standby_points_to(resp: httpx.Response) -> str | None:
    """The active controller's address, when a standby answered this write."""
    if resp.status_code != 503:
        return None
    try:
        err = resp.json()["error"]
        return str(err["active"]) if err.get("kind") == "standby" and err.get("active") else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _refused(e: BaseException) -> bool:
    """Whether a connect error is a refusal (nothing listens), not a closed connection."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(e).lower()
    return "refused" in text or "name or service not known" in text or "errno -2" in text


def _raise_for(resp: httpx.Response, hint: str = "") -> None:
    if resp.is_success:
        return
    if resp.status_code == 401:
        raise Unauthorized(f"the controller refused the API token{hint}")
    try:
        err = resp.json()["error"]
        kind, message = str(err["kind"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        if resp.status_code == 503:
            raise TransientError(
                "the controller is busy (HTTP 503: too many connections): retry in a moment"
            ) from None
        raise FleetserveError(
            f"controller answered HTTP {resp.status_code}: {resp.text[:200]}"
        ) from None
    raise ERROR_KINDS.get(kind, FleetserveError)(message)


def controller_of(settings: HomeSettings) -> RunningController | None:
    """This home's controller on the settings' API port, whether or not it runs with high
    availability; without it here, the home's controller without high availability on
    whichever port (there is one per home)."""
    found = running_controllers(settings.home)
    for c in found:
        if c.port == settings.api_port:
            return c
    if not settings.ha:
        for c in found:
            if not c.ha:
                return c
    return None


def server_pid(settings: HomeSettings) -> int | None:
    """The pid of this home's controller on the settings' port (see `controller_of`)."""
    c = controller_of(settings)
    return c.pid if c is not None else None


def _answering_pid(client: Client) -> int | None:
    """The pid of the controller that answers (None: it cannot be read)."""
    try:
        return client.health().pid
    except FleetserveError:
        return None


def start_server(settings: HomeSettings, wait: float = 30.0) -> tuple[int, bool]:
    """Start the controller in the background; returns its pid once its API answers, and
    True; or the pid of another controller of this home started at the same moment that won
    the port, and False.

    A start that fails says why in one line (the controller's own, from its stderr), and the
    log of a controller that already runs is only ever appended to."""
    secure_home(settings.home)  # refuses a home (or a file in it) another user planted
    env = dict(os.environ)
    env["FLEETSERVE_HOME"] = str(settings.home)
    env["FLEETSERVE_API_PORT"] = str(settings.api_port)
    env["FLEETSERVE_API_HOST"] = settings.api_host
    env["FLEETSERVE_TLS_CERTFILE"] = settings.tls_certfile or ""
    env["FLEETSERVE_TLS_KEYFILE"] = settings.tls_keyfile or ""
    env["FLEETSERVE_ALLOWED_HOSTS"] = ",".join(settings.allowed_hosts)
    env["FLEETSERVE_ADVERTISE_URL"] = settings.advertise_url or ""
    if settings.db_url:  # the store (docs/scaling.md); otherwise the environment's, if any
        env["FLEETSERVE_DB_URL"] = settings.db_url
    if settings.db_url_file:
        env["FLEETSERVE_DB_URL_FILE"] = str(settings.db_url_file)
    out = open_private(settings.controller_log)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetserve.api.server"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    finally:
        os.close(out)
    client = Client(settings=settings, auto_start=False)
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                why = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")
                last = why.strip().splitlines()[-1] if why.strip() else ""
                failed = FleetserveError(
                    last.removeprefix("fleetserve controller: ")
                    or f"the controller exited at start (code {proc.returncode}); see "
                    f"{settings.controller_log}"
                )
                # Invalid settings; another controller of this home (on another port); an
                # unusable database or home.
                if proc.returncode in (2, 5, 6):
                    failed.exit_code = proc.returncode
                raise failed
            if client.healthy():
                answering = _answering_pid(client)
                if answering in (None, proc.pid):
                    return proc.pid, True
                # Another controller took the port first (a `server start` at the same
                # moment): this one stops at its lock; the one that answers is the result.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                if proc.poll() is not None and answering is not None:
                    return answering, False
            time.sleep(0.1)
    finally:
        if proc.stderr is not None:
            proc.stderr.close()  # the controller's stderr then goes nowhere; it logs to stdout
    raise TransientError(f"the controller did not answer within {wait:.0f} s")


def stop_controllers(found: list[RunningController], wait: float = 60.0) -> None:
    """SIGTERM each (at once: a standby does not take over from one being stopped), then
    SIGKILL what still runs after `wait` seconds."""
    procs = []
    for c in found:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(c.pid)
            p.terminate()
            procs.append(p)
    deadline = time.monotonic() + wait
    while procs and time.monotonic() < deadline:
        procs = [p for p in procs if not _ended(p)]
        time.sleep(0.1)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _ended(p: psutil.Process) -> bool:
    """Gone, or a zombie (its parent may not be there to reap it)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def stop_server(settings: HomeSettings, wait: float = 60.0) -> bool:
    """Stop every controller of this home, with high availability or not (replicas and load
    balancers keep running). False if none ran."""
    found = running_controllers(settings.home)
    stop_controllers(found, wait)
    return bool(found)


def _loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _local_url(settings: HomeSettings) -> str:
    """The controller of this home on the API port: its scheme from its server file (it
    may serve TLS), whichever FLEETSERVE_HA it was started with."""
    running = controller_of(settings)
    if running is not None and running.port == settings.api_port:
        return running.url
    scheme = running.scheme if running is not None else settings.api_scheme
    return local_url(scheme, settings.api_host, settings.api_port)


def current_folder() -> str:
    """This process's current folder (a spec's relative paths start there, as in SkyPilot)."""
    try:
        return str(Path.cwd())
    except FileNotFoundError:
        raise InvalidSpec(
            "the current folder no longer exists: run the command from an existing folder"
        ) from None


class Client:
    def __init__(
        self,
        url: str | None = None,
        settings: HomeSettings | None = None,
        auto_start: bool = True,
        timeout: float = 30.0,
        token: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.settings = settings or HomeSettings.from_env()
        url = url or os.environ.get("FLEETSERVE_API_URL") or None
        self.remote = url is not None
        self.url = (url or _local_url(self.settings)).rstrip("/")
        self.auto_start = auto_start and not self.remote
        self._token = token or os.environ.get("FLEETSERVE_API_TOKEN") or None
        ca = ca_file or os.environ.get("FLEETSERVE_API_CA") or None
        if ca is not None and not os.path.isfile(ca):
            raise InvalidSpec(f"CA file {ca} does not exist (FLEETSERVE_API_CA)")
        # This home's own controller is on loopback, and is checked to be a process of this
        # user before the token goes out (`_check_owner`): that identifies it better than a
        # certificate naming its public host would, so its certificate is not verified.
        verify: str | bool = ca or self.remote
        if self.remote and urlsplit(self.url).scheme != "https" and not _loopback_url(self.url):
            raise InvalidSpec(
                f"FLEETSERVE_API_URL {self.url} is not https: the API token must not cross a "
                "network in clear"
            )
        self._verify = verify
        # On this machine (loopback), whoever listens on the port is checked before every
        # request: it must be this user's process.
        # (This home's controller may listen on another address of this machine only.)
        local = _loopback_url(self.url) or not self.remote
        hooks = {"request": [self._check_owner_hook]} if local else {}
        self._http = httpx.Client(
            base_url=self.url + "/api/v1",
            timeout=timeout,
            trust_env=False,
            verify=verify,
            event_hooks=hooks,
        )
        self._checked = False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------

    def token(self) -> str:
        """The API token: given, from FLEETSERVE_API_TOKEN, or this home's token file."""
        if self._token:
            if not _TOKEN.fullmatch(self._token):
                raise Unauthorized(
                    "FLEETSERVE_API_TOKEN is not an API token (it holds spaces, control or "
                    "non-ASCII characters): unset it, or set the controller's token"
                )
            return self._token
        path = self.settings.token_file
        try:
            self._token = path.read_text().strip()
        except FileNotFoundError:
            raise Unauthorized(
                f"no API token: {path} does not exist (the controller writes it at its first "
                "start); for a controller elsewhere set FLEETSERVE_API_TOKEN"
            ) from None
        except PermissionError:
            raise Unauthorized(
                f"no API token: {path} is not readable by this user; ask its owner for the "
                "token and set FLEETSERVE_API_TOKEN"
            ) from None
        return self._token

    def _headers(self, method: str, has_body: bool) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token()}"}
        if method in _WRITES and not has_body:
            headers["Content-Type"] = "application/json"
        return headers

    def _hint(self) -> str:
        if self._token and os.environ.get("FLEETSERVE_API_TOKEN") == self._token:
            return " (FLEETSERVE_API_TOKEN is not this controller's token)"
        return f" (the token in {self.settings.token_file} is not this controller's)"

    def healthy(self) -> bool:
        return self.reachability()[0] == "ok"

    def home_hashes(self) -> set[str]:
        """What this home's controller may say as `home_hash`: its path keyed with the token
        this client holds, or with the home's token file (a wrong FLEETSERVE_API_TOKEN then
        goes to this home's own controller, which refuses it: a 401 that says so); none
        without a token (no controller of this home has started)."""
        keys = set()
        with contextlib.suppress(Unauthorized):
            keys.add(self.token())
        with contextlib.suppress(OSError):
            keys.add(self.settings.token_file.read_text().strip())
        return {home_hash(self.settings.home, key) for key in keys if key}

    def reachability(self) -> tuple[str, str]:
        """("ok", ""), ("missing", why): nothing accepts a connection there, or what answers
        is no fleetserve controller; or ("busy", why): something took the connection but did
        not answer in time (a controller with too many connections held open answers 503,
        or closes a new TLS connection at once)."""
        try:
            # A connection of its own, closed after: the token never rides on a connection
            # opened before the controller's owner was checked.
            with httpx.Client(trust_env=False, verify=self._verify, timeout=2) as probe:
                r = probe.get(self.url + "/api/v1/health")
        except httpx.ConnectError as e:
            if "CERTIFICATE_VERIFY_FAILED" in str(e):
                raise TransientError(
                    f"the controller at {self.url} has a certificate this client does not "
                    f"trust ({e}): set FLEETSERVE_API_CA to its CA file"
                ) from None
            if _refused(e):
                return "missing", "connection refused"
            if "WRONG_VERSION_NUMBER" in str(e) or "wrong version number" in str(e):
                return "missing", "it does not speak TLS there (an http:// controller?)"
            return "busy", f"it closed the connection before answering ({e or 'no reason'})"
        except httpx.ConnectTimeout:
            return "busy", "no connection within 2 s"
        except httpx.TimeoutException:
            return "busy", "no answer within 2 s"
        except httpx.HTTPError as e:
            return "busy", f"it closed the connection before answering ({e or 'no reason'})"
        if r.status_code == 503:
            return "busy", "it answered 503 (too many connections)"
        if r.status_code != 200:
            return "missing", f"HTTP {r.status_code} from /api/v1/health"
        try:
            found = dict(r.json()).get("home_hash")
        except (ValueError, TypeError):
            return "missing", "its /api/v1/health is not a fleetserve controller's"
        if self.remote:
            return "ok", ""
        hashes = self.home_hashes()
        if not hashes:
            self.token()  # no token at all: says so (Unauthorized), not "another home"
        if not isinstance(found, str) or found not in hashes:
            owner = (
                "a fleetserve controller for another FLEETSERVE_HOME (or one whose API token "
                "is not the one this client holds)"
                if isinstance(found, str)
                else "another server (not a fleetserve controller: no home_hash in its health "
                "answer)"
            )
            raise FleetserveError(
                f"port {self.settings.api_port} is taken by {owner}; "
                "set FLEETSERVE_API_PORT to use another port for this FLEETSERVE_HOME"
            )
        return "ok", ""

    def _ensure(self) -> None:
        if self._checked:
            return
        state, why = self.reachability()
        if state != "ok":
            port = urlsplit(self.url).port or self.settings.api_port
            deadline = time.monotonic() + BUSY_WAIT_SECONDS
            while (state == "busy" or listener_uids(port)) and time.monotonic() < deadline:
                time.sleep(0.2)
                state, why = self.reachability()  # a controller that was just starting, or busy
                if state == "ok":
                    self._checked = True
                    return
            if self._another_of_home():
                self._checked = True
                return
            if state == "busy" and not self.remote and not running_controllers(self.settings.home):
                raise TransientError(
                    f"something on port {port} takes connections but does not answer ({why}), "
                    f"and no fleetserve controller of {self.settings.home} runs: set "
                    "FLEETSERVE_API_PORT to another port for this FLEETSERVE_HOME"
                )
            if state == "busy":
                raise TransientError(
                    f"the fleetserve controller at {self.url} is busy: {why}, for "
                    f"{BUSY_WAIT_SECONDS:.0f} s. It is running (do not start another); "
                    "retry in a moment. If it stays busy, clients are holding its connections "
                    "open (docs/security.md)"
                    + ("" if self.remote else f"; see {self.settings.controller_log}")
                )
            if not self.auto_start:
                raise TransientError(
                    f"no fleetserve controller answers at {self.url} ({why}; "
                    "start one with `fleetserve server start`)"
                )
            if listener_uids(port):
                # Something holds the port but does not answer: starting another controller
                # would only fail to bind it.
                raise TransientError(
                    f"the controller on port {port} does not answer its health check ({why}: "
                    f"not a fleetserve controller?): retry, or see {self.settings.controller_log}"
                )
            start_server(self.settings)
        self._checked = True

    def _another_of_home(self) -> bool:
        """None answers on the configured port, but this home has a controller on another
        one (started with another FLEETSERVE_API_PORT or FLEETSERVE_HA): use it, rather than
        fail or start a second controller on the same home."""
        if self.remote:
            return False
        configured = self.url
        for c in running_controllers(self.settings.home):
            if c.port == urlsplit(configured).port:
                continue
            self._use(c.url)
            if self.healthy():
                return True
        self._use(configured)
        return False

    def _use(self, url: str) -> None:
        self.url = url
        self._http.base_url = httpx.URL(url + "/api/v1")

    def _check_owner(self) -> None:
        """The token goes only to a controller of this user: another local user who got the
        port first (the controller was down) would otherwise be handed it. Who listens is
        read from /proc/net/tcp, before every request of a local client."""
        port = urlsplit(self.url).port or self.settings.api_port
        uids = listener_uids(port)
        me = os.getuid()
        if not uids:
            # Nobody listens: the controller stopped or is restarting, which a waiting command
            # rides out (TransientError), not a stranger on its port.
            raise TransientError(
                f"no fleetserve controller answers at {self.url} (nothing listens on port "
                f"{port}; `fleetserve server start` starts one)"
            )
        if uids != {me}:
            who = ", ".join(str(u) for u in sorted(uids)) or "nobody"
            raise Unauthorized(
                f"port {port} is not held by this user's controller (listening: uid {who}): "
                "the API token was not sent"
            )

    def _check_owner_hook(self, _request: httpx.Request) -> None:
        self._check_owner()

    def _call(self, method: str, path: str, _hops: int = 0, **kw: Any) -> httpx.Response:
        self._ensure()
        headers = self._headers(method, "json" in kw or "content" in kw)
        if method in _WRITES and "json" not in kw and "content" not in kw:
            kw["content"] = b"{}"
        try:
            resp = self._http.request(method, path, headers=headers, **kw)
        except httpx.HTTPError as e:
            raise TransientError(f"controller at {self.url} is unreachable: {e}") from None
        active = _standby_points_to(resp)
        if active is not None and _hops < 2 and self._follow(active):
            return self._call(method, path, _hops=_hops + 1, **kw)
        _raise_for(resp, self._hint())
        return resp

    def _follow(self, active: str) -> bool:
        """A standby named the active controller: a client of this machine's home follows it
        there (the same home, so the same token); a remote client is told instead."""
        if self.remote or not _loopback_url(active) or active.rstrip("/") == self.url:
            return False
        self._use(active.rstrip("/"))
        return True

    # -- services --------------------------------------------------------------------------

    def up(
        self,
        yaml_text: str,
        name: str | None = None,
        base_dir: str | None = None,
        infra: str | None = None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
        host: str | None = None,
    ) -> ServiceInfo:
        """Start a service. `envs` / `secrets` take precedence over the YAML's (and fill its
        null entries, which are otherwise refused); secrets are never shown back."""
        body = {
            "yaml": yaml_text,
            "name": name,
            "base_dir": base_dir,
            "infra": infra,
            "envs": dict(envs) if envs else None,
            "secrets": dict(secrets) if secrets else None,
        }
        if host is not None:
            body["host"] = host
        return ServiceInfo.model_validate(self._call("POST", "/services", json=body).json())

    def up_file(
        self,
        path: str | Path,
        name: str | None = None,
        infra: str | None = None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
        host: str | None = None,
        wait: bool = False,
        timeout: float = 1800.0,
    ) -> ServiceInfo:
        """Start the service in the YAML file. The answer comes at once (CONTROLLER_INIT);
        with `wait=True` it comes once the service is READY (`wait_ready`: raises
        ServiceFailed with the reason if it fails, WaitTimeout after `timeout` seconds)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise InvalidSpec(f"{p}: cannot be read: {e.strerror}") from None
        # Relative paths in the YAML start from the caller's folder, as in SkyPilot.
        svc = self.up(text, name, current_folder(), infra, envs, secrets, host)
        return self.wait_ready(svc.name, timeout) if wait else svc

    def wait_ready(
        self,
        name: str,
        timeout: float = 1800.0,
        on_poll: Callable[[ServiceInfo], None] | None = None,
    ) -> ServiceInfo:
        """Wait until the service is READY (a scale-to-zero service: until its endpoint is
        up with no replica) and return it. A service that fails raises ServiceFailed naming
        the reason (a crashed replica's last log lines included); none of these within
        `timeout` seconds raises WaitTimeout. `on_poll` sees each view (the CLI's progress)."""
        deadline = time.monotonic() + timeout
        while True:
            svc = self._service_riding_outages(name, deadline)
            if on_poll is not None:
                on_poll(svc)
            if svc.status == "READY":
                return svc
            if svc.min_replicas == 0 and svc.endpoint and not svc.replicas:
                return svc
            if svc.status in FAILED_SERVICE_STATUSES:
                why = svc.failure_reason or f"see `fleetserve status {name} -v`"
                raise ServiceFailed(f"service {name} is {svc.status}: {why}")
            if time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"service {name} is not READY after {timeout:g} s (it is {svc.status}; it "
                    f"keeps launching): see `fleetserve status {name} -v`"
                )
            time.sleep(WAIT_POLL)

    def update_file(
        self,
        name: str,
        path: str | Path,
        mode: str = "rolling",
        traffic_percent: int | None = None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> ServiceInfo:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise InvalidSpec(f"{p}: cannot be read: {e.strerror}") from None
        body = {
            "yaml": text,
            "base_dir": current_folder(),
            "mode": mode,
            "traffic_percent": traffic_percent,
            "envs": dict(envs) if envs else None,
            "secrets": dict(secrets) if secrets else None,
        }
        resp = self._call("POST", f"/services/{name}/update", json=body)
        return ServiceInfo.model_validate(resp.json())

    def rollback(self, name: str) -> ServiceInfo:
        return ServiceInfo.model_validate(self._call("POST", f"/services/{name}/rollback").json())

    def promote(self, name: str) -> ServiceInfo:
        return ServiceInfo.model_validate(self._call("POST", f"/services/{name}/promote").json())

    def health(self) -> Health:
        """The controller's /health: its version, pid, home, role, and how it stops a local
        replica's or job's processes."""
        return Health.model_validate(self._call("GET", "/health").json())

    def status(self, name: str | None = None) -> list[ServiceInfo]:
        if name is not None:
            return [self.service(name)]
        return [ServiceInfo.model_validate(s) for s in self._call("GET", "/services").json()]

    def service(self, name: str) -> ServiceInfo:
        return ServiceInfo.model_validate(self._call("GET", f"/services/{name}").json())

    def events(self, name: str, limit: int = 50, after: int | None = None) -> list[EventInfo]:
        """The newest `limit` events, oldest first; with `after` (an event_id), the first
        `limit` events after it: poll with the last id seen to follow a service."""
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        resp = self._call("GET", f"/services/{name}/events", params=params)
        return [EventInfo.model_validate(e) for e in resp.json()]

    def down(self, name: str, purge: bool = False) -> ServiceInfo:
        resp = self._call("DELETE", f"/services/{name}", params={"purge": purge})
        return ServiceInfo.model_validate(resp.json())

    def through_restarts(self, read: Callable[[], _T], deadline: float = math.inf) -> _T:
        """`read()`, for a command that waits: a controller that does not answer (stopped,
        restarting) is waited for up to OUTAGE_SECONDS in a row (its work goes on after a
        restart), never past `deadline` (time.monotonic())."""
        down_since: float | None = None
        while True:
            try:
                return read()
            except TransientError:
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since >= OUTAGE_SECONDS or now >= deadline:
                    raise
                time.sleep(1.0)

    def _service_riding_outages(self, name: str, deadline: float) -> ServiceInfo:
        """The service's view, through a controller's restart (`through_restarts`)."""
        return self.through_restarts(lambda: self.service(name), deadline)

    def wait_gone(
        self, name: str, timeout: float = 120.0, purge: bool = False
    ) -> ServiceInfo | None:
        """Wait until `down` has removed the service; returns its last view if it stayed
        (FAILED_CLEANUP: its replicas could not be terminated; with `purge` the service goes
        anyway, so only the timeout ends the wait)."""
        start = time.monotonic()
        deadline = start + timeout
        last: ServiceInfo | None = None
        stale = False  # it was FAILED_CLEANUP before this `down` (a retry of the cleanup)
        first = True
        while time.monotonic() < deadline:
            try:
                last = self._service_riding_outages(name, deadline)
            except NotFound:
                return None
            failed = last.status == "FAILED_CLEANUP"
            stale = failed and (stale or first)
            first = False
            settled = not stale or time.monotonic() - start >= STALE_CLEANUP_SECONDS
            if failed and not purge and settled:
                return last
            time.sleep(0.3)
        return last

    # -- pools and jobs (docs/pools.md) -----------------------------------------------------

    def apply_pool(
        self,
        name: str,
        path: str | Path | None = None,
        workers: int | None = None,
        envs: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> PoolApplied:
        text = None
        if path is not None:
            text = _read_text(path)
        body = {
            "yaml": text,
            "workers": workers,
            "base_dir": current_folder(),
            "envs": dict(envs) if envs else None,
            "secrets": dict(secrets) if secrets else None,
        }
        resp = self._call("PUT", f"/pools/{name}", json=body)
        return PoolApplied.model_validate(resp.json())

    def pools(self, name: str | None = None) -> list[ServiceInfo]:
        if name is not None:
            return [ServiceInfo.model_validate(self._call("GET", f"/pools/{name}").json())]
        return [ServiceInfo.model_validate(p) for p in self._call("GET", "/pools").json()]

    def down_pool(self, name: str, purge: bool = False, cancel_jobs: bool = False) -> ServiceInfo:
        params = {"purge": purge, "cancel_jobs": cancel_jobs}
        resp = self._call("DELETE", f"/pools/{name}", params=params)
        return ServiceInfo.model_validate(resp.json())

    def launch_jobs(
        self,
        pool: str,
        path: str | Path,
        num_jobs: int = 1,
        envs: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> list[JobInfo]:
        text = _read_text(path)
        body = {"yaml": text, "num_jobs": num_jobs, "name": name, "envs": dict(envs or {})}
        resp = self._call("POST", f"/pools/{pool}/jobs", json=body)
        return [JobInfo.model_validate(j) for j in resp.json()]

    def jobs(self, pool: str | None = None, limit: int = 1000) -> list[JobInfo]:
        params: dict[str, Any] = {"limit": limit}
        if pool is not None:
            params["pool"] = pool
        return [JobInfo.model_validate(j) for j in self._call("GET", "/jobs", params=params).json()]

    def job(self, job_id: int) -> JobInfo:
        return JobInfo.model_validate(self._call("GET", f"/jobs/{job_id}").json())

    def cancel_jobs(
        self, job_ids: list[int] | None = None, pool: str | None = None
    ) -> list[JobInfo]:
        resp = self._call("POST", "/jobs/cancel", json={"job_ids": job_ids, "pool": pool})
        return [JobInfo.model_validate(j) for j in resp.json()]

    def job_logs(self, job_id: int, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        params: dict[str, Any] = {"follow": follow}
        if tail is not None:
            params["tail"] = tail
        return self._stream(f"/jobs/{job_id}/logs", params)

    def dashboard_link(self) -> str:
        """A login link to the dashboard with a one-time code (two minutes, one use)."""
        code = self._call("POST", "/dashboard/login-codes").json()["code"]
        return f"{self.url}/login#code={code}"

    def zones(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/zones").json()
        return result

    def chaos_preempt(
        self, name: str, replica_id: int | None = None, zone: str | None = None
    ) -> list[Preempted]:
        body = {"service": name, "replica_id": replica_id, "zone": zone}
        resp = self._call("POST", "/chaos/preempt", json=body)
        return [Preempted.model_validate(p) for p in resp.json()]

    def chaos_capacity(self, capacity: dict[str, int | None]) -> list[Preempted]:
        resp = self._call("POST", "/chaos/capacity", json={"capacity": capacity})
        return [Preempted.model_validate(p) for p in resp.json()]

    def terminate_replica(self, name: str, replica_id: int, purge: bool = False) -> None:
        self._call(
            "POST", f"/services/{name}/replicas/{replica_id}/terminate", params={"purge": purge}
        )

    def replica_logs(
        self, name: str, replica_id: int, follow: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        params: dict[str, Any] = {"follow": follow}
        if tail is not None:
            params["tail"] = tail
        return self._stream(f"/services/{name}/replicas/{replica_id}/logs", params)

    def component_logs(
        self,
        which: str,
        service: str | None = None,
        follow: bool = False,
        tail: int | None = None,
    ) -> Iterator[str]:
        """The controller's log (with `service`: only its lines that name it) or a service's
        load balancer's; the last `tail` lines, if given."""
        params: dict[str, Any] = {"follow": follow}
        if service:
            params["service"] = service
        if tail is not None:
            params["tail"] = tail
        return self._stream(f"/logs/{which}", params)

    def _stream(self, path: str, params: dict[str, Any]) -> Iterator[str]:
        self._ensure()
        headers = self._headers("GET", False)
        with self._http.stream("GET", path, params=params, timeout=None, headers=headers) as resp:
            if not resp.is_success:
                resp.read()
                _raise_for(resp, self._hint())
            yield from resp.iter_lines()
