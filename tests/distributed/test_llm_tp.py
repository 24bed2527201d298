"""LLM(..., tensor_parallel_size=N) end to end on CPU (gloo): this process is rank 0 and starts the workers.

Greedy tokens must be identical to TP = 1 (fp32: the only differences are summation orders ~1e-7, far below
the gap between the top two logits of a random model). Logprobs agree to LOGPROB_ATOL (fp32 rounding of a
log-sum-exp assembled from per-rank sums). Seeded sampling gathers the full rows on rank 0 and must draw the
same tokens. A worker that dies or fails makes rank 0 raise WorkerDiedError naming it, within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.distributed import WorkerDiedError
from tests.oracle import greedy_oracle, make_oracle

LOGPROB_ATOL = 1e-5
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
KW = dict(device="cpu", dtype="float32", kv_cache_bytes=2 << 20, max_num_batched_tokens=48)


def _prompts(n, lo=5, hi=90, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _alive(llm) -> list[int | None]:
    return [p.poll() for p in llm.tp_context.procs.values()]


@pytest.fixture(scope="module")
def tp1():
    return LLM("tiny", **KW)


def test_tp2_matches_tp1_greedy_logprobs_sampling(tp1):
    """One TP2 group for the engine-level comparisons (one tensor-parallel LLM per process at a time)."""
    tp2 = LLM("tiny", tensor_parallel_size=2, **KW)
    # 5 prompts up to 90 tokens under a 48-token step budget: chunked prefill, mixed prefill/decode steps,
    # sparse selection active (tiny: 16-token blocks, top-2).
    prompts = _prompts(5)
    assert _tokens(tp2.generate(prompts, GREEDY, use_tqdm=False)) == _tokens(tp1.generate(prompts, GREEDY,
                                                                                           use_tqdm=False))
    assert tp2.engine.kv.spec.num_kv_heads == 1 and tp1.engine.kv.spec.num_kv_heads == 2

    prompts = _prompts(3, seed=1)
    lp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=4)
    for x, y in zip(tp1.generate(prompts, lp, use_tqdm=False), tp2.generate(prompts, lp, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < LOGPROB_ATOL for t in da)

    # a mixed batch (greedy + seeded top-p/top-k rows) takes the gathered-logits path
    mixed = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=40, seed=11),
             SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=1.0, seed=12, logprobs=2)]
    ta, tb = tp1.generate(prompts, mixed, use_tqdm=False), tp2.generate(prompts, mixed, use_tqdm=False)
    assert _tokens(ta) == _tokens(tb)
    assert len(set(_tokens(ta)[0])) > 1

    with pytest.raises(RuntimeError, match="already runs a tensor-parallel LLM"):
        LLM("tiny", tensor_parallel_size=2, **KW)
    procs = list(tp2.tp_context.procs.values())
    tp2.shutdown()
    assert [p.returncode for p in procs] == [0], "workers must exit cleanly on shutdown"
    with pytest.raises(WorkerDiedError, match="shut down"):
        tp2.generate(prompts, GREEDY, use_tqdm=False)


def test_oracle_checkpoint_greedy_matches_tp1_and_transformers(tmp_path):
    hf = make_oracle("a")
    hf.save_pretrained(tmp_path)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(3))
    one = LLM(str(tmp_path), **KW)
    with LLM(str(tmp_path), tensor_parallel_size=2, **KW) as two:
        got = _tokens(two.generate([{"prompt_token_ids": ids.tolist()}], GREEDY, use_tqdm=False))[0]
    assert got == _tokens(one.generate([{"prompt_token_ids": ids.tolist()}], GREEDY, use_tqdm=False))[0]
    assert got == greedy_oracle(hf, ids, 16)


def test_tp4_replicated_kv_heads_match_tp1(tp1):
    # tiny has 2 KV heads: at TP4 each KV head (and its index-query head) lives on two ranks.
    prompts = _prompts(3, seed=2)
    with LLM("tiny", tensor_parallel_size=4, **KW) as four:
        assert four.engine.kv.spec.num_kv_heads == 1
        got = _tokens(four.generate(prompts, GREEDY, use_tqdm=False))
        procs = list(four.tp_context.procs.values())
    assert got == _tokens(tp1.generate(prompts, GREEDY, use_tqdm=False))
    assert [p.returncode for p in procs] == [0, 0, 0]


def test_killed_worker_raises_instead_of_hanging():
    llm = LLM("tiny", tensor_parallel_size=2, **KW)
    pid = llm.tp_context.procs[1].pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pid}\) exited with code -9"):
        llm.generate(_prompts(2), GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    with pytest.raises(WorkerDiedError, match="rank 1"):          # the group stays down
        llm.generate(_prompts(1), GREEDY, use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("where", ["load", "step2"])
def test_failing_worker_reports_its_error(monkeypatch, where):
    monkeypatch.setenv("M3SERVE_TP_FAULT", f"1:{where}")
    if where == "load":
        with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 failed while slots.*injected fault"):
            LLM("tiny", tensor_parallel_size=2, **KW)
        return
    llm = LLM("tiny", tensor_parallel_size=2, **KW)
    with pytest.raises(WorkerDiedError, match=r"(?s)worker rank 1 .* exited with code 1.*injected fault"):
        llm.generate(_prompts(2), GREEDY, use_tqdm=False)
    llm.shutdown()
    assert all(rc is not None for rc in _alive(llm))


def test_torchrun_launch(tp1, tmp_path):
    """Under torchrun every process calls LLM(...); rank 0 gets the results, the follower exits with 0."""
    script = tmp_path / "run.py"
    out = tmp_path / "out.json"
    prompts = _prompts(2, seed=4)
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from m3serve import LLM, SamplingParams
        llm = LLM("tiny", tensor_parallel_size=2, device="cpu", dtype="float32", kv_cache_bytes=2 << 20)
        outs = llm.generate({prompts!r}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        json.dump([o.outputs[0].token_ids for o in outs], open({str(out)!r}, "w"))
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == _tokens(tp1.generate(prompts, GREEDY, use_tqdm=False))
