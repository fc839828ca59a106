"""Tokenizing requests as the engine does (fleetserve.lb.prompt_tokens) on a tokenizer made
here; tests/e2e/test_kv_events_vllm.py checks the same against vLLM's own /tokenize."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from fleetserve.lb.prompt_tokens import LoopTokenizer, PromptTokenizer, TokenizerError

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def make_tokenizer(root: Path) -> Path:
    """A byte-level BPE tokenizer with a chat template in `root` (a model folder's shape)."""
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|bos|>", "<|end|>", "<|start|>", "<|unk|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    tok.train_from_iterator(["hello world, the system prompt says hi"] * 50, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]
    )
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": {"content": "<|end|>"}})
    )
    (root / "chat_template.jinja").write_text(TEMPLATE)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def body(**doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_chat_is_rendered_then_tokenized_without_added_specials(folder: Path) -> None:
    pt = PromptTokenizer.load(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    msgs = [{"role": "system", "content": "the system prompt"}, {"role": "user", "content": "hi"}]
    text = "<|bos|><|start|>system\nthe system prompt<|end|>\n<|start|>user\nhi<|end|>\n"
    text += "<|start|>assistant\n"
    assert pt.render({"messages": msgs}) == text
    ids = tok.encode(text, add_special_tokens=False).ids
    assert pt.tokens(body(messages=msgs)) == tuple(ids)
    assert ids[0] == tok.token_to_id("<|bos|>")  # once: from the template
    # A later turn starts with the earlier turn's tokens (what prefix caching needs).
    longer = [*msgs, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    first = pt.tokens(body(messages=msgs, add_generation_prompt=False))
    assert pt.tokens(body(messages=longer))[: len(first)] == first
    # Text parts are joined by newlines, as vLLM gives them to a string-content template.
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert pt.render({"messages": [{"role": "user", "content": parts}]}) == pt.render(
        {"messages": [{"role": "user", "content": "a\nb"}]}
    )


def test_a_prompt_gets_the_special_tokens(folder: Path) -> None:
    pt = PromptTokenizer.load(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert pt.tokens(body(prompt="hello world")) == tuple(tok.encode("hello world").ids)


def test_what_it_cannot_vouch_for_gets_no_tokens(folder: Path) -> None:
    pt = PromptTokenizer.load(folder)
    image = [{"type": "image_url", "image_url": {"url": "data:"}}]
    for doc in (
        body(messages=[{"role": "user", "content": image}]),
        body(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]),
        body(messages=[{"role": "user"}, 5]),
        body(messages=[]),
        body(prompt=["a", "list"]),
        b"not json",
        b"[1, 2]",
        # Lone surrogates (valid JSON escapes): the tokenizer refuses them; no tokens, no raise.
        b'{"prompt": "hi \\ud800 there"}',
        b'{"messages": [{"role": "user", "content": "\\udfff x"}]}',
    ):
        assert pt.tokens(doc) == ()
        assert pt.tokens(doc, unlocked=True) == ()


def test_a_folder_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        PromptTokenizer.load(tmp_path)


def test_a_broken_template_is_named(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TokenizerError, match="chat template"):
        PromptTokenizer.load(tmp_path)


def long_chat(chars: int) -> bytes:
    return body(
        messages=[{"role": "user", "content": ("hello world, the prompt says hi " * chars)[:chars]}]
    )


def test_the_unlocked_tokens_are_the_same_and_leave_the_gil_to_other_threads(
    folder: Path,
) -> None:
    """What the tokenizer thread makes is what the event loop would have made, and while it
    works, another thread (the event loop) runs: tokenizers' encode holds the GIL throughout,
    its encode_batch does not."""
    pt = PromptTokenizer.load(folder)
    for doc in (body(prompt="hello world"), body(messages=[{"role": "user", "content": "hi"}])):
        assert pt.tokens(doc, unlocked=True) == pt.tokens(doc)
    doc = long_chat(250_000)

    def longest_stall(unlocked: bool) -> tuple[float, float]:
        gaps: list[float] = []
        done = threading.Event()

        def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.01)
        start = time.perf_counter()
        tokens = pt.tokens(doc, unlocked=unlocked)
        took = time.perf_counter() - start
        done.set()
        ticker.join()
        assert len(tokens) > 10_000
        return took, max(gaps)

    took, stall = longest_stall(unlocked=False)
    assert stall > 0.8 * took  # the GIL held: the other thread waited it all
    took, stall = longest_stall(unlocked=True)
    assert stall < 0.5 * took, (took, stall)


async def test_the_loop_tokenizer_takes_short_bodies_inline_and_bounds_what_waits(
    folder: Path,
) -> None:
    lt = LoopTokenizer(PromptTokenizer.load(folder), inline_bytes=2048, max_queued_bytes=300_000)
    short, long = long_chat(1000), long_chat(200_000)
    assert lt.inline(short) and not lt.inline(long)
    assert await lt.tokens_off_loop(long) == lt.tokens(long) != ()
    assert lt.queued_bytes == 0
    # Two long bodies at once exceed the bound: the second goes without tokens (approximate).
    first = asyncio.ensure_future(lt.tokens_off_loop(long))
    await asyncio.sleep(0)
    assert lt.queued_bytes == len(long)
    assert await lt.tokens_off_loop(long) == () and lt.skipped == 1
    assert await first == lt.tokens(long)
    # A request that leaves while its prompt is tokenized: its bytes count until the thread is
    # done with them (a client cannot pile up work by leaving).
    gone = asyncio.ensure_future(lt.tokens_off_loop(long))
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0)
    assert lt.queued_bytes == len(long)
    for _ in range(500):
        if not lt.queued_bytes:
            break
        await asyncio.sleep(0.01)
    assert lt.queued_bytes == 0
