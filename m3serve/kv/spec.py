"""What the paged KV cache stores: layers, roles, storage formats and their bytes per token.

Roles (one sub-page per (layer, role) in every slot, see layout.py):
    k, v      every attention layer (target layers 0..num_layers-1 and the draft layer)
    index_k   every sparse (MSA) layer: one head of index_head_dim, replicated across TP ranks
    k_scale, v_scale   NVFP4 layers only: one E4M3 byte per 16 values, in a separate scale pool

Storage formats (`Fmt`):
    fp32 / bf16 / fp16   plain floats ("auto" = the model dtype)
    fp8                  float8_e4m3fn, unscaled (a saturating cast, scale 1), as TRT stores M3
    nvfp4                packed E2M1 (2 values per byte) + E4M3 block scales + fp32 global scale

kv_cache_dtype -> per-layer format:
    auto   every K/V = model dtype          bf16   every K/V = bf16
    fp8    every K/V = fp8                  nvfp4  sparse K/V = nvfp4, dense and draft K/V = fp8
           (the "hybrid" cache: only MSA has an NVFP4 consumer, mechanisms.md §1.1)

fp8_layers (hybrid cache only): sparse layers kept in FP8 instead of NVFP4, the few whose keys NVFP4 hurts
measurably (chosen by m3serve.kv.calibrate, listed in kv_scales.json). They keep their index-K and MSA selection;
only their K/V storage format (and so their sub-page size, and no scale pages) changes.

kv_rotation_seed (hybrid cache only): every NVFP4 layer's K and V head vectors are stored rotated by the
randomized Hadamard rotation of this seed (m3serve.kv.rotation), which spreads outlier channels before NVFP4
quantization; None stores them as they are. FP8 / BF16 layers and index-K (never NVFP4) are not rotated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from m3serve.kv.rotation import check_rotatable

KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "nvfp4")
INDEX_K_DTYPES = ("auto", "bf16", "fp8")
NVFP4_BLOCK = 16  # values per E4M3 block scale

_MODEL_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Storage dtype of each format's container and its bytes per stored element.
FMT_TORCH_DTYPE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "nvfp4": torch.uint8,
}
_FMT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "nvfp4": 4}


def fmt_container_dim(fmt: str, dim: int) -> int:
    """Last-dim length of the stored container for `dim` logical values (NVFP4 packs 2 per byte)."""
    return dim // 2 if fmt == "nvfp4" else dim


def fmt_bytes(fmt: str, num_values: int) -> int:
    """Data bytes for `num_values` values in `fmt` (scale bytes not included)."""
    return num_values * _FMT_BITS[fmt] // 8


@dataclass(frozen=True)
class KVCacheSpec:
    page_size: int
    num_layers: int
    sparse_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    index_head_dim: int
    kv_cache_dtype: str = "auto"
    index_k_dtype: str = "auto"
    model_dtype: torch.dtype = torch.float32
    num_draft_layers: int = 0
    # Added: the draft head may differ from the target in KV heads (MHA vs GQA Eagle3 heads).
    draft_num_kv_heads: int | None = None
    # Hybrid ("nvfp4") cache: sparse layers stored as FP8 instead of NVFP4 (kept sorted).
    fp8_layers: tuple[int, ...] = ()
    # Hybrid cache: seed of the randomized Hadamard rotation of the NVFP4 layers' K/V (None = unrotated).
    kv_rotation_seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sparse_layers", tuple(int(i) for i in self.sparse_layers))
        if not isinstance(self.fp8_layers, (tuple, list)) or any(
                not isinstance(i, int) or isinstance(i, bool) for i in self.fp8_layers):
            raise TypeError(f"KVCacheSpec.fp8_layers: expected a tuple of int layer ids, found {self.fp8_layers!r}")
        object.__setattr__(self, "fp8_layers", tuple(sorted(self.fp8_layers)))
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"KVCacheSpec.{name}: expected a positive int, found {val!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KVCacheSpec.kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, "
                             f"found {self.kv_cache_dtype!r}")
        if self.index_k_dtype not in INDEX_K_DTYPES:
            raise ValueError(f"KVCacheSpec.index_k_dtype: expected one of {INDEX_K_DTYPES}, "
                             f"found {self.index_k_dtype!r}")
        if self.model_dtype not in _MODEL_DTYPES:
            raise TypeError(f"KVCacheSpec.model_dtype: expected one of {tuple(_MODEL_DTYPES)}, "
                            f"found {self.model_dtype!r}")
        if self.num_draft_layers not in (0, 1):
            raise ValueError(
                f"KVCacheSpec.num_draft_layers: expected 0 or 1 (the layout holds exactly one shared local "
                f"draft layer), found {self.num_draft_layers!r}"
            )
        if len(set(self.sparse_layers)) != len(self.sparse_layers) or any(
            not 0 <= i < self.num_layers for i in self.sparse_layers
        ):
            raise ValueError(
                f"KVCacheSpec.sparse_layers: expected distinct layer ids in [0, {self.num_layers}), "
                f"found {self.sparse_layers}"
            )
        if self.sparse_layers and (not isinstance(self.index_head_dim, int) or self.index_head_dim <= 0):
            raise ValueError("KVCacheSpec.index_head_dim: expected a positive int with sparse layers, "
                             f"found {self.index_head_dim!r}")
        if self.draft_num_kv_heads is not None and self.draft_num_kv_heads <= 0:
            raise ValueError("KVCacheSpec.draft_num_kv_heads: expected None or a positive int, "
                             f"found {self.draft_num_kv_heads!r}")
        self._check_fp8_layers()
        self._check_rotation()
        if any(self.kv_format(i) == "nvfp4" for i in self.sparse_layers):
            if self.head_dim % NVFP4_BLOCK:
                raise ValueError(f"KVCacheSpec.head_dim: NVFP4 needs a multiple of {NVFP4_BLOCK}, "
                                 f"found {self.head_dim}")
            if self.page_size % 4:
                # V scale bytes are stored in 4-token quads (mechanisms.md §1.1).
                raise ValueError(f"KVCacheSpec.page_size: NVFP4 needs a multiple of 4, found {self.page_size}")

    def _check_fp8_layers(self) -> None:
        if not self.fp8_layers:
            return
        if self.kv_cache_dtype != "nvfp4":
            raise ValueError(f"KVCacheSpec.fp8_layers: per-layer FP8 overrides exist only in the hybrid cache "
                             f"(kv_cache_dtype 'nvfp4'), found kv_cache_dtype {self.kv_cache_dtype!r} with "
                             f"fp8_layers {self.fp8_layers}")
        if len(set(self.fp8_layers)) != len(self.fp8_layers):
            raise ValueError(f"KVCacheSpec.fp8_layers: expected distinct layer ids, found {self.fp8_layers}")
        not_sparse = [i for i in self.fp8_layers if i not in self.sparse_layers]
        if not_sparse:
            # Dense and draft layers are FP8 in the hybrid cache already; naming one is a wrong layer id.
            raise ValueError(f"KVCacheSpec.fp8_layers: expected sparse (MSA) layers from {self.sparse_layers}, "
                             f"found {not_sparse} among {self.fp8_layers}")

    def _check_rotation(self) -> None:
        seed = self.kv_rotation_seed
        if seed is None:
            return
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"KVCacheSpec.kv_rotation_seed: expected None or a non-negative int, found {seed!r}")
        if self.kv_cache_dtype != "nvfp4":
            raise ValueError(f"KVCacheSpec.kv_rotation_seed: the K/V rotation applies to NVFP4 layers, which only the "
                             f"hybrid cache (kv_cache_dtype 'nvfp4') has; found kv_cache_dtype "
                             f"{self.kv_cache_dtype!r} with kv_rotation_seed {seed}")
        check_rotatable(self.head_dim)

    # --- layers and formats ------------------------------------------------------------------
    @property
    def draft_layer(self) -> int:
        """Layer id of the shared draft layer: appended after the target layers."""
        return self.num_layers

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers + self.num_draft_layers

    @property
    def dense_layers(self) -> tuple[int, ...]:
        sparse = set(self.sparse_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.num_attention_layers:
            draft = f" (draft layer {self.draft_layer})" if self.num_draft_layers else " (no draft layer configured)"
            raise ValueError(f"layer: expected an int in [0, {self.num_attention_layers}){draft}, found {layer!r}")

    def kv_heads(self, layer: int) -> int:
        self.check_layer(layer)
        if layer == self.draft_layer and self.draft_num_kv_heads is not None:
            return self.draft_num_kv_heads
        return self.num_kv_heads

    def kv_format(self, layer: int) -> str:
        self.check_layer(layer)
        if self.kv_cache_dtype == "auto":
            return _MODEL_DTYPES[self.model_dtype]
        if self.kv_cache_dtype == "nvfp4":
            return "nvfp4" if self.is_sparse(layer) and layer not in self.fp8_layers else "fp8"
        return self.kv_cache_dtype

    def is_rotated(self, layer: int) -> bool:
        """Whether `layer`'s K/V are stored in the rotated basis (an NVFP4 layer of a rotated cache)."""
        return self.kv_rotation_seed is not None and self.kv_format(layer) == "nvfp4"

    def index_k_format(self) -> str:
        return _MODEL_DTYPES[self.model_dtype] if self.index_k_dtype == "auto" else self.index_k_dtype

    # --- sizes -------------------------------------------------------------------------------
    def bytes_per_token(self) -> dict[str, int]:
        """True bytes per token per role on this rank (no padding), plus "total".

        sparse_kv / dense_kv / draft_kv: K+V data; sparse_kv_scale: NVFP4 block-scale bytes
        (K and V); index_k: index-K of all sparse layers. The per-tensor global scales are
        per layer, not per token, so they do not appear.
        """
        out = {"sparse_kv": 0, "sparse_kv_scale": 0, "dense_kv": 0, "index_k": 0, "draft_kv": 0}
        for layer in range(self.num_attention_layers):
            fmt = self.kv_format(layer)
            values = 2 * self.kv_heads(layer) * self.head_dim
            if layer == self.draft_layer:
                out["draft_kv"] += fmt_bytes(fmt, values)
            elif self.is_sparse(layer):
                out["sparse_kv"] += fmt_bytes(fmt, values)
                if fmt == "nvfp4":
                    out["sparse_kv_scale"] += values // NVFP4_BLOCK
                out["index_k"] += fmt_bytes(self.index_k_format(), self.index_head_dim)
            else:
                out["dense_kv"] += fmt_bytes(fmt, values)
        out["total"] = sum(out.values())
        return out

    def split_summary(self) -> str:
        """E.g. "56 sparse = NVFP4/P128, 1 sparse = FP8/P128, 3 dense = FP8/P128, 1 draft = FP8/P128,
        index-K = BF16": one entry per (kind, format), the most common format of a kind first."""
        parts = []
        groups = (("sparse", self.sparse_layers), ("dense", self.dense_layers),
                  ("draft", (self.draft_layer,) if self.num_draft_layers else ()))
        for name, layers in groups:
            by_fmt: dict[str, list[int]] = {}
            for layer in layers:
                by_fmt.setdefault(self.kv_format(layer), []).append(layer)
            for fmt, members in sorted(by_fmt.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
                parts.append(f"{len(members)} {name} = {fmt.upper()}/P{self.page_size}")
        if self.sparse_layers:
            parts.append(f"index-K = {self.index_k_format().upper()}")
        if self.kv_rotation_seed is not None:
            parts.append(f"NVFP4 K/V Hadamard-rotated (seed {self.kv_rotation_seed})")
        return ", ".join(parts)

    @staticmethod
    def from_model_config(
        cfg: Any,
        *,
        tp_size: int = 1,
        kv_cache_dtype: str = "auto",
        index_k_dtype: str = "auto",
        model_dtype: torch.dtype = torch.bfloat16,
        num_draft_layers: int = 0,
        draft_num_kv_heads: int | None = None,
        fp8_layers: tuple[int, ...] = (),
        kv_rotation_seed: int | None = None,
    ) -> KVCacheSpec:
        """Spec for one TP rank of a model config (duck-typed m3serve.config.M3Config).

        KV heads are split across ranks and replicated when ranks outnumber heads; index-K is
        replicated on every rank. `draft_num_kv_heads` is the drafter's global KV head count
        (default: the target's), split the same way. `fp8_layers`, `kv_rotation_seed`: see the module doc.
        """
        if not isinstance(tp_size, int) or tp_size <= 0:
            raise ValueError(f"tp_size: expected a positive int, found {tp_size!r}")
        layer_types = list(cfg.layer_types)
        if len(layer_types) != cfg.num_hidden_layers:
            raise ValueError(
                f"cfg.layer_types: expected {cfg.num_hidden_layers} entries (num_hidden_layers), "
                f"found {len(layer_types)}"
            )
        for i, kind in enumerate(layer_types):
            if kind not in ("sparse", "full"):
                raise ValueError(f"cfg.layer_types[{i}]: expected 'sparse' or 'full', found {kind!r}")
        draft_heads = None if draft_num_kv_heads is None else max(1, draft_num_kv_heads // tp_size)
        return KVCacheSpec(
            page_size=int(cfg.index_block_size),
            num_layers=int(cfg.num_hidden_layers),
            sparse_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "sparse"),
            num_kv_heads=max(1, int(cfg.num_key_value_heads) // tp_size),
            head_dim=int(cfg.head_dim),
            index_head_dim=int(cfg.index_head_dim),
            kv_cache_dtype=kv_cache_dtype,
            index_k_dtype=index_k_dtype,
            model_dtype=model_dtype,
            num_draft_layers=num_draft_layers,
            draft_num_kv_heads=draft_heads,
            fp8_layers=fp8_layers,
            kv_rotation_seed=kv_rotation_seed,
        )
