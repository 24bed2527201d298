"""Tensor-parallel group handle. TP = 1 is the default and costs nothing: every collective is a no-op."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

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
