"""Numeric settings take numbers as people write them in ASCII, and whole numbers where a
count is meant; anything else is one line naming the variable (an outside attack found
'1.5' connections, '1_0', ' 5' and Arabic-Indic digits taken)."""

from __future__ import annotations

import pytest

from fleetserve.controller.settings import Settings
from fleetserve.core.errors import InvalidSpec


def settings(**env: str) -> Settings:
    return Settings.from_env_dict({"FLEETSERVE_HOME": "/tmp/h", **env})


@pytest.mark.parametrize("raw", ["1.5", "1e3", "٣", " 5", "1_0", "-3", "0x10", "5 "])
def test_a_connection_cap_is_a_whole_number(raw: str) -> None:
    with pytest.raises(InvalidSpec, match="FLEETSERVE_API_MAX_CLIENT_CONNECTIONS"):
        settings(FLEETSERVE_API_MAX_CLIENT_CONNECTIONS=raw)


@pytest.mark.parametrize("raw", ["٣", "1_0", " 5", "inf", "nan", "10s", ""])
def test_a_timeout_is_an_ascii_number(raw: str) -> None:
    if raw == "":
        assert settings(FLEETSERVE_API_HEADER_TIMEOUT=raw).api_header_timeout == 10.0
        return
    with pytest.raises(InvalidSpec, match="FLEETSERVE_API_HEADER_TIMEOUT"):
        settings(FLEETSERVE_API_HEADER_TIMEOUT=raw)


def test_good_values_are_taken() -> None:
    s = settings(
        FLEETSERVE_API_MAX_CLIENT_CONNECTIONS="64",
        FLEETSERVE_API_HEADER_TIMEOUT="2.5",
        FLEETSERVE_RECONCILE_INTERVAL=".5",
        FLEETSERVE_PROBE_INTERVAL="1e1",
    )
    assert (s.api_max_client_connections, s.api_header_timeout) == (64, 2.5)
    assert (s.reconcile_interval, s.probe_interval) == (0.5, 10.0)
    with pytest.raises(InvalidSpec, match=r"=99999999999999999999 is out of range"):
        settings(FLEETSERVE_API_HEADER_TIMEOUT="99999999999999999999")


@pytest.mark.parametrize("raw", ["7200", "-1"])
def test_the_drain_is_bounded_as_a_load_balancer_config_takes_it(raw: str) -> None:
    """It is also a retired load balancer's drain (LbConfig.drain_seconds, 0 to 3600): a
    value past that would have made every load balancer refuse its own config at start."""
    with pytest.raises(InvalidSpec, match="FLEETSERVE_DRAIN_SECONDS"):
        settings(FLEETSERVE_DRAIN_SECONDS=raw)
    assert settings(FLEETSERVE_DRAIN_SECONDS="3600").drain_seconds == 3600
