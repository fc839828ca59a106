"""SkyPilot's task variables (fleetserve.spec.task_env): their values with SkyPilot's meaning,
and what a replica and a pool's job are given."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fleetserve.controller.executor import launch_request
from fleetserve.controller.pools import job_envs
from fleetserve.core.status import ReplicaStatus
from fleetserve.core.types import JobRecord, JobStatus, ReplicaRecord
from fleetserve.spec.loader import parse_spec
from fleetserve.spec.task_env import accelerator_count, task_env


@pytest.mark.parametrize(
    ("accelerators", "count"),
    [
        (None, 0.0),
        ("L4", 1.0),
        ("A100:8", 8.0),
        ("tpu-v5e:0.5", 0.5),
        ({"L4": 1, "A10G": 2}, 1.0),
        ({"H100": None}, 1.0),
        (["A100:4", "H100:2"], 2.0),
    ],
)
def test_accelerator_counts(accelerators: object, count: float) -> None:
    assert accelerator_count(accelerators) == count


@pytest.mark.parametrize(
    ("resources", "gpus"),
    [
        ("", 0),
        ("resources: {accelerators: 'L4:2'}\n", 2),
        ("resources: {accelerators: 'tpu-v5e:0.5'}\n", 1),  # rounded up, as SkyPilot does
        ("resources: {accelerators: {A100: 8, H100: 8}}\n", 8),
        ("resources: {ordered: [{accelerators: 'A100:4'}, {accelerators: 'L4:1'}]}\n", 4),
    ],
)
def test_a_replica_is_launched_with_the_gpus_of_its_accelerators(
    resources: str, gpus: int, tmp_path: Path
) -> None:
    spec = parse_spec("service: {readiness_probe: /}\nrun: x\n" + resources)
    rec = ReplicaRecord(
        service="s", replica_id=1, version=1, status=ReplicaStatus.PENDING, launch_token="t"
    )
    assert launch_request(spec, rec, tmp_path).gpus == gpus


def test_the_variables_of_a_single_node_task() -> None:
    env = task_env("10.0.0.7", 4, "svc-3", "local", "local", "zone-a")
    assert env["SKYPILOT_NODE_RANK"] == "0" and env["SKYPILOT_NUM_NODES"] == "1"
    assert env["SKYPILOT_NODE_IPS"] == "10.0.0.7" == env["SKYPILOT_SETUP_NODE_IPS"]
    assert env["SKYPILOT_SETUP_NODE_RANK"] == "0"
    assert env["SKYPILOT_NUM_GPUS_PER_NODE"] == "4" == env["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"]
    assert env["SKYPILOT_USER"]
    assert re.fullmatch(r"sky-\d{4}(-\d\d){5}-\d{6}_svc-3_1", env["SKYPILOT_TASK_ID"])
    info = json.loads(env["SKYPILOT_CLUSTER_INFO"])
    assert info == {"cluster_name": "svc-3", "cloud": "local", "region": "local", "zone": "zone-a"}


def test_a_job_gets_its_workers_address_and_gpus_and_its_own_envs_win(tmp_path: Path) -> None:
    spec = parse_spec("pool: {workers: 1}\nresources: {accelerators: 'H100:2'}\n")
    job = JobRecord(
        job_id=12,
        pool="p",
        batch=1,
        rank=0,
        num_jobs=1,
        status=JobStatus.PENDING,
        run="x",
        envs_json=json.dumps({"SKYPILOT_NUM_GPUS_PER_NODE": "1"}),
        worker_id=2,
    )
    worker = ReplicaRecord(
        service="p",
        replica_id=2,
        version=1,
        status=ReplicaStatus.READY,
        endpoint="http://10.1.2.3:8000",
        infra="ray",
    )
    envs = job_envs(spec, job, tmp_path, worker)
    assert envs["SKYPILOT_NODE_IPS"] == "10.1.2.3" and envs["SKYPILOT_NODE_RANK"] == "0"
    assert envs["SKYPILOT_NUM_NODES"] == "1"
    assert envs["SKYPILOT_NUM_GPUS_PER_NODE"] == "1"  # the job's own --env
    assert envs["SKYPILOT_TASK_ID"].endswith("_p-2_12")
    assert json.loads(envs["SKYPILOT_CLUSTER_INFO"])["cloud"] == "ray"
    job = JobRecord(**{**job.__dict__, "envs_json": "{}"})
    assert job_envs(spec, job, tmp_path, worker)["SKYPILOT_NUM_GPUS_PER_NODE"] == "2"
