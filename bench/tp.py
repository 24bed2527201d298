"""Tensor parallelism on two GPUs: the stock path at real dimensions, TP2 against TP1, and one 12 KB all-reduce.

    torchrun --nproc-per-node 2 bench/tp.py                 # 2 H200s; or `python bench/tp.py` (spawns 2 ranks)
    torchrun --nproc-per-node 2 bench/tp.py --no-tp1 --preset minimax-m3:auto    # deepest L at TP2 alone
    python bench/tp.py --device cpu --preset tiny --out /tmp    # the same logic on CPU with gloo

Model: `minimax-m3:L`, deterministic random weights (NVFP4 experts + MXFP8 projections by default), the same
tensors at any TP (each rank slices what it owns). `--preset minimax-m3:auto` picks the deepest L whose TP1 run
fits one GPU (bench/memory_plan.py from the config and the GPU's free memory; with --no-tp1 the deepest L at
TP2). Workload: one sequence, a prompt of P tokens (default 2176 = 17 pages, so MSA's top-16 selection is
active), then D greedy decode steps.

Phases
  1. rank 0 alone: TP1 in bf16 (free-running greedy: the reference tokens, logits and step times), then TP1 in
     fp32 teacher-forced on those tokens (the bf16 noise floor; weights stay in their NVFP4/MXFP8 codes).
  2. both ranks: TP2 free-running greedy (step times, greedy agreement), then teacher-forced on the TP1 tokens
     with every all-reduce timed by CUDA events (time per step, count, bytes) and the full logits gathered.
  3. all-reduce of 12 KB (6144 bf16 = one token's hidden state): NCCL eager (host-synced and back-to-back),
     NCCL in a CUDA graph, torch symmetric memory one-shot (NVLink multicast off).
Tolerance (bf16): TP2's logits may differ from TP1's by no more than bf16 itself moves TP1's logits away from
fp32: rel_rms(TP2 - TP1) <= 2 x rel_rms(TP1_bf16 - TP1_fp32), per row, worst row; and TP2 must be as close to
fp32 as TP1 is (rel_rms(TP2 - fp32) <= 1.5 x rel_rms(TP1 - fp32) + 1e-3). Without the fp32 run a fixed bound
of 5e-2 applies (bf16 keeps 8 bits: 2^-8 = 3.9e-3 per rounding, compounded over two reductions per layer).
Greedy agreement is reported, not required: one near-tie flip changes every later token.
Writes bench/results/tp/tp-<device>-<preset>-<date>.json (GPU, commit, command, date) on rank 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")   # before CUDA initialises: no NVLink multicast
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from m3serve.config import preset  # noqa: E402
from m3serve.distributed.vocab import vocab_parallel_argmax  # noqa: E402
from m3serve.kv.cache import PagedKVCache  # noqa: E402
from m3serve.kv.spec import KVCacheSpec  # noqa: E402
from m3serve.model.loader import load_model  # noqa: E402
from m3serve.model.m3 import ForwardBatch, SeqSpan  # noqa: E402
from m3serve.model.parallel import SINGLE, TPGroup  # noqa: E402

AR_NUMEL = 6144                        # one token's hidden state in bf16 = 12 KB
FIXED_REL_RMS = 5e-2
LONG = _dt.timedelta(days=1)


# ----------------------------------------------------------------------------- all-reduce timing hook
class ARTimer:
    """Times every TPGroup.all_reduce while active (CUDA events on GPU, wall clock on CPU)."""
    active = False
    spans: list = []
    nbytes: int = 0
    _orig = None

    @classmethod
    def install(cls) -> None:
        if cls._orig is not None:
            return
        cls._orig = orig = TPGroup.all_reduce

        def timed(self, x):
            if not cls.active or self.size == 1:
                return orig(self, x)
            cls.nbytes = x.numel() * x.element_size()
            if x.is_cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                orig(self, x)
                e.record()
                cls.spans.append((s, e))
            else:
                t = time.perf_counter()
                orig(self, x)
                cls.spans.append(time.perf_counter() - t)
            return x

        TPGroup.all_reduce = timed

    @classmethod
    def take_ms(cls) -> tuple[float, int]:
        """(total ms, count) since the last call; the caller has synchronised the device."""
        spans, cls.spans = cls.spans, []
        total = sum(sp[0].elapsed_time(sp[1]) if isinstance(sp, tuple) else sp * 1e3 for sp in spans)
        return total, len(spans)


# ----------------------------------------------------------------------------- model runs
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "n": len(xs), "all": [round(x, 4) for x in xs]}


def decode(model, kv: PagedKVCache, slots: torch.Tensor, prompt: list[int], steps: int, forced: list[int] | None,
           gather: bool, time_ar: bool) -> dict:
    """Prefill + `steps` greedy decode steps of one sequence; forced: feed these tokens instead of our own.
    Row i of the logits (gathered after the timed region) follows prompt + tokens[:i] on every run."""
    dev, tp, page = model.device, model.tp, kv.page_size
    seq, start = list(prompt), 0
    tokens, logits, times, ar_ms, ar_n = [], [], [], [], []
    for i in range(steps + 1):
        pos = torch.arange(start, len(seq), device=dev)
        batch = ForwardBatch(torch.tensor(seq[start:], device=dev), pos, [SeqSpan(0, pos.numel(), len(seq), slots)],
                             slot_mapping=slots[pos // page] * page + pos % page, kv=kv,
                             logits_rows=torch.tensor([pos.numel() - 1], device=dev))
        _sync(dev)
        ARTimer.active = time_ar
        t0 = time.perf_counter()
        with torch.inference_mode():
            local = model.local_logits(model.hidden(batch)[batch.logits_rows])
            tok = int(vocab_parallel_argmax(local, tp, model.vocab_start)[0])   # the host needs it: a sync
        times.append((time.perf_counter() - t0) * 1e3)
        ARTimer.active = False
        if time_ar:
            _sync(dev)
            a, n = ARTimer.take_ms()
            ar_ms.append(a)
            ar_n.append(n)
        if gather:
            with torch.inference_mode():
                logits.append(tp.all_gather_last(local)[0].float().cpu())
        tokens.append(tok)
        start = len(seq)
        seq.append(forced[i] if forced is not None else tok)
    out = {"tokens": tokens, "prefill_ms": times[0], "decode_ms": times[1:]}
    if gather:
        out["logits"] = torch.stack(logits)
    if time_ar:
        out["ar_ms_decode"], out["ar_count_decode"] = ar_ms[1:], ar_n[1:]
        out["ar_ms_prefill"], out["ar_count_prefill"] = ar_ms[0], ar_n[0]
    return out


def run_model(cfg, tp: TPGroup, dev: torch.device, dtype: torch.dtype, args, prompt: list[int],
              passes: list[tuple[str, list[int] | None, bool, bool]]) -> dict:
    """Load one shard, run `passes` = [(name, forced tokens or None, gather logits, time all-reduces)], each on
    its own pages of one KV cache, free everything."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    model = load_model(cfg, device=dev, dtype=dtype, tp=tp, random_weights=True, quantization=args.quant,
                       seed=args.seed, keep_quantized=True)
    _sync(dev)
    out = {"load_s": time.perf_counter() - t0, "dtype": str(dtype).replace("torch.", "")}
    spec = KVCacheSpec.from_model_config(cfg, tp_size=tp.size, model_dtype=dtype)
    per_seq = -(-(len(prompt) + args.steps + 1) // spec.page_size)
    kv = PagedKVCache(spec, per_seq * len(passes) + 1, dev)
    kv.check_bounds = False          # slot ids are ours; skip the per-write device sync
    for j, (name, forced, gather, time_ar) in enumerate(passes):
        slots = torch.arange(1 + j * per_seq, 1 + (j + 1) * per_seq, dtype=torch.int64, device=dev)
        out[name] = decode(model, kv, slots, prompt, args.steps, forced, gather, time_ar and tp.size > 1)
    if dev.type == "cuda":
        out["peak_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        free, total = torch.cuda.mem_get_info(dev)
        out["device_used_gb"] = (total - free) / 1e9
    del model, kv
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- accuracy
def rel_rms(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Per row ||a - b|| / ||b||."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    r = rel_rms(a, b)
    return {"max_abs": (a - b).abs().max().item(), "rel_rms_max": max(r), "rel_rms_mean": statistics.fmean(r),
            "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(), "rows": a.shape[0]}


def accuracy(tp1: dict, tp2: dict, fp32: dict | None) -> dict:
    ref = tp1["free"]["tokens"]
    got = tp2["free"]["tokens"]
    prefix = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), len(ref))
    out = {"tp2_vs_tp1": compare(tp2["forced"]["logits"], tp1["free"]["logits"]),
           "greedy_free_running": {"identical_prefix": prefix, "tokens": len(ref),
                                   "equal_fraction": sum(x == y for x, y in zip(ref, got)) / len(ref)}}
    if fp32 is not None:
        truth = fp32["forced"]["logits"]
        out["tp1_vs_fp32"] = compare(tp1["free"]["logits"], truth)
        out["tp2_vs_fp32"] = compare(tp2["forced"]["logits"], truth)
        floor = out["tp1_vs_fp32"]["rel_rms_max"]
        bound = 2.0 * floor
        ok = (out["tp2_vs_tp1"]["rel_rms_max"] <= bound
              and out["tp2_vs_fp32"]["rel_rms_max"] <= 1.5 * floor + 1e-3)
        rule = ("rel_rms(TP2-TP1) <= 2 x rel_rms(TP1_bf16-fp32) and rel_rms(TP2-fp32) <= 1.5 x "
                "rel_rms(TP1_bf16-fp32) + 1e-3 (worst row)")
    else:
        bound = FIXED_REL_RMS
        ok = out["tp2_vs_tp1"]["rel_rms_max"] <= bound
        rule = f"rel_rms(TP2-TP1) <= {FIXED_REL_RMS} (worst row; no fp32 reference run)"
    out["tolerance"] = {"rule": rule, "bound_rel_rms": bound}
    out["pass"] = bool(ok)
    return out


# ----------------------------------------------------------------------------- all-reduce microbenchmarks
def _ar_all_ok(ctl, ok: bool) -> bool:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok, group=ctl)
    return all(flags)


def _time_op(op, dev: torch.device, iters: int) -> dict:
    """op() launches one all-reduce. Host-synced latency (median), back-to-back, and in a CUDA graph."""
    for _ in range(20):
        op()
    _sync(dev)
    lat = []
    for _ in range(min(iters, 300)):
        _sync(dev)
        t = time.perf_counter()
        op()
        _sync(dev)
        lat.append((time.perf_counter() - t) * 1e6)
    out = {"synced_us_median": statistics.median(lat), "synced_us_p10": sorted(lat)[len(lat) // 10]}
    if dev.type != "cuda":
        return out
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        op()
    e.record()
    _sync(dev)
    out["back_to_back_us"] = s.elapsed_time(e) * 1e3 / iters
    try:
        per_graph = 50
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            op()
        torch.cuda.current_stream(dev).wait_stream(stream)
        _sync(dev)
        with torch.cuda.graph(g):
            for _ in range(per_graph):
                op()
        g.replay()
        _sync(dev)
        reps = max(1, iters // per_graph)
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        _sync(dev)
        out["cuda_graph_us"] = s.elapsed_time(e) * 1e3 / (reps * per_graph)
    except Exception as ex:                                  # graph capture of this op unsupported here
        out["cuda_graph_error"] = f"{type(ex).__name__}: {ex}"[:300]
    return out


def allreduce_bench(dev: torch.device, ctl, iters: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    src = torch.randn(AR_NUMEL, generator=g).to(dtype).to(dev)
    want = torch.zeros(AR_NUMEL, dtype=torch.float32)
    for r in range(world):
        want += torch.randn(AR_NUMEL, generator=torch.Generator(device="cpu").manual_seed(1234 + r)).to(dtype).float()
    res = {"bytes": AR_NUMEL * 2, "dtype": "bfloat16", "world_size": world}
    # bf16 sum of `world` bf16 values: within 1 bf16 ulp (2^-8 relative) of the exact fp32 sum, plus a
    # half-ulp per extra addition; 2e-2 absolute covers |sum| < 4 with unit-normal inputs.
    x = src.clone()
    dist.all_reduce(x)
    nccl_ok = bool(((x.float().cpu() - want).abs() <= 2e-2 + 8e-3 * want.abs()).all())
    buf = src.clone()       # summed in place over and over: it overflows to inf, which costs the same time
    res["nccl"] = {"correct": nccl_ok, **_time_op(lambda: dist.all_reduce(buf), dev, iters)}
    if dev.type != "cuda":
        res["symm_mem_one_shot"] = {"skipped": "needs CUDA"}
        return res
    sm: dict = {"multicast_disabled_env": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    ok, step = True, "import"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        group = dist.group.WORLD
        name = group.group_name
        step = "enable"
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(name)
            except Exception:
                pass
        step = "rendezvous"
        sbuf = symm_mem.empty(AR_NUMEL, dtype=dtype, device=dev)
        symm_mem.rendezvous(sbuf, name)
        sbuf.copy_(src)
        out = torch.empty_like(sbuf)
    except Exception as ex:
        ok, sm["error"] = False, f"{step}: {type(ex).__name__}: {ex}"[:500]
    if _ar_all_ok(ctl, ok):
        try:
            step = "one_shot_all_reduce"
            torch.ops.symm_mem.one_shot_all_reduce_out(sbuf, "sum", name, out)
            _sync(dev)
            sm["correct"] = bool(((out.float().cpu() - want).abs() <= 2e-2 + 8e-3 * want.abs()).all())
        except Exception as ex:
            ok, sm["error"] = False, f"{step}: {type(ex).__name__}: {ex}"[:500]
        if _ar_all_ok(ctl, ok):
            sm.update(_time_op(lambda: torch.ops.symm_mem.one_shot_all_reduce_out(sbuf, "sum", name, out), dev,
                               iters))
    res["symm_mem_one_shot"] = sm
    return res


# ----------------------------------------------------------------------------- orchestration
def _git() -> dict:
    def run(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
    try:
        return {"commit": run("rev-parse", "HEAD") or "unknown", "dirty": bool(run("status", "--porcelain"))}
    except Exception:
        return {"commit": "unknown", "dirty": None}


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _bcast(obj, ctl):
    box = [obj]
    dist.broadcast_object_list(box, 0, group=ctl)
    return box[0]


def choose_layers(name: str, args, dev: torch.device, world: int) -> tuple[str, dict]:
    """Resolve minimax-m3:auto to the deepest L that fits (rank 0 computes; caller broadcasts)."""
    base, _, layers = name.partition(":")
    if layers != "auto":
        return name, {"rule": "given"}
    from memory_plan import max_layers
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        budget = 0.95 * free                 # 5% of the free memory left as slack beyond the plan's reserve
    else:
        total = budget = 64e9
    tp = world if args.no_tp1 else 1
    dtypes = (torch.bfloat16,) if args.no_tp1 or args.no_fp32_ref else (torch.bfloat16, torch.float32)
    n = max_layers(tp, budget, args.quant, dtypes=dtypes, prompt=args.prompt_len,
                   kv_tokens=3 * (args.prompt_len + args.steps + 1))
    if n < 1:
        raise SystemExit(f"not even one layer of {base} fits {budget / 1e9:.1f} GB at TP{tp}")
    return f"{base}:{n}", {"rule": f"deepest L whose TP{tp} run fits 0.95 x free GPU memory (bench/memory_plan.py)",
                           "gpu_free_gb": budget / 0.95 / 1e9, "gpu_total_gb": total / 1e9, "tp_fitted": tp,
                           "dtypes_fitted": [str(d).replace("torch.", "") for d in dtypes]}


def run(rank: int, world: int, args, launcher: str) -> None:
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if args.device == "cuda" \
        else torch.device("cpu")
    ctl = dist.new_group(backend="gloo", timeout=LONG)
    tp = TPGroup(rank, world, dist.group.WORLD)
    ARTimer.install()
    choice = _bcast(choose_layers(args.preset, args, dev, world) if rank == 0 else None, ctl)
    name, l_rule = choice
    cfg = preset(name)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed + 17)
    prompt = torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    tp1 = fp32 = None
    if not args.no_tp1:
        if rank == 0:
            tp1 = run_model(cfg, SINGLE, dev, dtype, args, prompt, [("free", None, True, False)])
            if not args.no_fp32_ref:
                fp32 = run_model(cfg, SINGLE, dev, torch.float32, args, prompt,
                                 [("forced", tp1["free"]["tokens"], True, False)])
        dist.barrier(group=ctl)
    forced = _bcast(tp1["free"]["tokens"] if tp1 is not None else None, ctl)
    passes = [("free", None, False, False)]
    if forced is not None:
        passes.append(("forced", forced, True, True))
    else:                                    # no reference: time the all-reduces on the free-running tokens
        passes.append(("forced", None, False, True))
    tp2 = run_model(cfg, tp, dev, dtype, args, prompt, passes)
    mems = [None] * world
    dist.all_gather_object(mems, {k: tp2.get(k) for k in ("peak_allocated_gb", "device_used_gb", "load_s")},
                           group=ctl)
    ar = allreduce_bench(dev, ctl, args.ar_iters)
    if rank != 0:
        return
    result = {
        "bench": "tp", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **_git(),
        "command": " ".join([("torchrun --nproc-per-node %d" % world) if launcher == "torchrun" else "python"]
                            + sys.argv),
        "launcher": launcher, "device": dev.type,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "nccl": _nccl_version() if dev.type == "cuda" else None,
        "model": {"preset": name, "layers": cfg.num_hidden_layers, "quantization": args.quant, "dtype": args.dtype,
                  "random_weights": True, "seed": args.seed, "layer_choice": l_rule},
        "workload": {"prompt_tokens": args.prompt_len, "decode_steps": args.steps, "batch": 1},
        "tp2": _summary(tp2) | {"per_rank": mems},
        "allreduce_12kb": ar,
    }
    if tp1 is not None:
        result["tp1"] = _summary(tp1)
        result["tp1_fp32"] = {"load_s": fp32["load_s"]} if fp32 else None
        result["accuracy"] = accuracy(tp1, tp2, fp32)
        t1, t2 = result["tp1"]["decode_ms"].get("median"), result["tp2"]["decode_ms"].get("median")
        result["decode_speedup_tp2_over_tp1"] = t1 / t2 if t1 and t2 else None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"tp-{dev.type}-{name.replace(':', '-')}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("model", "tp2", "allreduce_12kb") if k in result}
                     | {k: result.get(k) for k in ("accuracy", "decode_speedup_tp2_over_tp1")}, indent=1,
                     default=str)[:6000])
    print(f"wrote {path}")


def _summary(r: dict) -> dict:
    free = r["free"]
    out = {"load_s": r["load_s"], "prefill_ms": free["prefill_ms"], "decode_ms": _stats(free["decode_ms"]),
           "greedy_tokens": free["tokens"]}
    for k in ("peak_allocated_gb", "device_used_gb"):
        if k in r:
            out[k] = r[k]
    f = r.get("forced")
    if f and "ar_ms_decode" in f:
        out["allreduce_per_decode_step"] = {
            "count": statistics.median(f["ar_count_decode"]), "bytes_each": ARTimer.nbytes,
            "ms": _stats(f["ar_ms_decode"]),
            "share_of_step": statistics.median(f["ar_ms_decode"]) / statistics.median(f["decode_ms"]),
            "note": "CUDA-event time inside the all-reduce calls of one decode step on rank 0 (includes waiting "
                    "for the peer); step times of this pass include the event overhead"}
        out["decode_ms_timed_pass"] = _stats(f["decode_ms"])
        out["allreduce_prefill"] = {"count": f["ar_count_prefill"], "ms": f["ar_ms_prefill"]}
    return out


def _init_and_run(rank: int, world: int, args, launcher: str, init: str | None) -> None:
    timeout = _dt.timedelta(minutes=20)
    if args.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=dev,
                                timeout=timeout)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    run(rank, world, args, launcher)          # an exception ends this rank; torchrun / spawn end the others
    dist.destroy_process_group()


def _spawned(rank: int, world: int, args, store: str) -> None:
    _init_and_run(rank, world, args, "spawn", f"file://{store}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default=None, help="minimax-m3:L | minimax-m3:auto | tiny (default: auto on "
                                                  "CUDA, tiny on CPU)")
    ap.add_argument("--quantization", default="nvfp4", choices=["nvfp4", "mxfp8", "none"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prompt-len", type=int, default=None, help="default 2176 on CUDA, 40 on CPU")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 16 on CUDA, 8 on CPU)")
    ap.add_argument("--no-tp1", action="store_true", help="TP2 only (L may then exceed one GPU)")
    ap.add_argument("--no-fp32-ref", action="store_true", help="skip the fp32 TP1 run (fixed tolerance)")
    ap.add_argument("--ar-iters", type=int, default=None, help="all-reduces per timing loop (1000 CUDA, 50 CPU)")
    ap.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp"))
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.preset = args.preset or ("minimax-m3:auto" if cuda else "tiny")
    args.prompt_len = args.prompt_len or (2176 if cuda else 40)
    args.steps = args.steps or (16 if cuda else 8)
    args.ar_iters = args.ar_iters or (1000 if cuda else 50)
    args.quant = None if args.quantization == "none" else args.quantization
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _init_and_run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "torchrun", None)
        return
    if cuda and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; found {torch.cuda.device_count()}")
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(args.world_size, args, os.path.join(tmp, "store")),
                           nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
