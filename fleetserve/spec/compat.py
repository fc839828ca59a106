"""What a SkyServe YAML asks for that fleetserve cannot do here: warnings and refusals.

SkyPilot's YAML names clouds, regions, instance types and disks; fleetserve runs replicas on
its own infras (local processes, a Ray cluster). A field that only a cloud acts on is accepted
with one warning line, so a file moves over unchanged and nobody believes it took effect. A
field is refused only where running without it would run something other than what the YAML
says (a container image, a multi-node replica, secrets held by SkyPilot's server).

Both functions are pure: the caller finds out whether a container runtime is installed.
"""

from __future__ import annotations

from fleetserve.spec.models import FLEETSERVE_INFRAS, ResourcesBase, ServiceTask

# resources fields that only a cloud (or Kubernetes) acts on, with what they would choose.
_CLOUD_ONLY: tuple[tuple[str, str], ...] = (
    ("cloud", "a cloud"),
    ("region", "a region"),
    ("zone", "a zone"),
    ("instance_type", "an instance type"),
    ("disk_size", "a disk size"),
    ("ephemeral_storage", "a disk size"),
    ("disk_tier", "a disk tier"),
    ("local_disk", "a local disk"),
    ("network_tier", "a network tier"),
    ("max_hourly_cost", "a price cap for instances"),
    ("accelerator_args", "TPU settings"),
    ("labels", "instance labels"),
    ("autostop", "cluster autostop"),
    ("priority_class", "a Kubernetes priority class"),
    ("volumes", "cloud volumes"),
)


# Fields an infra of ours acts on although SkyPilot's clouds own them: the ray infra places
# a replica with `zone` on nodes that declare the custom resource `zone:<name>`.
_ACTED_ON: dict[str, frozenset[str]] = {"ray": frozenset({"zone"})}


def infra_kind(infra: str | None) -> str | None:
    """`ray/head` -> `ray`; None stays None."""
    return infra.split("/")[0] if infra else None


def _fields_set(spec: ServiceTask) -> list[tuple[str, ResourcesBase]]:
    """(path prefix, resources) for the top level and each any_of/ordered alternative."""
    out: list[tuple[str, ResourcesBase]] = [("resources", spec.resources)]
    for key in ("any_of", "ordered"):
        for i, alt in enumerate(getattr(spec.resources, key) or []):
            out.append((f"resources.{key}[{i}]", alt))
    return out


def _container_image(spec: ServiceTask) -> tuple[str, str] | None:
    """(field path, image) of the first `image_id: docker:...`, if any."""
    for where, res in _fields_set(spec):
        images = res.image_id if isinstance(res.image_id, dict) else {"": res.image_id}
        for image in images.values():
            if isinstance(image, str) and image.startswith("docker:"):
                return f"{where}.image_id", image
    return None


def compat_warnings(spec: ServiceTask, infra_name: str) -> list[str]:
    """One line per cloud-only field set in `spec`: it is accepted and has no effect on
    `infra_name`, the infra the replicas will run on."""
    lines: list[str] = []
    seen: set[str] = set(_ACTED_ON.get(infra_kind(infra_name) or "", ()))
    for where, res in _fields_set(spec):
        for field, what in _CLOUD_ONLY:
            value = getattr(res, field)
            if value is None or field in seen:
                continue
            seen.add(field)
            lines.append(f"{where}.{field}: no effect on the {infra_name} infra ({what}); ignored")
        kind = infra_kind(res.infra)
        if kind is not None and kind not in FLEETSERVE_INFRAS and "infra" not in seen:
            seen.add("infra")
            lines.append(
                f"{where}.infra: {res.infra!r} is not an infra here "
                f"({', '.join(FLEETSERVE_INFRAS)}); the replicas run on the {infra_name} infra"
            )
        if isinstance(res.image_id, str | dict) and "image_id" not in seen:
            images = res.image_id.values() if isinstance(res.image_id, dict) else [res.image_id]
            if not any(str(i).startswith("docker:") for i in images):
                seen.add("image_id")
                lines.append(
                    f"{where}.image_id: a VM image does not apply on the {infra_name} infra; "
                    "the run command runs on this machine's OS"
                )
    lines.extend(_nginx_warnings(spec))
    return lines


# What the nginx data plane does not do (fleetserve/lb/nginx.py): it balances by least_conn.
_NGINX_IGNORES = ("prefix_affinity", "cache_aware")


def _nginx_warnings(spec: ServiceTask) -> list[str]:
    """A policy the nginx data plane replaces by least_conn: accepted, said so."""
    service = spec.service
    if service.load_balancer.data_plane != "nginx":
        return []
    policy = service.load_balancing_policy
    if policy not in _NGINX_IGNORES:
        return []
    return [
        f"service.load_balancing_policy: {policy} is not applied by data_plane: nginx (it "
        "balances by least_conn, and its cache and prefix options have no effect); use "
        "data_plane: python for it"
    ]


def compat_errors(spec: ServiceTask, has_container_runtime: bool) -> list[str]:
    """One line per field that cannot run here, each saying why and what to do instead."""
    lines: list[str] = []
    if spec.num_nodes != 1:
        lines.append(f"num_nodes: multi-node replicas are not supported (got {spec.num_nodes})")
    image = _container_image(spec)
    if image is not None:
        where, ref = image
        if has_container_runtime:
            lines.append(
                f"{where}: {ref!r}: container images are not run yet; start the container in "
                "`run` (docker run ... -p $PORT:<port>) or remove image_id"
            )
        else:
            lines.append(
                f"{where}: {ref!r} needs a container runtime and neither docker nor podman is "
                "installed; install one and start the container in `run`, or remove image_id"
            )
    if spec.managed_secrets:
        lines.append(
            "secrets: the list form names secrets kept by SkyPilot's API server, which "
            "fleetserve does not have; give each as `secrets: {NAME: null}` and pass it with "
            "--secret NAME"
        )
    if spec.volume_mounts or spec.volumes:
        lines.append(
            "volumes: SkyPilot volumes are not mounted here; mount a local folder with "
            "file_mounts: {/mnt/data: ./data} instead"
        )
    return lines
