"""SkyPilot's task environment variables, with SkyPilot's meanings, for replicas, pool workers
and jobs (docs/skyserve.md lists them).

SkyPilot exports these to a task's `setup` and `run` (docs/source/running-jobs/
environment-variables.rst; sky/backends/task_codegen.py and cloud_vm_ray_backend.py;
sky/skylet/constants.py; read in SkyPilot 0.14.1).
A fleetserve replica, worker or job is a single-node task: rank 0 of 1 node, whose address is
the only line of the node IPs. SKYPILOT_NUM_GPUS_PER_NODE is the count of the replica's
accelerators, rounded up (SkyPilot: "the same as the count in `accelerators: <name>:<count>`
(rounded up if a fraction)"), 0 with none.
"""

from __future__ import annotations

import datetime
import getpass
import json
import math
import os
import re

from fleetserve.spec.models import ResourcesBase, ServiceTask

NODE_RANK = "SKYPILOT_NODE_RANK"
NODE_IPS = "SKYPILOT_NODE_IPS"
NUM_NODES = "SKYPILOT_NUM_NODES"
NUM_GPUS_PER_NODE = "SKYPILOT_NUM_GPUS_PER_NODE"
SETUP_NODE_RANK = "SKYPILOT_SETUP_NODE_RANK"
SETUP_NODE_IPS = "SKYPILOT_SETUP_NODE_IPS"
SETUP_NUM_GPUS_PER_NODE = "SKYPILOT_SETUP_NUM_GPUS_PER_NODE"
USER = "SKYPILOT_USER"  # who launched it
TASK_ID = "SKYPILOT_TASK_ID"
CLUSTER_INFO = "SKYPILOT_CLUSTER_INFO"
SERVE_REPLICA_ID = "SKYPILOT_SERVE_REPLICA_ID"

_COUNT = re.compile(r"^\s*(\d+(\.\d+)?)\s*$")


def accelerator_count(accelerators: object) -> float:
    """How many accelerators `accelerators` asks for: `L4:2` -> 2, `L4` -> 1, a list or a
    dict of alternatives (`{L4: 1, A10G: 1}`) -> the fewest any of them has; none -> 0."""
    if accelerators is None:
        return 0.0
    if isinstance(accelerators, dict):
        counts = [float(v) if v is not None else 1.0 for v in accelerators.values()]
        return min(counts) if counts else 0.0
    if isinstance(accelerators, list):
        counts = [accelerator_count(a) for a in accelerators]
        return min(counts) if counts else 0.0
    _, _, count = str(accelerators).partition(":")
    m = _COUNT.match(count)
    return float(m.group(1)) if m else 1.0


def gpus_per_node(resources: ResourcesBase | None) -> int:
    """SKYPILOT_NUM_GPUS_PER_NODE for a replica with these resources (rounded up)."""
    if resources is None:
        return 0
    return math.ceil(accelerator_count(resources.accelerators))


def spec_gpus(spec: ServiceTask) -> int:
    """The replica's GPUs: its first (preferred) resources alternative's accelerators, the
    one the ray infra places it by."""
    return gpus_per_node(spec.resources.candidates()[0])


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        return str(os.getuid())


def task_id(cluster: str, when: datetime.datetime | None = None, job: int = 1) -> str:
    """SkyPilot's form: `sky-<YYYY-MM-DD-HH-MM-SS-ffffff>_<cluster>_<job id>`."""
    stamp = (when or datetime.datetime.now()).strftime("%Y-%m-%d-%H-%M-%S-%f")
    return f"sky-{stamp}_{cluster}_{job}"


def task_env(
    node_ip: str,
    gpus: int,
    cluster: str,
    cloud: str,
    region: str | None = None,
    zone: str | None = None,
    job: int = 1,
) -> dict[str, str]:
    """SkyPilot's variables for a single-node task on `node_ip` (set for setup and run)."""
    info = {"cluster_name": cluster, "cloud": cloud, "region": region, "zone": zone}
    return {
        NODE_RANK: "0",
        NODE_IPS: node_ip,
        NUM_NODES: "1",
        NUM_GPUS_PER_NODE: str(gpus),
        SETUP_NODE_RANK: "0",
        SETUP_NODE_IPS: node_ip,
        SETUP_NUM_GPUS_PER_NODE: str(gpus),
        USER: _user(),
        TASK_ID: task_id(cluster, job=job),
        CLUSTER_INFO: json.dumps(info, sort_keys=True),
    }
