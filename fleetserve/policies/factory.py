"""The selector for a `load_balancing_policy` name, made from the load balancer's options and
the parts it passes (the replicas' weights; for cache_aware's precise mode, the engines' KV
index and the prompt tokenizer). The one place that maps policy names to selectors."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import get_args

from fleetserve.policies.cache_aware import DEFAULT_MAX_BODY_BYTES, CacheAware
from fleetserve.policies.cache_aware_precise import PreciseCacheAware, PromptTokens
from fleetserve.policies.kv_index import KvIndex
from fleetserve.policies.lb import (
    LeastLoad,
    PowerOfTwo,
    PrefixAffinity,
    RoundRobin,
    Selector,
    Sticky,
)
from fleetserve.spec.models import LbPolicy, LoadBalancerOptions

POLICIES: tuple[str, ...] = get_args(LbPolicy)  # the names the YAML accepts


@dataclass(frozen=True)
class PreciseParts:
    """What cache_aware's precise mode reads, made by the load balancer
    (fleetserve.lb.kv_events.precise_mode): the engines' KV index and the prompt tokenizer."""

    index: KvIndex
    tokenizer: PromptTokens


def make_selector(
    policy: str,
    weights: Mapping[int, float] | None = None,
    rng: random.Random | None = None,
    max_extra_load: int | None = None,
    cache_block_chars: int = 256,
    cache_blocks: int = 2048,
    *,
    prefix_chars: int = 256,
    session_header: str | None = "X-Session-Id",
    session_cookie: str | None = None,
    cache_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    precise: PreciseParts | None = None,
    cache_choice: str = CacheAware.DEFAULT_CHOICE,
    cache_decode_weight: float = CacheAware.DEFAULT_DECODE_WEIGHT,
    cache_load_weight: float = CacheAware.DEFAULT_LOAD_WEIGHT,
) -> Selector:
    """The selector for a `load_balancing_policy` name."""
    if precise is not None and policy != "cache_aware":
        raise ValueError(f"kv_events (cache_aware's precise mode) does not apply to {policy!r}")
    if policy == "round_robin":
        return RoundRobin()
    if policy == "least_load":
        return LeastLoad()
    if policy == "instance_aware_least_load":
        return LeastLoad(weights)
    if policy == "power_of_two":
        return PowerOfTwo(rng)
    if policy == "sticky":
        return Sticky(session_header, session_cookie)
    if policy == "prefix_affinity":
        return PrefixAffinity(max_extra_load or PrefixAffinity.DEFAULT_MAX_EXTRA_LOAD, prefix_chars)
    if policy == "cache_aware":
        settings = (
            max_extra_load or CacheAware.DEFAULT_MAX_EXTRA_LOAD,
            cache_block_chars,
            cache_blocks,
            cache_max_body_bytes,
            cache_choice,
            cache_decode_weight,
            cache_load_weight,
        )
        if precise is not None:
            return PreciseCacheAware(precise.index, precise.tokenizer, *settings)
        return CacheAware(*settings)
    raise ValueError(f"unknown load_balancing_policy {policy!r}; use one of {', '.join(POLICIES)}")


def selector_for(
    policy: str,
    options: LoadBalancerOptions,
    weights: Mapping[int, float] | None = None,
    precise: PreciseParts | None = None,
) -> Selector:
    """The selector for a load balancer's policy and `load_balancer` options."""
    return make_selector(
        policy,
        weights=weights,
        max_extra_load=options.max_extra_load,
        cache_block_chars=options.cache_block_chars,
        cache_blocks=options.cache_blocks,
        prefix_chars=options.prefix_chars,
        session_header=options.session_header,
        session_cookie=options.session_cookie,
        cache_max_body_bytes=options.cache_max_body_bytes,
        precise=precise,
        cache_choice=options.cache_choice,
        cache_decode_weight=options.cache_decode_weight,
        cache_load_weight=options.cache_load_weight,
    )
