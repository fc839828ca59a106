"""A job YAML for a worker pool (`fleetserve jobs launch -p POOL job.yaml`): SkyPilot's task
format, of which a pool's job uses `name`, `run` and `envs` (and `secrets`); what the pool's
workers already did (setup, workdir, file mounts, resources) is noted and ignored."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.yaml_bounded import read_yaml

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_RUN_CHARS = 256 * 1024
_IGNORED = {
    "setup": "the pool's workers ran the pool's setup",
    "workdir": "a job runs in its worker's working folder (the pool's workdir)",
    "file_mounts": "the pool's workers have the pool's file mounts",
    "resources": "a job takes one worker (the pool's resources)",
    "num_nodes": "a job runs on one worker",
    "config": "no effect on a pool's job",
}
_KNOWN = {"name", "run", "envs", "secrets", *_IGNORED}


@dataclass(frozen=True)
class JobSpec:
    run: str
    name: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _env_block(data: Mapping[str, Any], key: str, source: str) -> dict[str, str]:
    block = data.get(key)
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise InvalidSpec(f"{source}: {key} must be a mapping of NAME: value")
    out: dict[str, str] = {}
    for k, v in block.items():
        if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
            raise InvalidSpec(f"{source}: {key}.{k}: not a variable name")
        if isinstance(v, dict | list):
            raise InvalidSpec(f"{source}: {key}.{k}: must be a string or a number")
        out[k] = "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return out


def parse_job(
    text: str, envs: Mapping[str, str] | None = None, source: str = "job YAML"
) -> JobSpec:
    """The job in `text`, with `envs` (`--env`) over its own; InvalidSpec names what is wrong."""
    data = read_yaml(text, source)
    if not isinstance(data, dict):
        raise InvalidSpec(f"{source}: a job YAML is a mapping (name, run, envs)")
    for key in ("service", "pool"):
        if data.get(key) is not None:
            raise InvalidSpec(
                f"{source}: {key}: a job YAML has no {key} section (that is the pool's YAML; "
                "`fleetserve pool apply` takes it)"
            )
    unknown = sorted(str(k) for k in data if k not in _KNOWN)
    if unknown:
        raise InvalidSpec(f"{source}: unknown field {unknown[0]!r} (a job has name, run, envs)")
    run = data.get("run")
    if not isinstance(run, str) or not run.strip():
        raise InvalidSpec(f"{source}: run: a job needs a `run` command")
    if len(run) > MAX_RUN_CHARS:
        raise InvalidSpec(f"{source}: run: longer than {MAX_RUN_CHARS} characters")
    name = data.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > 128):
        raise InvalidSpec(f"{source}: name: a string of at most 128 characters")
    merged = {**_env_block(data, "envs", source), **_env_block(data, "secrets", source)}
    for k, v in (envs or {}).items():
        if not _ENV_NAME.fullmatch(k):
            raise InvalidSpec(f"--env {k}: not a variable name")
        merged[k] = v
    notes = [f"{k}: ignored ({why})" for k, why in _IGNORED.items() if data.get(k) is not None]
    return JobSpec(run=run, name=name, envs=merged, notes=notes)
