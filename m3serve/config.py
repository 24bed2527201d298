"""MiniMax-M3 model configuration: one dataclass, read from either config.json form, plus named presets.

Two on-disk forms exist:
  * published (`model_type: minimax_m3_vl`): the text model sits under `text_config` and uses the legacy
    names (`sparse_attention_config.*`, `moe_layer_freq`, `rotary_dim`, `use_gemma_norm`, ...);
  * transformers text-only (`model_type: minimax_m3_vl_text`): `layer_types`, `mlp_layer_types`,
    `index_*`, `rope_parameters` (with `partial_rotary_factor`).
Both parse into `M3Config`. Attention kind ("full" | "sparse") and MLP kind ("dense" | "moe") are per layer
and independent. Fields that change the math and that this engine does not implement raise, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

ATTN_KINDS = ("full", "sparse")
MLP_KINDS = ("dense", "moe")


class ConfigError(ValueError):
    """A config.json field is missing, inconsistent or describes a model this engine does not run."""


@dataclass
class M3Config:
    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    # MLPs
    intermediate_size: int = 3072          # one routed expert
    shared_intermediate_size: int = 3072   # the shared expert (0 = none)
    dense_intermediate_size: int = 12288   # dense-MLP layers
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # positions and norms
    rotary_dim: int = 64
    rope_theta: float = 5_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1_048_576
    # MiniMax Sparse Attention (lightning indexer)
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    # per-layer kinds
    layer_types: list[str] = field(default_factory=lambda: ["full"] * 3 + ["sparse"] * 57)
    mlp_layer_types: list[str] = field(default_factory=lambda: ["dense"] * 3 + ["moe"] * 57)
    # tokens
    bos_token_id: int | None = 200034
    eos_token_id: int | list[int] | None = 200020
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False  # M3 is untied; tied tiny configs load with the head = embedding

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types"):
            kinds = getattr(self, name)
            if len(kinds) != n:
                raise ConfigError(f"{name} has {len(kinds)} entries but num_hidden_layers is {n}")
        for i, k in enumerate(self.layer_types):
            if k not in ATTN_KINDS:
                raise ConfigError(f"layer_types[{i}] = {k!r}; expected one of {ATTN_KINDS}")
        for i, k in enumerate(self.mlp_layer_types):
            if k not in MLP_KINDS:
                raise ConfigError(f"mlp_layer_types[{i}] = {k!r}; expected one of {MLP_KINDS}")
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "index_block_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim = {self.rotary_dim}: must be even and in (0, head_dim={self.head_dim}]")
        if "sparse" in self.layer_types:
            if self.index_n_heads != self.num_key_value_heads:
                raise ConfigError(f"index_n_heads ({self.index_n_heads}) must equal num_key_value_heads "
                                  f"({self.num_key_value_heads}): one index head drives each KV group")
            if self.index_topk_blocks <= 0:
                raise ConfigError(f"index_topk_blocks must be positive, got {self.index_topk_blocks}")
            if self.index_local_blocks < 1:
                raise ConfigError(f"index_local_blocks = {self.index_local_blocks}: the query's own block "
                                  "must always be selected (>= 1)")
            if self.index_local_blocks + self.index_init_blocks > self.index_topk_blocks:
                raise ConfigError("index_local_blocks + index_init_blocks exceeds index_topk_blocks")
            if self.rotary_dim > self.index_head_dim:
                raise ConfigError(f"rotary_dim ({self.rotary_dim}) exceeds index_head_dim ({self.index_head_dim})")
        if "moe" in self.mlp_layer_types:
            if not 0 < self.num_experts_per_tok <= self.num_local_experts:
                raise ConfigError(f"num_experts_per_tok = {self.num_experts_per_tok} with "
                                  f"num_local_experts = {self.num_local_experts}")

    # ------------------------------------------------------------------ derived
    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_types) if k == "sparse")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (e,)

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2) + 2 * d
        index = h * self.index_head_dim * (self.index_n_heads + 1) + 2 * self.index_head_dim
        total = 2 * self.vocab_size * h + h
        for i in range(self.num_hidden_layers):
            total += attn + 2 * h + (index if self.layer_types[i] == "sparse" else 0)
            if self.mlp_layer_types[i] == "dense":
                total += 3 * h * self.dense_intermediate_size
            else:
                total += self.num_local_experts * (3 * h * self.intermediate_size + h) + self.num_local_experts
                total += 3 * h * self.shared_intermediate_size
        return total

    def context_limit(self, requested: int | None) -> int:
        """The longest context an engine serves: `requested` (max_model_len; None = the model's), at most the
        model's max_position_embeddings."""
        return min(requested or self.max_position_embeddings, self.max_position_embeddings)

    def truncated(self, num_layers: int) -> "M3Config":
        if not 0 < num_layers <= self.num_hidden_layers:
            raise ConfigError(f"cannot keep {num_layers} layers of a {self.num_hidden_layers}-layer model")
        return dataclasses.replace(self, num_hidden_layers=num_layers,
                                   layer_types=self.layer_types[:num_layers],
                                   mlp_layer_types=self.mlp_layer_types[:num_layers])

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "M3Config":
        model_type = raw.get("model_type")
        if model_type == "minimax_m3_vl" or "text_config" in raw:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config.json: model_type minimax_m3_vl needs a `text_config` object")
            return _from_text_dict(text, published=True)
        if model_type in ("minimax_m3_vl_text", None):
            return _from_text_dict(raw, published=model_type is None)
        raise ConfigError(f"config.json: model_type {model_type!r} is not a MiniMax-M3 model "
                          "(expected minimax_m3_vl or minimax_m3_vl_text)")

    @classmethod
    def from_file(cls, path: str) -> "M3Config":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    def to_text_dict(self) -> dict[str, Any]:
        """The transformers text-only form (`minimax_m3_vl_text`), which transformers 5.17 reads."""
        return {
            "model_type": "minimax_m3_vl_text",
            "architectures": ["MiniMaxM3VLForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "dense_intermediate_size": self.dense_intermediate_size,
            "num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit,
            "rotary_dim": self.rotary_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim},
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_block_size": self.index_block_size, "index_topk_blocks": self.index_topk_blocks,
            "index_local_blocks": self.index_local_blocks,
            "layer_types": ["minimax_m3_sparse" if k == "sparse" else "full_attention" for k in self.layer_types],
            "mlp_layer_types": ["sparse" if k == "moe" else "dense" for k in self.mlp_layer_types],
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "tie_word_embeddings": self.tie_word_embeddings,
        }

    def to_published_dict(self) -> dict[str, Any]:
        """The published checkpoint form (`minimax_m3_vl`, legacy names under `text_config`)."""
        sparse = [1 if k == "sparse" else 0 for k in self.layer_types]
        text = {
            "architectures": ["MiniMaxM3SparseForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size, "n_shared_experts": 1,
            "dense_intermediate_size": self.dense_intermediate_size,
            "num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor, "scoring_func": "sigmoid",
            "use_routing_bias": True, "norm_topk_prob": True,
            "hidden_act": "swigluoai", "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit,
            "rotary_dim": self.rotary_dim, "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "use_gemma_norm": True, "use_qk_norm": True, "qk_norm_type": "per_head",
            "attention_output_gate": False,
            "moe_layer_freq": [1 if k == "moe" else 0 for k in self.mlp_layer_types],
            "sparse_attention_config": {
                "use_sparse_attention": any(sparse), "sparse_index_dim": self.index_head_dim,
                "sparse_num_index_heads": self.index_n_heads, "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_block_size": self.index_block_size, "sparse_score_type": "max",
                "sparse_init_block": self.index_init_blocks, "sparse_local_block": self.index_local_blocks,
                "sparse_attention_freq": sparse, "sparse_disable_index_value": list(sparse),
            },
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "tie_word_embeddings": self.tie_word_embeddings,
        }
        return {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                "text_config": text, "tie_word_embeddings": self.tie_word_embeddings}


# ---------------------------------------------------------------------- parsing
def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _from_text_dict(t: dict[str, Any], *, published: bool) -> M3Config:
    where = "text_config" if published else "config"
    g = lambda k, d=None: t.get(k, d)  # noqa: E731
    defaults = M3Config()

    # Fields that change the math: refuse rather than silently run a different model.
    _require(g("use_gemma_norm", True) is True, f"{where}.use_gemma_norm = {g('use_gemma_norm')}: only Gemma "
             "(1 + w) RMSNorm is implemented")
    _require(g("use_qk_norm", True) is True, f"{where}.use_qk_norm = {g('use_qk_norm')}: M3 applies per-head q/k norm")
    _require(g("qk_norm_type", "per_head") == "per_head", f"{where}.qk_norm_type = {g('qk_norm_type')!r}: only "
             "'per_head' is implemented")
    _require(not g("attention_output_gate", False), f"{where}.attention_output_gate = true is not implemented")
    _require(g("scoring_func", "sigmoid") == "sigmoid", f"{where}.scoring_func = {g('scoring_func')!r}: only "
             "'sigmoid' routing is implemented")
    _require(g("norm_topk_prob", True) is True, f"{where}.norm_topk_prob = false is not implemented")
    _require(g("use_routing_bias", True) is True, f"{where}.use_routing_bias = false is not implemented")
    n_shared = g("n_shared_experts", 1)
    _require(n_shared in (0, 1), f"{where}.n_shared_experts = {n_shared}: 0 or 1 supported")
    act = g("hidden_act", "swigluoai")
    # transformers' text config forces hidden_act="silu" while implementing SwiGLU-OAI, so both names mean it.
    _require(act in ("swigluoai", "silu"), f"{where}.hidden_act = {act!r}: only swigluoai is implemented")

    num_layers = g("num_hidden_layers", defaults.num_hidden_layers)
    head_dim = g("head_dim") or g("hidden_size", defaults.hidden_size) // g("num_attention_heads", defaults.num_attention_heads)

    # RoPE width. transformers reads only rope_parameters.partial_rotary_factor (rotary_dim is never read);
    # the published form carries rotary_dim (and usually partial_rotary_factor). See ecosystem.md B.1.
    rope = g("rope_parameters") or {}
    if rope.get("rope_type", "default") not in ("default", None):
        raise ConfigError(f"{where}.rope_parameters.rope_type = {rope.get('rope_type')!r}: M3 uses plain RoPE; "
                          "no scaling is implemented")
    theta = rope.get("rope_theta", g("rope_theta", defaults.rope_theta))
    factor = rope.get("partial_rotary_factor", g("partial_rotary_factor"))
    if factor is not None:
        rotary_dim = int(head_dim * factor)
        if published and g("rotary_dim") is not None and g("rotary_dim") != rotary_dim:
            raise ConfigError(f"{where}: rotary_dim = {g('rotary_dim')} disagrees with partial_rotary_factor "
                              f"{factor} × head_dim {head_dim} = {rotary_dim}")
    elif published:
        rotary_dim = g("rotary_dim", defaults.rotary_dim)
    else:
        rotary_dim = head_dim  # transformers' semantics: no partial factor means full-width RoPE

    sparse_cfg = g("sparse_attention_config") or {}
    if sparse_cfg.get("sparse_score_type", "max") != "max":
        raise ConfigError(f"{where}.sparse_attention_config.sparse_score_type = "
                          f"{sparse_cfg.get('sparse_score_type')!r}: only 'max' is implemented")
    disable_iv = sparse_cfg.get("sparse_disable_index_value")
    freq = sparse_cfg.get("sparse_attention_freq")

    layer_types = g("layer_types")
    if layer_types is not None:
        mapping = {"full_attention": "full", "minimax_m3_sparse": "sparse", "full": "full", "sparse": "sparse"}
        bad = [x for x in layer_types if x not in mapping]
        _require(not bad, f"{where}.layer_types has unknown kinds {sorted(set(bad))}")
        layer_types = [mapping[x] for x in layer_types]
    elif freq is not None:
        layer_types = ["sparse" if f else "full" for f in freq]
    elif sparse_cfg.get("use_sparse_attention") is False:
        layer_types = ["full"] * num_layers
    else:
        layer_types = defaults.layer_types[:num_layers] if num_layers <= 60 else None
        _require(layer_types is not None, f"{where}: no layer_types / sparse_attention_freq for {num_layers} layers")
    if disable_iv is not None:
        for i, (kind, d) in enumerate(zip(layer_types, disable_iv)):
            _require(kind != "sparse" or d, f"{where}.sparse_attention_config.sparse_disable_index_value[{i}] = "
                     f"{d}: the index-value path is not implemented (M3 disables it on every sparse layer)")

    mlp_types = g("mlp_layer_types")
    if mlp_types is not None:
        mapping = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        bad = [x for x in mlp_types if x not in mapping]
        _require(not bad, f"{where}.mlp_layer_types has unknown kinds {sorted(set(bad))}")
        mlp_types = [mapping[x] for x in mlp_types]
    elif g("moe_layer_freq") is not None:
        mlp_types = ["moe" if f else "dense" for f in g("moe_layer_freq")]
    else:
        mlp_types = defaults.mlp_layer_types[:num_layers] if num_layers <= 60 else None
        _require(mlp_types is not None, f"{where}: no mlp_layer_types / moe_layer_freq for {num_layers} layers")

    def pick(flat: str, legacy: str, default):
        a, b = g(flat), sparse_cfg.get(legacy)
        if a is not None and b is not None and a != b:
            raise ConfigError(f"{where}: {flat} = {a} disagrees with sparse_attention_config.{legacy} = {b}")
        return a if a is not None else (b if b is not None else default)

    shared = g("shared_intermediate_size", defaults.shared_intermediate_size) if n_shared else 0
    return M3Config(
        vocab_size=g("vocab_size", defaults.vocab_size),
        hidden_size=g("hidden_size", defaults.hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=g("num_attention_heads", defaults.num_attention_heads),
        num_key_value_heads=g("num_key_value_heads", defaults.num_key_value_heads),
        head_dim=head_dim,
        intermediate_size=g("intermediate_size", defaults.intermediate_size),
        shared_intermediate_size=shared,
        dense_intermediate_size=g("dense_intermediate_size", defaults.dense_intermediate_size),
        num_local_experts=g("num_local_experts", defaults.num_local_experts),
        num_experts_per_tok=g("num_experts_per_tok", defaults.num_experts_per_tok),
        routed_scaling_factor=float(g("routed_scaling_factor", defaults.routed_scaling_factor)),
        swiglu_alpha=float(g("swiglu_alpha", defaults.swiglu_alpha)),
        swiglu_limit=float(g("swiglu_limit", defaults.swiglu_limit)),
        rotary_dim=rotary_dim,
        rope_theta=float(theta),
        rms_norm_eps=float(g("rms_norm_eps", defaults.rms_norm_eps)),
        max_position_embeddings=g("max_position_embeddings", defaults.max_position_embeddings),
        index_n_heads=pick("index_n_heads", "sparse_num_index_heads", defaults.index_n_heads),
        index_head_dim=pick("index_head_dim", "sparse_index_dim", defaults.index_head_dim),
        index_block_size=pick("index_block_size", "sparse_block_size", defaults.index_block_size),
        index_topk_blocks=pick("index_topk_blocks", "sparse_topk_blocks", defaults.index_topk_blocks),
        index_local_blocks=pick("index_local_blocks", "sparse_local_block", defaults.index_local_blocks),
        index_init_blocks=sparse_cfg.get("sparse_init_block", 0),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        bos_token_id=g("bos_token_id", defaults.bos_token_id),
        eos_token_id=g("eos_token_id", defaults.eos_token_id),
        pad_token_id=g("pad_token_id"),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
    )


# ---------------------------------------------------------------------- presets
def _tiny() -> M3Config:
    # CPU-sized, with 16-token blocks and top-2 so sparse selection is active past 32 tokens.
    return M3Config(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=64, shared_intermediate_size=64, dense_intermediate_size=256,
        num_local_experts=8, num_experts_per_tok=2, rotary_dim=16, rope_theta=10_000.0,
        max_position_embeddings=4096, index_n_heads=2, index_head_dim=32, index_block_size=16,
        index_topk_blocks=2, layer_types=["full", "sparse", "sparse", "sparse"],
        mlp_layer_types=["dense", "moe", "moe", "moe"], bos_token_id=1, eos_token_id=2)


PRESETS = {"minimax-m3": M3Config, "tiny": _tiny}


def preset(name: str) -> M3Config:
    """`minimax-m3`, `minimax-m3:L` (the first L layers at real dimensions) or `tiny`."""
    base, _, layers = name.partition(":")
    if base not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)} (and minimax-m3:L)")
    cfg = PRESETS[base]()
    if layers:
        if not layers.isdigit():
            raise ConfigError(f"preset {name!r}: the layer count after ':' must be an integer")
        cfg = cfg.truncated(int(layers))
    return cfg


def is_preset(name: str) -> bool:
    return name.partition(":")[0] in PRESETS and not os.path.exists(name)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["M3Config", "ConfigError", "preset", "is_preset", "PRESETS", "ceil_div"]
