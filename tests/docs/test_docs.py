"""The docs harness (tests/docs/harness.py) over README.md, docs/*.md and examples/*/README.md:
every `fleetserve` command parsed by the real CLI, the quick ones run, the quick-start run on
one shared fleet, the rest checked or skipped with a reason (`python -m tests.docs.harness`
prints the list)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleetserve.cli.main import app
from tests.docs import harness
from tests.docs.harness import CHECK, FLEET, PARSE, ROOT, RUN, SKIP, Block, Step
from tests.e2e.conftest import Fleet, endpoint_of, fleet_in

PLAN = harness.plan()


def _squash(line: str) -> str:
    """Spaces squashed; `replica N` for any id (which replica is READY first is chance)."""
    return re.sub(r"\breplica \d+:", "replica N:", " ".join(line.split()))


# A replica's progress line before READY (`replica 1: STARTING`): which of them a command
# prints depends on when it polls (a fast replica goes from PROVISIONING to READY between two).
_PASSING = re.compile(r"replica N: (?!READY\b)[A-Z_]+")


def missing_lines(expect: list[str], output: str) -> list[str]:
    """The shown output lines (spaces squashed, comments gone) not in what was printed.
    Progress lines before READY may each be absent, but at least one READY or earlier
    progress line of the same shape must be printed where the doc shows some."""
    printed = {_squash(line) for line in output.splitlines()}
    wanted = [line for line in expect if _squash(line) and _squash(line) not in printed]
    passing = [line for line in wanted if _PASSING.fullmatch(_squash(line))]
    if passing and not any(re.fullmatch(r"replica N: [A-Z_]+", p) for p in printed):
        return wanted
    return [line for line in wanted if line not in passing]


def test_the_plan_covers_every_block_and_runs_what_it_can() -> None:
    """Each block has a step; no `fleetserve` command is skipped; the list is printed by
    `python -m tests.docs.harness` with what runs and why the rest does not."""
    where = {s.where.rsplit(":", 1)[0] for s in PLAN}
    for path in harness.doc_files():
        if any(True for _ in harness.blocks(path)):
            assert str(path.relative_to(ROOT)) in where, path
    assert not [s for s in PLAN if s.action == SKIP and harness._fleetserve_line(s.text)]
    assert not [s for s in PLAN if s.action == PARSE and not s.reason]
    counts = {a: sum(s.action == a for s in PLAN) for a in (RUN, FLEET, PARSE, CHECK, SKIP)}
    assert counts[RUN] >= 10 and counts[FLEET] >= 5 and counts[PARSE] >= 50, counts
    listing = subprocess.run(
        [sys.executable, "-m", "tests.docs.harness"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    for action, n in counts.items():
        assert f"== {action}: {n}" in listing.stdout
    as_data = subprocess.run(
        [sys.executable, "-m", "tests.docs.harness", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = json.loads(as_data.stdout)
    assert len(rows) == len(PLAN) and {r["action"] for r in rows} == set(counts)
    assert all(r["reason"] for r in rows if r["action"] == SKIP)


def test_every_documented_fleetserve_command_parses() -> None:
    """A renamed or removed option, a subcommand that no longer exists, an argument too many:
    the real typer app's parser says which doc line."""
    commands = [
        s
        for s in PLAN
        if s.action in (PARSE, RUN, FLEET) and harness._fleetserve_line(s.text) is not None
    ]
    inline = [s for s in PLAN if s.action == PARSE and s.reason.startswith("inline")]
    problems = [p for s in commands + inline if (p := harness.check_parse(s)) is not None]
    assert not problems, "\n".join(problems)


def test_the_parser_check_catches_drift() -> None:
    """The check itself: it refuses what the CLI does not take."""
    assert harness.check_parse(Step("x", "fleetserve up f.yaml --nope", PARSE)) is not None
    assert harness.check_parse(Step("x", "fleetserve teleport NAME", PARSE)) is not None
    assert harness.check_parse(Step("x", "fleetserve rollback A B", PARSE)) is not None
    assert harness.check_parse(Step("x", "fleetserve down NAME... [--all]", PARSE)) is None
    assert harness.check_parse(Step("x", "fleetserve jobs cancel 7 | --all -p p", PARSE)) is None
    redirected = Step("x", "fleetserve status -o json 2>/dev/null | jq .", PARSE)
    assert harness.check_parse(redirected) is None


def test_scripts_extras_and_environment_variables_the_docs_name_exist() -> None:
    problems = [p for s in PLAN if s.action == CHECK if (p := harness.check_other(s))]
    assert not problems, "\n".join(problems)
    bad = Step("x", "FLEETSERVE_NO_SUCH=1 .venv/bin/python bench/lb/compare.py --nope", CHECK)
    assert harness.check_other(bad) is not None


