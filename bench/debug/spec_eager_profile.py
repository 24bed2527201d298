"""cProfile of the speculative engine's eager step (prefill of N held-out prompts at once), after a warm-up round:
where the host time of `SpecDecoding._eager_step` goes (on CUDA, host syncs show as the calls that wait).
With --running M, M greedy streams decode in the step program while the N prompts arrive: the profiled step is
then serving's split step (the running rows' program step, then the prompts' eager step), and the steps after
it are timed too (the new rows joining the program).

    python bench/debug/spec_eager_profile.py --n 16,64 [--running 16] [--out-dir DIR]
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from m3serve import LLM, SamplingParams, embedded_drafter  # noqa: E402
from spec_serving_steps import heldout_prompts  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--n", default="16,64")
ap.add_argument("--running", type=int, default=0)
ap.add_argument("--out-dir", default=".")
args = ap.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
spec = {"method": "eagle3", "model": embedded_drafter(), "num_speculative_tokens": 3, "disable_by_batch_size": None}
llm = LLM(device=dev, max_num_seqs=128, speculative_config=spec, kv_cache_bytes=4 << 30)
ps = heldout_prompts(llm)
eng = llm.engine
sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
running = [eng.add_request(ps[(300 + i) % len(ps)], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
           for i in range(args.running)]
for _ in range(4 if running else 0):       # the streams prefilled and in the step program
    eng.step()


def timed_step() -> float:
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.step()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


for n in (int(x) for x in args.n.split(",")):
    for rnd in range(2):
        reqs = [eng.add_request(ps[(i + 100 * rnd) % len(ps)], sp) for i in range(n)]
        pr = cProfile.Profile()
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        pr.enable()
        eng.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        pr.disable()
        dt = time.perf_counter() - t
        after = [timed_step() for _ in range(4)] if running else []
        while any(not r.is_finished for r in reqs):
            eng.step()
        for r in reqs:
            eng.release(r)
        print(f"n={n} running={len(running)} round {rnd}: first step {dt * 1e3:.1f} ms, the next "
              f"{', '.join(f'{x:.2f}' for x in after)} ms", flush=True)
    path = os.path.join(args.out_dir, f"spec-eager-profile-n{n}-running{len(running)}.txt")
    with open(path, "w") as f:
        st = pstats.Stats(pr, stream=f)
        st.sort_stats("cumulative").print_stats(60)
        st.sort_stats("tottime").print_stats(40)
    print(open(path).read()[:6000])
