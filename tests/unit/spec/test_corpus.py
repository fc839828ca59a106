"""SkyPilot's own SkyServe YAMLs through the real `fleetserve validate`, each against the
verdict written for it in tests/fixtures/skyserve/corpus/manifest.yml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from fleetserve.cli.main import app

FIXTURES = Path(__file__).parents[2] / "fixtures" / "skyserve"
CORPUS = FIXTURES / "corpus"
MANIFEST: dict[str, dict[str, Any]] = yaml.safe_load((CORPUS / "manifest.yml").read_text())


def test_the_manifest_covers_the_corpus_exactly() -> None:
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.yaml")}
    assert files == set(MANIFEST)
    assert len(files) >= 30


@pytest.mark.parametrize("rel", sorted(MANIFEST))
def test_validate_gives_the_manifest_verdict(rel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = MANIFEST[rel]
    monkeypatch.setenv("COLUMNS", "1000")
    # From the tree's root, as SkyPilot runs them (a relative workdir is the caller's folder).
    monkeypatch.chdir(CORPUS)
    result = CliRunner().invoke(app, ["validate", str(CORPUS / rel)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    if expected["fleetserve"] == "ok":
        assert result.exit_code == 0, result.output
        warned = [line.removeprefix("warning: ").split(":")[0] for line in lines[:-1]]
        assert all(line.startswith("warning: ") for line in lines[:-1]), result.output
        assert warned == expected.get("warnings", []), result.output
        assert lines[-1].startswith("OK "), result.output
    elif expected["fleetserve"] == "not-here":
        assert result.exit_code == 0, result.output
        assert any(
            line.startswith("cannot run here: ") and expected["match"] in line for line in lines
        ), result.output
        assert lines[-1].startswith("OK ") and "refuses it here" in lines[-1], result.output
        strict = CliRunner().invoke(app, ["validate", "--strict", str(CORPUS / rel)])
        assert strict.exit_code == 2, strict.output
        assert expected["why"], "every refusal has its reason written down"
    else:
        assert expected["fleetserve"] == "refused"
        assert result.exit_code == 2, result.output
        assert expected["match"] in result.output, result.output
        assert expected["why"], "every refusal has its reason written down"


def test_validate_gives_skypilots_verdict_on_every_file() -> None:
    """The exit code of `fleetserve validate` is SkyPilot's parser's verdict, file by file."""
    for rel, v in MANIFEST.items():
        accepted = v["fleetserve"] in ("ok", "not-here")
        assert accepted == (v["skypilot"] == "accept"), rel


def test_every_file_skypilot_accepts_is_accepted_or_refused_on_purpose() -> None:
    refused = {
        k for k, v in MANIFEST.items() if v["skypilot"] == "accept" and v["fleetserve"] != "ok"
    }
    assert refused == {
        "examples/serve/multi_node/multi_node.yaml",
        "tests/skyserve/volumes/kubernetes.yaml",
    }
    for rel in refused:
        assert MANIFEST[rel]["why"].startswith("deliberate")