def _files_before(step: Step) -> dict[str, str]:
    """The `# NAME.yaml` blocks of the step's file above it."""
    assert step.block is not None
    files = {}
    for block in harness.blocks(step.block.path):
        name = harness.file_name(block)
        if name is not None and block.line < step.block.line:
            files[name] = "\n".join(block.lines) + "\n"
    return files


def _workspace(tmp_path: Path) -> Path:
    """A folder to run in, where the repository's examples are where the docs say."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    if not (work / "examples").exists():
        (work / "examples").symlink_to(ROOT / "examples")
    return work


def _yaml_args(block: Block, work: Path) -> list[str]:
    """`validate FILE` for a YAML block (a fragment of `service:` gets a `run:`), with a
    value for each `null` entry, as the docs tell (`--env K=V`, `--secret K=V`)."""
    doc = yaml.safe_load("\n".join(block.lines))
    assert isinstance(doc, dict), block.where
    if "run" not in doc and "pool" not in doc:
        doc["run"] = "python3 server.py"
    args = []
    for key, flag in (("envs", "--env"), ("secrets", "--secret")):
        for name, value in (doc.get(key) or {}).items():
            if value is None:
                args += [flag, f"{name}=x"]
    path = work / f"block-{block.line}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return ["validate", path.name, *args]


QUICK = [s for s in PLAN if s.action == RUN]


@pytest.mark.parametrize("step", QUICK, ids=[s.where for s in QUICK])
def test_quick_commands_and_yaml_blocks_run_as_documented(
    step: Step, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run for real (the CLI in process): exit 0, or the shown output, line for line."""
    work = _workspace(tmp_path)
    monkeypatch.chdir(work)
    if step.block is None:  # an example's YAML, as its README runs it (from the root)
        rel = step.text.split()[-1]
        doc = yaml.safe_load((ROOT / rel).read_text())
        fill = [f"--env={k}=x" for k, v in (doc.get("envs") or {}).items() if v is None]
        res = CliRunner().invoke(app, ["validate", rel, *fill])
        assert res.exit_code == 0, f"{step.where}: {res.stdout}{res.stderr}"
        return
    if step.text.startswith("yaml: bad"):
        return  # a file for the command after it (below)
    for name, text in _files_before(step).items():
        (work / name).write_text(text)
    if step.text.startswith("yaml"):
        doc = yaml.safe_load("\n".join(step.block.lines))
        if "service" not in doc and "pool" not in doc:  # a job's YAML (`jobs launch`)
            from fleetserve.spec.jobs import parse_job

            assert parse_job("\n".join(step.block.lines), source=step.where).run
            return
        args = _yaml_args(step.block, work)
        expect_code = 0
        name = harness.file_name(step.block)
        if name is not None and f"fleetserve up {name}" in step.block.path.read_text():
            # a file the doc runs (`fleetserve up spot.yaml`): what `run` starts is there
            script = re.search(r"python3? ([\w./-]+\.py)", str(doc.get("run", "")))
            folder = ROOT / str(doc.get("workdir", "."))
            assert script is None or (folder / script.group(1)).is_file(), (
                f"{step.where}: `{doc['run']}` needs {script.group(1) if script else ''} in "
                f"workdir {doc.get('workdir', '.')!r}, which has none"
            )
    else:
        args = shlex.split(harness._fleetserve_line(step.text) or "")[1:]
        expect_code = 2 if "bad" in step.text else 0
    (work / "server.py").write_text("")  # the file a fragment's `run:` names
    for png in [a for a in args if a.endswith(".png")]:
        args[args.index(png)] = str(work / png)
    res = CliRunner().invoke(app, args, env={"FLEETSERVE_HOME": str(tmp_path / "home")})
    output = res.stdout + res.stderr
    assert res.exit_code == expect_code, f"{step.where}: fleetserve {' '.join(args)}\n{output}"
    assert "Traceback" not in output
    missing = missing_lines(step.expect, output)
    assert not missing, f"{step.where}: not printed: {missing}\nprinted:\n{output}"


# -- the shared fleet ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from fleet_in(tmp_path_factory.mktemp("docs-fleet"))


FLEET_STEPS = [s for s in PLAN if s.action == FLEET]


