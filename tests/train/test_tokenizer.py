from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from m3serve.train.tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    SPECIAL_TOKENS,
    chat_prompt,
    render_chat,
    save_tokenizer,
    train_tokenizer,
)

TEXT = ("HAMLET. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles.\n") * 20
CHATS = [render_chat([{"role": "user", "content": f"What is {i} + {i * 3}?"},
                      {"role": "assistant", "content": f"{i} + {i * 3} = {4 * i}\n#### {4 * i}"}]) for i in range(50)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = train_tokenizer([TEXT] + CHATS, vocab_size=400)
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, d, model_max_length=1024)
    return d


def test_special_ids_and_digits(tok_dir: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    pieces = tok.convert_ids_to_tokens(tok("12345 + 678", add_special_tokens=True)["input_ids"])
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("12345678")  # one digit per token
    assert tok("abc")["input_ids"][0] != BOS_ID  # nothing is added by encode


def test_round_trip_including_unseen_bytes(tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for s in ["Whether 'tis nobler", "naïve café — ünïcödé ✓ 🎭", "  spaced\n\nlines\t42 "]:
        assert tok.decode(tok(s)["input_ids"]) == s


def test_chat_template_loads_and_matches_python_twin(tok_dir: Path) -> None:
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 7"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "and?"}]
    for gen in (False, True):
        want = render_chat(msgs, add_generation_prompt=gen)
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == want
    assert chat_prompt("Hi") == "<|bos|><|user|>\nHi<|eos|><|assistant|>\n"
    ids = tok(chat_prompt("Hi"))["input_ids"]
    assert ids[:2] == [BOS_ID, tok.convert_tokens_to_ids("<|user|>")]
    assert ids[-2] == tok.convert_tokens_to_ids("<|assistant|>")


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\]"):
        render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(TypeError, match=r"messages\[0\]\['content'\]"):
        render_chat([{"role": "user", "content": 3}])  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
