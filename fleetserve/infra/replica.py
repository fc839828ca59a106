"""What every infra gives a replica, written once: its environment (`replica_env`) and its
folder (`replica_layout`, `create_replica_dir`). The local infra and the ray infra (in its
actor, on the node) both build a replica from these, so the two cannot drift apart.

The environment: the infra's own (the controller's on the local infra, the Ray worker's on a
node), the spec's `envs`, then fleetserve's variables (the port, the KV cache events ports,
the replica's id, service and version, SkyPilot's task variables) and PYTHONUNBUFFERED=1
unless the spec or the environment sets it. Where the infras genuinely differ
(tests/unit/infra/test_replica.py pins it):

- the local infra adds FLEETSERVE_LAUNCH_TOKEN and FLEETSERVE_HOME_ID, by which it finds,
  adopts and stops a replica's processes (fleetserve.oshelpers.procs); a Ray replica is found
  by its actor's name, which holds the launch token;
- SkyPilot's task variables (fleetserve.spec.task_env) name where the replica runs: the local
  infra's cloud `local`, region `local`, the placed zone and this machine's address (or the
  replica's own, in a network namespace); the ray infra's cloud `ray`, no region, and the
  node's address, which only the node knows. SKYPILOT_NUM_GPUS_PER_NODE is the GPUs Ray
  reserves for the actor (rounded up) on ray, the spec's count locally.

The folder, `<root>/<service>/<replica id>` (root: `<home>/replicas` locally, the ray infra's
`root` on each node), made afresh and readable by its owner only: `workdir/` (a copy of the
spec's workdir, which must be a directory: the ray infra copies it from the same path on the
node), `setup.sh`, `run.sh`, and `setup.done` once setup succeeded. The local infra adds its
wrapper `entry.sh`, the run's `exit_code` and the git and file_mounts sources (the ray infra
refuses a git workdir at `up` and does not ship file mounts: docs/ray.md); its log is in
`<home>/logs`, a Ray replica's in its folder (`replica.log`).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fleetserve.core.errors import TerminalError
from fleetserve.core.types import ReplicaId
from fleetserve.infra.base import FileMount
from fleetserve.infra.git import GitSource, clone
from fleetserve.infra.kv_ports import kv_events_env


def replica_env(
    base: Mapping[str, str],
    *,
    envs: Mapping[str, str],
    port: int,
    service: str,
    replica_id: ReplicaId,
    version: int,
    task: Mapping[str, str],
) -> dict[str, str]:
    """A replica's environment (pure): `base` (the infra's own environment), the spec's `envs`,
    then fleetserve's variables and SkyPilot's task variables `task` on top."""
    env = dict(base)
    env.update(envs)
    env.update(
        {
            "PORT": str(port),
            # cache_aware's precise mode: where the replica publishes its KV cache events (the
            # load balancer derives them from its URL: fleetserve.lb.kv_events).
            **kv_events_env(port),
            "FLEETSERVE_REPLICA_ID": str(replica_id),
            "SKYPILOT_SERVE_REPLICA_ID": str(replica_id),
            **task,
            "FLEETSERVE_SERVICE": service,
            "FLEETSERVE_VERSION": str(version),
            "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
        }
    )
    return env


@dataclass(frozen=True)
class ReplicaLayout:
    """A replica's folder and the files in it (see the module's docstring)."""

    dir: Path

    @property
    def workdir(self) -> Path:
        return self.dir / "workdir"

    @property
    def setup_script(self) -> Path:
        return self.dir / "setup.sh"

    @property
    def run_script(self) -> Path:
        return self.dir / "run.sh"

    @property
    def setup_done(self) -> Path:
        """Made once setup succeeded: `run` has started."""
        return self.dir / "setup.done"

    @property
    def exit_code(self) -> Path:
        """The run's exit code, where the infra records it (local: its wrapper writes it)."""
        return self.dir / "exit_code"


def replica_layout(root: Path, service: str, replica_id: ReplicaId) -> ReplicaLayout:
    """Where a replica's folder is under `root` (pure)."""
    return ReplicaLayout(root / service / str(replica_id))


def create_replica_dir(
    layout: ReplicaLayout,
    *,
    run: str,
    setup: str | None = None,
    workdir: Path | None = None,
    workdir_git: GitSource | None = None,
    file_mounts: tuple[FileMount, ...] = (),
) -> None:
    """Make the replica's folder afresh (0700; one left by an earlier, cut-short launch of this
    replica is removed): its workdir (cloned, a copy of `workdir`, or empty), the file mounts,
    setup.sh and run.sh. TerminalError names a workdir that is not a directory or a file_mounts
    source that does not exist."""
    rdir = layout.dir
    if rdir.exists():
        shutil.rmtree(rdir)
    rdir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    rdir.mkdir(mode=0o700)
    rdir.chmod(0o700)
    dest = layout.workdir
    if workdir_git is not None:
        clone(workdir_git, dest)
    elif workdir is not None:
        if not workdir.is_dir():
            raise TerminalError(f"workdir {workdir} is not a directory")
        shutil.copytree(workdir, dest, symlinks=True)
    else:
        dest.mkdir(parents=True)
    for mount in file_mounts:
        target = dest / mount.dest.removeprefix("~/").lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if mount.source.is_dir():
            shutil.copytree(mount.source, target, symlinks=True, dirs_exist_ok=True)
        elif mount.source.is_file():
            shutil.copy2(mount.source, target)
        else:
            raise TerminalError(f"file_mounts source {mount.source} does not exist")
    layout.setup_script.write_text(setup or "")
    layout.run_script.write_text(run)
