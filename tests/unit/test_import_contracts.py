"""The import contracts in pyproject.toml (import-linter) hold: the layers, the CLI and the SDK
reaching the controller through its API only, the two infras built on shared parts, and the
layers inside the load balancer and its policies (no import cycle, TYPE_CHECKING included). The
same check runs as `lint-imports` in scripts/test.sh; here it fails the suite too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = (
    "Layers: a lower layer never imports a higher one",
    "The CLI and the SDK reach the controller through its API only",
    "Infras: the two infras build on shared parts, never on each other",
    "LB: the proxy's parts import downwards only (back-references are protocols)",
    "LB policies: the factory names policies, capabilities build on selectors",
)


def lint(config: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_every_import_contract_is_kept() -> None:
    done = lint(ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in CONTRACTS:
        assert f"{name} KEPT" in done.stdout, done.stdout


def test_a_broken_contract_fails_the_check(tmp_path: Path) -> None:
    """The checker sees this tree's imports: a contract they break is reported (the CLI does
    import the SDK)."""
    config = tmp_path / "contracts.ini"
    config.write_text(
        "[importlinter]\nroot_package = fleetserve\n\n"
        "[importlinter:contract:cli-without-sdk]\nname = CLI without SDK\ntype = forbidden\n"
        "source_modules = fleetserve.cli\nforbidden_modules = fleetserve.client\n"
    )
    done = lint(config)
    assert done.returncode != 0
    assert "CLI without SDK BROKEN" in done.stdout
    assert "fleetserve.cli" in done.stdout and "fleetserve.client" in done.stdout


def test_a_type_checking_import_counts(tmp_path: Path) -> None:
    """An import under `if TYPE_CHECKING:` is an import for the contracts: a back-reference
    in the LB must be a protocol, not a type-only import of a higher module."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import high\n"
    )
    (package / "high.py").write_text("from pkg import low\n")
    config = tmp_path / "contracts.ini"
    config.write_text(
        "[importlinter]\nroot_package = pkg\n\n"
        "[importlinter:contract:layers]\nname = high over low\ntype = layers\n"
        "layers =\n    pkg.high\n    pkg.low\n"
    )
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert "high over low BROKEN" in done.stdout, done.stdout
