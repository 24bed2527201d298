"""Byte layout of one slot: where each (layer, role) sub-page lives, and the sub-page arithmetic.

Shape legend (per sub-page, HND):
    k, v       [H, P, Dc]     H = local KV heads, P = page_size, Dc = head_dim (head_dim/2 for NVFP4)
    index_k    [P, Di]
    k_scale    [H, P*G]       uint8 bytes of E4M3 scales, G = head_dim/16, token-major (t*G + g)
    v_scale    [H, P*G]       same bytes in 4x4 token-quad order ((t//4)*4G + 4g + t%4)

A slot of the data pool is the concatenation of its sub-pages; V always directly follows K of
the same layer. Kernels address a layer through a flat pool of that layer's sub-page size,
rooted at the pool base, with

    K page = slot * index_scale + layer_offset,   V page = K page + 1

so slot_bytes must be a multiple of every K/V sub-page size and each sub-page offset a multiple
of its own size. Index-K pages are addressed by slot id only (MSA kernels index
[num_slots, P, Di] views), so they impose no slot-size multiple. Sub-pages are placed largest
first: with power-of-two sizes that leaves no alignment gaps, and the only padding rounds
slot_bytes up to a multiple of the largest K/V sub-page (zero for M3 at TP >= 4; under 0.6% at
TP 1-2, where index-K totals are not a multiple of the 4-head K/V page). Odd head counts may add
alignment gaps. All of it is reported as `padding_bytes`. The NVFP4 scale pool mirrors the data
pool slot for slot (same slot ids) with its own layout of k_scale/v_scale sub-pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from m3serve.kv.spec import FMT_TORCH_DTYPE, NVFP4_BLOCK, KVCacheSpec, fmt_bytes, fmt_container_dim


@dataclass(frozen=True)
class SubPage:
    layer: int
    role: str  # "k" | "v" | "index_k" | "k_scale" | "v_scale"
    offset: int  # byte offset inside the slot
    nbytes: int
    dtype: torch.dtype  # element type of the typed view
    shape: tuple[int, ...]  # typed page shape (see the legend)


@dataclass(frozen=True)
class SubpageGeometry:
    """Page-index converter of one layer in one pool (units = this layer's K/V sub-page)."""

    unit_bytes: int
    index_scale: int  # sub-pages per slot
    layer_offset: int  # K sub-page position inside a slot
    kv_offset: int = 1  # V follows K

    def num_pages(self, num_slots: int) -> int:
        """Length of the flat pool rooted at this layer's K: stops 2 past the last slot's K."""
        return (num_slots - 1) * self.index_scale + 2

    def k_page(self, slot: int) -> int:
        """Page index of `slot`'s K counted from the pool base (V is one further)."""
        return slot * self.index_scale + self.layer_offset


def _place(items: list[tuple[int, str, int, torch.dtype, tuple[int, ...]]], pair_roles: tuple[str, str] | None
           ) -> tuple[dict[tuple[int, str], SubPage], int, int]:
    """Lay out items = [(layer, role, nbytes, dtype, shape)] largest first; K/V pairs stay adjacent.

    Returns (sub-pages by (layer, role), slot_bytes, padding_bytes).
    """
    groups: list[list[tuple[int, str, int, torch.dtype, tuple[int, ...]]]] = []
    by_layer: dict[int, list] = {}
    for it in items:
        if pair_roles is not None and it[1] in pair_roles:
            by_layer.setdefault(it[0], []).append(it)
        else:
            groups.append([it])
    for layer, pair in by_layer.items():
        pair.sort(key=lambda it: pair_roles.index(it[1]))
        groups.append(pair)
    # Largest unit first, then by layer id and K/V before index-K, for a deterministic order.
    groups.sort(key=lambda g: (-g[0][2], g[0][0], g[0][1] not in (pair_roles or ())))
    pages: dict[tuple[int, str], SubPage] = {}
    offset = 0
    units = []  # K/V units: slot_bytes must be a multiple of each (integral index_scale)
    for group in groups:
        unit = group[0][2]
        if len(group) == 2:
            units.append(unit)
        offset = -(-offset // unit) * unit
        for layer, role, nbytes, dtype, shape in group:
            pages[(layer, role)] = SubPage(layer, role, offset, nbytes, dtype, shape)
            offset += nbytes
    used = sum(p.nbytes for p in pages.values())
    align = math.lcm(*units) if units else 1
    slot_bytes = -(-offset // align) * align
    return pages, slot_bytes, slot_bytes - used


class SlotLayout:
    """Sub-page placement for a KVCacheSpec: data pool and (for NVFP4) scale pool."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        p = spec.page_size
        data_items = []
        scale_items = []
        for layer in range(spec.num_attention_layers):
            fmt = spec.kv_format(layer)
            h = spec.kv_heads(layer)
            dc = fmt_container_dim(fmt, spec.head_dim)
            nbytes = fmt_bytes(fmt, h * p * spec.head_dim)
            for role in ("k", "v"):
                data_items.append((layer, role, nbytes, FMT_TORCH_DTYPE[fmt], (h, p, dc)))
            if fmt == "nvfp4":
                g = spec.head_dim // NVFP4_BLOCK
                for role in ("k_scale", "v_scale"):
                    scale_items.append((layer, role, h * p * g, torch.float8_e4m3fn, (h, p * g)))
            if spec.is_sparse(layer):
                ifmt = spec.index_k_format()
                data_items.append((layer, "index_k", fmt_bytes(ifmt, p * spec.index_head_dim),
                                   FMT_TORCH_DTYPE[ifmt], (p, spec.index_head_dim)))
        self.pages, self.slot_bytes, self.padding_bytes = _place(data_items, ("k", "v"))
        self.scale_pages, self.scale_slot_bytes, self.scale_padding_bytes = _place(scale_items, ("k_scale", "v_scale"))

    def page(self, layer: int, role: str) -> SubPage:
        key = (layer, role)
        if key in self.pages:
            return self.pages[key]
        if key in self.scale_pages:
            return self.scale_pages[key]
        raise ValueError(f"(layer, role): no sub-page {key!r} in this layout")

    def _geometry(self, k: SubPage, slot_bytes: int) -> SubpageGeometry:
        # Exactness is guaranteed by _place; the asserts document the contract kernels rely on.
        assert slot_bytes % k.nbytes == 0 and k.offset % k.nbytes == 0
        return SubpageGeometry(unit_bytes=k.nbytes, index_scale=slot_bytes // k.nbytes,
                               layer_offset=k.offset // k.nbytes)

    def geometry(self, layer: int) -> SubpageGeometry:
        """Converter of `layer`'s K/V sub-pages in the data pool."""
        self.spec.check_layer(layer)
        k, v = self.pages[(layer, "k")], self.pages[(layer, "v")]
        assert v.offset == k.offset + k.nbytes and v.nbytes == k.nbytes
        return self._geometry(k, self.slot_bytes)

    def scale_geometry(self, layer: int) -> SubpageGeometry:
        """Converter of `layer`'s K/V scale sub-pages in the scale pool (NVFP4 layers only)."""
        self.spec.check_layer(layer)
        if (layer, "k_scale") not in self.scale_pages:
            raise ValueError(f"layer: {layer} has no NVFP4 scale pages (format {self.spec.kv_format(layer)})")
        return self._geometry(self.scale_pages[(layer, "k_scale")], self.scale_slot_bytes)
