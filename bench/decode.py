"""Decode-step benchmark: the stock path, the eager routed path and the decode target (CUDA graphs), side by side
in one process on the same model, cache and requests.

    route  off           stock PyTorch (the numerics reference)
           auto          routed catalog entries + the paged-attention kernels, eager (enforce_eager)
           target        the same, pure decode steps replayed as CUDA graphs (the defaults)
           target-pdl    the same graphs captured with programmatic dependent launch on (m3serve/kernels/_pdl.py;
           target-nopdl  off), whatever the default
           target-pdl8   PDL in the graph buckets of 8 rows and more only (DecodeGraphs' pdl_from; today's default)

For each (model, route, batch) it prefills `batch` requests of `context` tokens, then times whole engine decode
steps (schedule + pack + forward + sample + stop checks; median of `--steps` samples: one step, synchronised, on
the eager routes; a window of --window (8) back-to-back steps on the target, so its overlap loop runs as it serves;
each window starts from a synchronised, drained GPU, so its first step pays the host's launch latency once: a longer
window, with fewer steps to keep the same context growth, charges less of it), and profiles a
few steps for the GPU-busy time (sum of kernel durations) and the launches per step (runtime API launch calls:
kernels, graph launches, copies). The roofline is the bytes a step must read (weights touched + KV) over the
copy bandwidth measured in the same run.

    python bench/decode.py --models m3-tiny-verse,minimax-m3:5 --batch 1,8 --context 512
writes bench/results/decode/decode-target-h200.json (or --out), after every row: until the last, the file says
`"complete": false`, so a run its time limit cuts short keeps the rows it measured and says it was cut short.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from m3serve import LLM, SamplingParams  # noqa: E402
from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.gemm._gemv import gemv_split  # noqa: E402


def copy_bandwidth(device, nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of 10."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times[2:])


def step_bytes(llm, batch: int, context: int, greedy: bool = True) -> int:
    """Bytes one decode step must read: every attention / dense weight, the experts the batch touches
    (expected count under uniform routing), the head as the step reads it (its 12-bit tiles for greedy rows where
    the bound greedy head serves them on head.head12, and for sampled rows where head.head12_logits serves them;
    else the BF16 weight), and the KV of `context` tokens per
    request."""
    m, cfg = llm.model, llm.model.cfg
    total = 0
    for layer in m.layers:
        for mod in layer.modules():
            if hasattr(mod, "qweight") and getattr(mod, "num_experts", None) is None:
                total += mod.qweight.nbytes()
        mlp = layer.mlp
        if hasattr(mlp, "w13"):
            e, k = cfg.num_local_experts, cfg.num_experts_per_tok
            touched = e * (1 - (1 - k / e) ** batch)
            per_expert = (mlp.w13.qweight.nbytes() + mlp.w2.qweight.nbytes()) / e
            total += int(touched * per_expert) + mlp.router.numel() * 4
    head = getattr(m, "greedy_head", None)
    table12 = getattr(head, "table12", None)
    logits12 = getattr(m.lm_head, "kernel", None)       # targets.routing.HeadLogitsKernel where it was bound
    if greedy and table12 is not None and table12(batch) is not None:
        total += head.tiles.nbytes()
    elif not greedy and logits12 is not None and logits12.table(batch) is not None:
        total += logits12.tiles.nbytes()
    else:
        total += m.lm_head.qweight.nbytes()
    total += int(llm.engine.kv.spec.bytes_per_token()["total"] * context * batch)
    return total


# certified-cell variants a side-by-side route binds (route "target-<variant>"): (entries, config type changed or None
# for every cell, the config fields replaced). gate-up-whole: the MMA-step MoE's gate|up over the whole of H in
# every CTA; moe-rolled: the MMA MoE's gate|up and down loops one step an iteration, the ring copied at each back
# edge and down's addresses derived every step (PAIRED off); gemv-rolled: the same for the MMA GEMV (2-8 rows;
# NVFP4 1-8); rolled: both; paired: both paired (whatever the default); paired-split2: and gate-up-split2;
# gate-up-hoist: gate|up's per-thread load offsets computed once before the K loop (MmaMoEConfig.HOIST, opt-in);
# gate-up-split2: split 2 ways over H while (touched slots + shared) x 2 <= 10 (one token: one wave of 960 CTAs at
# the paired loop's 64 registers); gate-up-split(-r72): split 4 ways over H while (touched slots + shared) x 4 <= 20
# (one token), the split launches capped at 64 (72) registers a thread; down-uncapped: the MoE's down launch without
# its register cap;
# gate-up-stages3: gate|up's register ring two steps deep (80 registers, 6 CTAs an SM); down-stages3: the same for
# the down projection (uncapped registers: capped at 80 its one-token variant keeps 32 bytes on the stack); rings3:
# both (more loads in flight a warp: the H200 has 1.4x the H100's bandwidth at the same
# latency, and its one-token MoE ran at about the H100's microseconds);
# split-router: the K-split router (moe_router) at decode token counts too, instead of one program per expert
# (moe_router_rows); mma-gemv-uncapped: the MXFP8 MMA GEMV (3-8 rows) without its register cap; gemv-split2x: the
# MXFP8 CUDA-core GEMV (1-2 rows) split over K twice as many ways where each split keeps >= 2 K steps (fields may
# be a function of the config and the cell's shape)
CELL_VARIANTS = {
    "gate-up-whole": (("moe.nvfp4",), "MmaMoEConfig", {"GSPLIT": 1}),
    "moe-rolled": (("moe.nvfp4",), "MmaMoEConfig", {"PAIRED": False}),
    "gate-up-split2": (("moe.nvfp4",), "MmaMoEConfig", {"GSPLIT": 2, "GSPLIT_SLOTS": 10}),
    "gate-up-hoist": (("moe.nvfp4",), "MmaMoEConfig", {"HOIST": True}),
    "gemv-rolled": (("linear.nvfp4", "linear.mxfp8", "qkv.nvfp4", "qkv.mxfp8"), "MmaGemvConfig", {"PAIRED": False}),
    "gate-up-split": (("moe.nvfp4",), "MmaMoEConfig", {"GSPLIT": 4, "GSPLIT_SLOTS": 20, "maxnreg": 64}),
    "gate-up-split-r72": (("moe.nvfp4",), "MmaMoEConfig", {"GSPLIT": 4, "GSPLIT_SLOTS": 20, "maxnreg": 72}),
    "down-uncapped": (("moe.nvfp4",), "MmaMoEConfig", {"down_maxnreg": 0}),
    "gate-up-stages3": (("moe.nvfp4",), "MmaMoEConfig", {"STAGES": 3}),
    "down-stages3": (("moe.nvfp4",), "MmaMoEConfig", {"down_stages": 3, "down_maxnreg": 0}),
    "rings3": (("moe.nvfp4",), "MmaMoEConfig", {"STAGES": 3, "down_stages": 3, "down_maxnreg": 0}),
    "split-router": (("moe.nvfp4",), None, {"ROUTER_ROWS": 0}),
    "mma-gemv-uncapped": (("linear.mxfp8", "qkv.mxfp8"), "MmaGemvConfig", {"maxnreg": 0}),
    "gemv-split2x": (("linear.mxfp8", "qkv.mxfp8"), "GemvConfig",
                     lambda c, shape: {"SPLIT": 2 * c.SPLIT} if shape[1] % (c.BK * c.SPLIT * 4) == 0 else {}),
}
# every MMA loop one step an iteration (the MoE's and the GEMV's), as before the paired loops
CELL_VARIANTS["rolled"] = [CELL_VARIANTS["moe-rolled"], CELL_VARIANTS["gemv-rolled"]]
CELL_VARIANTS["paired"] = [(names, kind, {"PAIRED": True}) for names, kind, _ in CELL_VARIANTS["rolled"]]
CELL_VARIANTS["paired-split2"] = CELL_VARIANTS["paired"] + [CELL_VARIANTS["gate-up-split2"]]
# the decode cells as the seventh round of issue 30 left them (route target-round7, with the MSA walk over every
# selection slot): the one-step MMA loops, gate|up over the whole of H
CELL_VARIANTS["round7"] = CELL_VARIANTS["rolled"] + [CELL_VARIANTS["gate-up-whole"]]
# the decode cells as issue 30's third round left them (with route target-round3 also attn.paged's split count
# rounded up): the one-token MoE down and the MXFP8 MMA GEMV uncapped, the MXFP8 GEMV split toward 528 programs
CELL_VARIANTS["round3"] = [CELL_VARIANTS["down-uncapped"], CELL_VARIANTS["mma-gemv-uncapped"],
                           (("linear.mxfp8", "qkv.mxfp8"), "GemvConfig",
                            lambda c, shape: {"SPLIT": gemv_split(shape[0], shape[1], c.BN, c.BK, 528)})]


# routes that set m3serve.targets.plan switches (the others keep the plan module's values: the defaults)
SWITCH_ROUTES = {"target-index-gemv": {"INDEX_GEMV": True}, "target-head12": {"HEAD12": True},
                 "target-head-bf16": {"HEAD12": False}, "target-opt-in": {"INDEX_GEMV": True, "HEAD12": True},
                 "target-head12-logits": {"HEAD12": True, "HEAD12_LOGITS": True}}


def route_binding(route: str) -> tuple[str, str | None, bool, str | None, tuple[tuple[str, bool], ...]]:
    """(route mode, weight layout, fused greedy head, cell variant, plan switches set) a route runs with. target-rows:
    NVFP4 / MXFP8 weights left row-major (the layout before the MMA tile layout); target-logits-head: greedy tokens
    from the head's logits + argmax instead of the fused greedy head (head.bf16); target-<v> for v in CELL_VARIANTS:
    those entries' cells changed as CELL_VARIANTS[v] says; SWITCH_ROUTES: those m3serve.targets.plan switches set
    (INDEX_GEMV: the index-q|index-k projections on linear.bf16 instead of cuBLAS; HEAD12: the greedy head's 1-8 rows
    on head.head12, or with False on head.bf16; HEAD12_LOGITS: the head's 1-8 logits rows, those that sample, on
    head.head12_logits), the others as the plan module has them; every other target route:
    the defaults."""
    variant = route[len("target-"):] if route.startswith("target-") else None
    return ("off" if route == "off" else "auto", "rows" if route == "target-rows" else None,
            route != "target-logits-head", variant if variant in CELL_VARIANTS else None,
            tuple(sorted(SWITCH_ROUTES.get(route, {}).items())))


def set_cell_variant(variant: str | None, saved: dict) -> None:
    """Every entry's cells CELL_VARIANTS names as the catalog has them (variant None), or changed as
    CELL_VARIANTS[variant] says (a change or a list of them; kind None: every config that has the fields): the
    cells' configs are what routing.install binds. saved: {(entry, cell index): its config dict as the catalog has
    it}, filled on first use."""
    from dataclasses import replace

    from m3serve.kernels.catalog import all_entries
    entries = all_entries()
    changes = CELL_VARIANTS[variant] if variant else []
    changes = changes if isinstance(changes, list) else [changes]
    every = {n for v in CELL_VARIANTS.values() for ch in (v if isinstance(v, list) else [v]) for n in ch[0]}
    for name in sorted(every):
        for i, cell in enumerate(entries[name].cells):
            configs = saved.setdefault((name, i), dict(cell.config))
            for key, cfg in configs.items():
                for names, kind, fields in changes:
                    if name in names and (type(cfg).__name__ == kind if kind else
                                          all(hasattr(cfg, f) for f in fields)):
                        cfg = replace(cfg, **(fields(cfg, cell.shape) if callable(fields) else fields))
                cell.config[key] = cfg


def set_route(llm, route: str, state: dict) -> None:
    """Bind the route's binding (only when it changes) and give the runner its graphs. A graph replays the kernels,
    flags and workspace addresses of the binding it was captured under, so a new binding drops every cached graph
    (the decode graphs here; the bench runs without prefill graphs) and each graph route captures its own on first
    use. state: {"binding", "graphs": {route: DecodeGraphs}, "buckets"}."""
    from m3serve.targets import routing
    want = route_binding(route)
    if state["binding"] != want:
        from m3serve.targets import plan
        set_cell_variant(want[3], state.setdefault("cells", {}))
        defaults = state.setdefault("plan_switches",
                                    {n: getattr(plan, n) for n in ("INDEX_GEMV", "HEAD12", "HEAD12_LOGITS")})
        for name, default in defaults.items():   # read when the plan is built
            setattr(plan, name, dict(want[4]).get(name, default))
        routing.install(llm.model, want[0], weight_layout=want[1])
        if not want[2]:
            llm.model.greedy_head = None
        state["binding"], state["graphs"] = want, {}
    llm.engine.runner.target_attention = route != "off"
    from m3serve.kernels.attention import _paged_call
    # read when a step's split plan is made (graph capture, eager steps)
    _paged_call.SPLITS_ROUND_UP = route in ("target-splits-up", "target-round3")
    # read at launch (graph capture): the split-KV merge as a second launch, the layout before it was folded in
    _paged_call.COMBINE_LAUNCH = route == "target-combine-launch"
    # the MSA tile walk: all top-k slots, or only those that can hold a block; other routes keep the tree's default
    walk_default = state.setdefault("sel_walk_all", _paged_call.SEL_WALK_ALL)
    _paged_call.SEL_WALK_ALL = {"target-msa-walk-all": True, "target-round7": True,
                                  "target-msa-bound": False}.get(route, walk_default)
    graphs = state["graphs"]
    if route.startswith("target") and route not in graphs:
        # PDL from this many rows (DecodeGraphs' pdl_from): every bucket, none (past the largest), from 8 rows
        pdl_from = {"target-pdl": 1, "target-nopdl": max(state["buckets"]) + 1, "target-pdl8": 8}.get(route)
        graphs[route] = recapture(llm, state["buckets"], pdl_from,
                                  race_sampler=False if route == "target-torch-sampler" else None)
    llm.engine.runner.graphs = graphs.get(route)


def recapture(llm, buckets: tuple[int, ...], pdl_from: int | None = None, race_sampler: bool | None = None):
    """The target's graphs captured again (these buckets) for a side-by-side run: as the model is bound now (its
    weight layout, its greedy head), with programmatic dependent launch in the buckets of at least `pdl_from` rows
    and not in the others (DecodeGraphs' pdl_from; None: as the tree has it). race_sampler=False: the sampling
    variant draws with the torch sampler instead of sample.race (DecodeGraphs)."""
    from m3serve.runtime.decode_graphs import DecodeGraphs
    eng = llm.engine
    g = DecodeGraphs(llm.model, eng.kv, eng.runner.tables, buckets, penalties=eng.penalties,
                     race_sampler=race_sampler, pdl_from=pdl_from)
    g.capture()
    return g


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync",
                "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemsetAsync")


def triton_families() -> dict[str, str]:
    """Triton kernel name -> its op family (the kernels/ sub-package, or `kv` for the block-table kernels): every
    @kernel of the package, found by walking its modules."""
    import importlib
    import pkgutil

    import m3serve.kernels as kernels_pkg
    from m3serve.kernels._jit import DualKernel
    names = ["m3serve.kv._expand_triton"] + [m.name for m in pkgutil.walk_packages(kernels_pkg.__path__,
                                                                                    "m3serve.kernels.")]
    out = {}
    for name in names:
        mod = importlib.import_module(name)
        parts = name.split(".")
        family = parts[2] if parts[1] == "kernels" and len(parts) > 3 else parts[1]
        for v in vars(mod).values():
            if isinstance(v, DualKernel):
                out[v.__name__] = family
    return out


def kernel_class(name: str, families: dict[str, str]) -> str:
    """The class a GPU kernel's time is reported under: a catalog family (gemm, moe, attention, norm, mlp, head,
    spec, formats, kv), `cublas` (cuBLAS / CUTLASS GEMMs), `copy` (memcpy / memset), or `torch` (the rest: PyTorch's
    elementwise, reduction and indexing kernels)."""
    if name in families:
        return families[name]
    low = name.lower()
    if "memcpy" in low or "memset" in low:
        return "copy"
    if any(t in low for t in ("gemm", "cutlass", "nvjet", "xmma", "sm90_")):
        return "cublas"
    return "torch"


def kernel_gaps(intervals: list[tuple[float, float]], steps: int) -> dict:
    """The GPU's idle time between kernels (issue 30: ramp-up and tail inside a graph): from the (start, end) µs of
    every kernel of `steps` steps, the gaps between one kernel's end and the next one's start (overlapping kernels
    leave none). Per step: kernels, idle seconds; over all gaps: the median, 90th percentile and largest, in µs."""
    spans = sorted(intervals)
    gaps, reach = [], None
    for start, end in spans:
        if reach is not None:
            gaps.append(max(0.0, start - reach))
        reach = end if reach is None else max(reach, end)
    if not gaps:
        return {"kernels_per_step": len(spans) / steps, "gpu_idle_s": 0.0, "gap_us_p50": None, "gap_us_p90": None,
                "gap_us_max": None, "idle_in_long_gaps_s": 0.0, "long_gaps_per_step": 0.0}
    q = sorted(gaps)
    # the idle a graph's launches cannot explain: gaps over LONG_GAP_US (between steps: the host; inside one: a
    # sync or an eager op)
    long = [x for x in gaps if x > LONG_GAP_US]
    return {"kernels_per_step": len(spans) / steps, "gpu_idle_s": sum(gaps) / 1e6 / steps,
            "gap_us_p50": q[len(q) // 2], "gap_us_p90": q[min(len(q) - 1, (9 * len(q)) // 10)], "gap_us_max": q[-1],
            "idle_in_long_gaps_s": sum(long) / 1e6 / steps, "long_gaps_per_step": len(long) / steps}


LONG_GAP_US = 5.0  # a gap between kernels longer than this is not a launch inside a graph (those are ~0.5 µs)
TOP_KERNELS = 40  # kernels listed by name per result (the rest is in the class totals)


def top_kernels(times: dict[str, list[float]], steps: int, n: int = TOP_KERNELS) -> list[dict]:
    """The `n` kernels with the most GPU time, from {name: [µs, ...]} over `steps` steps: per step, seconds and
    launches, and the mean µs of one launch (where a layer's time goes, kernel by kernel)."""
    rows = sorted(times.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [{"kernel": name, "s_per_step": sum(us) / 1e6 / steps, "calls_per_step": len(us) / steps,
             "us_per_call": sum(us) / len(us)} for name, us in rows]


def profile_steps(eng, steps: int) -> tuple[float, float, dict[str, float], dict]:
    """(GPU-busy seconds per step, launch calls per step, GPU seconds per step by kernel class, kernel_gaps and the
    top kernels by name) over `steps` engine steps."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    families = triton_families()
    busy_us, launches, by_class, spans, by_name = 0.0, 0, {}, [], {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            busy_us += ev.device_time
            c = kernel_class(ev.name, families)
            by_class[c] = by_class.get(c, 0.0) + ev.device_time
            by_name.setdefault(ev.name, []).append(ev.device_time)
            spans.append((ev.time_range.start, ev.time_range.end))
        elif ev.name in LAUNCH_CALLS:
            launches += 1
    return (busy_us / 1e6 / steps, launches / steps, {c: us / 1e6 / steps for c, us in sorted(by_class.items())},
            {**kernel_gaps(spans, steps), "top_kernels": top_kernels(by_name, steps)})


WINDOW = 8   # decode steps per timing sample on the target (the eager routes sync every step anyway: 1)


def time_decode(llm, batch: int, context: int, steps: int, seed: int, window: int = 1,
                sampling: dict | None = None) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    vocab = llm.model.cfg.vocab_size
    params = SamplingParams(max_tokens=window * steps + 16, ignore_eos=True, **(sampling or {"temperature": 0.0}))
    reqs = [eng.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(), params) for _ in range(batch)]
    while any(r.num_computed < len(r.prompt_token_ids) for r in reqs):   # prefill (chunked)
        eng.step()
    # Steps run back to back, as a serving loop runs them: the overlap loop keeps one step in flight, so a
    # synchronize around every step would serialise host and GPU and time their sum. Each sample is a window
    # of `window` consecutive steps (synchronized only at its ends), divided by `window`.
    times = []
    eng.step()
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(window):
            eng.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / window)
    busy, launches, by_class, gaps = profile_steps(eng, 3)
    tokens = [list(r.output_token_ids) for r in reqs]
    for r in reqs:
        eng.abort(r.request_id)
    med = statistics.median(times[1:])
    return {"median_s": med, "min_s": min(times[1:]), "steps": window * (len(times) - 1), "window": window,
            "tokens_per_s": batch / med,
            "gpu_busy_s": busy, "gpu_s_by_class": by_class, "launches_per_step": launches, **gaps, "_tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="m3-tiny-verse,minimax-m3:5",
                    help="comma list: m3-tiny-verse (the embedded model) or presets (random weights)")
    ap.add_argument("--quantization", default="nvfp4", choices=["none", "fp8", "mxfp8", "nvfp4"],
                    help="for presets (the embedded model is BF16)")
    ap.add_argument("--kv-cache-dtype", default="nvfp4", help="for presets (the embedded model keeps BF16 KV)")
    ap.add_argument("--kv-rotation", default="auto",
                    help="hybrid cache's NVFP4 K/V rotation (m3serve.kv.rotation): auto (the default seed, or the "
                         "model's kv_scales.json), off, or a seed; run once each way for the side-by-side cost")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=WINDOW,
                    help="back-to-back steps a timing sample on the target routes (synchronised at its ends)")
    ap.add_argument("--routes", default="off,auto,target",
                    help="comma list of off, auto, target, target-pdl, target-nopdl, target-pdl8, target-rows (NVFP4 / MXFP8 "
                         "weights row-major), target-logits-head (greedy tokens from the head's logits), "
                         "target-<v> for v in CELL_VARIANTS (certified cells changed: gate-up-whole, moe-rolled, "
                         "gate-up-hoist, gate-up-split2, gemv-rolled, rolled, paired, paired-split2, gate-up-split, "
                         "gate-up-split-r72, down-uncapped, gate-up-stages3, down-stages3, rings3, split-router, "
                         "mma-gemv-uncapped, "
                         "gemv-split2x, round3: all of the third round's changes undone, round7: the seventh "
                         "round's cells and MSA walk), target-splits-up (attn.paged's "
                         "split count rounded up, the rule before the one-wave rule), target-index-gemv (the index "
                         "projections on linear.bf16, opt-in, not cuBLAS), target-head12 / target-head-bf16 (the "
                         "greedy head's 1-8 rows on the 12-bit / the BF16 head), target-opt-in (index GEMV + head12), "
                         "target-torch-sampler (the sampling variant on the torch sampler, not sample.race), "
                         "target-combine-launch (attn.paged's split-KV merge as a second launch, not in the split "
                         "kernel's last arrival), target-msa-walk-all (MSA rows walk all top-k selection slots, "
                         "the -1 padding too, as before the tile bound), target-msa-bound (only the slots that can "
                         "hold a block)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples (seeded per request)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "decode", "decode-target-h200.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    penalties = {k: v for k, v in (("repetition_penalty", args.repetition_penalty),
                                   ("frequency_penalty", args.frequency_penalty),
                                   ("presence_penalty", args.presence_penalty)) if v != (1.0 if k[0] == "r" else 0.0)}
    sampling = None
    if args.temperature > 0 or penalties:
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, **penalties,
                    "seed": 1}
    routes = args.routes.split(",")
    kv_rotation = {"auto": "auto", "off": None}.get(args.kv_rotation) if not args.kv_rotation.isdigit() else int(
        args.kv_rotation)
    if args.kv_rotation not in ("auto", "off") and not args.kv_rotation.isdigit():
        raise ValueError(f"--kv-rotation: expected auto, off or a non-negative int seed, found {args.kv_rotation!r}")
    bw = copy_bandwidth(dev)
    results, loads = [], {}
    header = {"bench": "decode", **run_metadata(), "copy_bandwidth_Bps": bw, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "kv_rotation": args.kv_rotation, "sampling": sampling}
    for name in args.models.split(","):
        embedded = name == "m3-tiny-verse"
        quant = None if (embedded or args.quantization == "none") else args.quantization
        t0 = time.perf_counter()
        llm = LLM(None if embedded else name, device="cuda", dtype="bfloat16", random_weights=not embedded,
                  quantization=quant, kv_cache_dtype="auto" if embedded else args.kv_cache_dtype,
                  kv_rotation=kv_rotation, max_num_seqs=max(batches),
                  max_num_batched_tokens=max(2048, args.context), gpu_memory_utilization=0.85,
                  max_model_len=args.context + args.window * args.steps + 64, route="auto",
                  # every route prefills its prompts itself: a prefix hit would give a later route other prefill
                  # rows (other kernels, other summation order) than the route it is compared with; and eagerly:
                  # prefill graphs would replay the kernels of the binding they were captured under (set_route)
                  enable_prefix_caching=False, prefill_graph_tokens=0)
        loads[name] = time.perf_counter() - t0
        init = llm.engine.runner.graphs
        state = {"binding": route_binding("target"), "graphs": {"target": init}, "buckets": init.buckets}
        base_tokens, target_tokens = {}, {}
        for route in routes:
            set_route(llm, route, state)
            for b in batches:
                r = time_decode(llm, b, args.context, args.steps, seed=b,
                                window=args.window if route.startswith("target") else 1,
                                sampling=sampling)
                toks = r.pop("_tokens")
                if route == "off":
                    base_tokens[b] = toks
                if route == "target":
                    target_tokens[b] = toks
                same = [x == y for ref, got in zip(base_tokens.get(b, []), toks) for x, y in zip(ref, got)]
                nbytes = step_bytes(llm, b, args.context, greedy=args.temperature == 0)
                r.update(model=name, route=route, batch=b, context=args.context, bytes_per_step=nbytes,
                         roofline_s=nbytes / bw, fraction_of_roofline=(nbytes / bw) / r["median_s"],
                         greedy_agreement_vs_off=(sum(same) / len(same)) if same else None)
                if route.startswith("target-") and b in target_tokens:
                    eq = [x == y for ref, got in zip(target_tokens[b], toks) for x, y in zip(ref, got)]
                    r["tokens_equal_to_target"] = sum(eq) / len(eq) if eq else None
                    # greedy decoding of random weights is chaotic: one near-tie flipped by summation order parts the
                    # sequences for good, so where they first part says more than the share of equal tokens
                    r["first_difference_vs_target"] = [next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y),
                                                            None) for ref, got in zip(target_tokens[b], toks)]
                print(json.dumps(r), flush=True)
                results.append(r)
                # written after every row: a run cut short by a time limit keeps what it measured, marked so
                write_results(args.out, {**header, "load_s": loads, "results": results}, complete=False)
        del llm, state, init
        gc.collect()   # the routing hooks and graphs hold reference cycles; the next model sizes its KV from free memory
        torch.cuda.empty_cache()
    write_results(args.out, {**header, "load_s": loads, "results": results}, complete=True)
    print(f"wrote {args.out}", flush=True)


def write_results(path: str, out: dict, complete: bool) -> None:
    """Write the results file whole (a temporary file renamed over it, so a kill mid-write leaves the previous
    version); `complete` False says the run had rows still to measure (bench/report.py shows it)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({**out, "complete": complete}, f, indent=2)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
