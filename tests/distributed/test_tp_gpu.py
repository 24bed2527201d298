"""TP2 on two GPUs through NCCL (run on the device machine: `pytest -m gpu tests/distributed`).

fp32 with TF32 off on both sides, so TP2's greedy tokens must equal TP1's exactly (summation order only, as on
CPU). A worker killed while idle is reported at the next call; one killed inside a step is reported after the
watchdog aborts the NCCL communicator (or rank 0 exits after tp_grace_s with the error printed)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.distributed import WorkerDiedError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
KW = dict(device="cuda", dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=64)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 500, (int(torch.randint(20, 120, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


def test_tp2_nccl_greedy_and_logprobs_match_tp1():
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(4)
    ref = LLM("tiny", **KW)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    lp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    want_lp = ref.generate(prompts[:1], lp, use_tqdm=False)[0].outputs[0].logprobs
    with LLM("tiny", tensor_parallel_size=2, **KW) as two:
        assert two.model.device == torch.device("cuda", 0)
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        got_lp = two.generate(prompts[:1], lp, use_tqdm=False)[0].outputs[0].logprobs
    assert got == want
    for a, b in zip(want_lp, got_lp):   # fp32 log-sum-exp from per-rank partial sums: rounding only
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_tp2_nccl_worker_killed_idle_and_in_step():
    llm = LLM("tiny", tensor_parallel_size=2, **KW)
    os.kill(llm.tp_context.procs[1].pid, signal.SIGKILL)
    time.sleep(1.0)                                  # the watchdog notices within 0.2 s
    with pytest.raises(WorkerDiedError, match="worker rank 1"):
        llm.generate(_prompts(1), GREEDY, use_tqdm=False)
    llm.shutdown()

    llm = LLM("tiny", tensor_parallel_size=2, tp_grace_s=30, **KW)
    pid = llm.tp_context.procs[1].pid
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1"):
        llm.generate(_prompts(8, seed=1), long, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    llm.shutdown()


def test_tp2_nccl_speculative_greedy_equals_tp1_on_the_embedded_model():
    """Eagle3 (the embedded model's trained drafter, K = 3) at TP2 through NCCL vs TP1 on one GPU, fp32 with TF32
    off: token-identical greedy outputs over 8 held-out chat questions and the same acceptance counts (the
    drafter is replicated, so both propose the same drafts; TP only reorders sums, ~1e-7, far below the gap
    between the top two logits)."""
    import json
    from m3serve.llm import DEFAULT_MODEL_DIR
    from m3serve.tokenizer import chat_token_ids
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = {"method": "eagle3", "model": os.path.join(DEFAULT_MODEL_DIR, "eagle3"), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}     # TP 1 speculates at every batch size too (the policy is off at TP 2)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    one = LLM(DEFAULT_MODEL_DIR, speculative_config=spec, **KW)
    items = [json.loads(line) for line in open(os.path.join(DEFAULT_MODEL_DIR, "synthetic_heldout.jsonl"))][:8]
    prompts = [{"prompt_token_ids": chat_token_ids(one.tokenizer, [{"role": "user", "content": it["question"]}])}
               for it in items]
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    st1 = one.engine.stats()["spec_decode"]
    assert st1["acceptance_length"] > 2.0
    with LLM(DEFAULT_MODEL_DIR, speculative_config=spec, tensor_parallel_size=2, **KW) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        st2 = two.engine.stats()["spec_decode"]
    assert got == want
    assert (st2["verify_steps"], st2["accepted_tokens"]) == (st1["verify_steps"], st1["accepted_tokens"])