@pytest.mark.slow  # 12 s on an idle 2-core machine, 26 s on a busy one
def test_the_quick_start_runs_on_one_fleet(docs_fleet: Fleet, tmp_path: Path) -> None:
    """The README's quick start, in its order, as a user types it: `up` prints what the
    README shows, `curl` gets an answer from each replica in turn, `status -o json | jq`
    prints docs/output.md's lines, `down` removes it; then the README's SDK snippet."""
    fleet = docs_fleet
    order = sorted(FLEET_STEPS, key=lambda s: ("SDK" in s.text, "down" in s.text))
    assert len(order) == len(FLEET_STEPS) >= 5
    port = None
    for step in order:
        if step.text == "the SDK snippet":
            assert step.block is not None
            fleet.wait_for("the service gone", lambda: not fleet.client().status(), 60)
            code = "\n".join(step.block.lines)
            proc = subprocess.run(
                [sys.executable, "-c", code],
                cwd=ROOT,
                env=fleet.env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, f"{step.where}:\n{proc.stdout}\n{proc.stderr}"
            # `print(...)  # WHAT IT PRINTS`: the comment is the output (the port aside)
            shown = [c.strip() for c in re.findall(r"print\(.*\)\s*#\s*(.+)$", code, re.M)]
            printed = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:30001", proc.stdout)
            missing = missing_lines(shown, printed)
            assert not missing, f"{step.where}: not printed: {missing}\nprinted:\n{proc.stdout}"
            continue
        line = step.text.replace(".venv/bin/fleetserve", "fleetserve")
        if port is not None:
            line = line.replace("127.0.0.1:30001", f"127.0.0.1:{port}")
        if line.startswith("curl "):
            assert port is not None, "curl before up"

            def both_ready() -> bool:
                (svc,) = fleet.client().status()
                return sum(r.status == "READY" for r in svc.replicas) == 2

            fleet.wait_for("both replicas READY (as the README's comment says)", both_ready, 60)
            url = shlex.split(line)[1]
            seen = {urllib.request.urlopen(url, timeout=10).read() for _ in range(4)}
            assert len(seen) == 2, (step.where, seen)  # two replicas, in turn
            continue
        command, _, pipe = line.partition(" | ")
        proc = fleet.cli(*shlex.split(command)[1:], cwd=ROOT, timeout=120)
        output = proc.stdout + proc.stderr  # what a terminal shows: progress may go to stderr
        if pipe:
            output = subprocess.run(
                shlex.split(pipe), input=proc.stdout, capture_output=True, text=True, timeout=30
            ).stdout
        if "up " in command:
            endpoint = endpoint_of(proc.stdout + proc.stderr)
            port = int(endpoint.rsplit(":", 1)[1])
            expect = [x.replace(":30001", f":{port}") for x in step.expect]
        else:
            expect = step.expect
        missing = missing_lines(expect, output)
        assert not missing, f"{step.where}: not printed: {missing}\nprinted:\n{output}"
    fleet.wait_for("the service gone", lambda: not fleet.client().status(), 60)
    assert json.loads(fleet.cli("status", "-o", "json").stdout) == []
    assert not [p for p in fleet.processes() if "server.py" in " ".join(p.cmdline())]


def test_no_doc_refers_to_a_file_of_the_repository_that_is_not_there() -> None:
    """Files in code spans (`examples/...`, `docs/...`, `scripts/...`, `bench/...`); folders
    may be another repository's (SkyPilot's `examples/serve/`)."""
    missing = []
    for path in harness.doc_files():
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            refs = re.findall(
                r"`((?:examples|docs|scripts|bench|fleetserve|tests)/[\w./-]+\.\w+)`", line
            )
            for ref in refs:
                if not (ROOT / ref).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {ref}")
    assert not missing, "\n".join(missing)


def test_environment_names_in_prose_are_read_by_the_code() -> None:
    """`FLEETSERVE_*` in any doc line: a renamed variable fails here."""
    code = harness.code_text()
    unknown = sorted(
        {
            f"{path.relative_to(ROOT)}: {name}"
            for path in harness.doc_files()
            for name in harness.ENV_NAME.findall(path.read_text())
            if name not in code
        }
    )
    assert not unknown, "\n".join(unknown)


if __name__ == "__main__":  # pragma: no cover
    os.execv(sys.executable, [sys.executable, "-m", "tests.docs.harness"])


def test_tables_of_measured_figures_name_the_command_that_produced_them() -> None:
    assert not harness.unsourced_tables()
    table = "| policy | p50 | p99 |\n|---|---|---|\n| a | 1 ms | 2 ms |\n| b | 3 ms | 4 ms |\n"
    assert harness.unsourced_in("Measured today:\n\n" + table) == ["3: | policy | p50 | p99 |"]
    assert harness.unsourced_in("`bench/lb/policies.py`:\n\n" + table) == []
