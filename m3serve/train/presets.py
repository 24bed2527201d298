"""Model and run sizes for training.

m3-tiny-verse: the shipped default model. The M3 layout at small size: 2 dense layers
(full attention, dense MLP), then 4 MSA layers (lightning indexer, 32-token blocks, top-8
so selection is active past 256 tokens) with MoE (8 routed experts, top-2, plus a shared
expert), vocabulary 3840. BF16 weights ~15.4 MB, so the checkpoint directory (with the
tokenizer and the held-out task file) stays under 16,000,000 bytes.

toy: a CPU-sized variant of the same layout for tests (selection active past 16 tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

from m3serve.config import M3Config
from m3serve.train.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True)
class RunPreset:
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    n_syn_train: int
    n_syn_heldout: int
    eval_items: int
    heldout_windows: int
    max_new_tokens: int
    sample_tokens: int


RUN_PRESETS: dict[str, RunPreset] = {
    "m3-tiny-verse": RunPreset(vocab_size=3840, seq_len=1024, batch_size=32, steps=1200, lr=2e-3,
                               warmup_steps=60, n_syn_train=100_000, n_syn_heldout=500, eval_items=256,
                               heldout_windows=32, max_new_tokens=40, sample_tokens=64),
    "toy": RunPreset(vocab_size=320, seq_len=64, batch_size=8, steps=30, lr=3e-3, warmup_steps=3,
                     n_syn_train=400, n_syn_heldout=16, eval_items=4, heldout_windows=4, max_new_tokens=12,
                     sample_tokens=8),
}


def model_config(preset: str, vocab_size: int) -> M3Config:
    """The M3Config of a preset with the trained tokenizer's vocabulary size."""
    if preset == "m3-tiny-verse":
        return M3Config(
            vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32, rope_theta=10_000.0,
            intermediate_size=128, shared_intermediate_size=128, dense_intermediate_size=512,
            num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
            rms_norm_eps=1e-6, max_position_embeddings=4096,
            index_n_heads=2, index_head_dim=64, index_block_size=32, index_topk_blocks=8, index_local_blocks=1,
            layer_types=["full"] * 2 + ["sparse"] * 4, mlp_layer_types=["dense"] * 2 + ["moe"] * 4,
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    if preset == "toy":
        return M3Config(
            vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, rotary_dim=8, rope_theta=10_000.0,
            intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=128,
            num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0,
            rms_norm_eps=1e-6, max_position_embeddings=256,
            index_n_heads=1, index_head_dim=16, index_block_size=8, index_topk_blocks=2, index_local_blocks=1,
            layer_types=["full", "sparse", "sparse"], mlp_layer_types=["dense", "moe", "moe"],
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    raise ValueError(f"preset: expected one of {sorted(RUN_PRESETS)}, found {preset!r}")


def estimate_weight_bytes(cfg: M3Config) -> int:
    """model.safetensors payload: BF16 tensors, except each MoE router and selection bias in fp32."""
    n_moe = sum(1 for k in cfg.mlp_layer_types if k == "moe")
    fp32 = n_moe * (cfg.num_local_experts * cfg.hidden_size + cfg.num_local_experts)
    return 2 * cfg.num_parameters() + 2 * fp32
