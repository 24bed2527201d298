"""Test / bench cases of attn.paged: a real PagedKVCache with its pages scattered over the pool,
random K/V written through PagedKVCache.write (so every format is quantized by the cache's own
codec), stale junk bytes (NaN codes included) everywhere else, and the step metadata.

Shape legend:
    shape key   (fmt code, Hq, Hk, D, P, topk or 0)
    rows        query tokens of the first (longest) sequence; the others draw 1..rows
    sequences   `batch` with keys (the first has exactly `context` keys, the others 1..context)
                + one padding sequence (seq_len 0, `rows` query rows) when `padding`
                + `orphan_rows` trailing query rows that belong to no sequence
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.kernels.attention._paged_call import FMT_NAMES, choose_num_splits, make_workspace
from m3serve.kernels.catalog import Case, device_rng, poisoned
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.rotation import DEFAULT_ROTATION_SEED
from m3serve.kv.spec import KVCacheSpec
from m3serve.model import msa

# fmt -> (kv_cache_dtype, model dtype) of a two-layer spec whose layer 1 is sparse (MSA)
_SPEC_FOR = {"bf16": ("bf16", torch.bfloat16), "fp8": ("fp8", torch.bfloat16), "nvfp4": ("nvfp4", torch.bfloat16),
             "fp32": ("auto", torch.float32)}
Q_STD = 2.5  # scores of std ~2.5 (unit K): a softmax that is neither flat nor one-hot


@dataclass(frozen=True)
class CaseShape:
    batch: int  # sequences with keys
    context: int  # keys of the first sequence (the longest)
    num_splits: int | None = None  # None: choose_num_splits
    padding: bool = True
    orphan_rows: int = 0
    rotate: bool = False  # NVFP4 only: a Hadamard-rotated layer (KVCacheSpec.kv_rotation_seed)


@dataclass
class PagedCase:
    case: Case
    cache: PagedKVCache
    layer: int
    slots: list[list[int]]  # each sequence's page slots, in order
    written: list[int]  # each sequence's keys written to the cache (its first seq_len)


def _randint(lo: int, hi: int, gen: torch.Generator) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def build_case(shape_key: tuple[int, ...], rows: int, device: torch.device, gen: torch.Generator | None,
               cs: CaseShape) -> PagedCase:
    """gen None: deterministic zero data (for 'meta' capture and warm-up), no writes."""
    code, hq, hk, d, p, topk = shape_key
    fmt = FMT_NAMES[code]
    kv_dtype, model_dtype = _SPEC_FOR[fmt]
    spec = KVCacheSpec(page_size=p, num_layers=2, sparse_layers=(1,), num_kv_heads=hk, head_dim=d, index_head_dim=16,
                       kv_cache_dtype=kv_dtype, model_dtype=model_dtype,
                       kv_rotation_seed=DEFAULT_ROTATION_SEED if cs.rotate else None)
    layer = 1 if topk > 0 or fmt == "nvfp4" else 0
    if rows > cs.context:
        raise ValueError(f"rows: {rows} query tokens do not fit in a context of {cs.context} keys")
    ns = [rows] + [(_randint(1, rows, gen) if gen is not None else rows) for _ in range(cs.batch - 1)]
    lens = [cs.context] + [(_randint(n, cs.context, gen) if gen is not None else cs.context) for n in ns[1:]]
    if cs.padding:
        ns.append(rows)
        lens.append(0)
    nblocks = [-(-length // p) for length in lens]
    width = max(1, -(-cs.context // p)) + 1  # one never-used column: unallocated entries are 0
    total = sum(nblocks)
    cache = PagedKVCache(spec, total + 3, device)
    order = torch.randperm(total + 3, generator=gen).tolist() if gen is not None else list(range(total + 3))
    slots, k0 = [], 0
    for nb in nblocks:
        slots.append(order[k0:k0 + nb])
        k0 += nb
    slot_table = torch.zeros(len(ns), width, dtype=torch.int32)
    for s, sl in enumerate(slots):
        slot_table[s, :len(sl)] = torch.tensor(sl, dtype=torch.int32)
    t_rows = sum(ns) + cs.orphan_rows
    qs = [0]
    for n in ns:
        qs.append(qs[-1] + n)
    if gen is not None:
        dg = device_rng(gen, device)
        cache.data.random_(0, 256, generator=dg)  # stale bytes of other sequences, NaN codes included
        if cache.scales is not None:
            cache.scales.random_(0, 256, generator=dg)
        if fmt == "nvfp4":
            amax = 4.0 + 12.0 * torch.rand(2, generator=gen)
            cache.set_nvfp4_amax(layer, float(amax[0]), float(amax[1]))
        flat = torch.cat([torch.tensor(sl, dtype=torch.int64).repeat_interleave(p)[:length] * p
                          + torch.arange(length) % p for sl, length in zip(slots, lens)])
        n_tok = flat.numel()
        k = torch.randn(n_tok, hk, d, generator=dg, device=device)
        v = torch.randn(n_tok, hk, d, generator=dg, device=device)
        ik = torch.randn(n_tok, 16, generator=dg, device=device) if layer == 1 else None
        cache.write(layer, flat.to(device), k, v, ik)
        q = (Q_STD * torch.randn(t_rows, hq, d, generator=dg, device=device)).to(torch.bfloat16)
    else:
        q = torch.zeros(t_rows, hq, d, dtype=torch.bfloat16, device=device)
    sel = None
    if topk > 0:
        sel = torch.full((t_rows, hk, topk), -1 if gen is not None else 0, dtype=torch.int32)
        for s, (n, length) in enumerate(zip(ns, lens)):
            if gen is None or length == 0:
                continue
            q_pos = torch.arange(length - n, length)
            scores = torch.rand(1, hk, n, -(-length // p), generator=gen)
            pick = msa.select_blocks(scores, q_pos[None], p, topk, local_blocks=1, init_blocks=0)[0]  # [Hk, n, K']
            sel[qs[s]:qs[s + 1], :, :pick.shape[-1]] = pick.permute(1, 0, 2).to(torch.int32)
        sel = sel.to(device)
    num_splits = cs.num_splits or choose_num_splits(t_rows, topk if topk else width, kv_heads=hk,
                                                     min_blocks_per_split=1 if topk else 2)
    ws = make_workspace(t_rows, hq, d, num_splits, device)
    if gen is not None:
        ws.acc.fill_(float("nan"))  # every partial the combine reads must have been written
        ws.ml.fill_(float("nan"))
    scales = (cache.pages(layer, "k_scale"), cache.pages(layer, "v_scale")) if fmt == "nvfp4" else (None, None)
    kv_gs = cache.kv_global_scale[layer] if fmt == "nvfp4" else None
    args = (q, cache.pages(layer, "k"), cache.pages(layer, "v"), *scales, kv_gs, slot_table.to(device),
            torch.tensor(lens, dtype=torch.int32).to(device), torch.tensor(qs, dtype=torch.int32).to(device), sel,
            poisoned((t_rows, hq, d), torch.bfloat16, device), ws)
    kwargs = dict(fmt=fmt, sm_scale=d ** -0.5, max_query_len=rows, num_splits=num_splits)
    if cs.rotate:
        kwargs["rot_matrix"] = cache.kv_rotation_matrix
    per_token = hk * (2 * d * spec_bits(fmt) // 8 + (2 * d // 16 if fmt == "nvfp4" else 0))
    if topk > 0:
        kv_tokens = sum(n * min(length, topk * p) for n, length in zip(ns, lens))
    else:
        kv_tokens = sum(lens)
    return PagedCase(case=Case(args=args, kwargs=kwargs, bytes_moved=kv_tokens * per_token + 2 * t_rows * hq * d * 2),
                     cache=cache, layer=layer, slots=slots, written=lens[:])


def spec_bits(fmt: str) -> int:
    return {"nvfp4": 4, "fp8": 8, "bf16": 16, "fp32": 32}[fmt]


def resample_step(pc: PagedCase, gen: torch.Generator, pad_prob: float = 0.25) -> None:
    """A new step on the same buffers (what a CUDA-graph replay sees): each sequence keeps its
    query count and pages but gets a new length in [n, its written length] (or 0: padding, with
    probability pad_prob), fresh queries, and fresh MSA selections for the new positions."""
    case = pc.case
    q, slot_table, seq_lens, query_start, sel = case.args[0], case.args[6], case.args[7], case.args[8], case.args[9]
    p = case.args[1].shape[2]
    qs = query_start.tolist()
    lens = []
    for s in range(len(qs) - 1):
        n = qs[s + 1] - qs[s]
        if pc.written[s] < n or float(torch.rand(1, generator=gen)) < pad_prob:
            lens.append(0)
        else:
            lens.append(_randint(n, pc.written[s], gen))
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    q.copy_((Q_STD * torch.randn(q.shape, generator=gen)).to(q.dtype))
    if sel is not None:
        hk, topk = sel.shape[1], sel.shape[2]
        new = torch.full(tuple(sel.shape), -1, dtype=torch.int32)
        for s, length in enumerate(lens):
            n = qs[s + 1] - qs[s]
            if length == 0 or n == 0:
                continue
            q_pos = torch.arange(length - n, length)
            scores = torch.rand(1, hk, n, -(-length // p), generator=gen)
            pick = msa.select_blocks(scores, q_pos[None], p, topk, local_blocks=1, init_blocks=0)[0]
            new[qs[s]:qs[s + 1], :, :pick.shape[-1]] = pick.permute(1, 0, 2).to(torch.int32)
        sel.copy_(new)
    case.args[10].fill_(float("nan"))
