"""docs/schema/v1 is what the models generate (a change of the output is deliberate), and
what the CLI prints with -o json validates against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from fleetserve.api.models import EventInfo, JobInfo
from fleetserve.cli.main import app
from fleetserve.cli.output import to_data
from fleetserve.cli.schema import KINDS, VERSION, generate
from tests.unit.cli.test_output import POOL, SVC, event

ROOT = Path(__file__).resolve().parents[3]
SCHEMAS = ROOT / "docs" / "schema" / VERSION


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schemas_are_exactly_what_the_models_generate() -> None:
    generated = generate()
    for name, text in generated.items():
        path = SCHEMAS / name
        assert path.exists(), f"{path} is missing: run scripts/gen_schema.py"
        assert path.read_text() == text, (
            f"{path} differs from the models: if the change is deliberate (v1 only ever adds "
            "fields), run `.venv/bin/python scripts/gen_schema.py` and commit the result"
        )
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(generated)


def test_the_script_checks_without_writing() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_schema.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_output_kind_is_documented() -> None:
    doc = (ROOT / "docs" / "output.md").read_text()
    for kind in KINDS:
        assert f"schema/{VERSION}/{kind.file}" in doc, kind.file


JOB = JobInfo(job_id=1, pool="batch", batch=1, rank=0, num_jobs=1, status="PENDING", created_at=1.0)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("service.json", to_data(SVC)),
        ("service-list.json", to_data([SVC, POOL])),
        ("pool-list.json", to_data([POOL])),
        ("events.json", to_data([event(1), event(2, replica_id=1, status_to="READY")])),
        ("event.json", to_data(event(3))),
        ("job-list.json", to_data([JOB])),
        ("job-list.json", []),
    ],
)
def test_the_models_json_forms_validate(name: str, data: Any) -> None:
    validator(name).validate(data)


def test_a_renamed_or_missing_field_does_not_validate() -> None:
    good = to_data(event(1))
    renamed = dict(good)
    renamed["when"] = renamed.pop("at")
    with pytest.raises(jsonschema.ValidationError, match="'at' is a required property"):
        validator("event.json").validate(renamed)
    with pytest.raises(jsonschema.ValidationError):
        validator("events.json").validate([dict(good, event_id="one")])
    assert EventInfo.model_validate(good) == event(1)


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--burst", "2:30:900:300", "--duration", "1800", "-o", "json"],
        ["simulate", "--burst", "0.5:3:900:300", "--duration", "900", "--engine", "-o", "json"],
        ["simulate", "--spot-trace", "GCP1", "--duration", "21600", "--seeds", "1", "--json"],
        ["pool", "simulate", "--burst-jobs", "5", "-o", "json"],
    ],
)
def test_simulate_json_validates_against_the_simulation_schema(args: list[str]) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    validator("simulation.json").validate(json.loads(res.stdout))
