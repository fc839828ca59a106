"""`workdir: {url, ref}`: a replica's working folder cloned from a git repository.

A ref that looks like a commit (7 to 40 hex digits) is checked out after a full clone; any
other ref (a branch or a tag) is cloned alone at depth 1. Every git command runs with no
prompt (a repository that needs credentials fails instead of waiting for a password) and
within one bounded time for the whole clone."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fleetserve.core.errors import TerminalError

CLONE_TIMEOUT = 300.0  # seconds for the whole clone (and checkout) of one replica's workdir
_COMMIT = re.compile(r"[0-9a-fA-F]{7,40}")
_USERINFO = re.compile(r"(://)[^/@\s]*@")  # https://user:token@host: never shown


@dataclass(frozen=True)
class GitSource:
    url: str
    ref: str | None = None


def shown_url(text: str) -> str:
    """A URL (or git's message quoting one) without the credentials it may carry."""
    return _USERINFO.sub(r"\1***@", text)


def clone_commands(src: GitSource, dest: Path) -> list[list[str]]:
    """The git commands that make `dest` a checkout of `src` (pure: tested as a table)."""
    base = ["git", "-c", "protocol.ext.allow=never", "-c", "advice.detachedHead=false"]
    if src.ref is None:
        return [[*base, "clone", "--depth", "1", "--", src.url, str(dest)]]
    if _COMMIT.fullmatch(src.ref):
        return [
            [*base, "clone", "--no-checkout", "--", src.url, str(dest)],
            [*base, "-C", str(dest), "checkout", "--detach", src.ref, "--"],
        ]
    return [[*base, "clone", "--depth", "1", "--branch", src.ref, "--", src.url, str(dest)]]


def clone(src: GitSource, dest: Path, timeout: float = CLONE_TIMEOUT) -> None:
    """Clone `src` into `dest` (which must not exist); TerminalError says why it failed."""
    what = shown_url(src.url) + (f" at {src.ref}" if src.ref else "")
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "", "SSH_ASKPASS": ""}
    deadline = time.monotonic() + timeout
    for cmd in clone_commands(src, dest):
        try:
            # Its own process group: a timeout kills git's helpers too (git-remote-*, ssh),
            # which would otherwise hold its stderr open.
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise TerminalError("workdir: a git repository needs git installed") from None
        try:
            _out, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TerminalError(f"workdir: cloning {what} took longer than {timeout:g} s") from None
        if proc.returncode != 0:
            lines = [line for line in stderr.splitlines() if line.strip()]
            why = shown_url(lines[-1].strip())[:300] if lines else f"exit {proc.returncode}"
            raise TerminalError(f"workdir: cloning {what} failed: {why}")
