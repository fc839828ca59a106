"""Tokenizing requests as the engine does (fleetserve.lb.prompt_tokens) on a tokenizer made
here; tests/e2e/test_kv_events_vllm.py checks the same against vLLM's own /tokenize."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from fleetserve.lb.prompt_tokens import PromptTokenizer, TokenizerError

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


def test_a_folder_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        PromptTokenizer.load(tmp_path)


def test_a_broken_template_is_named(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TokenizerError, match="chat template"):
        PromptTokenizer.load(tmp_path)
