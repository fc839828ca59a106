"""Job YAMLs for pools: name, run and envs; what the workers did is noted; bad input named."""

from __future__ import annotations

import pytest

from fleetserve.core.errors import InvalidSpec
from fleetserve.spec.jobs import parse_job


def test_a_job_yaml_with_envs_and_overrides() -> None:
    job = parse_job("name: j\nrun: echo $A\nenvs: {A: 1, B: true, C: null}\n", {"C": "x"})
    assert (job.name, job.run) == ("j", "echo $A")
    assert job.envs == {"A": "1", "B": "true", "C": "x"}
    assert job.notes == []


def test_what_the_pool_already_did_is_noted_not_refused() -> None:
    job = parse_job("run: x\nsetup: pip install y\nfile_mounts: {/a: b}\nworkdir: .\n")
    assert [n.split(":")[0] for n in job.notes] == ["setup", "workdir", "file_mounts"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("name: x\n", "needs a `run`"),
        ("run: '   '\n", "needs a `run`"),
        ("- run: x\n", "is a mapping"),
        ("run: x\nservice: {replicas: 1}\n", "no service section"),
        ("run: x\npool: {workers: 1}\n", "no pool section"),
        ("run: x\nbogus: 1\n", "unknown field 'bogus'"),
        ("run: x\nenvs: [A]\n", "envs must be a mapping"),
        ("run: x\nenvs: {1A: b}\n", "not a variable name"),
        ("run: x\nenvs: {A: {b: c}}\n", "string or a number"),
        ("run: x\nname: [a]\n", "name:"),
        ("run: " + "x" * 300_000 + "\n", "longer than"),
    ],
)
def test_bad_job_yamls_name_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(InvalidSpec, match=words):
        parse_job(text)


def test_a_bad_env_override_is_refused() -> None:
    with pytest.raises(InvalidSpec, match="--env 1X"):
        parse_job("run: x\n", {"1X": "y"})


def test_a_jobs_resources_are_read_for_packing() -> None:
    job = parse_job("run: x\nresources: {cpus: 2+, accelerators: 'A100:1', memory: 8}\n")
    assert (job.cpus, job.accelerators) == (2.0, 1.0)
    assert job.notes == ["resources.memory: ignored (jobs are packed by cpus and accelerators)"]
    assert parse_job("run: x\nresources: {accelerators: {H100: 1, H200: 1}}\n").accelerators == 1
    with pytest.raises(InvalidSpec, match=r"resources\.cpus"):
        parse_job("run: x\nresources: {cpus: -2}\n")
    with pytest.raises(InvalidSpec, match="resources must be a mapping"):
        parse_job("run: x\nresources: 2\n")


def test_a_run_that_is_not_text_says_so() -> None:
    with pytest.raises(InvalidSpec, match="must be a string of commands"):
        parse_job("run: true\n")
