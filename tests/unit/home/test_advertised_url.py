"""The address an HA lease names for standbys to send clients to (HomeSettings.advertised_url)."""

from pathlib import Path

import pytest

from fleetserve.core.errors import InvalidSpec
from fleetserve.home.settings import HomeSettings, home_fields


def settings(**env: str) -> HomeSettings:
    return HomeSettings(**home_fields({"FLEETSERVE_HOME": "/tmp/x", **env}))


def test_a_loopback_controller_names_its_own_address() -> None:
    assert settings(FLEETSERVE_API_PORT="8123").advertised_url == "http://127.0.0.1:8123"


def test_a_wildcard_host_is_never_named_it_is_an_allowed_host_name(tmp_path: Path) -> None:
    s = settings(
        FLEETSERVE_API_HOST="0.0.0.0",
        FLEETSERVE_TLS_CERTFILE=str(tmp_path / "c"),
        FLEETSERVE_ALLOWED_HOSTS="ctl.example.org, other",
        FLEETSERVE_API_PORT="9443",
    )
    assert s.advertised_url == "https://ctl.example.org:9443"


def test_a_wildcard_host_without_names_is_the_machines_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("socket.getfqdn", lambda: "node7.cluster")
    s = settings(FLEETSERVE_API_HOST="::", FLEETSERVE_API_PORT="9000")
    assert s.advertised_url == "http://node7.cluster:9000"
    v6 = settings(FLEETSERVE_API_HOST="fd00::5", FLEETSERVE_API_PORT="9000")
    assert v6.advertised_url == "http://[fd00::5]:9000"


def test_the_advertised_url_can_be_given() -> None:
    given = " https://LB.example:8443/ "
    s = settings(FLEETSERVE_API_HOST="0.0.0.0", FLEETSERVE_ADVERTISE_URL=given)
    assert s.advertised_url == "https://lb.example:8443"
    assert settings(FLEETSERVE_ADVERTISE_URL="http://[fd00::1]:80").advertised_url == (
        "http://[fd00::1]:80"
    )


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("ftp://h:1", "http(s)://HOST:PORT"),
        ("https://0.0.0.0:8443", "every address"),
        ("https://h:99999", "Port out of range"),
        ("https://h:1/api", "no path"),
        ("https://u:p@h:1", "no path, query or user"),
        ("https://bad_host!:1", "not a host name"),
        ("https://h\u00e9:1", "ASCII"),
        ("https://" + "a" * 400, "at most 300"),
    ],
)
def test_a_bad_advertised_url_is_one_clear_error(raw: str, says: str) -> None:
    with pytest.raises(InvalidSpec, match="FLEETSERVE_ADVERTISE_URL") as e:
        settings(FLEETSERVE_ADVERTISE_URL=raw)
    assert says in str(e.value)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("ctl.example.org:8443", "without a scheme, port or path"),
        ("https://ctl.example.org", "without a scheme, port or path"),
        ("ctl.example.org/api", "without a scheme, port or path"),
        ("fd00::5", "in brackets, as [fd00::5]"),
        ("ctl example", "not a host name"),
        ("-ctl", "not a host name"),
    ],
)
def test_an_allowed_host_with_a_port_or_scheme_is_refused_by_name(entry: str, says: str) -> None:
    # The API compares the Host header's name only: such an entry would never match, and the
    # advertised URL made from it would be wrong ("https://ctl.example.org:8443:9443").
    with pytest.raises(InvalidSpec, match="allowed host") as e:
        settings(FLEETSERVE_API_HOST="0.0.0.0", FLEETSERVE_ALLOWED_HOSTS=f"ok.example,{entry}")
    assert says in str(e.value)


def test_allowed_hosts_as_the_host_header_carries_them_are_accepted() -> None:
    s = settings(
        FLEETSERVE_API_HOST="0.0.0.0",
        FLEETSERVE_API_PORT="9443",
        FLEETSERVE_ALLOWED_HOSTS="[fd00::5],10.0.0.7,ctl.example.org",
    )
    assert s.allowed_hosts == ("[fd00::5]", "10.0.0.7", "ctl.example.org")
    assert s.advertised_url == "http://[fd00::5]:9443"
