"""Attention-side kernels at real M3 shapes: dense decode, the MSA layer, the KV write and prefill.

Rows (one NVFP4 hybrid cache of the `minimax-m3` preset, TP1: dense layer 0 in FP8, sparse layer 1
in NVFP4 + bf16 index-K; every page of both layers holds random K/V written by PagedKVCache.write,
and each row's sequences take their pages from a random permutation of the slots):
    attn.paged   dense FP8 decode: batch 1 at 4k / 32k / 128k, batch 16 at 4k
    msa.*        the MSA layer at batch 1, 4k and 128k: msa.scores (indexer), msa.select (top-k), attn.paged
                 on NVFP4 pages with the selection, each alone and the three in one graph ("msa.layer")
    kv.write     one decode token per sequence, batch 1 and 16, dense FP8 layer and sparse NVFP4 layer
    attn.prefill an 8k-token first chunk (and an 8k chunk after 8k of context) on the FP8 dense layer, and
                 the 8k first chunk on bf16 pages; TFLOP/s = 2*2*D*Hq*(causal pairs) / time
    decode_step  (CUDA only, run last; key "decode_step") whole engine decode steps of the decode target (route
                 "auto", CUDA graphs) at batch 1, context 4k and 128k: an LLM of --decode-step-model
                 (default `minimax-m3:5`, random NVFP4 weights, NVFP4 KV cache) built as bench/decode.py builds
                 a preset's, timed by bench/decode.py's time_decode (windows of its WINDOW back-to-back steps,
                 median of --decode-step-steps; gpu_busy_s and launches_per_step from a profile of 3 steps).
                 msa.select is certified up to a block table of 1024 pages (128k tokens), and a wider table
                 turns the target off, so max_model_len stops there: a context whose prompt plus the timed
                 steps would not fit is prefilled with fewer tokens ("prompt_tokens"; 128k -> 131072 - 8 *
                 steps - 64). Prefill runs in chunks of at most 8192 tokens (the certified prefill rows).
                 Rows {model, context, batch, median_s, gpu_busy_s, launches_per_step, prompt_tokens, ...};
                 "decode_step": [] when the group did not run (--device cpu skips it with a note).
Timing: CUDA events around a CUDA-graph replay (eager if capture fails), median of --iters, the 60 MB
L2 flushed by a 256 MB memset before each replay (outside the events); on the CPU (--device cpu, the
Triton interpreter, tiny shapes of the `tiny` preset) a wall-clock median: a smoke test, not a result.
"entry" = catalog entry / variant (msa.layer: the three MSA launches together); "context" = keys after the
step (L); "bytes" = what the kernel must move at least: K/V (incl. NVFP4 scales) or index-K bytes read + outputs
written; frac_copy = bytes / time / the device-to-device copy bandwidth measured in the same run.

The entry modules are imported when the run starts; a missing one fails the run (no row is skipped).

    python3 bench/attention.py [--quick] [--iters 50] [--only decode,msa,kv_write,prefill,decode_step]
                               [--decode-step-model minimax-m3:5] [--decode-step-contexts 4096,131072]
                               [--decode-step-steps 12] [--out-dir DIR]
    python3 bench/attention.py --only decode_step             # only the whole decode-step rows
    python3 bench/attention.py --device cpu --quick          # smoke test on the interpreter (no decode_step)
Writes bench/results/attention/attention-h200.json on CUDA (--out FILE to change; CPU writes only with --out).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.config import is_preset, preset  # noqa: E402
from m3serve.kv.cache import PagedKVCache  # noqa: E402
from m3serve.kv.spec import KVCacheSpec  # noqa: E402
from m3serve.runtime.step_inputs import sparse_tiles_per_block, split_plan  # noqa: E402

GROUPS = ("decode", "msa", "kv_write", "prefill", "decode_step")
MODULES = ("m3serve.kernels.attention.kv_write", "m3serve.kernels.attention.msa_index", "m3serve.kernels.attention.paged",
           "m3serve.kernels.attention.prefill")
FLUSH_BYTES = 256 << 20
# decode_step: prefill tokens per engine step; kv.write, msa.scores and msa.select are certified up to 8192 rows
DECODE_STEP_CHUNK = 8192


def load_modules() -> dict[str, object]:
    """Every entry module this bench times; a missing one stops the run with its name."""
    mods = {}
    for name in MODULES:
        try:
            mods[name.rsplit(".", 1)[1]] = importlib.import_module(name)
        except ImportError as exc:
            raise SystemExit(f"bench/attention.py: cannot import {name} ({exc}); every attention entry must "
                             "exist to run this benchmark") from exc
    return mods


# --- timing ------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, dev: torch.device, iters: int) -> None:
        self.dev, self.iters = dev, iters
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None

    def seconds(self, fn: Callable[[], object]) -> tuple[float, bool]:
        """(median seconds, whether a CUDA graph was replayed)."""
        if self.dev.type != "cuda":
            fn()
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times), False
        from bench.kernels import graphed, time_call

        replay = graphed(fn)
        return time_call(replay or fn, self.iters, self.flush), replay is not None

    def copy_bandwidth(self) -> float:
        if self.dev.type == "cuda":
            from bench.kernels import copy_bandwidth

            return copy_bandwidth(self.dev)
        src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return 2 * src.numel() / statistics.median(times)


# --- the cache and the steps -------------------------------------------------------------------------


@dataclass
class Model:
    hq: int
    hk: int
    d: int
    p: int
    di: int
    topk: int
    local_blocks: int
    init_blocks: int
    dense: int  # layer ids in the cache
    sparse: int


def build_cache(cfg, num_slots: int, dev: torch.device, gen: torch.Generator) -> tuple[PagedKVCache, Model]:
    """The hybrid NVFP4 cache of the whole model; pages of one dense and one sparse layer filled with
    random K/V (and index-K) through PagedKVCache.write."""
    spec = KVCacheSpec.from_model_config(cfg, kv_cache_dtype="nvfp4")
    cache = PagedKVCache(spec, num_slots, dev)
    dense = spec.dense_layers[0]
    sparse = spec.sparse_layers[0]
    m = Model(hq=cfg.num_attention_heads, hk=spec.num_kv_heads, d=spec.head_dim, p=spec.page_size,
              di=spec.index_head_dim, topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
              init_blocks=cfg.index_init_blocks, dense=dense, sparse=sparse)
    tokens = num_slots * m.p
    chunk = 1 << 16
    for t0 in range(0, tokens, chunk):
        flat = torch.arange(t0, min(tokens, t0 + chunk), device=dev)
        n = flat.numel()
        for layer in (dense, sparse):
            k = torch.randn(n, m.hk, m.d, generator=gen, device=dev)
            v = torch.randn(n, m.hk, m.d, generator=gen, device=dev)
            ik = torch.randn(n, m.di, generator=gen, device=dev) if layer == sparse else None
            cache.write(layer, flat, k, v, ik)
    return cache, m


@dataclass
class Step:
    table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    query_lens: list[int]
    contexts: list[int]  # keys after the step, per sequence


def make_step(m: Model, num_slots: int, query_lens: list[int], contexts: list[int], dev: torch.device,
              gen: torch.Generator) -> Step:
    """Sequences whose pages are distinct random slots (1..num_slots-1); table rows padded with a 0 column."""
    pages = [-(-c // m.p) for c in contexts]
    if sum(pages) > num_slots - 1:
        raise ValueError(f"num_slots: {num_slots} cannot hold {sum(pages)} pages")
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).to(torch.int32)
    table = torch.zeros(len(contexts), max(pages) + 1, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(pages):
        table[s, :nb] = perm[used:used + nb]
        used += nb
    qs = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Step(table.to(dev), torch.tensor(contexts, dtype=torch.int32, device=dev), qs.to(dev), query_lens,
                contexts)


def _q(t: int, h: int, d: int, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t, h, d, generator=gen, device=dev).to(torch.bfloat16)


# --- rows --------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, mods, cache: PagedKVCache, m: Model, timer: Timer, bw: float, gen: torch.Generator) -> None:
        self.mods, self.cache, self.m, self.timer, self.bw, self.gen = mods, cache, m, timer, bw, gen
        self.host_gen = torch.Generator().manual_seed(1)  # slot permutations and case seeds
        self.dev = cache.device
        self.rows: list[dict] = []

    def record(self, entry: str, what: str, batch: int, context: int, query_tokens: int, fn, nbytes: int,
               flops: int | None = None) -> None:
        t, graph = self.timer.seconds(fn)
        rec = {"entry": entry, "what": what, "batch": batch, "context": context, "query_tokens": query_tokens,
               "us": t * 1e6, "bytes": nbytes, "frac_copy": nbytes / t / self.bw, "graph": graph}
        if flops is not None:
            rec["tflops"] = flops / t / 1e12
        self.rows.append(rec)
        extra = f"  {rec['tflops']:7.1f} TFLOP/s" if flops is not None else ""
        print(f"{entry:20s} {what:34s} b{batch:<3d} ctx {context:6d} q {query_tokens:5d}  {t * 1e6:10.1f} us  "
              f"{nbytes / 2**20:9.2f} MiB  {100 * rec['frac_copy']:5.1f}% copy{extra}", flush=True)

    def _attn_args(self, step: Step, layer: int, fmt: str, q: torch.Tensor, sel, num_splits: int):
        pa = self.mods["paged"]
        c, m = self.cache, self.m
        nv = fmt == "nvfp4"
        ws = pa.make_workspace(q.shape[0], m.hq, m.d, num_splits, self.dev)
        out = torch.empty(q.shape[0], m.hq, m.d, dtype=torch.bfloat16, device=self.dev)
        args = (q, c.pages(layer, "k"), c.pages(layer, "v"), c.pages(layer, "k_scale") if nv else None,
                c.pages(layer, "v_scale") if nv else None, c.kv_global_scale[layer] if nv else None, step.table,
                step.seq_lens, step.query_start, sel, out, ws)
        kw = dict(fmt=fmt, sm_scale=m.d ** -0.5, max_query_len=max(step.query_lens), num_splits=num_splits)
        return args, kw

    def decode(self, points: list[tuple[int, int]]) -> None:
        pa = self.mods["paged"]
        m = self.m
        for batch, ctx in points:
            step = make_step(m, self.cache.num_slots, [1] * batch, [ctx] * batch, self.dev, self.host_gen)
            ns = pa.choose_num_splits(batch, step.table.shape[1], kv_heads=m.hk)
            args, kw = self._attn_args(step, m.dense, "fp8", _q(batch, m.hq, m.d, self.dev, self.gen), None, ns)
            nbytes = batch * ctx * m.hk * m.d * 2 + 2 * batch * m.hq * m.d * 2
            self.record("attn.paged/dense-fp8", f"dense fp8 decode (splits {ns})", batch, ctx, 1,
                        lambda: pa.paged_attention(*args, **kw), nbytes)

    def msa(self, contexts: list[int]) -> None:
        pa, mi = self.mods["paged"], self.mods["msa_index"]
        m = self.m
        for ctx in contexts:
            step = make_step(m, self.cache.num_slots, [1], [ctx], self.dev, self.host_gen)
            nb = step.table.shape[1]
            iq = _q(1, m.hk, m.di, self.dev, self.gen)
            scores = torch.empty(1, m.hk, nb, dtype=torch.float32, device=self.dev)
            sel = torch.empty(1, m.hk, m.topk, dtype=torch.int32, device=self.dev)
            _, ns = split_plan(1, nb, m.hk, m.topk, sparse_tiles_per_block(self.cache.spec))  # as the engine splits
            args, kw = self._attn_args(step, m.sparse, "nvfp4", _q(1, m.hq, m.d, self.dev, self.gen), sel, ns)
            ip = self.cache.pages(m.sparse, "index_k")

            def score() -> None:
                mi.msa_block_scores(iq, ip, step.table, step.seq_lens, step.query_start, scores, max_query_len=1,
                                    topk=m.topk)

            def select() -> None:
                mi.msa_select(scores, step.seq_lens, step.query_start, sel, max_query_len=1, topk=m.topk,
                              block_size=m.p, local_blocks=m.local_blocks, init_blocks=m.init_blocks)

            def attend() -> None:
                pa.paged_attention(*args, **kw)

            def layer() -> None:
                score()
                select()
                attend()

            layer()  # valid scores and selections before the parts are timed alone
            score_bytes = ctx * m.di * ip.element_size() + m.hk * m.di * 2 + m.hk * nb * 4
            select_bytes = m.hk * nb * 4 + m.hk * m.topk * 4
            kv_keys = min(ctx, m.topk * m.p)
            attn_bytes = kv_keys * m.hk * (m.d + 2 * m.d // 16) + 2 * m.hq * m.d * 2 + m.hk * m.topk * 4
            self.record("msa.scores", "indexer block scores", 1, ctx, 1, score, score_bytes)
            self.record("msa.select", f"top-{m.topk} block selection", 1, ctx, 1, select, select_bytes)
            self.record("attn.paged/msa-nvfp4", f"MSA nvfp4 attention (splits {ns})", 1, ctx, 1, attend, attn_bytes)
            self.record("msa.layer", "scores + select + attention", 1, ctx, 1, layer,
                        score_bytes + select_bytes + attn_bytes)

    def kv_write(self, batches: list[int]) -> None:
        kw_mod = self.mods["kv_write"]
        c, m = self.cache, self.m
        for batch in batches:
            flat = (torch.randperm(c.num_slots * m.p, generator=self.host_gen)[:batch]).to(self.dev)
            for layer, fmt in ((m.dense, "fp8"), (m.sparse, "nvfp4")):
                nv = fmt == "nvfp4"
                k = _q(batch, m.hk, m.d, self.dev, self.gen)
                v = _q(batch, m.hk, m.d, self.dev, self.gen)
                ik = torch.randn(batch, m.di, generator=self.gen, device=self.dev).to(torch.bfloat16) if nv else None
                args = (k, v, ik, flat, c.pages(layer, "k"), c.pages(layer, "v"),
                        c.pages(layer, "k_scale") if nv else None, c.pages(layer, "v_scale") if nv else None,
                        c.kv_global_scale[layer] if nv else None, c.pages(layer, "index_k") if nv else None)
                kw = dict(fmt=fmt, index_fmt=c.spec.index_k_format() if nv else None)
                written = batch * m.hk * (m.d + 2 * m.d // 16 if nv else 2 * m.d)
                index = batch * m.di * 2 * 2 if nv else 0  # read bf16 + write bf16
                nbytes = 2 * batch * m.hk * m.d * 2 + written + index + batch * 8
                what = f"{fmt} {'sparse' if nv else 'dense'} layer, 1 token/seq"
                self.record(f"kv.write/{fmt}", what, batch, 0, batch, lambda: kw_mod.kv_write(*args, **kw), nbytes)

    def prefill(self, chunk: int, contexts: list[int]) -> None:
        pf = self.mods["prefill"]
        c, m = self.cache, self.m
        for ctx in contexts:
            step = make_step(m, c.num_slots, [chunk], [ctx + chunk], self.dev, self.host_gen)
            q = _q(chunk, m.hq, m.d, self.dev, self.gen)
            out = torch.empty_like(q)
            args = (q, c.pages(m.dense, "k"), c.pages(m.dense, "v"), step.table, step.seq_lens, step.query_start,
                    out)
            kw = dict(sm_scale=m.d ** -0.5, max_query_len=chunk)
            flops = pf.causal_flops([chunk], [ctx + chunk], m.hq, m.d)
            nbytes = (ctx + chunk) * m.hk * m.d * 2 + 2 * q.numel() * 2
            self.record("attn.prefill/fp8", f"fp8 dense layer, chunk {chunk}", 1, ctx + chunk, chunk,
                        lambda: pf.prefill_attention(*args, **kw), nbytes, flops)
        # the same first chunk on bf16 pages (a uniform bf16 cache), synthetic strided pool
        case = pf.make_step_case((m.hq, m.hk, m.d, m.p, 16), [chunk], [0], self.dev, self.host_gen)
        kw = {k: v for k, v in case.kwargs.items() if k != "tiles"}
        flops = pf.causal_flops([chunk], [chunk], m.hq, m.d)
        self.record("attn.prefill/bf16", f"bf16 pages, chunk {chunk}", 1, chunk, chunk,
                    lambda: pf.prefill_attention(*case.args, **kw), chunk * m.hk * m.d * 4 + 4 * chunk * m.hq * m.d,
                    flops)


# --- whole decode steps (the decode target) ------------------------------------------------------------


def _load_decode_bench():
    """bench/decode.py (its LLM settings, time_decode and WINDOW: one methodology for both benchmarks)."""
    spec = importlib.util.spec_from_file_location("bench_decode", Path(__file__).with_name("decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def target_len_limit(cfg) -> int | None:
    """The longest max_model_len the decode target runs at with its narrowest certified msa.select table (1024
    pages = 128k tokens at M3 TP1): one page more widens the table to the next certified width (8192 pages, M3's
    full 1M context), whose selection rounds scan 8x the blocks on every step. None: no sparse layer, no limit."""
    if "sparse" not in cfg.layer_types:
        return None
    from m3serve.kernels.catalog import all_entries
    p = cfg.index_block_size
    widths = [c.shape[3] for c in all_entries()["msa.select"].cells
              if c.shape[:3] == (cfg.num_key_value_heads, p, cfg.index_topk_blocks)]
    return min(widths) * p if widths else None


def decode_step(model: str, contexts: list[int], steps: int) -> tuple[list[dict], dict]:
    """Whole decode steps of the decode target at batch 1 for each context: (rows, setup)."""
    from m3serve import LLM

    if not is_preset(model):
        raise SystemExit(f"--decode-step-model: expected a preset (random weights), found {model!r}")
    dec = _load_decode_bench()
    headroom = dec.WINDOW * steps + 64       # bench/decode.py's max_model_len margin over its --context
    max_len = max(contexts) + headroom
    limit = target_len_limit(preset(model))
    if limit is not None and max_len > limit:
        print(f"decode_step: max_model_len {max_len} capped at {limit} (msa.select's narrowest certified "
              "table width; a wider table makes every step's block selection scan 8x the blocks)", flush=True)
        max_len = limit
    if max_len - headroom < 1:
        raise SystemExit(f"decode_step: max_model_len {max_len} leaves no prompt after {headroom} tokens of steps")
    # bench/decode.py's LLM for a preset (its --quantization / --kv-cache-dtype defaults), one request at a time;
    # its prefill chunk max(2048, context) is capped at the certified prefill rows.
    kwargs = dict(device="cuda", dtype="bfloat16", random_weights=True, quantization="nvfp4", kv_cache_dtype="nvfp4",
                  max_num_seqs=1, max_num_batched_tokens=min(max(2048, max(contexts)), DECODE_STEP_CHUNK),
                  gpu_memory_utilization=0.85, max_model_len=max_len, route="auto")
    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    load_s = time.perf_counter() - t0
    eng = llm.engine
    if eng.runner.graphs is None or not eng.runner.target_attention:
        raise SystemExit(f"decode_step: the decode target is off for {model} (max_model_len {max_len}); the log "
                         "names the uncertified placements")
    print(f"decode_step: {model} loaded in {load_s:.1f} s; max_model_len {eng.max_model_len}, KV capacity "
          f"{eng.capacity_tokens} tokens, prefill chunk {kwargs['max_num_batched_tokens']}", flush=True)
    rows = []
    for ctx in contexts:
        prompt = min(ctx, eng.max_model_len - headroom)
        if prompt != ctx:
            print(f"decode_step: context {ctx}: a prompt of {prompt} tokens ({prompt} + {headroom} for the steps = "
                  f"max_model_len {eng.max_model_len})", flush=True)
        t0 = time.perf_counter()
        r = dec.time_decode(llm, batch=1, context=prompt, steps=steps, seed=0, window=dec.WINDOW)
        row = {"model": model, "context": ctx, "batch": 1, "median_s": r["median_s"], "gpu_busy_s": r["gpu_busy_s"],
               "launches_per_step": r["launches_per_step"], "prompt_tokens": prompt, "min_s": r["min_s"],
               "steps": r["steps"], "window": r["window"], "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"decode_step {model:14s} b1 ctx {ctx:6d} (prompt {prompt:6d})  {r['median_s'] * 1e3:8.3f} ms/step  "
              f"GPU busy {r['gpu_busy_s'] * 1e3:8.3f} ms  {r['launches_per_step']:.1f} launches/step  "
              f"({row['wall_s']:.1f} s with prefill)", flush=True)
    setup = {"model": model, **{k: v for k, v in kwargs.items() if k != "device"}, "window": dec.WINDOW,
             "steps": steps, "load_s": load_s, "kv_capacity_tokens": eng.capacity_tokens}
    del llm, eng
    gc.collect()   # the routing hooks and graphs hold reference cycles (as in bench/decode.py)
    torch.cuda.empty_cache()
    return rows, setup


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="fewer points (CPU: tiny shapes)")
    ap.add_argument("--iters", type=int, default=None, help="timed repetitions (default 50 CUDA, 2 CPU)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated subset of {GROUPS}")
    ap.add_argument("--out", default=None, help="results file (CUDA default bench/results/attention/attention-h200.json)")
    ap.add_argument("--out-dir", default=None, help="also write a copy here")
    ap.add_argument("--decode-step-model", default="minimax-m3:5", help="decode_step: preset (random weights)")
    ap.add_argument("--decode-step-contexts", default="4096,131072", help="decode_step: comma-separated contexts")
    ap.add_argument("--decode-step-steps", type=int, default=12, help="decode_step: timed windows per context")
    a = ap.parse_args(argv)
    groups = [g for g in a.only.split(",") if g]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise SystemExit(f"--only: expected names from {GROUPS}, found {bad}")
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/attention.py: --device cuda needs a CUDA GPU "
                         "(use --device cpu --quick for a smoke test)")
    mods = load_modules()
    gen = torch.Generator(device=dev).manual_seed(0)
    if dev.type == "cpu":
        cfg = preset("tiny")
        decode_pts, msa_ctx, kv_batches, chunk, pre_ctx = [(1, 64), (2, 40)], [80], [1, 2], 32, [0, 20]
        iters = a.iters or 2
    else:
        cfg = preset("minimax-m3")
        decode_pts = [(1, 4096), (1, 32768), (16, 4096)] + ([] if a.quick else [(1, 131072)])
        msa_ctx = [4096] + ([] if a.quick else [131072])
        kv_batches, chunk, pre_ctx = [1, 16], 8192, [0] + ([] if a.quick else [8192])
        iters = a.iters or 50
    p = cfg.index_block_size
    need = max([b * -(-c // p) for b, c in decode_pts] + [-(-c // p) for c in msa_ctx]
               + [-(-(c + chunk) // p) for c in pre_ctx])
    timer = Timer(dev, iters)
    bw = timer.copy_bandwidth()
    t0 = time.time()
    cache, m = build_cache(cfg, need + 2, dev, gen)
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}: copy bandwidth {bw / 1e12:.3f} TB/s "
          f"(read + write); cache {cache.num_slots} slots x {cache.layout.slot_bytes} B built in "
          f"{time.time() - t0:.1f} s",
          flush=True)
    b = Bench(mods, cache, m, timer, bw, gen)
    if "decode" in groups:
        b.decode(decode_pts)
    if "msa" in groups:
        b.msa(msa_ctx)
    if "kv_write" in groups:
        b.kv_write(kv_batches)
    if "prefill" in groups:
        b.prefill(chunk, pre_ctx)
    rows = b.rows
    steps, step_setup = [], None
    if "decode_step" in groups:
        if dev.type != "cuda":
            print("decode_step: skipped (CUDA only: the decode target runs CUDA graphs)", flush=True)
        else:
            del b, cache, timer   # the attention cache and the L2 flush buffer: the LLM sizes its KV from free memory
            gc.collect()
            torch.cuda.empty_cache()
            contexts = [int(c) for c in a.decode_step_contexts.split(",") if c]
            steps, step_setup = decode_step(a.decode_step_model, contexts, a.decode_step_steps)
    meta = run_metadata()
    doc = {"commit": meta["commit"], "gpu": meta["gpu"], "command": meta["command"], "date": meta["date"],
           "torch": meta["torch"], "triton": __import__("triton").__version__, "device": a.device,
           "preset": "tiny" if dev.type == "cpu" else "minimax-m3", "iters": iters,
           "l2_flush_bytes": FLUSH_BYTES if dev.type == "cuda" else 0, "copy_bandwidth_Bps": bw, "results": rows,
           "decode_step": steps, "decode_step_setup": step_setup}
    out = a.out or (str(Path(__file__).resolve().parent / "results" / "attention" / "attention-h200.json") if dev.type == "cuda"
                    else None)
    text = json.dumps(doc, indent=1)
    for path in [out, str(Path(a.out_dir) / "attention-h200.json") if a.out_dir else None]:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
