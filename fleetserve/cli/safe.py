"""Showing text that came from a replica, a user or the controller in the CLI's rich output."""

from __future__ import annotations

from rich.markup import escape

from fleetserve.core.text import visible


def safe(text: str) -> str:
    """`text` for rich markup: its brackets shown as they are (never read as markup, which
    could hide them or fail the command) and its control characters as escapes (never acted
    on by the terminal); its lines kept."""
    return escape(visible(text, "\n"))
