"""The replica networks' pure parts: names from tokens, /30 allocation, route collisions."""

from __future__ import annotations

import ipaddress

import pytest

from fleetserve.core.errors import TerminalError
from fleetserve.infra.netns import (
    COLLISION_RECHECKS,
    allocate_link,
    collisions,
    lasting_collisions,
    namespace_name,
    parse_range,
    token_digest,
    token_of_namespace,
    veth_names,
)

NET = ipaddress.IPv4Network("10.231.0.0/16")


def addrs(*text: str) -> set[ipaddress.IPv4Address]:
    return {ipaddress.IPv4Address(t) for t in text}


def test_the_first_link_is_the_first_slash_30() -> None:
    link = allocate_link(NET, set())
    assert (str(link.host), str(link.replica)) == ("10.231.0.1/30", "10.231.0.2/30")


@pytest.mark.parametrize(
    ("used", "expected_replica"),
    [
        (addrs("10.231.0.1"), "10.231.0.6"),  # the host end is taken
        (addrs("10.231.0.2"), "10.231.0.6"),  # the replica end is taken
        (addrs("10.231.0.0"), "10.231.0.6"),  # even the network address: skip the /30
        (addrs("10.231.0.1", "10.231.0.5"), "10.231.0.10"),
        (addrs("192.168.1.1"), "10.231.0.2"),  # outside the range: no matter
    ],
)
def test_a_link_skips_every_slash_30_with_an_address_in_use(
    used: set[ipaddress.IPv4Address], expected_replica: str
) -> None:
    assert str(allocate_link(NET, used).replica.ip) == expected_replica


def test_a_full_range_is_a_clear_error() -> None:
    small = ipaddress.IPv4Network("10.231.0.0/29")  # two /30s
    with pytest.raises(TerminalError, match="no free /30"):
        allocate_link(small, addrs("10.231.0.1", "10.231.0.5"))


def test_routes_that_overlap_the_range_collide_unless_they_are_ours_or_default() -> None:
    routes = [
        (ipaddress.IPv4Network("0.0.0.0/0"), "eth0"),
        (ipaddress.IPv4Network("10.231.0.0/30"), "fsh0123456789a"),  # our own veth
        (ipaddress.IPv4Network("10.0.0.0/8"), "tun0"),  # a VPN's: overlaps
        (ipaddress.IPv4Network("172.17.0.0/16"), "docker0"),
    ]
    assert collisions(NET, routes) == ["10.0.0.0/8 dev tun0"]


@pytest.mark.parametrize("text", ["8.8.8.0/24", "10.231.0.0/30", "10.231.0.1/16", "nonsense"])
def test_a_range_must_be_private_and_big_enough(text: str) -> None:
    with pytest.raises(TerminalError):
        parse_range(text)


def test_names_derive_from_the_token_and_the_home() -> None:
    name = namespace_name("home-a", "token-1")
    assert name == namespace_name("home-a", "token-1")  # recovery finds it again
    assert name != namespace_name("home-b", "token-1")
    assert token_of_namespace(name, "home-a") == token_digest("token-1")
    assert token_of_namespace(name, "home-b") is None  # another home's: never swept
    outer, inner = veth_names("token-1")
    assert outer != inner and max(len(outer), len(inner)) <= 15  # the kernel's limit


def test_routes_of_an_interface_being_removed_do_not_collide() -> None:
    """iproute2 prints `if<index>` for an interface gone between its dumps (a sibling
    replica's veth removed that second), and a replica end may be seen on the host before
    it moves into its namespace: neither is a route of someone else."""
    routes = [
        (ipaddress.IPv4Network("10.231.0.1/32"), "if1234"),
        (ipaddress.IPv4Network("10.231.0.4/30"), "fsr0123456789a"),
        (ipaddress.IPv4Network("10.231.9.0/24"), "ifb0"),  # a real interface named ifb0
    ]
    assert collisions(NET, routes) == ["10.231.9.0/24 dev ifb0"]


def test_a_collision_that_goes_away_within_the_rechecks_does_not_refuse_the_range() -> None:
    foreign = [(ipaddress.IPv4Network("10.231.0.0/30"), "veth9")]
    reads = iter([foreign, foreign, []])
    slept: list[float] = []
    assert lasting_collisions(NET, lambda: next(reads), slept.append) == []
    assert slept == [0.2, 0.5]
    slept.clear()
    assert lasting_collisions(NET, lambda: foreign, slept.append) == ["10.231.0.0/30 dev veth9"]
    assert slept == list(COLLISION_RECHECKS)
