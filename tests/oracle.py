"""Shared fixtures: transformers' MiniMaxM3VLForCausalLM at tiny random configs, the test oracle."""

from __future__ import annotations

import torch
from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

# Two shapes that differ in every dimension that matters: GQA ratio, head / index dims, partial RoPE width,
# block size and top-k, local blocks, layer pattern (a sparse layer first, dense MLP after MoE), experts.
ORACLE_CONFIGS = {
    "a": dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=48, shared_intermediate_size=32, dense_intermediate_size=96,
              num_local_experts=6, num_experts_per_tok=2, index_n_heads=2, index_head_dim=32,
              index_block_size=8, index_topk_blocks=3,
              layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
              mlp_layer_types=["dense", "sparse", "sparse"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "b": dict(vocab_size=260, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
              head_dim=16, intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=64,
              num_local_experts=5, num_experts_per_tok=3, index_n_heads=3, index_head_dim=24,
              index_block_size=4, index_topk_blocks=4, index_local_blocks=2,
              layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
              mlp_layer_types=["sparse", "dense", "sparse"], routed_scaling_factor=1.5,
              rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}),
}


def make_oracle(name: str, seed: int = 0) -> MiniMaxM3VLForCausalLM:
    """A random fp32 oracle with non-trivial Gemma norms and router correction bias (zeros would hide bugs)."""
    torch.manual_seed(seed)
    cfg = MiniMaxM3VLTextConfig(max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                                **ORACLE_CONFIGS[name])
    m = MiniMaxM3VLForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0.0, 0.2)
    return m


def greedy_oracle(m, ids: torch.Tensor, n: int) -> list[int]:
    out = m.generate(ids[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                     pad_token_id=0)
    return out[0, ids.numel():].tolist()
