"""`fleetserve validate` (the real command, in process): null secrets are refused as null envs
are, `--strict` says everything `up` would refuse, and SkyPilot's pool forms are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app

POOLS = Path(__file__).parents[2] / "fixtures" / "skypilot_pools"


def validate(tmp_path: Path, text: str, *args: str) -> tuple[int, str]:
    path = tmp_path / "svc.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["validate", *args, str(path)])
    return result.exit_code, result.output


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.chdir(tmp_path)


def test_a_null_secret_is_refused_like_a_null_env_and_a_value_passes(tmp_path: Path) -> None:
    text = "service: {readiness_probe: /}\nsecrets:\n  HF_TOKEN:\nrun: echo\n"
    code, out = validate(tmp_path, text)
    assert code == 2, out
    assert "secrets.HF_TOKEN: null in the YAML" in out and "Traceback" not in out
    env_code, env_out = validate(tmp_path, "service: {readiness_probe: /}\nenvs: {A: null}\n")
    assert env_code == 2 and "envs.A: null in the YAML" in env_out
    code, out = validate(tmp_path, text, "--secret", "HF_TOKEN=x")
    assert code == 0 and out.rstrip().splitlines()[-1].startswith("OK "), out


@pytest.mark.parametrize(
    ("text", "words"),
    [
        # Valid to SkyPilot (run is optional in a task), refused by `up`.
        ("service: {readiness_probe: /}\n", "run: a service needs a `run` command"),
        ("service: {readiness_probe: /}\nworkdir: ./nowhere\nrun: echo\n", "nowhere is not a"),
        (
            "service: {readiness_probe: /}\nfile_mounts: {/data: ./missing.txt}\nrun: echo\n",
            "file_mounts./data:",
        ),
        (
            "service: {readiness_probe: /}\nfile_mounts: {/d: {source: 's3://b/'}}\nrun: echo\n",
            "only local files and folders",
        ),
        ("service: {readiness_probe: /}\nnum_nodes: 2\nrun: echo\n", "num_nodes"),
    ],
)
def test_strict_fails_on_what_up_refuses_and_plain_validate_says_it(
    tmp_path: Path, text: str, words: str
) -> None:
    code, out = validate(tmp_path, text)
    assert code == 0, out
    assert any(line.startswith("cannot run here: ") and words in line for line in out.splitlines())
    assert "refuses it here" in out.splitlines()[-1]
    strict, strict_out = validate(tmp_path, text, "--strict")
    assert strict == 2 and words in strict_out


def test_strict_passes_what_up_takes(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    code, out = validate(
        tmp_path, "service: {readiness_probe: /}\nworkdir: ./app\nrun: echo\n", "--strict"
    )
    assert code == 0 and "cannot run here" not in out, out


def test_skypilots_pool_with_run_is_valid_with_a_warning(tmp_path: Path) -> None:
    # examples/batch/custom_formats/pool.yaml (tests/fixtures/skypilot_pools/README.md)
    code, out = validate(tmp_path, (POOLS / "custom_formats_pool.yaml").read_text(), "--strict")
    assert code == 0, out
    assert "warning: run: ignored in a pool" in out
    assert out.rstrip().splitlines()[-1].endswith("a worker pool of 2 workers")


def test_a_pool_with_workers_and_min_max_workers_is_valid_and_autoscaled(tmp_path: Path) -> None:
    code, out = validate(tmp_path, "pool: {workers: 2, min_workers: 1, max_workers: 4}\n")
    assert code == 0, out
    assert out.rstrip().endswith("a worker pool of 1..4 workers"), out
    code, out = validate(tmp_path, "pool: {workers: 2, max_workers: 4}\n")
    assert code == 0 and out.rstrip().endswith("a worker pool of 2..4 workers"), out
    code, out = validate(tmp_path, "pool: {min_workers: 2}\n")
    assert code == 2 and "max_workers must be set when min_workers is set" in out, out


def test_skypilots_pool_example_with_an_s3_mount_cannot_run_here(tmp_path: Path) -> None:
    code, out = validate(tmp_path, (POOLS / "pool.yaml").read_text())
    assert code == 0 and "cannot run here: file_mounts./my-data" in out, out
    strict, _ = validate(tmp_path, (POOLS / "pool.yaml").read_text(), "--strict")
    assert strict == 2


def test_infra_is_checked_as_up_checks_it(tmp_path: Path) -> None:
    text = "service: {readiness_probe: /}\nworkdir: {url: 'file:///r.git'}\nrun: echo\n"
    code, out = validate(tmp_path, text, "--strict")
    assert code == 0, out  # a git workdir is cloned on the local infra
    code, out = validate(tmp_path, text, "--strict", "--infra", "ray")
    assert code == 2 and "cloned on the local infra only, not on ray" in out, out
    code, out = validate(tmp_path, text, "--infra", "aws")
    assert code == 2 and "infra 'aws' is not available" in out, out
