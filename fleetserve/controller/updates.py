"""Updates: a new version of a service's spec, rolled out, rolled back or promoted.

`apply_update` validates the new YAML completely before it writes anything: a rejected update
leaves the service as it was and no version row behind. A change to the `service` section
alone (no workdir or file_mounts) moves the running replicas to the new version in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetserve.core.errors import Conflict, InvalidSpec
from fleetserve.core.types import ServicePhase, ServiceRecord
from fleetserve.policies.rollout import BLUE_GREEN, UPDATE_MODES
from fleetserve.spec.admission import check_deployable, resolve_paths
from fleetserve.spec.loader import parse_spec
from fleetserve.spec.models import ServiceTask
from fleetserve.store import Store


def _task_fields(spec: ServiceTask) -> dict[str, Any]:
    """The spec less its `service` section, with `any_of` compared without regard to order."""
    d = spec.model_dump(exclude={"service"}, mode="json")
    any_of = d.get("resources", {}).get("any_of")
    if any_of:
        d["resources"]["any_of"] = sorted(any_of, key=lambda x: repr(sorted(x.items())))
    return d


def reusable(old: ServiceTask, new: ServiceTask) -> bool:
    """Whether running replicas of `old` can serve `new` as they are (SkyServe's rule)."""
    if new.workdir or new.file_mounts:
        return False
    return _task_fields(old) == _task_fields(new)


def apply_update(
    store: Store,
    svc: ServiceRecord,
    current: ServiceTask,
    yaml_text: str,
    base_dir: Path,
    mode: str,
    traffic_percent: int | None,
    infra: str,
    now: float,
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
    netns_mode: str = "auto",
    force_in_place: bool = False,
) -> tuple[ServiceRecord, bool]:
    """Store the new version and start its rollout; returns (service, moved in place).
    `force_in_place`: the replicas move as they are (`pool apply --workers N`: only the size
    changed, whatever the workdir)."""
    if svc.phase is ServicePhase.SHUTTING_DOWN:
        raise Conflict(f"service {svc.name!r} is shutting down")
    if mode not in UPDATE_MODES:
        raise InvalidSpec(f"--mode {mode!r}: use {' or '.join(UPDATE_MODES)}")
    if traffic_percent is not None and not 1 <= traffic_percent <= 99:
        raise InvalidSpec("--traffic-percent must be between 1 and 99")
    if traffic_percent is not None and mode == BLUE_GREEN:
        raise InvalidSpec(
            "a canary (--traffic-percent) is a rolling update; drop --mode blue_green"
        )
    # A rollout whose version stopped launching (it crash-looped) is over: a new version
    # replaces it (as SkyServe takes an update over a failed one); one still in progress is not.
    superseding = svc.rolling_out and svc.launch_stop is not None
    if svc.rolling_out and not superseding:
        raise Conflict(
            f"service {svc.name!r} is still rolling out version {svc.active_version}: wait, "
            f"`fleetserve promote` it, or `fleetserve rollback` first"
        )
    spec = parse_spec(yaml_text, envs=envs, secrets=secrets)
    check_deployable(spec, infra, netns_mode)
    spec = resolve_paths(spec, base_dir)
    if (spec.service.tls is None) != (current.service.tls is None) or (
        spec.service.tls and current.service.tls and spec.service.tls != current.service.tls
    ):
        raise InvalidSpec("service.tls cannot be changed by an update (take the service down)")
    # (over a failed version, from the version that serves: `current` is the failed one)
    in_place = (
        not superseding and traffic_percent is None and (force_in_place or reusable(current, spec))
    )
    version = store.add_version(svc.name, yaml_text, spec.model_dump_json(), now)
    if superseding:
        store.add_event(
            svc.name,
            now,
            "rollout",
            f"version {svc.active_version} failed and is dropped: version {version} replaces "
            f"it, from version {svc.serving_version}",
        )
    if in_place:
        for r in store.list_replicas(svc.name):
            if not r.status.is_terminal:
                store.update_replica(
                    r, now, f"moved to version {version} in place", version=version
                )
        store.add_event(
            svc.name,
            now,
            "rollout",
            f"version {version}: service section only, replicas moved in place",
        )
        return store.update_service(
            svc.name,
            now,
            active_version=version,
            stable_version=version,
            previous_version=svc.serving_version,
            update_mode=None,
            traffic_percent=None,
            launch_stop=None,
            lb_error=None,
        ), True
    label = f"canary at {traffic_percent}%" if traffic_percent is not None else mode
    store.add_event(svc.name, now, "rollout", f"version {version}: {label} update started")
    return store.update_service(
        svc.name,
        now,
        active_version=version,
        stable_version=svc.serving_version,
        update_mode=mode,
        traffic_percent=traffic_percent,
        launch_stop=None,
        lb_error=None,
    ), False


def rollback(store: Store, svc: ServiceRecord, now: float) -> ServiceRecord:
    """Back to the version that served before: stop a rollout in progress (or failed), or roll
    out the previous version again after a finished one."""
    if svc.rolling_out:
        target, what = svc.serving_version, f"rollout of version {svc.active_version} abandoned"
        store.add_event(svc.name, now, "rollout", f"{what}: version {target} serves")
        return store.update_service(
            svc.name,
            now,
            active_version=target,
            update_mode=None,
            traffic_percent=None,
            launch_stop=None,
            lb_error=None,
        )
    if svc.previous_version is None:
        raise Conflict(f"service {svc.name!r} has no earlier version to roll back to")
    target = svc.previous_version
    store.add_event(svc.name, now, "rollout", f"rolling back to version {target}")
    return store.update_service(
        svc.name,
        now,
        active_version=target,
        stable_version=svc.serving_version,
        update_mode="rolling",
        traffic_percent=None,
        launch_stop=None,
        lb_error=None,
    )


def promote(store: Store, svc: ServiceRecord, now: float) -> ServiceRecord:
    """End a canary: the new version takes over by a rolling update."""
    if svc.traffic_percent is None or not svc.rolling_out:
        raise Conflict(f"service {svc.name!r} has no canary to promote")
    store.add_event(svc.name, now, "rollout", f"canary version {svc.active_version} promoted")
    return store.update_service(svc.name, now, traffic_percent=None)
