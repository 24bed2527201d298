"""Chunked prefill beside running streams: for each chunk size (max_num_batched_tokens), the time to first token
of one long prompt and the inter-token latency of the streams that keep decoding while it prefills.

    python bench/prefill_interference.py --model minimax-m3:5 --quant nvfp4 --prompt 32768 \
        --chunks 2048,4096,8192,16384 --streams 4 --out bench/results/prefill_interference/prefill-interference-h200.json

Per chunk size: `LLM(model, random_weights=True, quantization=q, max_num_batched_tokens=chunk)` (its start-up
warm-up compiles every variant first); `--streams` requests of 128 prompt tokens decode until each has 16 tokens,
their ITL over the next 32 steps is the baseline; then the long prompt arrives and the engine steps until its
first token. Every step that prefills also carries the streams' decode rows (decode rows are scheduled first), so
a larger chunk means fewer, longer steps: a shorter TTFT for the long prompt and a longer stall for the streams.
The figures per row: the long prompt's TTFT, the streams' ITL p50 / p99 / max during its prefill and before it.
The engine is stepped directly (no server), so the figures hold the engine's own cost only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from m3serve.benchmeta import run_metadata  # noqa: E402


def _prompt(vocab: int, n: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + i * 104729) % (vocab - 200) for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _run_until(eng, streams, last_seen, itls, until) -> int:
    """Step the engine until until() holds; every stream token's gap since that stream's previous one -> itls."""
    steps = 0
    while not until():
        got = eng.step()
        now = time.perf_counter()
        steps += 1
        for r in got:
            if r.request_id in last_seen:
                itls.append(now - last_seen[r.request_id])
                last_seen[r.request_id] = now
        if not eng.has_work():
            raise RuntimeError("prefill_interference: the engine ran out of work before the condition held")
    return steps


def measure(model: str, quant: str | None, prompt_tokens: int, chunk: int, streams: int, device: str) -> dict:
    from m3serve import LLM, SamplingParams
    llm = LLM(model, random_weights=True, quantization=quant, max_num_batched_tokens=chunk, device=device,
              max_model_len=prompt_tokens + 512, max_num_seqs=max(8, streams + 1))
    eng, vocab = llm.engine, llm.model.cfg.vocab_size
    decode = SamplingParams(max_tokens=prompt_tokens + 256, temperature=0.0, ignore_eos=True)
    runners = [eng.add_request(_prompt(vocab, 128, 1 + i), decode) for i in range(streams)]
    last_seen: dict[int, float] = {}
    _run_until(eng, runners, last_seen, [], lambda: all(len(r.output_token_ids) >= 16 for r in runners))
    now = time.perf_counter()
    last_seen = {r.request_id: now for r in runners}
    base: list[float] = []
    mark = min(len(r.output_token_ids) for r in runners) + 32
    _run_until(eng, runners, last_seen, base, lambda: all(len(r.output_token_ids) >= mark for r in runners))
    during: list[float] = []
    t0 = time.perf_counter()
    long = eng.add_request(_prompt(vocab, prompt_tokens, 999), SamplingParams(max_tokens=1, ignore_eos=True))
    steps = _run_until(eng, runners, last_seen, during, lambda: len(long.output_token_ids) >= 1)
    ttft = time.perf_counter() - t0
    for r in runners:
        eng.abort(r.request_id)
    eng.drain()
    row = {"model": model, "quantization": quant or "none", "prompt_tokens": prompt_tokens, "chunk": chunk,
           "streams": streams, "ttft_s": ttft, "prefill_steps": steps,
           "itl_ms": {"p50": 1e3 * statistics.median(during), "p99": 1e3 * _pct(during, 0.99),
                      "max": 1e3 * max(during)} if during else None,
           "baseline_itl_ms": {"p50": 1e3 * statistics.median(base), "p99": 1e3 * _pct(base, 0.99)}}
    llm.shutdown()
    del llm, eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minimax-m3:5")
    ap.add_argument("--quant", default="nvfp4", help="none|fp8|mxfp8|nvfp4")
    ap.add_argument("--prompt", type=int, default=32768, help="tokens of the long prompt")
    ap.add_argument("--chunks", default="2048,4096,8192,16384", help="comma list of max_num_batched_tokens")
    ap.add_argument("--streams", type=int, default=4, help="requests decoding while the long prompt prefills")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.streams < 1 or args.prompt < 1 or min(chunks) < 1:
        raise SystemExit("prefill_interference: --streams, --prompt and every chunk must be >= 1")
    quant = None if args.quant == "none" else args.quant
    meta = run_metadata()
    results = []
    for c in chunks:
        results.append(measure(args.model, quant, args.prompt, c, args.streams, args.device))
        r = results[-1]
        print(json.dumps(r), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "prefill_interference", **meta, "results": results}, f, indent=2)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
