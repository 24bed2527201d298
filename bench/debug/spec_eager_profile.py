"""cProfile of the speculative engine's eager step (prefill of N held-out prompts at once), after a warm-up round:
where the host time of `SpecDecoding._eager_step` goes (on CUDA, host syncs show as the calls that wait).

    python bench/debug/spec_eager_profile.py --n 16,64 [--out-dir DIR]
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
ap.add_argument("--out-dir", default=".")
args = ap.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
spec = {"method": "eagle3", "model": embedded_drafter(), "num_speculative_tokens": 3, "disable_by_batch_size": None}
llm = LLM(device=dev, max_num_seqs=128, speculative_config=spec, kv_cache_bytes=4 << 30)
ps = heldout_prompts(llm)
eng = llm.engine
sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
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
        while eng.has_work():
            eng.step()
        for r in reqs:
            eng.release(r)
        print(f"n={n} round {rnd}: first step {dt * 1e3:.1f} ms", flush=True)
    path = os.path.join(args.out_dir, f"spec-eager-profile-n{n}.txt")
    with open(path, "w") as f:
        st = pstats.Stats(pr, stream=f)
        st.sort_stats("cumulative").print_stats(60)
        st.sort_stats("tottime").print_stats(40)
    print(open(path).read()[:6000])
