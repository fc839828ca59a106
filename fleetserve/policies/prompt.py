"""Reading a prompt out of a request body's head, without parsing the whole body: what the
body-reading policies key on when the body is long (or they read only its start)."""

from __future__ import annotations

import json
import re

_PROMPT = re.compile(rb'"(?:prompt|content|input)"\s*:\s*"((?:[^"\\]|\\.){1,4096})')
PEEK_BYTES = 16 * 1024  # how much of a body prefix_affinity reads for its prompt


def prompt_prefix(head: bytes, chars: int) -> str | None:
    """The first `chars` characters of the prompt in a JSON body's head (OpenAI-style
    `prompt`, the first message's `content`, or `input`), or None."""
    m = _PROMPT.search(head)
    if m is None:
        return None
    try:
        text = json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        text = m.group(1).decode(errors="replace")
    return str(text)[:chars] or None
