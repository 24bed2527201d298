"""Fixtures for the server tests: a tiny random-weight checkpoint with a real byte-level BPE tokenizer and
a chat template, saved to a temp dir, and helpers to serve it on 127.0.0.1 at a free port."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from m3serve import LLM
from m3serve.model.checkpoint import save_checkpoint
from m3serve.server.app import BackgroundServer, build_app

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL_NAME = "tiny-test"
# <unk>, <s>, </s> at ids 0, 1, 2: the tiny preset's bos/eos ids (1, 2) then mean the same tokens.
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS_ALPHABET = "abcdefghijklmnopqrstuvwxyz" * 3 + "éüß中文字"


def corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Pseudo-words with a few multi-byte characters, so byte-level tokens can split a UTF-8 character."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(WORDS_ALPHABET) for _ in range(rng.randint(2, 7))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(n_lines)]


def build_tokenizer(out_dir: str, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if tok.get_vocab_size() != vocab_size:   # every id the tiny model can emit must decode to something
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()}, expected {vocab_size}")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}, f)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tiny-model"))
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=1 << 20, seed=0)
    save_checkpoint(llm.model, llm.model.cfg, d, layout="original", dtype=torch.float32)
    build_tokenizer(d)
    return d


def make_llm(model_dir: str, **kw) -> LLM:
    kw.setdefault("kv_cache_bytes", 8 << 20)
    return LLM(model_dir, device="cpu", dtype="float32", **kw)


def serve(llm: LLM, **kw) -> BackgroundServer:
    return BackgroundServer(build_app(llm, served_model_name=MODEL_NAME, **kw), host="127.0.0.1", port=0).start()


def engine_idle(srv: BackgroundServer) -> dict:
    """Engine state read on its own thread once nothing is in flight: stats after clearing the prefix cache."""
    def probe(engine):
        engine.blocks.clear_prefix_cache()
        s = engine.stats()
        s["live_seqs"] = len(engine.blocks.live_seq_ids())
        s["requests"] = len(engine.requests)
        return s
    return srv.engine_loop.call_sync(probe)
