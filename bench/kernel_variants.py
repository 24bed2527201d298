"""Tile and schedule variants of the bandwidth-bound decode kernels, timed side by side in one run.

Groups (each variant runs on the SAME inputs as its group's default, timed like bench/kernels.py: CUDA
graph replay, 256 MB L2 flush before each replay, median of --iters; fraction of this run's copy bandwidth):
    attn     attn.paged dense FP8 decode (batch 1 at 4k / 32k / 128k, batch 16 at 4k) and the MSA NVFP4
             sparse attention over 16 selected blocks: key tile BN, pipeline stages, warps, split count
    select   msa.select at 4k and 128k context: warps per (row, head); msa.scores
             (the indexer over bf16 index-K) at the same contexts: warps per block
    moe      moe.nvfp4 at 1 / 4 / 16 tokens, NVFP4 and BF16 shared expert: gate|up tile (BN, BK, stages),
             down tile (DBN, DBK, DSPLIT, stages)
    head     the 12-bit head (head.head12's MMA head) at 1 and 8 rows: row pairs, warps, stages, register caps,
             beside head.bf16's
             default on the same M3 head weight (200064 x 6144); each checked by the entries' argmax band
Checks: every attention / select variant's output is compared with its group default's (attention:
max |diff| <= 2**-6 * max |out| + 1e-3, the two differ by summation order and one bf16 rounding;
selection: identical); every MoE variant's output goes through moe.nvfp4's certified compare against the
fp32 reference. A failed check is recorded ("ok": false) and the run continues.

    moe MMA  the MMA-step MoE (gate|up warps / ring depth, down DSPLIT / warps / ring depth, RP) at 1-8 tokens,
             beside the default and the certified cells it replaces (--moe-mma-only)
    python3 bench/kernel_variants.py [--only attn,select,moe,head] [--moe-tokens 1,4,16] [--moe-mma-only]
                                     [--iters 30] [--name FILE] [--out-dir DIR]   (GPU)
Writes bench/results/kernel_variants/FILE (default kernel-variants-h200.json; and a copy under --out-dir).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.config import preset  # noqa: E402
from m3serve.kernels.attention import msa_index, paged as pa  # noqa: E402
from m3serve.kernels.moe import nvfp4 as moe_nvfp4  # noqa: E402
from m3serve.kernels.moe._mma import MmaMoEConfig  # noqa: E402
from m3serve.kernels.attention._paged_call import TileConfig, tile_config  # noqa: E402
from m3serve.kernels.catalog import Case, Cell, poisoned  # noqa: E402
from m3serve.runtime.step_inputs import sparse_tiles_per_block, split_plan  # noqa: E402
from m3serve.quant.nvfp4 import untile_nvfp4  # noqa: E402
from m3serve.kv import rotation  # noqa: E402

GROUPS = ("attn", "msa", "select", "moe", "head")  # attn: dense decode cases, msa: the MSA decode case


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


KB = _load("kernels")
AB = _load("attention")

# (name, BN, num_stages, num_warps[, PAIRS]); QB/BM come from tile_config; PAIRS: FP8 read as 16-bit pairs
DENSE_TILES = (("n128s2w4", 128, 2, 4), ("n128s3w4", 128, 3, 4), ("n64s3w4", 64, 3, 4), ("n64s4w4", 64, 4, 4),
               ("n128s2w8", 128, 2, 8), ("n64s3w8", 64, 3, 8), ("n128s2w4p", 128, 2, 4, True),
               ("n128s3w4p", 128, 3, 4, True), ("n64s3w4p", 64, 3, 4, True))
SPARSE_TILES = (("n64s3w4", 64, 3, 4), ("n32s4w4", 32, 4, 4), ("n64s2w4", 64, 2, 4), ("n64s3w8", 64, 3, 8),
                ("n128s2w8", 128, 2, 8))
SELECT_WARPS = (1, 2, 4, 8)
SCORES_WARPS = (2, 4, 8)
# gate|up: (name, BN, BK, stages, warps); down: (name, DBN, DBK, DSPLIT, stages, warps)
GATE_UP = (("gu64x128s3", 64, 128, 3, 4), ("gu64x256s3", 64, 256, 3, 4), ("gu64x256s4", 64, 256, 4, 4),
           ("gu64x512s2", 64, 512, 2, 4), ("gu16x256s3", 16, 256, 3, 4), ("gu128x128s3w8", 128, 128, 3, 8))
DOWN = (("d64x128k4s3", 64, 128, 4, 3, 4), ("d64x256k12s2", 64, 256, 12, 2, 4), ("d64x128k8s3", 64, 128, 8, 3, 4),
        ("d64x256k6s3", 64, 256, 6, 3, 4), ("d64x512k6s2", 64, 512, 6, 2, 4), ("d16x256k4s3", 16, 256, 4, 3, 4),
        ("d128x128k8s3w8", 128, 128, 8, 3, 8))

# head.head12's MMA head configs: (name, RP, num_warps, STAGES, maxnreg, BN_REDUCE); the first is the catalog's
# default. The escape + argmax pass took 9 / 22 us at 1 / 8 rows in the step with programs of 1024 rows (196 of them,
# H100, decode/decode-target-h100-m3_12-head12.json): the b256 / b128 variants size it by the problem instead
HEAD12_CONFIGS = (("r2w2s2", 2, 2, 2, 0, 1024), ("r1w4s2", 1, 4, 2, 0, 1024), ("r1w4s3", 1, 4, 3, 0, 1024),
                  ("r1w8s2", 1, 8, 2, 0, 1024), ("r2w4s2", 2, 4, 2, 0, 1024), ("r1w4s2c96", 1, 4, 2, 96, 1024),
                  ("r1w4s3c128", 1, 4, 3, 128, 1024), ("r2w2s2b256", 2, 2, 2, 0, 256),
                  ("r2w2s2b128", 2, 2, 2, 0, 128))


class Runner:
    def __init__(self, dev: torch.device, iters: int) -> None:
        self.dev, self.iters = dev, iters
        self.flush = torch.empty(KB.FLUSH_BYTES, dtype=torch.uint8, device=dev)
        self.bw = KB.copy_bandwidth(dev)
        self.rows: list[dict] = []

    def time(self, fn) -> float:
        replay = KB.graphed(fn)
        return KB.time_call(replay or fn, self.iters, self.flush)

    def add(self, group: str, what: str, variant: str, fn, nbytes: int, check=None, **extra) -> None:
        rec = {"group": group, "what": what, "variant": variant, **extra}
        try:
            t = self.time(fn)
            ok, why = check() if check is not None else (True, "")
            rec.update(us=t * 1e6, bytes=nbytes, frac_copy=nbytes / t / self.bw, ok=ok, why=why)
            print(f"{group:6s} {what:34s} {variant:16s} {t * 1e6:9.1f} us  {100 * nbytes / t / self.bw:5.1f}% copy"
                  f"{'' if ok else '  CHECK FAILED: ' + why}", flush=True)
        except Exception as exc:  # a variant that does not compile or run is a result too
            rec.update(ok=False, why=f"{type(exc).__name__}: {exc}"[:400])
            print(f"{group:6s} {what:34s} {variant:16s} ERROR {rec['why']}", flush=True)
            traceback.print_exc(limit=2)
            torch.cuda.synchronize()
        self.rows.append(rec)


def close_to(ref: torch.Tensor, got: torch.Tensor) -> tuple[bool, str]:
    d = (got.float() - ref.float()).abs().max().item()
    tol = 2.0 ** -6 * ref.float().abs().max().item() + 1e-3
    return (d <= tol and bool(torch.isfinite(got.float()).all())), f"max|diff| {d:.3g} (tol {tol:.3g})"


def attn_variants(r: Runner, bench, step, m, layer: int, fmt: str, q, sel, what: str, nbytes: int, splits, tiles,
                  is_default, rot_matrix=None, **extra) -> None:
    """Every (split count, tile) of one attention case on the same inputs, each checked against the first
    (rot_matrix: the pages read as a rotated NVFP4 layer's, q rotated and the output un-rotated in the kernel)."""
    ref = None
    for ns in splits:
        for name, bn, stages, warps, *pairs in tiles:
            base = tile_config(m.hq // m.hk, m.p, 1, sel is not None, fmt == "nvfp4")
            tile = TileConfig(QB=base.QB, BM=base.BM, BN=bn, num_warps=warps, num_stages=stages,
                              PAIRS=bool(pairs and pairs[0]))
            args, kw = bench._attn_args(step, layer, fmt, q, sel, ns)
            out = args[10]
            out.fill_(float("nan"))
            fn = lambda args=args, kw=kw, tile=tile: pa.paged_attention(*args, **kw, tile=tile,  # noqa: E731
                                                                        rot_matrix=rot_matrix)
            if ref is None:
                fn()
                ref = out.clone()
            r.add("attn", what, f"{name}/s{ns}", fn, nbytes, lambda out=out, ref=ref: close_to(ref, out), splits=ns,
                  default=is_default(ns, name), **extra)


def attn_group(r: Runner, cache, m) -> None:
    gen = torch.Generator(device=r.dev).manual_seed(0)
    host = torch.Generator().manual_seed(1)
    bench = AB.Bench({"paged": pa}, cache, m, None, r.bw, gen)
    for batch, ctx in ((1, 4096), (1, 32768), (16, 4096), (1, 131072)):
        step = AB.make_step(m, cache.num_slots, [1] * batch, [ctx] * batch, r.dev, host)
        q = AB._q(batch, m.hq, m.d, r.dev, gen)
        ns0 = pa.choose_num_splits(batch, step.table.shape[1], kv_heads=m.hk)
        nbytes = batch * ctx * m.hk * m.d * 2 + 2 * batch * m.hq * m.d * 2
        attn_variants(r, bench, step, m, m.dense, "fp8", q, None, f"dense fp8 b{batch} ctx{ctx}", nbytes,
                      sorted({ns0, min(2 * ns0, 128), max(ns0 // 2, 1)}), DENSE_TILES,
                      lambda ns, name, ns0=ns0: ns == ns0 and name == "n128s2w4", batch=batch, context=ctx)


def msa_group(r: Runner, cache, m) -> None:
    """MSA decode: NVFP4 pages, 16 selected blocks per KV head (the query's own + init forced, the rest random),
    read as an unrotated and as a rotated layer's."""
    gen = torch.Generator(device=r.dev).manual_seed(0)
    host = torch.Generator().manual_seed(1)
    bench = AB.Bench({"paged": pa}, cache, m, None, r.bw, gen)
    ctx = 4096
    step = AB.make_step(m, cache.num_slots, [1], [ctx], r.dev, host)
    nb = step.table.shape[1] - 1
    sel = torch.stack([torch.sort(torch.randperm(nb, generator=host)[:m.topk]).values for _ in range(m.hk)])
    sel = sel.to(torch.int32)[None].to(r.dev)
    q = AB._q(1, m.hq, m.d, r.dev, gen)
    nbytes = m.topk * m.p * m.hk * (m.d + m.d // 8) + 2 * m.hq * m.d * 2  # NVFP4 K+V with E4M3 scales
    _, ns0 = split_plan(1, nb + 1, m.hk, m.topk, sparse_tiles_per_block(cache.spec))  # what the engine runs
    attn_variants(r, bench, step, m, m.sparse, "nvfp4", q, sel, "msa nvfp4 top-16", nbytes, (8, 16, 32), SPARSE_TILES,
                  lambda ns, name: ns == ns0 and name == "n64s3w4", batch=1, context=ctx)
    # the same pages read as a rotated layer's (the hybrid cache's default: kv.rotation, seed 31)
    rot = rotation.query_matrix(rotation.rotation_signs(m.d, rotation.DEFAULT_ROTATION_SEED)).to(torch.bfloat16)
    attn_variants(r, bench, step, m, m.sparse, "nvfp4", q, sel, "msa nvfp4 top-16 rotated", nbytes, (8, 16, 32),
                  SPARSE_TILES, lambda ns, name: ns == ns0 and name == "n64s3w4", rot_matrix=rot.to(r.dev), batch=1,
                  context=ctx)


def select_group(r: Runner, cache, m) -> None:
    host = torch.Generator().manual_seed(2)
    gen = torch.Generator(device=r.dev).manual_seed(3)
    for ctx in (4096, 131072):
        step = AB.make_step(m, cache.num_slots, [1], [ctx], r.dev, host)
        nb = step.table.shape[1]
        scores = torch.randn(1, m.hk, nb, generator=host).to(r.dev)
        ref = msa_index.msa_select_reference(scores, step.seq_lens, step.query_start, max_query_len=1, topk=m.topk,
                                             block_size=m.p, local_blocks=m.local_blocks, init_blocks=m.init_blocks)
        for warps in SELECT_WARPS:
            sel = torch.full((1, m.hk, m.topk), -7, dtype=torch.int32, device=r.dev)
            fn = lambda sel=sel, w=warps: msa_index.msa_select(  # noqa: E731
                scores, step.seq_lens, step.query_start, sel, max_query_len=1, topk=m.topk, block_size=m.p,
                local_blocks=m.local_blocks, init_blocks=m.init_blocks, num_warps=w)
            r.add("select", f"msa.select ctx{ctx}", f"w{warps}", fn, nb * m.hk * 4,
                  lambda sel=sel: (bool(torch.equal(sel, ref)), "vs msa_select_reference"), context=ctx,
                  default=(warps == msa_index.select_warps(1 << (nb - 1).bit_length())))
        # the scorer on the bf16 index-K pages of the sparse layer
        iq = AB._q(1, m.hk, m.di, r.dev, gen)
        ip = cache.pages(m.sparse, "index_k")
        out0 = None
        for warps in SCORES_WARPS:
            sc = torch.full((1, m.hk, nb), float("nan"), device=r.dev)
            fn = lambda sc=sc, w=warps: msa_index.msa_block_scores(  # noqa: E731
                iq, ip, step.table, step.seq_lens, step.query_start, sc, max_query_len=1, topk=m.topk, num_warps=w)
            if out0 is None:
                fn()
                out0 = sc.clone()
            r.add("scores", f"msa.scores ctx{ctx}", f"w{warps}", fn,
                  -(-ctx // m.p) * m.p * m.di * ip.element_size() + nb * m.hk * 4,
                  lambda sc=sc, o=out0: (bool(torch.equal(sc, o)), f"vs the w{SCORES_WARPS[0]} output"), context=ctx,
                  default=(warps == 4))


# the MMA-step MoE (moe/_mma.py, NVFP4 shared expert, 1-8 tokens):
# (name, RP, gate|up warps, STAGES, DSPLIT, down warps, down stages[, GSPLIT, GSPLIT_SLOTS: gate|up split over H
#  [, maxnreg, down_maxnreg: registers per thread capped, so that more CTAs are resident]])
MMA_MOE = (("mma_w4s2_d4w4s2", 1, 4, 2, 4, 4, 2), ("mma_w4s3_d4w4s3", 1, 4, 3, 4, 4, 3),
           ("mma_w2s2_d4w4s2", 1, 2, 2, 4, 4, 2), ("mma_w2s3_d8w4s2", 1, 2, 3, 8, 4, 2),
           ("mma_w4s2_d8w4s2", 1, 4, 2, 8, 4, 2), ("mma_w4s2_d2w4s2", 1, 4, 2, 2, 4, 2),
           ("mma_w4s2_d8w2s2", 1, 4, 2, 8, 2, 2), ("mma_w4s3_d8w4s3", 1, 4, 3, 8, 4, 3),
           ("mma_w8s2_d4w8s2", 1, 8, 2, 4, 8, 2), ("mma_r2w4s2_d4w4s2", 2, 4, 2, 4, 4, 2),
           ("mma_g2_d8", 1, 4, 2, 8, 4, 2, 2, 64), ("mma_g4_d8", 1, 4, 2, 8, 4, 2, 4, 64),
           ("mma_g8_d8", 1, 4, 2, 8, 4, 2, 8, 64), ("mma_g4s20_d8", 1, 4, 2, 8, 4, 2, 4, 20),
           ("mma_g4s3_d8", 1, 4, 3, 8, 4, 2, 4, 64), ("mma_g4_d6", 1, 4, 2, 6, 4, 2, 4, 20),
           ("mma_g4_d12", 1, 4, 2, 12, 4, 2, 4, 20), ("mma_g3_d6", 1, 4, 2, 6, 4, 2, 3, 64),
           ("mma_g2r64_d8r80", 1, 4, 2, 8, 4, 2, 2, 64, 64, 80), ("mma_g4r64_d8r80", 1, 4, 2, 8, 4, 2, 4, 20, 64, 80),
           ("mma_g4_d8r80", 1, 4, 2, 8, 4, 2, 4, 20, 0, 80))
# the whole-K variants an --moe-mma-only run still times beside the split ones: the first (with its launches alone)
# and the default before the gate|up split
MMA_MOE_KEEP = ("mma_w4s2_d4w4s2", "mma_w4s2_d8w4s2")
# the router launch of the MMA step (name, RBE experts per program, RSPLIT, warps): its last program sums RSPLIT
# partials in order before the top-k, so fewer splits shorten that serial tail and lengthen each program's K loop
ROUTER = (("rt_e16k8w4", 16, 8, 4), ("rt_e16k4w4", 16, 4, 4), ("rt_e32k4w4", 32, 4, 4), ("rt_e16k2w4", 16, 2, 4),
          ("rt_e32k8w8", 32, 8, 8), ("rt_e64k4w8", 64, 4, 8))


def moe_group(r: Runner, token_counts=(1, 4, 16), mma_only: bool = False) -> None:
    """mma_only: the MMA-step variants beside the default and the cells they replace, each MMA variant also on the
    row-major experts ("/rows": the layout before the MMA tile layout, same weights), and the router variants."""
    gen = torch.Generator().manual_seed(0)
    for shared_bf16 in ((0,) if mma_only else (0, 1)):
        for tokens in token_counts:
            base = moe_nvfp4.MoEConfig(BT=16)
            cell = Cell(rows=(tokens, tokens), shape=(128, 6144, 3072, shared_bf16), why="variants",
                        config={"moe": base})
            case = moe_nvfp4.make_case(cell, tokens, r.dev, gen)
            configs = [("base", base)]
            if mma_only:  # side by side with the 1-16 token cells that the MMA step replaces
                old = moe_nvfp4._moe_cfg(1, 4, 3072, 0) if tokens <= 4 else moe_nvfp4._moe_cfg(5, 16, 3072, 0)
                configs = [("base", base), ("old_cell", old)]
            else:
                for name, bn, bk, st, w in GATE_UP[1:]:
                    configs.append((name, replace(base, BN=bn, BK=bk, num_stages=st, num_warps=w, DBN=64, DBK=128,
                                                  down_stages=3, down_warps=4)))
                for name, dbn, dbk, ds, st, w in DOWN[1:]:
                    configs.append((name, replace(base, DBN=dbn, DBK=dbk, DSPLIT=ds, down_stages=st, down_warps=w)))
            if not shared_bf16 and tokens <= 8:
                for name, rp, w, st, ds, dw, dst, *split in MMA_MOE:
                    if mma_only and not split and name not in MMA_MOE_KEEP:   # measured before (H100 files)
                        continue
                    gs, gslots, regs, dregs = (*split, 0, 0)[:4] if split else (1, 0, 0, 0)
                    mma = MmaMoEConfig(RP=rp, num_warps=w, STAGES=st, DSPLIT=ds, down_warps=dw, down_stages=dst,
                                       GSPLIT=gs, GSPLIT_SLOTS=gslots, maxnreg=regs, down_maxnreg=dregs)
                    configs.append((name, mma))
                    if mma_only and not split:
                        configs.append((f"{name}/rows", mma))
                if mma_only:
                    for name, rbe, rsplit, rw in ROUTER:
                        configs.append((name, replace(MmaMoEConfig(), RBE=rbe, RSPLIT=rsplit, router_warps=rw)))
            rows_case = _row_major_moe(case)
            nbytes = None
            for name, cfg in configs:
                c = rows_case if name.endswith("/rows") else case
                x = c.args[0]
                ws = moe_nvfp4.make_moe_workspace(cfg, tokens, 128, 6144, 3072, r.dev)
                ws.act.fill_(float("nan"))
                out = poisoned(tuple(x.shape), torch.bfloat16, r.dev)
                args = (*c.args[:-3], out, ws, cfg)
                c2 = Case(args=args, kwargs=c.kwargs, bytes_moved=c.bytes_moved)
                kw = c.kwargs
                fn = lambda args=args, kw=kw: moe_nvfp4.moe_nvfp4(*args, **kw)  # noqa: E731

                def check(c2=c2, out=out) -> tuple[bool, str]:
                    try:
                        ref = moe_nvfp4.moe_reference(*c2.args, **c2.kwargs)
                        moe_nvfp4.compare(out, ref, c2)
                        return True, ""
                    except AssertionError as exc:
                        return False, str(exc)[:300]

                if nbytes is None:
                    fn()
                    torch.cuda.synchronize()
                    nbytes = KB.moe_bytes(c2)
                what = f"moe T{tokens} shared {'bf16' if shared_bf16 else 'nvfp4'}"
                if name.startswith("rt_"):  # a router variant: checked on the whole call, timed alone
                    fn()
                    torch.cuda.synchronize()
                    ok, why = check()
                    r.add("moe", what, f"{name}/r", lambda args=args, kw=kw: moe_nvfp4.moe_nvfp4(
                        *args, **kw, launches="r"), 128 * 6144 * 4, lambda ok=ok, why=why: (ok, why), tokens=tokens,
                        shared_bf16=shared_bf16, launch="r", config=cfg.__dict__)
                    continue
                r.add("moe", what, name, fn, nbytes, check,
                      tokens=tokens, shared_bf16=shared_bf16, config=cfg.__dict__, default=(name == "base"))
                # each launch alone, on the routing and activations the call left
                if name in ("base", MMA_MOE[0][0], f"{MMA_MOE[0][0]}/rows", "mma_g4_d8", "mma_g4_d6"):
                    e_, h_, i_ = 128, 6144, 3072
                    touched = int((ws.slot_e >= 0).sum()) + 1
                    # a BF16 shared expert reads 32/9 the bytes of an NVFP4 one
                    parts = {"r": e_ * h_ * 4,
                             "g": (touched - 1 + (32 / 9 if shared_bf16 else 1)) * 2 * i_ * h_ * 9 // 16,
                             "d": (touched - 1 + (32 / 9 if shared_bf16 else 1)) * i_ * h_ * 9 // 16}
                    for launch, nb in parts.items():
                        fn1 = lambda args=args, kw=kw, launch=launch: moe_nvfp4.moe_nvfp4(  # noqa: E731
                            *args, **kw, launches=launch)
                        r.add("moe", what, f"{name}/{launch}", fn1, int(nb), None, tokens=tokens,
                              shared_bf16=shared_bf16, launch=launch)
            del case, rows_case
            torch.cuda.empty_cache()


def head_group(r: Runner, row_counts=(1, 8), shape: tuple[int, int] | None = None) -> None:
    """head.head12's MMA head configs beside head.bf16's default, the same weight (N(0, 0.02) with outliers, zeros and
    subnormals: escapes of both kinds) and activations; every variant's ids and best values through the entries'
    argmax band against the fp32 logits. A config whose tile does not divide V is skipped."""
    from m3serve.kernels.catalog import true_fp32
    from m3serve.kernels.gemm._linear import bm_for, fresh_x
    from m3serve.kernels.head import bf16 as HB, head12 as H12
    from m3serve.kernels.head._head12_mma import Head12MmaConfig
    from m3serve.quant.head12 import encode_head12
    from m3serve.quant.head12_tiles import tile_head12
    gen = torch.Generator().manual_seed(0)  # CPU: device_rng seeds the card's generator from it
    v, k = shape or (HB.VOCAB_TP1, 6144)
    w = HB.random_head_weight(v, k, r.dev, gen)
    t = tile_head12(encode_head12(w))
    h12_bytes = v * k * 3 // 2 + t.esc_row.numel() * 8
    for rows in row_counts:
        x = fresh_x(rows, k, r.dev, gen)
        with true_fp32():
            logits, absprod = x.float() @ w.float().T, x.float().abs() @ w.float().abs().T
        what = f"head T{rows}"
        variants = [("bf16", HB.HeadConfig(BM=bm_for(rows)), False)]
        variants += [(f"h12/{name}", Head12MmaConfig(RP=rp, num_warps=nw, STAGES=st, maxnreg=cap, BN_REDUCE=bnr), True)
                     for name, rp, nw, st, cap, bnr in HEAD12_CONFIGS if v % (16 * rp * nw) == 0]
        for name, cfg, coded in variants:
            ids = torch.full((rows,), -1, dtype=torch.int64, device=r.dev)
            best = torch.full((rows,), float("nan"), dtype=torch.float32, device=r.dev)
            if coded:
                ws = H12.make_head12_workspace(cfg, v, r.dev)
                fn = lambda ids=ids, best=best, ws=ws, cfg=cfg: H12.head12_argmax(x, *t.args(), ids, best, ws, 0, cfg)  # noqa: E731
            else:
                ws = HB.make_head_workspace(cfg, v, r.dev)
                fn = lambda ids=ids, best=best, ws=ws, cfg=cfg: HB.head_bf16_argmax(x, w, ids, best, ws, 0, cfg)  # noqa: E731

            def check(ids=ids, best=best, name=name) -> tuple[bool, str]:
                try:
                    HB.compare_argmax(name, (ids, best), logits, absprod, k, 0)
                    return True, ""
                except AssertionError as exc:
                    return False, str(exc)[:300]

            r.add("head", what, name, fn, h12_bytes if coded else v * k * 2, check, rows=rows,
                  config={f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, default=(name == "bf16"))
    del w, t
    if r.dev.type == "cuda":
        torch.cuda.empty_cache()


def _row_major_moe(case: Case) -> Case:
    """The same MoE case with its NVFP4 experts (and NVFP4 shared expert) row-major, as checkpoints hold them."""
    if not case.kwargs.get("tiled"):
        return case
    args = list(case.args)
    for w, s in ((3, 4), (6, 7), (9, 10), (12, 13)):
        if args[s] is not None:
            args[w], args[s] = untile_nvfp4(args[w], args[s])
    return Case(args=tuple(args), kwargs={**case.kwargs, "tiled": False}, bytes_moved=case.bytes_moved)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(GROUPS))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--moe-tokens", default="1,4,16", help="token counts of the moe group")
    ap.add_argument("--moe-mma-only", action="store_true",
                    help="moe group: only the MMA-step variants, beside the default and the cells they replace")
    ap.add_argument("--name", default="kernel-variants-h200.json", help="results file name")
    a = ap.parse_args(argv)
    groups = [g for g in a.only.split(",") if g]
    if any(g not in GROUPS for g in groups):
        raise SystemExit(f"--only: expected names from {GROUPS}, found {groups}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_variants.py needs a CUDA GPU")
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    r = Runner(dev, a.iters)
    print(f"copy bandwidth {r.bw / 1e12:.3f} TB/s", flush=True)
    if "attn" in groups or "msa" in groups or "select" in groups:
        cfg = preset("minimax-m3")
        gen = torch.Generator(device=dev).manual_seed(0)
        cache, m = AB.build_cache(cfg, 16 * 32 + 2 + 1024 + 2, dev, gen)
        if "attn" in groups:
            attn_group(r, cache, m)
        if "msa" in groups:
            msa_group(r, cache, m)
        if "select" in groups:
            select_group(r, cache, m)
        del cache
        torch.cuda.empty_cache()
    if "moe" in groups:
        moe_group(r, tuple(int(v) for v in a.moe_tokens.split(",")), a.moe_mma_only)
    if "head" in groups:
        head_group(r)
    meta = run_metadata()
    doc = {**{k: meta[k] for k in ("commit", "gpu", "command", "date", "torch")},
           "triton": __import__("triton").__version__, "copy_bandwidth_Bps": r.bw, "iters": a.iters,
           "l2_flush_bytes": KB.FLUSH_BYTES, "wall_s": time.time() - t0, "results": r.rows}
    KB.write_results(doc, a.name, a.out_dir, bench="kernel_variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
