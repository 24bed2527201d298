"""Time to first token of long prompts: m3serve per weight format beside transformers' BF16 reference, one run.

    python bench/prefill.py --model minimax-m3:5 --tokens 1024,8192,32768,131072 --quant nvfp4,mxfp8,none \
        --chunk 8192 --out bench/results/prefill/prefill-h200.json

Each m3serve row builds `LLM(model, random_weights=True, quantization=q, max_num_batched_tokens=chunk)` (with
--prefill-graph-tokens 0,1024: once per value, short prompts' eager steps then replaying prefill graphs) (its
start-up warm-up compiles every variant first), then times `generate(prompt, max_tokens=1)` (median of --repeat
after one untimed run). The transformers row builds `MiniMaxM3VLForCausalLM` from the same config in BF16
(random init on the GPU, sdpa attention: on Hopper transformers has only the dense-mask MSA path) and times
one full-prompt forward; lengths whose dense mask does not fit are recorded as skipped. frac_bf16_peak is the
prefill's model FLOPs (GEMMs over the active parameters + causal attention, dense on full layers and over the
selected blocks on MSA layers) over TTFT x the H200's dense BF16 rate.
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

BF16_PEAK = 790e12   # H200 dense BF16 tensor rate, FLOP/s


def prefill_flops(cfg, tokens: int) -> float:
    """Model FLOPs of one prefill of `tokens` tokens (multiply-adds x 2)."""
    h, d, hq, hk = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    per_tok = 0
    attn = 0.0
    for i in range(cfg.num_hidden_layers):
        per_tok += h * (hq + 2 * hk) * d + hq * d * h                     # q, k, v, o
        if cfg.layer_types[i] == "sparse":
            per_tok += h * (cfg.index_n_heads + 1) * cfg.index_head_dim    # indexer projections
            keys = min(tokens, cfg.index_topk_blocks * cfg.index_block_size)
            attn += 4.0 * hq * d * tokens * keys                           # QK^T and PV over the selected blocks
            attn += 2.0 * cfg.index_n_heads * cfg.index_head_dim * tokens * tokens / 2   # block scores (causal)
        else:
            attn += 4.0 * hq * d * tokens * tokens / 2                      # causal QK^T and PV
        if cfg.mlp_layer_types[i] == "dense":
            per_tok += 3 * h * cfg.dense_intermediate_size
        else:
            per_tok += h * cfg.num_local_experts                           # router
            per_tok += 3 * h * cfg.intermediate_size * cfg.num_experts_per_tok
            per_tok += 3 * h * cfg.shared_intermediate_size
    return 2.0 * per_tok * tokens + attn


def prompt(vocab: int, n: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + i * 104729) % (vocab - 200) for i in range(n)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_prefill(llm, sp, n: int, path: str) -> None:
    """One more prefill of n tokens under the torch profiler: the kernel table by GPU time, to `path`."""
    from torch.profiler import ProfilerActivity, profile
    ids = prompt(llm.model.cfg.vocab_size, n, 99)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        _sync()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90))


def time_m3serve(model: str, quant: str | None, tokens: list[int], chunk: int, repeat: int, device: str,
                 profile_dir: str | None = None, graph_tokens: int = 0, weight_layout: str | None = None,
                 sparse_prefill: tuple[str, ...] = ("on",), context_copy: tuple[str, ...] = ("on",),
                 kv_cache_dtype: str = "auto", lazy_rescale: tuple[str, ...] = ("off",)):
    """One LLM; per prompt length, one row per (sparse_prefill, context_copy, lazy_rescale) setting, timed side by
    side on the same engine. sparse_prefill "on": MSA layers' prefill rows take attn.prefill_sparse, "off":
    attn.paged; context_copy "on": dense layers' visible pages copied head-major as bf16 once per long prefill step
    and read by TMA (targets.attention.CONTEXT_COPY), "off": attn.prefill reads the pages; lazy_rescale "on": attn.prefill's bf16 tiles rescale acc only when a
    row's max grows by more than 2**8 (kernels.attention.prefill.LAZY_RESCALE)."""
    from m3serve import LLM, SamplingParams
    from m3serve.kernels.attention import prefill as prefill_kernel
    from m3serve.targets import attention as target_attention
    routed_default = (target_attention.MSA_PREFILL_TILED, target_attention.CONTEXT_COPY,
                      prefill_kernel.LAZY_RESCALE)
    llm = LLM(model, random_weights=True, quantization=quant, max_num_batched_tokens=chunk, device=device,
              max_model_len=max(tokens) + 16, max_num_seqs=8, prefill_graph_tokens=graph_tokens,
              weight_layout=weight_layout, kv_cache_dtype=kv_cache_dtype)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = []
    for n in tokens:
        for mode, ctx, lazy in ((m, c, z) for m in sparse_prefill for c in context_copy for z in lazy_rescale):
            target_attention.MSA_PREFILL_TILED = mode == "on"
            target_attention.CONTEXT_COPY = ctx == "on"
            prefill_kernel.LAZY_RESCALE = lazy == "on"
            times = []
            for r in range(repeat + 1):
                ids = prompt(llm.model.cfg.vocab_size, n, r)
                _sync()
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
                _sync()
                if r:
                    times.append(time.perf_counter() - t0)
            ttft = statistics.median(times)
            rows.append({"engine": "m3serve", "model": model, "quantization": quant or "none", "tokens": n,
                         "chunk": chunk, "ttft_s": ttft,
                         "frac_bf16_peak": prefill_flops(llm.model.cfg, n) / ttft / BF16_PEAK,
                         "prefill_graph_tokens": graph_tokens, "weight_layout": weight_layout or "mma_tile",
                         "sparse_prefill": mode, "context_copy": ctx, "kv_cache_dtype": kv_cache_dtype,
                         "lazy_rescale": lazy})
            print(json.dumps(rows[-1]), flush=True)
            if profile_dir:
                profile_prefill(llm, sp, n, os.path.join(profile_dir, f"prefill-profile-{model.replace('minimax-m3:', 'm3_')}-{quant or 'none'}-{n}"
                                                         f"{'-rows' if weight_layout == 'rows' else ''}"
                                                         f"{'' if kv_cache_dtype == 'auto' else '-kv-' + kv_cache_dtype}"
                                                         f"{'-sparse-off' if mode == 'off' else ''}"
                                                         f"{'-no-ctx-copy' if ctx == 'off' else ''}"
                                                         f"{'-lazy' if lazy == 'on' else ''}.txt"))
    (target_attention.MSA_PREFILL_TILED, target_attention.CONTEXT_COPY,
     prefill_kernel.LAZY_RESCALE) = routed_default
    cfg = llm.model.cfg
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, cfg


