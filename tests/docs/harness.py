"""The docs harness: every command block of README.md, docs/*.md and examples/*/README.md is
checked against the code, so that a changed flag, output or example fails CI.

Each fenced block is cut into steps, and each step gets one action:

- `parse`: a `fleetserve ...` command (in a block or in an inline code span) is parsed by the real
  typer app's own parser: the subcommand must exist, every option must be one of its options
  with the right number of values, no positional argument too many. Placeholders (`NAME`,
  `[--wait]`, `A | B`, `...`) are read as the docs mean them.
- `run`: a quick command run for real, in process, on the real CLI (`fleetserve validate`,
  short `fleetserve simulate` runs, a YAML block fed to `fleetserve validate`); a console
  block's shown output must appear in what it prints.
- `fleet`: run for real against one shared fleet (a private controller started once by
  tests/docs/test_docs.py): `up` of the quick-start example, `curl` of its endpoint,
  `status -o json | jq`, `down`, the README's SDK snippet.
- `check`: what is not fleetserve's CLI but names something of the repository: a script must
  exist (and accept the `--flags` the docs give it), an extra (`.[sim]`) must be declared,
  an environment variable (`FLEETSERVE_*`) must be read by the code.
- `skip`: run nowhere, with the reason (another machine, a cloud, PostgreSQL, a long
  benchmark, a block of output).

`python -m tests.docs.harness` prints the whole list: what runs, what is only parsed, what
is skipped and why (`--json`: the same as data). The examples' service YAMLs
(examples/*/service.yaml) are validated too.
"""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
INLINE = re.compile(r"`(?:\.venv/bin/)?(fleetserve [^`]+)`")
ENV_NAME = re.compile(r"\b(FLEETSERVE_[A-Z0-9_]+)\b")

PARSE, RUN, FLEET, CHECK, SKIP = "parse", "run", "fleet", "check", "skip"

# Commands run for real in process: quick (a few seconds at most) and needing no controller.
QUICK = (
    re.compile(r"^fleetserve validate "),
    re.compile(r"^fleetserve simulate (?:autoscale )?--burst .* --duration (\d{1,4})\b"),
    re.compile(r"^fleetserve simulate (?:spot GCP1|--spot-trace GCP1)"),
    re.compile(r"^fleetserve pool simulate( --trace maf1 --max-workers \d+)?$"),
    re.compile(r"^fleetserve --show-completion"),
)
# Commands (and curls of the quick-start endpoint) run against the one shared fleet.
FLEET_COMMANDS = (
    re.compile(r"^fleetserve up examples/http_server/service\.yaml$"),
    re.compile(r"^fleetserve status hello -o json"),
    re.compile(r"^fleetserve down hello$"),
    re.compile(r"^curl http://127\.0\.0\.1:30001/"),
)
# Why a fleetserve command is parsed but not run (the first pattern that matches).
NOT_RUN = (
    (
        re.compile(r"--spot-trace AWS3|spot AWS3|--trace maf1 .*--plot|--duration 43200"),
        "a long run (>10 s)",
    ),
    (re.compile(r"--infra ray|RAY_ADDRESS"), "needs a Ray cluster"),
    (re.compile(r"FLEETSERVE_DB_URL|FLEETSERVE_HA"), "needs PostgreSQL or a second controller"),
    (re.compile(r"--install-completion"), "writes the user's shell profile"),
    (re.compile(r"^fleetserve (server|dashboard)\b"), "starts or stops this home's controller"),
    (re.compile(r"\bNAME\b|\bFILE\b|\bID\b|service-v2|pool-v2"), "placeholders (NAME, FILE...)"),
    (re.compile(r"^fleetserve (pool|jobs) "), "a pool's files (pool.yaml, job.yaml) of the user"),
    (re.compile(r"^fleetserve (chaos|up spot|status spotty)"), "needs FLEETSERVE_LOCAL_ZONES"),
    (re.compile(r"-f\b|--follow"), "follows forever"),
    (re.compile(r"."), "needs a service of the user's (not the quick-start)"),
)
SKIP_LINES = (
    (re.compile(r"^(createuser|createdb|git archive|tar |python3 -m venv|\. )"), "not fleetserve"),
    (re.compile(r"^pip install"), "installs packages (the extra is checked)"),
    (re.compile(r"^python3? -c "), "reads a live load balancer's file"),
    (
        re.compile(r"^curl .*/v1/embeddings"),
        "needs the embeddings example up (torch and its model: "
        "tests/e2e/test_embeddings_example.py runs it)",
    ),
    (re.compile(r"^curl .*/v1/chat/"), "needs vLLM (minutes to build: tests/e2e/test_vllm.py)"),
    (
        re.compile(r"^curl .*/metrics"),
        "needs a live controller's or LB's secret (tests/e2e/test_metrics.py scrapes both)",
    ),
    (re.compile(r"^curl "), "needs a live service"),
    (re.compile(r"^MODEL=\$\(\./scripts/llm/setup\.sh\)"), "builds vLLM (minutes)"),
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    lines: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass
class Step:
    where: str
    text: str
    action: str
    reason: str = ""
    expect: list[str] = field(default_factory=list)  # a console block's output lines
    block: Block | None = None


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "examples").glob("*/README.md"))
    return files


def blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2)
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        yield Block(path, start, lang, tuple(body))
        i += 1


def _joined(lines: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    """Lines with their `\\` continuations joined; (offset of the first, text)."""
    buf, first = "", 0
    for n, line in enumerate(lines):
        if not buf:
            first = n
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        yield first, buf + line
        buf = ""
    if buf:
        yield first, buf


def strip_comment(text: str) -> str:
    """A shell line without its `# comment` (not inside quotes)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def _fleetserve_line(text: str) -> str | None:
    """`fleetserve ...` (also `.venv/bin/fleetserve`, after `VAR=value` prefixes), or None."""
    words = text.split()
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    if words and words[0] in ("fleetserve", ".venv/bin/fleetserve"):
        if len(words) > 1 and not re.match(r"^[-a-z]", words[1]):
            return None  # output that names fleetserve: `fleetserve (launch to ...): 21 s`
        return " ".join(["fleetserve", *words[1:]])
    return None


def steps_of(block: Block) -> list[Step]:
    if block.lang == "yaml":
        return [_yaml_step(block)]
    if block.lang == "python":
        if "fleetserve.Client" in "\n".join(block.lines):
            return [Step(block.where, "the SDK snippet", FLEET, block=block)]
        return [Step(block.where, "python", SKIP, "not a runnable snippet", block=block)]
    if block.lang not in ("bash", "sh", "console", ""):
        return [Step(block.where, block.lang, SKIP, f"a {block.lang} block (not a command)")]
    console = block.lang == "console" or any(x.startswith("$ ") for x in block.lines)
    if (
        block.lang == ""
        and not console
        and not any(_fleetserve_line(strip_comment(x)) for x in block.lines)
    ):
        return [Step(block.where, block.lines[0] if block.lines else "", SKIP, "not commands")]
    out: list[Step] = []
    for offset, raw in _joined(block.lines):
        where = f"{block.path.relative_to(ROOT)}:{block.line + 1 + offset}"
        if console:
            if raw.startswith("$ "):
                out.append(_command_step(where, strip_comment(raw[2:]), block))
            elif raw.strip() and out:
                out[-1].expect.append(strip_comment(raw))
            continue
        for part in split_commands(strip_comment(raw)):
            out.append(_command_step(where, part, block))
    return out


def split_commands(text: str) -> list[str]:
    """A shell line cut at `;` and `&&` outside quotes."""
    parts, buf, quote, i = [], "", None, 0
    while i < len(text):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ";" or text.startswith("&&", i):
            parts.append(buf)
            buf = ""
            i += 2 if ch == "&" else 1
            continue
        buf += ch
        i += 1
    parts.append(buf)
    return [p.strip() for p in parts if p.strip()]


def _command_step(where: str, text: str, block: Block) -> Step:
    cmd = _fleetserve_line(text)
    if cmd is not None:
        if any(p.search(cmd) for p in FLEET_COMMANDS):
            return Step(where, text, FLEET, block=block)
        m = next((p.search(cmd) for p in QUICK if p.search(cmd)), None)
        if m is not None and "NAME" not in cmd:
            return Step(where, text, RUN, block=block)
        reason = next(r for p, r in NOT_RUN if p.search(text))
        return Step(where, text, PARSE, reason, block=block)
    if any(p.search(text) for p in FLEET_COMMANDS):
        return Step(where, text, FLEET, block=block)
    first = text.split()[0]
    if first.startswith(("./scripts/", ".venv/bin/python", "python")) and (
        first.startswith("./") or (len(text.split()) > 1 and text.split()[1].endswith(".py"))
    ):
        return Step(where, text, CHECK, "a script of the repository: exists, takes its flags")
    if text.startswith("export FLEETSERVE_") or text.startswith("FLEETSERVE_"):
        return Step(where, text, CHECK, "the environment variable is read by the code")
    if text.startswith("pip install"):
        return Step(where, text, CHECK, "the extra is declared in pyproject.toml")
    for pattern, reason in SKIP_LINES:
        if pattern.search(text):
            return Step(where, text, SKIP, reason, block=block)
    return Step(where, text, SKIP, "not a command of this repository", block=block)


def file_name(block: Block) -> str | None:
    """A YAML block that starts `# NAME.yaml` is that file, for the commands after it."""
    m = re.match(r"^# ([\w.-]+\.yaml)\b", block.lines[0]) if block.lines else None
    return m.group(1) if m else None


def _yaml_step(block: Block) -> Step:
    text = "\n".join(block.lines)
    name = file_name(block)
    if name is not None and name.startswith("bad"):
        return Step(block.where, f"yaml: {name}", RUN, "its errors: the next command", block=block)
    if re.search(r"^(service|pool|run|resources|name):", text, re.M):
        return Step(block.where, "yaml: fleetserve validate", RUN, block=block)
    return Step(block.where, "yaml", SKIP, "not a fleetserve YAML (Prometheus, ...)", block=block)


def inline_steps(path: Path) -> Iterator[Step]:
    """`fleetserve ...` in inline code spans, outside fenced blocks: parsed only."""
    fenced = False
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line) or (fenced and line.strip() == "```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in INLINE.finditer(line.replace("\\|", "|")):
            where = f"{path.relative_to(ROOT)}:{n}"
            yield Step(where, m.group(1), PARSE, "inline: the command and its options")


def example_files() -> list[Path]:
    """The examples' service YAMLs: each is validated as `fleetserve validate` does."""
    return sorted(
        p
        for p in (ROOT / "examples").rglob("*.yaml")
        if re.search(r"^(service|pool|run):", p.read_text(), re.M)
    )


def plan() -> list[Step]:
    steps: list[Step] = []
    for path in doc_files():
        for block in blocks(path):
            steps.extend(steps_of(block))
        steps.extend(inline_steps(path))
    for path in example_files():
        rel = path.relative_to(ROOT)
        steps.append(Step(f"{rel}:1", f"fleetserve validate {rel}", RUN))
    return steps


# -- parsing against the real CLI ---------------------------------------------------------------


@cache
def cli() -> Any:
    import typer.main

    from fleetserve.cli.main import app

    return typer.main.get_command(app)


def alternatives(cmd: str) -> list[list[str]]:
    """The argument lists a documented command stands for: `[x]` is x, `K[=V]` is K, `A | B`
    is A and the command's path + B, `--opt ...` is the option with a value, a word `a|b|c`
    in a subcommand's place is each of them; other `...` go."""
    cmd = cmd.split(" | jq")[0].split(" | yq")[0]
    cmd = re.sub(r"\s\d?>>?\s*\S+", "", cmd)  # redirections: `2>/dev/null`, `> out.json`
    cmd = re.sub(r"(?<=\S)\[[^\]\s]*\]", "", cmd)  # K[=V] -> K
    cmd = cmd.replace("[", " ").replace("]", " ")
    parts = re.split(r"\s\|\s", cmd)
    out = []
    for n, part in enumerate(parts):
        words = _values(shlex.split(part))
        if n == 0 or words[:1] == ["fleetserve"]:
            out.append(words)
        else:
            out.append(["fleetserve", *_path_of(out[0][1:]), *words])
    expanded = []
    for words in out:
        path = _path_of(words[1:])
        nxt = 1 + len(path)
        if nxt < len(words) and "|" in words[nxt] and not words[nxt].startswith("-"):
            for choice in words[nxt].split("|"):
                expanded.append([*words[:nxt], choice, *words[nxt + 1 :]])
        else:
            expanded.append(words)
    return expanded


def _values(words: list[str]) -> list[str]:
    """`--opt ...` keeps a value (`X`); other `...` and a trailing `...` of a word go."""
    out: list[str] = []
    for w in words:
        if w == "...":
            if out and out[-1].startswith("-"):
                out.append("X")
            continue
        out.append(w.removesuffix("..."))
    return out


def _path_of(words: list[str]) -> list[str]:
    cmd: Any = cli()
    path: list[str] = []
    for w in words:
        sub = getattr(cmd, "commands", {}).get(w)
        if sub is None:
            break
        cmd, path = sub, [*path, w]
    return path


def parse_error(words: list[str]) -> str | None:
    """None if the real CLI's parser takes `words` (fleetserve ...); else what is wrong."""
    import click

    cmd = cli()
    args = words[1:]
    name = "fleetserve"
    while True:
        ctx = click.Context(cmd, info_name=name)
        parser = cmd.make_parser(ctx)
        commands = getattr(cmd, "commands", None)
        if commands is not None:
            # a group: its own options, then a subcommand (or nothing: `fleetserve --x`); a
            # group that sends some spellings to a hidden command says how (`simulate --x`)
            args = getattr(cmd, "route", lambda a: a)(list(args))
            i = 0
            while i < len(args) and args[i].startswith("-"):
                i += 1
            try:
                parser.parse_args(args[:i])
            except Exception as e:
                return f"{name}: {e}"
            if i == len(args):
                return None
            sub = commands.get(args[i])
            if sub is None:
                return f"{name}: no command {args[i]!r} (has {', '.join(sorted(commands))})"
            cmd, name, args = sub, f"{name} {args[i]}", args[i + 1 :]
            continue
        try:
            _, rest, _ = parser.parse_args(list(args))
        except Exception as e:
            if args and args[-1].startswith("-") and "requires an argument" in str(e):
                return None  # prose naming an option: `fleetserve up --host`
            return f"{name}: {e}"
        if rest:
            return f"{name}: an argument too many: {rest}"
        return None


def check_parse(step: Step) -> str | None:
    cmd = _fleetserve_line(step.text) or step.text
    for words in alternatives(cmd):
        problem = parse_error(words)
        if problem is not None:
            return f"{step.where}: `{step.text}`: {problem}"
    return None


# -- checks of what is not the CLI ---------------------------------------------------------------


@cache
def code_text() -> str:
    """The code that may read an environment variable: fleetserve/, tests/, bench/, scripts/."""
    folders = ("fleetserve", "tests", "bench", "scripts")
    return "\n".join(
        p.read_text()
        for folder in folders
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".sh") and "docs" not in p.parts
    )


