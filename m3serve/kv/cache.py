"""PagedKVCache: one byte pool of slots holding every (layer, role) sub-page, plus the NVFP4 scale pool.

Shape legend:
    data pool    uint8 [num_slots, slot_bytes]         (layout.py says where each sub-page lies)
    scale pool   uint8 [num_slots, scale_slot_bytes]   mirrors the data pool slot for slot
    k/v pages    [num_slots, H, P, Dc]   typed views (HND), Dc = D (D/2 packed for NVFP4)
    index-K      [num_slots, P, Di]
    slot_mapping int64 [T]   flat token slot = slot_id * P + offset_in_page; < 0 = skip
    k, v         [T, H, D];  index_k [T, Di]
    kv_global_scale fp32 [num_attention_layers, 2]   NVFP4 encode scale of K (col 0) and V (col 1);
                                                      1.0 for layers that are not NVFP4
    kv_rotation_signs fp32 [D]   +-1 signs of the K/V rotation (spec.kv_rotation_seed; None unrotated)
    kv_rotation_matrix bf16 [D, D]  rotation.query_matrix of those signs (q @ M rotates q; o_rot @ M^T undoes V's)

Rotated layers (spec.is_rotated): write() stores rotation.rotate(K), rotate(V) (then quantizes); read() decodes
and un-rotates, so callers see K and V in the model's basis (q.k and p.v as without rotation, up to rounding).

write()/read() are the torch reference semantics for the Triton kernels to come.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from m3serve.device import canonical_device
from m3serve.kv import codec
from m3serve.kv import rotation
from m3serve.kv.draft_view import DraftKVView
from m3serve.kv.layout import SlotLayout, SubPage, SubpageGeometry
from m3serve.kv.spec import NVFP4_BLOCK, KVCacheSpec
from m3serve.quant.nvfp4 import nvfp4_global_scale

if TYPE_CHECKING:
    from m3serve.kv.block_manager import BlockManager

# Calibration amax behind the default NVFP4 global scale gs = 448*6/amax (m3serve.quant.nvfp4).
# It is the clip bound: |x| > amax saturates (the block scale tops out at 448). A 16-value block
# leaves E4M3's normal range only when its max is below amax * 2^-6 / 448 (~2.2e-3 here). For
# unit-RMS K/V (typical |x| of a few units) 64 leaves >10x headroom for outlier channels while
# every plausible block stays in range. Real checkpoints should set calibrated per-layer amaxes
# with set_nvfp4_amax.
DEFAULT_NVFP4_KV_AMAX = 64.0


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_slots: int, device: torch.device | str,
                 *, nvfp4_amax: float = DEFAULT_NVFP4_KV_AMAX) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec: expected KVCacheSpec, found {type(spec).__name__}")
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots: expected a positive int, found {num_slots!r}")
        self.spec = spec
        self.layout = SlotLayout(spec)
        self.num_slots = num_slots
        self.page_size = spec.page_size
        self.draft_layer = spec.draft_layer
        self.device = canonical_device(device)
        # Check bounds of slot ids on write/read (costs a device sync on CUDA; hot paths may disable).
        self.check_bounds = True
        self.data = torch.zeros(num_slots, self.layout.slot_bytes, dtype=torch.uint8, device=self.device)
        self.scales = (torch.zeros(num_slots, self.layout.scale_slot_bytes, dtype=torch.uint8, device=self.device)
                       if self.layout.scale_slot_bytes else None)
        self.kv_global_scale = torch.ones(spec.num_attention_layers, 2, dtype=torch.float32, device=self.device)
        self.kv_rotation_signs: Tensor | None = None
        self.kv_rotation_matrix: Tensor | None = None
        if spec.kv_rotation_seed is not None:
            signs = rotation.rotation_signs(spec.head_dim, spec.kv_rotation_seed)
            self.kv_rotation_signs = signs.to(self.device)
            self.kv_rotation_matrix = rotation.query_matrix(signs).to(torch.bfloat16).to(self.device)
        self._views: dict[tuple[int, str], Tensor] = {}
        for key, sp in self.layout.pages.items():
            self._views[key] = self._typed(self.data, sp)
        for key, sp in self.layout.scale_pages.items():
            self._views[key] = self._typed(self.scales, sp)
        for layer in range(spec.num_attention_layers):
            if spec.kv_format(layer) == "nvfp4":
                self.set_nvfp4_amax(layer, nvfp4_amax, nvfp4_amax)

    # --- construction from a memory budget ---------------------------------------------------
    @classmethod
    def from_budget(cls, spec: KVCacheSpec, *, device: torch.device | str, budget_bytes: int,
                    **kwargs) -> PagedKVCache:
        """As many slots as fit in `budget_bytes`, at the true hybrid bytes per slot (data + scales). On a GPU the
        runner's memory plan gives the bytes (runtime/memory_plan.kv_budget_bytes: the utilization's share of the
        card less what is in use and the steps' working memory)."""
        device = torch.device(device)
        layout = SlotLayout(spec)
        per_slot = layout.slot_bytes + layout.scale_slot_bytes
        num_slots = int(budget_bytes) // per_slot
        if num_slots < 1:
            raise ValueError(f"budget_bytes: {budget_bytes} B does not hold one {spec.page_size}-token slot "
                             f"({per_slot} B); raise the budget (kv_cache_bytes or gpu_memory_utilization)")
        return cls(spec, num_slots, device, **kwargs)

    def describe(self) -> str:
        """Start-up report: pages, tokens, bytes per page and per token per role."""
        bpt = self.spec.bytes_per_token()
        per_slot = self.layout.slot_bytes + self.layout.scale_slot_bytes
        roles = " ".join(f"{k}={v}" for k, v in bpt.items() if v or k == "total")
        pad = self.layout.padding_bytes + self.layout.scale_padding_bytes
        return (
            f"PagedKVCache on {self.device}: {self.num_slots} pages x {self.page_size} tokens = "
            f"{self.num_slots * self.page_size} tokens, {per_slot} B/page "
            f"(data {self.layout.slot_bytes} + scales {self.layout.scale_slot_bytes}, padding {pad}), "
            f"{_fmt_bytes(per_slot * self.num_slots)} total\n"
            f"  layers: {self.spec.split_summary()}\n"
            f"  bytes/token: {roles}"
        )

    # --- views -------------------------------------------------------------------------------
    def _typed(self, pool: Tensor, sp: SubPage) -> Tensor:
        raw = pool[:, sp.offset:sp.offset + sp.nbytes]
        return raw.view(sp.dtype).view(self.num_slots, *sp.shape)

    def pages(self, layer: int, role: str) -> Tensor:
        """Typed [num_slots, *page_shape] view of one (layer, role); see the shape legend."""
        self.spec.check_layer(layer)
        if (layer, role) not in self._views:
            raise ValueError(f"role: layer {layer} has no {role!r} sub-page (format {self.spec.kv_format(layer)})")
        return self._views[(layer, role)]

    def geometry(self, layer: int) -> SubpageGeometry:
        return self.layout.geometry(layer)

    def uniform_index_scale(self, layers: list[int] | tuple[int, ...]) -> int | None:
        """The index_scale shared by all `layers` (one expanded table serves them all), else None."""
        scales = {self.geometry(layer).index_scale for layer in layers}
        return scales.pop() if len(scales) == 1 else None

    def _flat(self, pool: Tensor, sp: SubPage, geom: SubpageGeometry) -> Tensor:
        n = geom.num_pages(self.num_slots)
        raw = pool.as_strided((n, sp.nbytes), (sp.nbytes, 1), pool.storage_offset() + sp.offset)
        return raw.view(sp.dtype).view(n, *sp.shape)

    def flat_subpage_pool(self, layer: int) -> Tensor:
        """[(num_slots-1)*scale + 2, *page_shape] pool rooted at `layer`'s K sub-page of slot 0.

        With the expanded table (K = slot*scale, V = K + 1) pool[K] / pool[V] are exactly that
        slot's K / V page of this layer. The length stops 2 past the last slot's K, so it never
        runs off the allocation (the bound is computed from this root, cf. TRT PR #17656).
        """
        return self._flat(self.data, self.layout.pages[(layer, "k")], self.geometry(layer))

    def flat_scale_pool(self, layer: int) -> Tensor:
        """Same as flat_subpage_pool for an NVFP4 layer's E4M3 scale pages (scale-pool geometry)."""
        geom = self.layout.scale_geometry(layer)
        return self._flat(self.scales, self.layout.scale_pages[(layer, "k_scale")], geom)

    def set_nvfp4_amax(self, layer: int, k_amax: float | Tensor, v_amax: float | Tensor) -> None:
        """Fix the per-tensor NVFP4 global scales of `layer` from calibration amaxes of K and V."""
        if self.spec.kv_format(layer) != "nvfp4":
            raise ValueError(f"layer: {layer} is stored as {self.spec.kv_format(layer)}, not nvfp4")
        for col, amax in enumerate((k_amax, v_amax)):
            self.kv_global_scale[layer, col] = nvfp4_global_scale(amax).to(self.device)

    # --- write / read --------------------------------------------------------------------------
    def _check_tokens(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor, index_k: Tensor | None) -> None:
        if not isinstance(slot_mapping, Tensor) or slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
            found = ((slot_mapping.dtype, tuple(slot_mapping.shape)) if isinstance(slot_mapping, Tensor)
                     else type(slot_mapping))
            raise TypeError(f"slot_mapping: expected int64 [T], found {found}")
        t = slot_mapping.shape[0]
        want = (t, self.spec.kv_heads(layer), self.spec.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or not x.is_floating_point():
                raise TypeError(f"{name}: expected a float tensor, found {getattr(x, 'dtype', type(x).__name__)}")
            if tuple(x.shape) != want:
                raise ValueError(f"{name}: expected shape [T, Hk, D] = {want}, found {tuple(x.shape)}")
        if index_k is not None and not isinstance(index_k, Tensor):
            raise TypeError(f"index_k: expected a tensor or None, found {type(index_k).__name__}")
        if self.spec.is_sparse(layer):
            if index_k is None:
                raise ValueError(f"index_k: layer {layer} is sparse (MSA) and needs index_k [T, Di], found None")
            if tuple(index_k.shape) != (t, self.spec.index_head_dim) or not index_k.is_floating_point():
                raise ValueError(f"index_k: expected float [T, Di] = {(t, self.spec.index_head_dim)}, "
                                 f"found {index_k.dtype} {tuple(index_k.shape)}")
        elif index_k is not None:
            raise ValueError(f"index_k: layer {layer} is dense/draft and has no index-K, found a tensor")
        for name, x in (("slot_mapping", slot_mapping), ("k", k), ("v", v), ("index_k", index_k)):
            if x is not None and x.device != self.device:
                raise ValueError(f"{name}: expected device {self.device}, found {x.device}")

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor, index_k: Tensor | None = None) -> None:
        """Quantize K, V (and index-K) of T tokens into their slots; slot_mapping < 0 skips a token.

        Each flat slot may appear at most once per call (duplicates leave an unspecified winner).
        """
        self.spec.check_layer(layer)
        self._check_tokens(layer, slot_mapping, k, v, index_k)
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
            index_k = None if index_k is None else index_k[valid]
        if slot_mapping.numel() == 0:
            return
        if self.check_bounds:
            top = int(slot_mapping.max())
            if top >= self.num_slots * self.page_size:
                raise ValueError(f"slot_mapping: expected flat slots < {self.num_slots * self.page_size} "
                                 f"(num_slots*page_size), found {top}")
        slot = slot_mapping // self.page_size
        off = slot_mapping % self.page_size
        fmt = self.spec.kv_format(layer)
        rotated = self.spec.is_rotated(layer)
        for col, role, x in ((0, "k", k), (1, "v", v)):
            if rotated:
                x = rotation.rotate(x, self.kv_rotation_signs)
            data, scale = codec.encode(fmt, x, self.kv_global_scale[layer, col])
            self._views[(layer, role)][slot, :, off] = data
            if scale is not None:
                self._write_scales(layer, role, slot, off, scale)
        if index_k is not None:
            data, _ = codec.encode(self.spec.index_k_format(), index_k)
            self._views[(layer, "index_k")][slot, off] = data

    def _write_scales(self, layer: int, role: str, slot: Tensor, off: Tensor, scale: Tensor) -> None:
        """Store E4M3 scales [T, H, G] of tokens at (slot, off) in mechanisms.md §1.1 byte order:
        K token-major (byte t*G + g), V in 4x4 token quads (byte (t//4)*4G + 4g + t%4)."""
        g = self.spec.head_dim // NVFP4_BLOCK
        p = self.page_size
        page = self._views[(layer, f"{role}_scale")]  # [N, H, P*G]
        h = page.shape[1]
        if role == "k":
            page.view(self.num_slots, h, p, g)[slot, :, off] = scale
        else:
            page.view(self.num_slots, h, p // 4, g, 4)[slot, :, off // 4, :, off % 4] = scale

    def read(self, layer: int, slots: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
        """K, V [length, Hk, D] (and index-K [length, Di] on sparse layers) of ONE sequence whose
        pages are `slots` (int64 [nblocks], in order), dequantized to `dtype` (un-rotated in fp32 first on a
        rotated layer)."""
        self.spec.check_layer(layer)
        if not isinstance(slots, Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            found = (slots.dtype, tuple(slots.shape)) if isinstance(slots, Tensor) else type(slots)
            raise TypeError(f"slots: expected int64 [nblocks], found {found}")
        if not isinstance(length, int) or not 0 <= length <= slots.shape[0] * self.page_size:
            raise ValueError(f"length: expected an int in [0, nblocks*page_size = {slots.shape[0] * self.page_size}], "
                             f"found {length!r}")
        if slots.device != self.device:
            raise ValueError(f"slots: expected device {self.device}, found {slots.device}")
        if self.check_bounds and slots.numel() and not bool(((slots >= 0) & (slots < self.num_slots)).all()):
            raise ValueError(f"slots: expected slot ids in [0, {self.num_slots}), found {slots.tolist()}")
        fmt = self.spec.kv_format(layer)
        out = []
        for col, role in ((0, "k"), (1, "v")):
            data = self._tokens(self._views[(layer, role)][slots], length)
            scale = None
            if fmt == "nvfp4":
                scale = self._tokens(self._scale_pages_hnd(layer, role, slots), length)
            if self.spec.is_rotated(layer):
                y = codec.decode(fmt, data, scale, self.kv_global_scale[layer, col], torch.float32)
                out.append(rotation.unrotate(y, self.kv_rotation_signs).to(dtype))
            else:
                out.append(codec.decode(fmt, data, scale, self.kv_global_scale[layer, col], dtype))
        index_k = None
        if self.spec.is_sparse(layer):
            pages = self._views[(layer, "index_k")][slots]  # [nb, P, Di]
            data = pages.reshape(-1, pages.shape[-1])[:length]
            index_k = codec.decode(self.spec.index_k_format(), data, None, None, dtype)
        return out[0], out[1], index_k

    def _scale_pages_hnd(self, layer: int, role: str, slots: Tensor) -> Tensor:
        """Scale pages of `slots` as [nb, H, P, G] E4M3 (undoing V's token-quad order)."""
        g = self.spec.head_dim // NVFP4_BLOCK
        page = self._views[(layer, f"{role}_scale")][slots]  # [nb, H, P*G]
        nb, h = page.shape[:2]
        if role == "k":
            return page.view(nb, h, self.page_size, g)
        return page.view(nb, h, self.page_size // 4, g, 4).transpose(-1, -2).reshape(nb, h, self.page_size, g)

    @staticmethod
    def _tokens(pages: Tensor, length: int) -> Tensor:
        """[nb, H, P, X] pages -> [length, H, X] tokens in sequence order."""
        nb, h, p, x = pages.shape
        return pages.permute(0, 2, 1, 3).reshape(nb * p, h, x)[:length]

    # --- draft layer ---------------------------------------------------------------------------
    def draft_view(self, manager: BlockManager, *, tree_drafts: bool = False, relocate_accepted_tokens: bool = False,
                   ring_size: int = 3) -> DraftKVView:
        """The shared draft layer presented as a single-pool cache (see draft_view.py)."""
        return DraftKVView(self, manager, tree_drafts=tree_drafts,
                           relocate_accepted_tokens=relocate_accepted_tokens, ring_size=ring_size)

