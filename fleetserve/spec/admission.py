"""What `up` checks beyond the YAML's own rules: can this infra run this service, and where
do its relative paths point. The controller checks them at `up` and `update`; `fleetserve
validate` predicts them (deploy_problems) on the CLI's machine."""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path

from fleetserve.core.errors import InvalidSpec
from fleetserve.oshelpers import netcaps
from fleetserve.spec.compat import compat_errors
from fleetserve.spec.loader import require_values
from fleetserve.spec.models import FLEETSERVE_INFRAS, ServiceTask, WorkdirGit

_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_REMOTE = re.compile(r"^[a-z][a-z0-9+.-]*://")
SUPPORTED_INFRAS = FLEETSERVE_INFRAS


def _as_service_name(task_name: str) -> str | None:
    """`Llama_3.1-8B` -> `llama-3-1-8b`; None when nothing of it makes a service name."""
    text = re.sub(r"[^a-z0-9]+", "-", task_name.lower())
    text = re.sub(r"^[^a-z]+", "", text)[:63].rstrip("-")
    return text if _NAME.fullmatch(text) else None


def has_container_runtime() -> bool:
    return shutil.which("docker") is not None or shutil.which("podman") is not None


def service_name(requested: str | None, spec: ServiceTask) -> str:
    """The name given, else the YAML's `name` made a service name (SkyPilot's task names also
    take capitals, `_` and `.`, and `sky serve up` never refuses a file for its task name),
    else SkyServe's default `sky-service-<4 hex>`."""
    name = requested or (spec.name and _as_service_name(spec.name))
    name = name or f"sky-service-{secrets.token_hex(2)}"
    if not _NAME.fullmatch(name):
        raise InvalidSpec(
            f"service name {name!r}: use 1-63 lowercase letters, digits and '-', starting with a "
            "letter and not ending with '-'"
        )
    return name


def check_deployable(spec: ServiceTask, infra: str = "local", netns_mode: str = "auto") -> None:
    """Refuse what cannot run here (values still missing, compat.compat_errors, then this
    infra's own rules)."""
    require_values(spec)
    errors = compat_errors(spec, has_container_runtime())
    if errors:
        raise InvalidSpec("\n".join(errors))
    _infra_rules(spec, infra, netns_mode)


def deploy_problems(
    spec: ServiceTask, infra: str = "local", netns_mode: str = "auto", base_dir: Path | None = None
) -> list[str]:
    """Everything `up` (or `pool apply`) would refuse in a valid spec, one line each, without
    starting anything: compat.compat_errors, this infra's rules and the paths (workdir,
    file_mounts, tls files, relative to `base_dir`). `validate` prints them and `--strict`
    fails on them, so that strict predicts `up`."""
    problems = list(compat_errors(spec, has_container_runtime()))
    for check in (
        lambda: _infra_rules(spec, infra, netns_mode),
        lambda: resolve_paths(spec, base_dir or Path.cwd()),
    ):
        try:
            check()
        except InvalidSpec as e:
            problems.append(e.message)
    return problems


def _infra_rules(spec: ServiceTask, infra: str, netns_mode: str) -> None:
    wanted = spec.requested_infra()
    if spec.service.pool is not None:
        return  # a pool has no `run` of its own: jobs bring theirs (local and ray)
    if not spec.run:
        raise InvalidSpec("run: a service needs a `run` command that starts the server on $PORT")
    if spec.service.load_balancer.data_plane == "nginx" and shutil.which("nginx") is None:
        raise InvalidSpec(
            "service.load_balancer.data_plane: nginx is not installed on this machine "
            "(apt-get install nginx-light), or use the default python data plane"
        )
    where = (wanted or infra).split("/")[0]
    if isinstance(spec.workdir, WorkdirGit) and where != "local":
        raise InvalidSpec(
            f"workdir: a git repository ({{url, ref}}) is cloned on the local infra only, "
            f"not on {where}; use a folder"
        )
    _lo, hi = spec.service.replica_bounds()
    port = spec.replica_port()
    local = (wanted or infra).split("/")[0] == "local"
    if local and port is not None and hi > 1 and netcaps.kind(netns_mode) is None:
        raise InvalidSpec(
            f"the spec fixes port {port} and asks for up to {hi} replicas: on the local infra "
            f"each replica then runs in a network namespace of its own, which needs root and "
            f"iproute2 (`ip netns`) or, as a normal user, unprivileged user namespaces, and "
            f"neither is possible here ({netcaps.MODE_ENV}={netns_mode}), so port {port} can be "
            "bound only once. Run the controller as root, allow user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1), or remove `ports` (from service and resources) "
            "and make the run command listen on $PORT, which fleetserve sets to a free port for "
            "each replica"
        )


def resolve_paths(spec: ServiceTask, base_dir: Path) -> ServiceTask:
    """Make workdir, file_mounts sources and tls files absolute. `base_dir` is the folder the
    caller ran `fleetserve up` in (SkyPilot's meaning of a relative path), not the YAML's."""
    changes: dict[str, object] = {}
    if isinstance(spec.workdir, WorkdirGit):
        for field, value in (("url", spec.workdir.url), ("ref", spec.workdir.ref)):
            if value is not None and (value.startswith("-") or not value.strip()):
                raise InvalidSpec(f"workdir.{field}: must not be empty or start with '-'")
    elif spec.workdir:
        wd = (base_dir / Path(spec.workdir).expanduser()).resolve()
        if not wd.is_dir():
            raise InvalidSpec(f"workdir: {wd} is not a directory")
        changes["workdir"] = str(wd)
    mounts: dict[str, str] = {}
    for dest, src in spec.file_mounts.items():
        if not isinstance(src, str) or _REMOTE.match(src):
            raise InvalidSpec(
                f"file_mounts.{dest}: only local files and folders can be mounted on the local "
                f"infra (got {src!r})"
            )
        path = (base_dir / Path(src).expanduser()).resolve()
        if not path.exists():
            raise InvalidSpec(f"file_mounts.{dest}: {path} does not exist")
        mounts[dest] = str(path)
    if mounts:
        changes["file_mounts"] = mounts
    tls = spec.service.tls
    if tls is not None:
        paths = {}
        for field in ("keyfile", "certfile"):
            path = (base_dir / Path(getattr(tls, field)).expanduser()).resolve()
            if not path.is_file():
                raise InvalidSpec(f"service.tls.{field}: {path} is not a file")
            paths[field] = str(path)
        service = spec.service.model_copy(update={"tls": tls.model_copy(update=paths)})
        changes["service"] = service
    return spec.model_copy(update=changes) if changes else spec
