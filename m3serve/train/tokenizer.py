"""Byte-level BPE tokenizer for the embedded m3-tiny-verse model.

The tokenizer is trained from scratch on the training corpus with the `tokenizers`
library and saved in the layout `transformers.AutoTokenizer` reads from a directory:
tokenizer.json (the fast tokenizer), tokenizer_config.json (special tokens and the
chat template) and special_tokens_map.json.

Conventions (the engine relies on them):
- Encoding adds NO special tokens: `tok(text)` yields exactly the tokens of `text`.
  Special tokens written literally in the text (e.g. "<|bos|>") are parsed as one token.
- The chat template writes `<|bos|>` itself, then per message `<|role|>\\n{content}<|eos|>`,
  and, with add_generation_prompt, `<|assistant|>\\n`. So a rendered chat prompt must be
  encoded with add_special_tokens=False (harmless here, since nothing is added anyway),
  and generation stops at `<|eos|>` (= eos_token_id), which ends every turn.
- Digits are split one per token, so arithmetic is learnable by a small model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLES: tuple[str, ...] = ("system", "user", "assistant")
ROLE_TOKENS: tuple[str, ...] = tuple(f"<|{r}|>" for r in ROLES)
# Order fixes the ids: pad=0, bos=1, eos=2, system=3, user=4, assistant=5.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN) + ROLE_TOKENS
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# Jinja chat template; `render_chat` below is its Python twin (a test keeps them equal).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('chat role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages exactly as CHAT_TEMPLATE does (no tokenizer needed)."""
    parts = [BOS_TOKEN]
    for i, m in enumerate(messages):
        role = m.get("role")
        content = m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role']: expected one of {ROLES}, found {role!r}")
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}]['content']: expected str, found {type(content).__name__}")
        parts.append(f"<|{role}|>\n{content}{EOS_TOKEN}")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def chat_prompt(question: str) -> str:
    """The single-turn generation prompt used for task questions."""
    return render_chat([{"role": "user", "content": question}], add_generation_prompt=True)


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # NFC only: the Gutenberg texts mix composed and decomposed accents; nothing else is
    # normalised so that decode(encode(x)) == x for NFC input.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with SPECIAL_TOKENS at ids 0..5 and the full byte alphabet."""
    n_min = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_min:
        raise ValueError(f"vocab_size: expected >= {n_min} (specials + 256 bytes), found {vocab_size}")
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s}: expected id {i}, found {tok.token_to_id(s)}")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json (with chat_template) and special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ROLE_TOKENS),
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def load_tokenizer(path: str | Path):
    """Load the saved tokenizer directory with transformers (PreTrainedTokenizerFast)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
