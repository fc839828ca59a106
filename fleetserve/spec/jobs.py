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
MAX_ENV_BYTES = 128 * 1024  # one NAME=value, as the kernel allows it
_IGNORED = {
    "setup": "the pool's workers ran the pool's setup",
    "workdir": "a job runs in its worker's working folder (the pool's workdir)",
    "file_mounts": "the pool's workers have the pool's file mounts",
    "num_nodes": "a job runs on one worker",
    "config": "no effect on a pool's job",
}
_KNOWN = {"name", "run", "envs", "secrets", "resources", *_IGNORED}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*\+?\s*$")


@dataclass(frozen=True)
class JobSpec:
    run: str
    name: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # What the job asks of a worker (`resources: {cpus, accelerators}`): packing.
    cpus: float | None = None
    accelerators: float | None = None


def amount(value: Any) -> float | None:
    """A count from `cpus: 2`, `"2+"`, or an accelerator spec (`A100:2`, `{H100: 1}`)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict):
        counts = [amount(v) if v is not None else 1.0 for v in value.values()]
        known = [c for c in counts if c is not None]
        return min(known) if known else None
    if isinstance(value, list):
        return amount(value[0]) if value else None
    text = str(value)
    if ":" in text:
        return amount(text.rsplit(":", 1)[1])
    m = _AMOUNT.match(text)
    if m:
        return float(m.group(1))
    return 1.0 if text.strip() else None  # an accelerator name alone: one of it


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
    if run is not None and not isinstance(run, str):
        raise InvalidSpec(f"{source}: run: must be a string of commands (got {run!r}; quote it)")
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
    for k, v in merged.items():
        # The kernel refuses to start a process with one `NAME=value` this long (MAX_ARG_STRLEN).
        if len(k.encode()) + len(v.encode()) + 1 >= MAX_ENV_BYTES:
            raise InvalidSpec(f"{source}: envs.{k}: a value of at most {MAX_ENV_BYTES - 2} bytes")
    notes = [f"{k}: ignored ({why})" for k, why in _IGNORED.items() if data.get(k) is not None]
    res = data.get("resources")
    if res is not None and not isinstance(res, dict):
        raise InvalidSpec(f"{source}: resources must be a mapping (cpus, accelerators)")
    res = res or {}
    cpus = _amount_of(res.get("cpus"), "resources.cpus", source)
    if res.get("accelerators") is not None:
        accelerators = _amount_of(res.get("accelerators"), "resources.accelerators", source)
    else:
        accelerators = None
    others = sorted(k for k in res if k not in ("cpus", "accelerators"))
    if others:
        notes.append(f"resources.{others[0]}: ignored (jobs are packed by cpus and accelerators)")
    return JobSpec(
        run=run, name=name, envs=merged, notes=notes, cpus=cpus, accelerators=accelerators
    )


def _amount_of(value: Any, field_name: str, source: str) -> float | None:
    try:
        n = amount(value)
    except (ValueError, TypeError):
        n = None
    if value is not None and (n is None or not 0 < n <= 1e6):
        raise InvalidSpec(f"{source}: {field_name}: {value!r} is not a positive amount")
    return n
