"""What each built-in policy can do besides choosing, as the load balancer finds it once."""

from __future__ import annotations

from fleetserve.policies.capabilities import Capabilities, capabilities
from fleetserve.policies.factory import POLICIES, make_selector
from fleetserve.policies.lb import RequestKey


def names(caps: Capabilities) -> set[str]:
    return {
        name
        for name in (
            "header_key",
            "body_key",
            "off_loop",
            "forget",
            "reports_choices",
            "takes_turns",
            "shares_index",
            "reported",
        )
        if getattr(caps, name) is not None
    }


def test_each_policy_has_the_capabilities_the_load_balancer_relies_on() -> None:
    found = {policy: names(capabilities(make_selector(policy))) for policy in POLICIES}
    assert found == {
        "round_robin": {"takes_turns"},
        "least_load": {"takes_turns"},
        "instance_aware_least_load": {"takes_turns"},
        "power_of_two": set(),
        "sticky": {"header_key"},
        "prefix_affinity": {"body_key"},
        "cache_aware": {"body_key", "forget", "reports_choices", "shares_index", "reported"},
    }


def test_body_limits_and_header_keys_come_from_the_options() -> None:
    assert capabilities(make_selector("prefix_affinity")).body_limit == 16 * 1024
    cache = capabilities(make_selector("cache_aware", cache_max_body_bytes=4096))
    assert cache.body_limit == 4096
    sticky = capabilities(make_selector("sticky", session_header=None, session_cookie="sid"))
    assert sticky.header_key is not None
    assert sticky.header_key({b"cookie": b"a=1; sid=xyz"}) == RequestKey(session="xyz")
    assert sticky.header_key({b"x-session-id": b"s"}) == RequestKey(session=None)
    default = capabilities(make_selector("sticky")).header_key
    assert default is not None and default({b"x-session-id": b"s"}) == RequestKey(session="s")


def test_prefix_affinity_keys_on_the_prompts_start() -> None:
    caps = capabilities(make_selector("prefix_affinity", prefix_chars=5))
    assert caps.body_key is not None
    assert caps.body_key(b'{"prompt": "hello world"}', True) == RequestKey(prefix="hello")
