"""Tensor-parallel group handle. TP = 1 is the default and costs nothing: every collective is a no-op.

Sharding rules (one place, used by the layers, the loader, the KV spec and the memory plan):
  even split      rank r owns items [r*n/tp, (r+1)*n/tp)   (query heads, intermediate sizes, vocab)
  KV heads        split like the above while tp <= Hkv; when tp > Hkv (TP8 with 4 KV heads) each KV head is
                  replicated on tp/Hkv consecutive ranks, so rank r holds head r // (tp/Hkv) -- the head its
                  query heads [r*Hq/tp, (r+1)*Hq/tp) attend to under GQA grouping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1 (None: the default group)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"TPGroup.size: expected a positive int, found {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup.rank: expected an int in [0, {self.size}), found {self.rank!r}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max over ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_stack(self, x: torch.Tensor) -> torch.Tensor:
        """[*] on each rank -> [size, *] in rank order."""
        if self.size == 1:
            return x.unsqueeze(0)
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        if x.device.type == "cpu":   # gloo has no usable all_gather_into_tensor; views of `out` receive
            dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        else:
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        parts = self.all_gather_stack(x)                                  # [tp, ..., n]
        return torch.cat(parts.unbind(0), dim=-1)

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even slice of n items; raises when n does not split evenly."""
        if n % self.size:
            raise ValueError(f"{what}: size {n} does not split over tensor-parallel size {self.size}")
        per = n // self.size
        return self.rank * per, per

    def kv_head_shard(self, num_kv_heads: int) -> tuple[int, int]:
        """KV heads split across ranks, replicated when ranks outnumber heads (TP8 with 4 KV heads)."""
        if self.size <= num_kv_heads:
            return self.shard(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tensor-parallel size {self.size} is neither a divisor nor a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        return self.rank // (self.size // num_kv_heads), 1


SINGLE = TPGroup()


def check_tp_shapes(cfg, size: int) -> None:
    """Raise ValueError naming the first config dimension that `size` ranks cannot shard (before any
    process starts). Quantized checkpoints add block-alignment limits, checked by the loader."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: expected a positive int, found {size!r}")
    tp = TPGroup(0, size)
    tp.shard(cfg.num_attention_heads, "num_attention_heads")
    tp.kv_head_shard(cfg.num_key_value_heads)
    tp.shard(cfg.vocab_size, "vocab_size")
    if "dense" in cfg.mlp_layer_types:
        tp.shard(cfg.dense_intermediate_size, "dense_intermediate_size")
    if "moe" in cfg.mlp_layer_types:
        tp.shard(cfg.intermediate_size, "intermediate_size")
        if cfg.shared_intermediate_size:
            tp.shard(cfg.shared_intermediate_size, "shared_intermediate_size")
