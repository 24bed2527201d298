"""Where a decode step's GPU time goes: torch-profiler kernel table of the decode target (CUDA graphs) at one
batch size on the embedded model or a preset; --spec K profiles Eagle3 speculative steps instead (SpecSteps
graphs: the embedded model's trained drafter, or a random drafter with forced acceptance --forced-al on a preset).

    python bench/profile_step.py --model m3-tiny-verse --batch 1 --context 256 --out FILE.txt
    python bench/profile_step.py --model m3-tiny-verse --spec 3 --out FILE.txt
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from m3serve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m3-tiny-verse")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--spec", type=int, default=0, help="K > 0: speculative steps with K drafts")
    ap.add_argument("--forced-al", type=float, default=2.78, help="--spec on a preset: forced acceptance length")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests (the sampling graphs)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    embedded = args.model == "m3-tiny-verse"
    spec = None
    if args.spec:
        from m3serve.llm import DEFAULT_MODEL_DIR
        spec = {"method": "eagle3", "num_speculative_tokens": args.spec, "disable_by_batch_size": None,
                "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3") if embedded else None}
        if not embedded:
            spec["forced_acceptance"] = args.forced_al
    room = (args.spec + 1) * (args.steps + 12) + 3 * args.spec
    llm = LLM(None if embedded else args.model, device="cuda", dtype="bfloat16", random_weights=not embedded,
              quantization=None if embedded else "nvfp4", kv_cache_dtype="auto" if embedded else "nvfp4",
              max_num_seqs=args.batch, max_model_len=args.context + 64 + args.steps + room,
              gpu_memory_utilization=0.85, speculative_config=spec)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=(args.steps + 40) * (args.spec + 1), temperature=args.temperature,
                        top_p=args.top_p, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(torch.randint(3, llm.model.cfg.vocab_size, (args.context,), generator=g).tolist(), sp)
    for _ in range(8):
        eng.step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) * 1e-6 / args.steps
    # first kernel start to last kernel end: with the overlap loop the GPU idles only where the host is late
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) * 1e-6 / args.steps
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    table = (f"kernels per step {len(kernels) / args.steps:.1f}, GPU busy per step {busy * 1e3:.3f} ms, "
             f"GPU span per step {span * 1e3:.3f} ms (first kernel start to last kernel end / steps)\n"
             + table + "\nhost side, by self CPU time:\n" + host)
    print(table)
    if args.out:
        from m3serve.benchmeta import run_metadata
        meta = run_metadata()
        with open(args.out, "w") as f:
            f.write(f"# command: {meta['command']}\n# commit: {meta['commit']} · gpu: {meta['gpu']} · date: {meta['date']}\n"
                    f"model {args.model} batch {args.batch} context {args.context} steps {args.steps} spec K {args.spec} "
                    f"temperature {args.temperature} top-p {args.top_p}\n"
                    f"{table}\n")


if __name__ == "__main__":
    main()
