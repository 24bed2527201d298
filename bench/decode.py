"""Decode-step benchmark of the engine at real MiniMax-M3 dimensions with deterministic random weights.

Runs the same engine side by side in one process: the stock path (dispatch off) and, when the kernel catalog
is available, the dispatch-table path (auto). For each batch size it prefills `batch` requests of `context`
tokens, then times whole engine decode steps (schedule + forward + sample, CUDA-synchronised, median of
`--steps`). The roofline is the bytes a decode step must read (weights touched + KV) over the copy bandwidth
measured in the same run.

    python bench/decode.py --preset minimax-m3:8 --quantization nvfp4 --batch 1,4,16 --context 2048
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from m3serve import LLM, SamplingParams  # noqa: E402
from m3serve.benchmeta import run_metadata  # noqa: E402


def copy_bandwidth(device, nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of 10."""
    if device.type != "cuda":
        return float("nan")
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


def step_bytes(llm, batch: int, context: int) -> int:
    """Bytes one decode step must read: every attention / dense weight, the experts the batch touches
    (expected count under uniform routing), the head, and the KV of `context` tokens per request."""
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
    total += m.lm_head.qweight.nbytes()
    total += int(llm.engine.kv.spec.bytes_per_token()["total"] * context * batch)
    return total


def time_decode(llm, batch: int, context: int, steps: int, seed: int) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    vocab = llm.model.cfg.vocab_size
    params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(), params) for _ in range(batch)]
    while any(r.num_computed < len(r.prompt_token_ids) for r in reqs):   # prefill (chunked)
        eng.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    for r in reqs:
        eng.abort(r.request_id)
    return {"median_s": statistics.median(times[1:]), "min_s": min(times[1:]), "steps": len(times) - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="minimax-m3:8")
    ap.add_argument("--quantization", default="nvfp4", choices=["none", "mxfp8", "nvfp4"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--routes", default="off,auto", help="dispatch modes to compare (off = stock)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    quant = None if args.quantization == "none" else args.quantization
    batches = [int(b) for b in args.batch.split(",")]
    t0 = time.perf_counter()
    llm = LLM(args.preset, device="cuda", dtype="bfloat16", random_weights=True, quantization=quant,
              kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(batches),
              max_num_batched_tokens=max(8192, args.context), gpu_memory_utilization=0.85,
              max_model_len=args.context + 64)
    load_s = time.perf_counter() - t0
    bw = copy_bandwidth(dev)
    results = []
    for route in args.routes.split(","):
        try:
            from m3serve.targets import routing
            routing.set_mode(route)
        except ImportError:
            if route != "off":
                print(f"route {route}: m3serve.targets.routing not available, skipped", file=sys.stderr)
                continue
        for b in batches:
            r = time_decode(llm, b, args.context, args.steps, seed=b)
            nbytes = step_bytes(llm, b, args.context)
            r.update(route=route, batch=b, context=args.context, bytes_per_step=nbytes,
                     roofline_s=nbytes / bw, fraction_of_roofline=(nbytes / bw) / r["median_s"],
                     tokens_per_s=b / r["median_s"])
            print(json.dumps(r), flush=True)
            results.append(r)
    out = {
        "bench": "decode", **run_metadata(), "preset": args.preset, "quantization": quant,
        "kv_cache": llm.engine.kv.describe(), "load_s": load_s, "copy_bandwidth_Bps": bw, "results": results,
    }
    path = args.out or os.path.join(os.path.dirname(__file__), "results",
                                    f"decode-{args.preset.replace(':', '_')}-{datetime.date.today()}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
