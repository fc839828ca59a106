"""compat_warnings / compat_errors: what a SkyServe YAML asks for that does not apply here."""

from __future__ import annotations

import pytest

from fleetserve.spec import parse_spec
from fleetserve.spec.admission import check_deployable
from fleetserve.spec.compat import compat_errors, compat_warnings

HEAD = "service:\n  readiness_probe: /\nrun: python -m http.server $PORT\n"


@pytest.mark.parametrize(
    ("extra", "fields"),
    [
        ("", []),
        ("resources: {cpus: 2+, memory: 4+, ports: 8080}\n", []),
        ("resources: {infra: local}\n", []),
        ("resources: {infra: ray}\n", []),
        ("resources: {cloud: gcp}\n", ["resources.cloud"]),
        ("resources: {infra: gcp}\n", ["resources.infra"]),
        ("resources: {infra: aws/us-east-1}\n", ["resources.infra"]),
        ("resources: {infra: kubernetes}\n", ["resources.infra"]),
        (
            "resources: {region: us-east-1, zone: us-east-1a}\n",
            ["resources.region", "resources.zone"],
        ),
        ("resources: {instance_type: n2-standard-8}\n", ["resources.instance_type"]),
        (
            "resources: {disk_size: 256, disk_tier: best}\n",
            ["resources.disk_size", "resources.disk_tier"],
        ),
        (
            "resources: {max_hourly_cost: 2.5, local_disk: nvme}\n",
            ["resources.local_disk", "resources.max_hourly_cost"],
        ),
        (
            "resources: {ephemeral_storage: 10, priority_class: high}\n",
            ["resources.ephemeral_storage", "resources.priority_class"],
        ),
        ("resources: {image_id: projects/x/images/y}\n", ["resources.image_id"]),
        # one line per field, however many alternatives set it
        (
            "resources:\n  any_of: [{cloud: aws}, {cloud: gcp, region: r}]\n",
            ["resources.any_of[0].cloud", "resources.any_of[1].region"],
        ),
    ],
)
def test_each_cloud_only_field_gives_one_warning_line(extra: str, fields: list[str]) -> None:
    spec = parse_spec(HEAD + extra)
    lines = compat_warnings(spec, "local")
    assert [line.split(":")[0] for line in lines] == fields
    assert all("local infra" in line for line in lines)
    assert compat_errors(spec, has_container_runtime=True) == []


@pytest.mark.parametrize(
    ("extra", "runtime", "words"),
    [
        ("resources: {image_id: 'docker:vllm/vllm-openai'}\n", False, "neither docker nor podman"),
        (
            "resources: {image_id: 'docker:vllm/vllm-openai'}\n",
            True,
            "container images are not run yet",
        ),
        ("resources: {image_id: {us-east-1: 'docker:x'}}\n", True, "resources.image_id"),
        ("resources:\n  any_of: [{image_id: 'docker:x'}]\n", False, "resources.any_of[0].image_id"),
        ("num_nodes: 2\n", True, "multi-node replicas are not supported (got 2)"),
        ("secrets: [HF_TOKEN]\n", True, "--secret NAME"),
        ("volumes: {/mnt/data: my-pvc}\n", True, "file_mounts"),
        ("volume_mounts: [{path: /mnt, volume_name: v}]\n", True, "file_mounts"),
    ],
)
def test_what_cannot_run_here_is_refused_with_the_fix(
    extra: str, runtime: bool, words: str
) -> None:
    spec = parse_spec(HEAD + extra)
    errors = compat_errors(spec, has_container_runtime=runtime)
    assert len(errors) == 1
    assert words in errors[0]


def test_a_pool_runs_on_the_local_and_ray_infras() -> None:
    spec = parse_spec("service:\n  pool: {workers: 2}\n")
    assert compat_errors(spec, has_container_runtime=False) == []
    check_deployable(spec, "local")
    check_deployable(spec, "ray")


def test_a_field_the_ray_infra_acts_on_is_not_called_ignored_there() -> None:
    spec = parse_spec(HEAD + "resources: {zone: us-east-1a, cloud: aws}\n")
    assert [w.split(":")[0] for w in compat_warnings(spec, "ray")] == ["resources.cloud"]
    assert [w.split(":")[0] for w in compat_warnings(spec, "local")] == [
        "resources.cloud",
        "resources.zone",
    ]


def test_a_git_workdir_runs_here() -> None:
    """Cloned at launch on the local infra (fleetserve.infra.git): not a compat refusal."""
    spec = parse_spec(HEAD + "workdir: {url: 'https://github.com/x/y.git', ref: main}\n")
    assert compat_errors(spec, has_container_runtime=False) == []


@pytest.mark.parametrize(
    ("policy", "plane", "warned"),
    [
        ("cache_aware", "nginx", True),
        ("prefix_affinity", "nginx", True),
        ("cache_aware", "python", False),
        ("least_load", "nginx", False),
    ],
)
def test_a_cache_policy_under_nginx_is_said_to_be_least_conn(
    policy: str, plane: str, warned: bool
) -> None:
    spec = parse_spec(
        f"service:\n  readiness_probe: /\n  load_balancing_policy: {policy}\n"
        f"  load_balancer: {{data_plane: {plane}}}\nrun: python -m http.server $PORT\n"
    )
    lines = [w for w in compat_warnings(spec, "local") if w.startswith("service.")]
    assert bool(lines) is warned
    if warned:
        assert f"{policy} is not applied by data_plane: nginx" in lines[0]
        assert "least_conn" in lines[0]
