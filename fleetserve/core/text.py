"""Text that came from a replica or a user, made safe to show on a terminal."""

from __future__ import annotations


def _escaped(c: str) -> str:
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def visible(text: str, keep: str = "") -> str:
    """`text` with each character a terminal would act on instead of showing (control
    characters: an escape sequence's ESC, a bell, a carriage return; bidirectional overrides)
    written as its escape, e.g. `\\x1b`; the characters in `keep` (say, a newline) stay.
    Printable text comes back as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escaped(c) for c in text)
