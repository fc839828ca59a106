"""What a replica's host lacks, read from its log when `setup` fails: a command the shell did
not find (`bash: line 3: conda: command not found`), or the network (a download that could not
resolve or reach its host).

SkyPilot runs setup on its own VM images, which carry conda (Miniconda) and uv among other
tools; real service YAMLs call them in `setup` (docs/skyserve.md, "Hosts without SkyPilot's
image"). On a host without them the failure reason names the command and what provides it.
"""

from __future__ import annotations

import re
from pathlib import Path

TAIL_BYTES = 64 * 1024  # read from the log's end

# bash: `bash: line 3: conda: command not found`, `/x/setup.sh: line 3: uv: command not
# found`; dash: `sh: 1: conda: not found`.
_NOT_FOUND = re.compile(r":\s*(?:line\s+)?\d+:\s+([^\s:]+):\s+(?:command\s+)?not found\s*$")

# What provides a command that SkyPilot's images (or a GPU host) have and a plain host may not.
_PROVIDERS = {
    "conda": "conda (Miniconda), which SkyPilot's VM images carry",
    "mamba": "mamba (Miniforge), a conda that SkyPilot's VM images do not need",
    "micromamba": "micromamba",
    "uv": "uv (https://docs.astral.sh/uv/), which SkyPilot's VM images carry",
    "uvx": "uv (https://docs.astral.sh/uv/), which SkyPilot's VM images carry",
    "nvidia-smi": "an NVIDIA GPU and its driver",
    "nvcc": "the CUDA toolkit",
    "docker": "docker",
}


# What a download that cannot reach the network prints (pip, curl, wget, git, Python).
_OFFLINE = re.compile(
    r"Temporary failure in name resolution|Could not resolve host[^\n]*|"
    r"Name or service not known|Network is unreachable|No route to host|"
    r"Failed to establish a new connection|unable to resolve host address[^\n]*"
)


def offline(text: str) -> str:
    """`: ... this host may have no internet access` when `text` shows a download that
    could not reach the network ("" otherwise)."""
    found = _OFFLINE.findall(text)
    if not found:
        return ""
    return (
        f": setup could not reach the network ({found[-1].strip()[:120]}); this host may "
        "have no internet access, which SkyPilot's cloud VMs have"
    )


def missing_commands(text: str) -> list[str]:
    """The commands a shell reported as not found in `text`, first seen first."""
    found: list[str] = []
    for line in text.splitlines():
        m = _NOT_FOUND.search(line)
        if m and m.group(1) not in found:
            found.append(m.group(1))
    return found


def what_is_missing(commands: list[str]) -> str:
    """`: <cmd> not found: this host lacks ...` for a failure reason ("" when none)."""
    if not commands:
        return ""
    first = commands[0]
    lacks = _PROVIDERS.get(first.rsplit("/", 1)[-1], f"`{first}`")
    more = f" (also not found: {', '.join(commands[1:4])})" if len(commands) > 1 else ""
    return f": command not found in setup: {first}; this host lacks {lacks}{more}"


def setup_missing(log: Path) -> str:
    """`what_is_missing` for the commands the end of a replica's log reports not found, else
    `offline` for a download that could not reach the network."""
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return what_is_missing(missing_commands(text)) or offline(text)