def time_transformers(cfg, model: str, tokens: list[int], repeat: int, device: str) -> list[dict]:
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig
    text = cfg.to_text_dict()
    text.pop("model_type", None)
    text.pop("architectures", None)
    hf_cfg = MiniMaxM3VLTextConfig(**text)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        m = MiniMaxM3VLForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    rows = []
    for n in tokens:
        try:
            times = []
            for r in range(repeat + 1):
                ids = torch.tensor([prompt(cfg.vocab_size, n, r)], device=device)
                _sync()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    m(input_ids=ids, logits_to_keep=1)
                _sync()
                if r:
                    times.append(time.perf_counter() - t0)
            ttft = statistics.median(times)
            rows.append({"engine": "transformers", "model": model, "quantization": "none", "tokens": n,
                         "chunk": n, "ttft_s": ttft, "frac_bf16_peak": prefill_flops(cfg, n) / ttft / BF16_PEAK})
        except torch.OutOfMemoryError:
            rows.append({"engine": "transformers", "model": model, "quantization": "none", "tokens": n,
                         "chunk": n, "ttft_s": None, "frac_bf16_peak": None,
                         "skipped": "out of GPU memory (the dense-mask sparse attention is O(tokens^2))"})
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    del m
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minimax-m3:5")
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--quant", default="nvfp4,none", help="comma list of none|fp8|mxfp8|nvfp4")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens of the m3serve rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile-dir", default=None, help="also write a torch-profiler kernel table per row here")
    ap.add_argument("--weight-layouts", default="default",
                    help="comma list: m3serve rows per NVFP4 / MXFP8 weight layout (default = mma_tile, or rows)")
    ap.add_argument("--prefill-graph-tokens", default="0",
                    help="comma list: m3serve rows per value of EngineConfig.prefill_graph_tokens (0: eager steps)")
    ap.add_argument("--sparse-prefill", default="off",
                    help="comma list of on|off: MSA layers' prefill rows through attn.prefill_sparse (on) or "
                         "attn.paged (off, the engine's default: targets.attention.MSA_PREFILL_TILED), rows side by side on "
                         "one engine")
    ap.add_argument("--context-copy", default="on",
                    help="comma list of on|off: dense layers' pages in long prefill steps copied head-major as bf16 once "
                         "per layer and read by TMA (on, the default: targets.attention.CONTEXT_COPY) or read from the "
                         "pages by attn.prefill (off), rows side by side on one engine")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="EngineConfig.kv_cache_dtype of the m3serve rows: auto (the model dtype) | bf16 | fp8 | nvfp4 "
                         "(the hybrid cache: NVFP4 sparse layers, FP8 dense)")
    ap.add_argument("--lazy-rescale", default="default",
                    help="comma list of on|off: attn.prefill's bf16 tiles with the conditional rescale or without, "
                         "rows side by side on one engine (default: the module's LAZY_RESCALE)")
    args = ap.parse_args()
    sparse_modes = tuple(args.sparse_prefill.split(","))
    if not set(sparse_modes) <= {"on", "off"}:
        ap.error(f"--sparse-prefill: expected a comma list of on|off, found {args.sparse_prefill!r}")
    from m3serve.kernels.attention import prefill as prefill_kernel
    lazy_modes = (("on" if prefill_kernel.LAZY_RESCALE else "off",) if args.lazy_rescale == "default"
                  else tuple(args.lazy_rescale.split(",")))
    if not set(lazy_modes) <= {"on", "off"}:
        ap.error(f"--lazy-rescale: expected a comma list of on|off, found {args.lazy_rescale!r}")
    ctx_modes = tuple(args.context_copy.split(","))
    if not set(ctx_modes) <= {"on", "off"}:
        ap.error(f"--context-copy: expected a comma list of on|off, found {args.context_copy!r}")
    tokens = [int(t) for t in args.tokens.split(",")]
    meta = run_metadata()
    results, cfg = [], None
    for q in args.quant.split(","):
        for g in (int(v) for v in args.prefill_graph_tokens.split(",")):
            for lay in args.weight_layouts.split(","):
                rows, cfg = time_m3serve(args.model, None if q == "none" else q, tokens, args.chunk, args.repeat,
                                         args.device, args.profile_dir, g, None if lay == "default" else lay,
                                         sparse_modes, ctx_modes, args.kv_cache_dtype, lazy_modes)
                results += rows
    if not args.no_transformers and cfg is not None:
        results += time_transformers(cfg, args.model, tokens, args.repeat, args.device)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "prefill", **meta, "bf16_peak_flops": BF16_PEAK, "results": results}, f, indent=2)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