def check_other(step: Step) -> str | None:
    text = step.text
    problems = []
    for env in ENV_NAME.findall(text):
        if env not in code_text():
            problems.append(f"{env} is read nowhere (fleetserve/, tests/, bench/, scripts/)")
    extras = re.findall(r"\.\[([\w,-]+)\]", text)
    if extras:
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]
        for extra in ",".join(extras).split(","):
            if extra not in declared:
                problems.append(f"no extra {extra!r} in pyproject.toml")
    words = shlex.split(text.replace("[", " ").replace("]", " "))
    paths = [w for w in words if w.endswith((".py", ".sh"))]
    for other in paths[1:]:
        if not (ROOT / other).is_file():
            problems.append(f"{other} does not exist")
    script = paths[0] if paths else None
    if script is not None:
        path = ROOT / script
        if not path.is_file():
            problems.append(f"{script} does not exist")
        else:
            source = path.read_text()
            for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    problems.append(f"{script} takes no {flag}")
    return f"{step.where}: `{text}`: {'; '.join(problems)}" if problems else None


def main() -> None:
    """Print what the harness runs, parses, checks and skips, and why (`--json`: as data)."""
    steps = plan()
    if "--json" in sys.argv[1:]:
        import json

        rows = [
            {"where": s.where, "text": s.text, "action": s.action, "reason": s.reason}
            for s in steps
        ]
        print(json.dumps(rows, indent=1))
        return
    for action in (RUN, FLEET, PARSE, CHECK, SKIP):
        chosen = [s for s in steps if s.action == action]
        print(f"== {action}: {len(chosen)}")
        for s in chosen:
            why = f"  ({s.reason})" if s.reason else ""
            print(f"  {s.where}  {s.text[:100]}{why}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()


# -- measured figures ---------------------------------------------------------------------------

MEASURED = re.compile(r"\d[\d,.]*\s?(ms|µs|req/s|replica-h(ours)?|worker-h)\b")
COMMAND_NAMED = re.compile(r"bench/|\bbench\b|`fleetserve |fleetserve simulate|pytest|scripts/")


def unsourced_tables() -> list[str]:
    """Tables of measured figures (4 or more values in ms, µs, req/s, replica-hours) with no
    command named in them, in the 30 lines above or in the 3 below."""
    found = []
    for path in doc_files():
        name = str(path.relative_to(ROOT))
        found += [f"{name}:{line}" for line in unsourced_in(path.read_text())]
    return found


def unsourced_in(text: str) -> list[str]:
    """`unsourced_tables` of one document: "LINE: the table's header"."""
    lines = text.splitlines()
    found = []
    i, fenced = 0, False
    while i < len(lines):
        if lines[i].strip().startswith("```"):
            fenced = not fenced
        head = not fenced and lines[i].startswith("|") and i + 1 < len(lines)
        if head and re.match(r"^\|[-| :]+\|$", lines[i + 1].strip()):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            if len(MEASURED.findall("\n".join(lines[i:j]))) >= 4:
                near = "\n".join(lines[max(0, i - 30) : j + 3])
                if not COMMAND_NAMED.search(near):
                    found.append(f"{i + 1}: {lines[i][:70]}")
            i = j
        else:
            i += 1
    return found
