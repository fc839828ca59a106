"""FLEETSERVE_DB_URL and FLEETSERVE_DB_URL_FILE: which URLs select PostgreSQL, a password
never shown, and a URL file nobody else may read."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.controller.settings import Settings
from fleetserve.core.errors import InvalidSpec
from fleetserve.store.url import UnsafeUrlFile, mask_url, normalize_db_url

SECRET = "s3cr%40t-pw"  # percent-encoded "s3cr@t-pw"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://fleet:{SECRET}@db.example:5432/fleet",
        f"postgresql+psycopg://fleet:{SECRET}@db.example:5432/fleet",
        f"postgres://fleet:{SECRET}@db.example:5432/fleet",
        f"  postgresql://fleet:{SECRET}@db.example:5432/fleet\n",
    ],
)
def test_postgresql_urls_are_normalised_to_psycopg(url: str) -> None:
    assert normalize_db_url(url) == f"postgresql+psycopg://fleet:{SECRET}@db.example:5432/fleet"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("sqlite:////tmp/x.db", "sqlite:// is not a PostgreSQL URL"),
        ("mysql://u:pw@h/db", "mysql:// is not a PostgreSQL URL"),
        ("postgresql+psycopg2://u:pw@h/db", "is not a PostgreSQL URL"),
        ("postgresql://u:pw@h:5432/", "names no database"),
        ("postgresql://u:pw@h:70000/db", "port 70000 is out of range"),
        ("postgresql://u:pw@h:port/db", "is not a valid URL"),
        ("postgresql://u:p@w@h/db", "percent-encode an @ in the password"),
    ],
)
def test_other_urls_are_refused_in_one_line_without_the_password(url: str, words: str) -> None:
    with pytest.raises(InvalidSpec, match=words) as e:
        normalize_db_url(url)
    assert "pw" not in e.value.message and "\n" not in e.value.message
    assert e.value.exit_code == 2


def test_a_value_that_is_no_url_is_never_echoed() -> None:
    with pytest.raises(InvalidSpec) as e:
        normalize_db_url("hunter2-my-password")
    assert "hunter2" not in e.value.message


def test_mask_url_hides_the_password_only() -> None:
    assert mask_url(f"postgresql+psycopg://fleet:{SECRET}@h:5/db") == (
        "postgresql+psycopg://fleet:***@h:5/db"
    )
    assert mask_url("postgresql://fleet@h/db") == "postgresql://fleet@h/db"
    assert mask_url("postgresql://:pw@h/db") == "postgresql://:***@h/db"
    assert "p@ss" not in mask_url("postgresql://u:p@ss@h/db")  # an unencoded @: masked too


def test_settings_read_the_url_and_never_show_it() -> None:
    url = f"postgresql://fleet:{SECRET}@h:5432/fleet"
    settings = Settings.from_env_dict({"FLEETSERVE_HOME": "/tmp/h", "FLEETSERVE_DB_URL": url})
    assert settings.db_url == url
    assert settings.store_url() == f"postgresql+psycopg://fleet:{SECRET}@h:5432/fleet"
    assert SECRET not in repr(settings) and "s3cr" not in repr(settings)
    default = Settings.from_env_dict({"FLEETSERVE_HOME": "/tmp/h"})
    assert default.store_url() is None and default.db_path == Path("/tmp/h/fleetserve.db")


def _settings(url_file: Path, url: str | None = None) -> Settings:
    env = {"FLEETSERVE_HOME": "/tmp/h", "FLEETSERVE_DB_URL_FILE": str(url_file)}
    if url:
        env["FLEETSERVE_DB_URL"] = url
    return Settings.from_env_dict(env)


def test_a_url_file_of_the_owner_only_is_read(tmp_path: Path) -> None:
    f = tmp_path / "db-url"
    f.write_text(f"postgresql://fleet:{SECRET}@h:5432/fleet\n")
    f.chmod(0o600)
    assert _settings(f).store_url() == f"postgresql+psycopg://fleet:{SECRET}@h:5432/fleet"
    f.chmod(0o400)
    assert _settings(f).store_url() is not None


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_url_file_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    f = tmp_path / "db-url"
    f.write_text(f"postgresql://fleet:{SECRET}@h:5432/fleet\n")
    f.chmod(mode)
    with pytest.raises(UnsafeUrlFile, match=rf"open to group or others \(mode 0{mode:o}\)") as e:
        _settings(f).store_url()
    assert f"chmod 600 {f}" in e.value.message and SECRET not in e.value.message
    assert e.value.exit_code == 6  # like an unusable database: the controller does not start


def test_url_file_mistakes_are_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(UnsafeUrlFile, match="cannot be read"):
        _settings(missing).store_url()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(UnsafeUrlFile, match="must hold one URL on one line"):
        _settings(empty).store_url()
    with pytest.raises(UnsafeUrlFile, match="not a regular file"):
        _settings(tmp_path).store_url()
    f = tmp_path / "db-url"
    f.write_text("mysql://u:pw@h/db")
    f.chmod(0o600)
    with pytest.raises(InvalidSpec, match=f"FLEETSERVE_DB_URL_FILE {f}: mysql://"):
        _settings(f).store_url()
    with pytest.raises(InvalidSpec, match="not both"):
        _settings(f, "postgresql://u@h/db").store_url()
