"""The token ids an engine will see for a request, for cache_aware's precise mode: the model
folder's `tokenizer.json` (the `tokenizers` library) and its chat template (jinja2, in the
environment transformers and vLLM render it with), so that the LB's block keys are the engine's.

vLLM renders chat `messages` with the template (`add_generation_prompt` true unless the request
says otherwise) and tokenizes the text without adding special tokens (the template has them);
a completion's `prompt` string is tokenized with them. A request this module cannot render
exactly as vLLM would (tools, images, other content parts, a template error) gets no tokens:
the policy then places it with the approximate index, as before.

A long prompt takes the tokenizer a while (about 0.15 s for 250 KB on an idle core, 0.4-0.7 s
on a loaded one), so `LoopTokenizer` keeps the load balancer's event loop free of it: a short
body is tokenized inline (cheaper than the hand-off), a longer one in a thread of its own,
with a bound on the bytes waiting there (past it, the request is placed by the approximate
index). In the thread the tokenizer runs without the GIL (`encode_batch` releases it; `encode`
does not), so the loop keeps proxying meanwhile.

Optional dependencies (the `llm` extra): `tokenizers` and `jinja2`. `load` says which is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

MAX_TOKENS = 1 << 20  # a prompt longer than this is not tokenized (the approximate index serves)
MAX_CHARS = 4 * 1024 * 1024
# Bodies up to this size are tokenized on the event loop (bench/lb/tokenizer_cost.py: a 2 KB
# chat body takes ~0.5 ms there, the hand-off to the thread ~0.1 ms of the loop's time but
# ~0.1-0.2 ms more for the request; an 8 KB one blocks the loop 2-3 ms).
INLINE_BYTES = 2048
# Bytes of bodies waiting for (or in) the tokenizer thread, at most; one body is always taken.
MAX_QUEUED_BYTES = 4 * 1024 * 1024
log = logging.getLogger("fleetserve.lb")

MISSING = (
    "cache_aware's precise mode (service.load_balancer.kv_events) needs the optional packages "
    "of fleetserve's `llm` extra: pip install 'fleetserve[llm]' ({missing} is not installed)"
)


class TokenizerError(Exception):
    """The tokenizer folder cannot be used (missing files or packages)."""


def _special(config: dict[str, Any], name: str) -> str:
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _content(content: object) -> str | None:
    """A message's content as vLLM gives it to a string-format template: a string, or its text
    parts joined by newlines; None for anything else (images, audio, tool data)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "\n".join(texts)
    return None


