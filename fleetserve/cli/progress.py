"""What a command that waits shows while it waits (`up`, `update`, `promote`, `rollback`,
`pool apply`, `jobs launch --wait`; docs/output.md).

On a terminal: a spinner line with the current state, and each change printed above it.
Piped: each change as one plain line on stderr, no spinner, so that stdout keeps only the
result. With `-o json|yaml` (quiet): nothing but the result on stdout and errors on stderr.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console


class Progress:
    def __init__(self, out: Console, err: Console, quiet: bool = False) -> None:
        self.out = out
        self.err = err
        self.quiet = quiet
        self.live = out.is_terminal and not quiet
        self._status: Any = None

    def __enter__(self) -> Progress:
        if self.live:
            self._status = self.out.status("", spinner="dots")
            self._status.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._status is not None:
            self._status.__exit__(exc_type, exc, tb)
            self._status = None

    def state(self, text: str) -> None:
        """The spinner's text (markup): the state now; nothing when not on a terminal."""
        if self._status is not None:
            self._status.update(text)

    def line(self, text: str) -> None:
        """A change worth a line of its own (markup)."""
        if self.quiet:
            return
        to = self.out if self.live else self.err
        to.print(text, highlight=False, soft_wrap=True)
