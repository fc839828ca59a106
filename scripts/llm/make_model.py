"""Make the real-engine testbed's model offline: a small random-weight Llama and a byte-level
BPE tokenizer trained here, both seeded, so that vLLM can serve it with no model hub.

    .venv-vllm/bin/python scripts/llm/make_model.py [--out DIR]

The folder (default: $FLEETSERVE_TESTBED_MODEL, else ~/.cache/fleetserve/testbed/tiny-llama-v1)
is made once and reused: a `READY` file is written last, so a run killed half way makes it
again. The weights are random: the model's answers are noise, but everything an LLM server does
with them (tokenizing, paged KV cache, prefix caching, batching, streaming, metrics) is real,
and prompt processing costs what a model of this shape costs. Shape: 8 layers, hidden 512,
8 heads (4 KV heads), vocabulary 4,096 (the tokenizer's: every id the model can generate
decodes to text), context 4,096 tokens: about 31M parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

VERSION = "tiny-llama-v2"  # change it when the shape or the recipe changes
SEED = 20261204
VOCAB = 4096
CONTEXT = 4096

# A chat template in the shape Llama-style models ship (role headers, an end-of-turn token).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is string else "
    "(m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) }}"
    "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def default_dir() -> Path:
    env = os.environ.get("FLEETSERVE_TESTBED_MODEL")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "fleetserve" / "testbed" / VERSION


def corpus(rng: random.Random, lines: int) -> list[str]:
    """Seeded English-like text for the tokenizer: words drawn from a fixed list, so merges
    form on common words as they would on real text."""
    words = (  # noqa: SIM905 - one readable block of text
        "the of and to in is you that it he was for on are as with his they at be this have "
        "from or one had by word but not what all were we when your can said there use an each "
        "which she do how their if will up other about out many then them these so some her "
        "would make like him into time has look two more write go see number no way could people "
        "my than first water been call who oil its now find long down day did get come made may "
        "part model serve fleet replica request token cache prefix system user assistant answer "
        "question load balancer latency throughput engine batch prompt reply chat conversation"
    ).split()
    # Pseudo-words from syllables, so that BPE learns a full vocabulary (the model's: every id
    # it can generate decodes to text) and rare words still split into several tokens.
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    words += ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(6000)]
    out = []
    for _ in range(lines):
        n = rng.randint(5, 30)
        out.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + ".")
    return out


def make_tokenizer(out: Path, rng: random.Random) -> int:
    """Train and save the tokenizer; its vocabulary size (the model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|bos|>", "<|eos|>", "<|start|>", "<|end|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rng, 40000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def make_model(out: Path, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=3,
        pad_token_id=4,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 3, "pad_token_id": 4}) + "\n"
    )


def make(out: Path) -> Path:
    if (out / "READY").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        rng = random.Random(SEED)
        vocab = make_tokenizer(tmp, rng)
        make_model(tmp, vocab)
        (tmp / "READY").write_text(f"{VERSION} seed {SEED}\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp's 0700: replicas of other users read it too
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="model folder (made once)")
    args = ap.parse_args()
    out = make(args.out or default_dir())
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
