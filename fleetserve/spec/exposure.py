"""Where a service's endpoint listens, and whether that exposes it beyond this machine."""

from __future__ import annotations

import ipaddress

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.models import ServiceTask

LOOPBACK = "127.0.0.1"
EVERY_ADDRESS = ("0.0.0.0", "::")


def lb_host(spec: ServiceTask, infra: str) -> str:
    """`service.load_balancer.host`, else 127.0.0.1 on the local infra and 0.0.0.0 when the
    replicas run on Ray (other machines' clients are the point there)."""
    if spec.service.load_balancer.host is not None:
        return spec.service.load_balancer.host
    return "0.0.0.0" if (spec.requested_infra() or infra).split("/")[0] == "ray" else LOOPBACK


def exposed(host: str) -> bool:
    return not ipaddress.ip_address(host).is_loopback


def exposure_warning(spec: ServiceTask, infra: str) -> str | None:
    """One line when the endpoint listens beyond loopback with neither api_keys nor TLS."""
    host = lb_host(spec, infra)
    if not exposed(host) or spec.service.load_balancer.api_keys or spec.service.tls:
        return None
    return (
        f"warning: the endpoint listens on {host}, beyond this machine's loopback, with no "
        "api_keys and no TLS: anyone who can reach this machine can use it"
    )


def reachable_host(bound: str, hostname: str) -> str:
    """The host part of the endpoint's URL: this machine's name when it binds every address,
    else the address it binds (in brackets for IPv6)."""
    if bound in EVERY_ADDRESS:
        return hostname
    return f"[{bound}]" if ":" in bound else bound


def override_host(spec: ServiceTask, host: str) -> ServiceTask:
    """The spec with `service.load_balancer.host` set (`fleetserve up --host`)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise InvalidSpec(f"--host: {host!r} is not an IP address (0.0.0.0: every one)") from None
    lb = spec.service.load_balancer.model_copy(update={"host": host})
    service = spec.service.model_copy(update={"load_balancer": lb})
    return spec.model_copy(update={"service": service})