class PromptTokenizer:
    """Renders and tokenizes request bodies as the engine does (see the module's docstring)."""

    def __init__(
        self,
        encode: Callable[[str, bool], list[int]],
        template: Any,
        special: dict[str, str],
        encode_unlocked: Callable[[str, bool], list[int]] | None = None,
    ):
        self._encode = encode
        # The same ids, made without holding the GIL (for a thread beside the event loop).
        self._encode_unlocked = encode_unlocked or encode
        self._template = template
        self._special = special

    @classmethod
    def load(cls, folder: str | Path) -> PromptTokenizer:
        """From a model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja).
        Raises TokenizerError naming what is missing."""
        try:
            import jinja2.sandbox
            from tokenizers import Tokenizer
        except ImportError as e:
            raise TokenizerError(MISSING.format(missing=e.name)) from None
        root = Path(folder)
        if not (root / "tokenizer.json").is_file():
            raise TokenizerError(f"{root}: no tokenizer.json (service.load_balancer.tokenizer)")
        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # (tokenizers raises a bare Exception on a corrupt file)
            raise TokenizerError(f"{root / 'tokenizer.json'}: unusable: {e}") from None
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            loaded = json.loads((root / "tokenizer_config.json").read_text())
            config = loaded if isinstance(loaded, dict) else {}
        source = config.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
        template = None
        if isinstance(source, str):
            # As transformers compiles chat templates (vLLM renders with it).
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **_: Any) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                template = env.from_string(source)
            except jinja2.exceptions.TemplateError as e:
                raise TokenizerError(f"{root}: the chat template does not compile: {e}") from None
        special = {
            name: _special(config, name)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }

        def encode(text: str, add_special: bool) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=add_special).ids)

        def encode_unlocked(text: str, add_special: bool) -> list[int]:
            # encode_batch releases the GIL while it works; encode holds it throughout.
            return list(tokenizer.encode_batch([text], add_special_tokens=add_special)[0].ids)

        return cls(encode, template, special, encode_unlocked)

    def render(self, doc: dict[str, Any]) -> str | None:
        """The chat prompt text of a request, or None when it cannot be rendered exactly."""
        messages = doc.get("messages")
        if self._template is None or not isinstance(messages, list) or not messages:
            return None
        if doc.get("tools") or doc.get("documents") or doc.get("continue_final_message"):
            return None
        conversation = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return None
            if m.get("tool_calls") or set(m) - {"role", "content", "name"}:
                return None
            content = _content(m.get("content"))
            if content is None:
                return None
            conversation.append({**m, "content": content})
        add_generation_prompt = doc.get("add_generation_prompt", True)
        kwargs = doc.get("chat_template_kwargs")
        extra = kwargs if isinstance(kwargs, dict) else {}
        try:
            text: str = self._template.render(
                **{
                    **self._special,
                    **extra,
                    "messages": conversation,
                    "add_generation_prompt": add_generation_prompt is not False,
                }
            )
        except Exception:  # a template's own error (raise_exception) or a sandbox refusal
            return None
        return text

    def tokens(self, body: bytes, unlocked: bool = False) -> tuple[int, ...]:
        """The prompt's token ids, () when this request has none this module can vouch for.
        `unlocked`: tokenize without holding the GIL (from a thread beside the event loop)."""
        if len(body) > MAX_CHARS:
            return ()
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return ()
        if not isinstance(doc, dict):
            return ()
        if "messages" in doc:
            text = self.render(doc)
            add_special = doc.get("add_special_tokens", False) is True
        else:
            prompt = doc.get("prompt")
            text = prompt if isinstance(prompt, str) else None
            add_special = doc.get("add_special_tokens", True) is not False
        if not text or len(text) > MAX_CHARS:
            return ()
        try:
            ids = (self._encode_unlocked if unlocked else self._encode)(text, add_special)
        except TypeError:  # lone surrogates (JSON allows them): not text the engine could take
            return ()
        return tuple(ids) if len(ids) <= MAX_TOKENS else ()


class LoopTokenizer:
    """A PromptTokenizer for the event loop (see the module's docstring): `inline` says whether
    a body is tokenized on the loop (`tokens`), else `tokens_off_loop` hands it to the thread."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        inline_bytes: int = INLINE_BYTES,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.inline_bytes = inline_bytes
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.skipped = 0  # bodies placed by the approximate index: the queue was full
        self._logged = 0.0
        self._pool: ThreadPoolExecutor | None = None  # made on first use

    def inline(self, body: bytes) -> bool:
        return len(body) <= self.inline_bytes

    def tokens(self, body: bytes) -> tuple[int, ...]:
        return self.tokenizer.tokens(body)

    async def tokens_off_loop(self, body: bytes) -> tuple[int, ...]:
        """The same ids as `tokens`, made in the tokenizer thread; () when the bodies already
        waiting there come to `max_queued_bytes` (the request goes by the approximate index)."""
        size = len(body)
        if self.queued_bytes and self.queued_bytes + size > self.max_queued_bytes:
            self.skipped += 1
            now = time.monotonic()
            if now - self._logged >= 60:
                self._logged = now
                log.warning(
                    "cache_aware's precise mode: %d bytes of prompts wait for the tokenizer; "
                    "a %d-byte one goes by the approximate index (%d so far)",
                    self.queued_bytes,
                    size,
                    self.skipped,
                )
            return ()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fleetserve-tokenizer")
        loop = asyncio.get_running_loop()
        self.queued_bytes += size
        job = self._pool.submit(self.tokenizer.tokens, body, True)

        # Counted until the thread is done with it, even when its request went meanwhile.
        def done(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._release, size)

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def _release(self, size: int) -> None:
        self.queued_bytes -= size
