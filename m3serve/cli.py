"""`m3serve` command line: generate, quantize, calibrate-kv, serve, bench, eval, explain."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPT = "To be, or not to be:"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or preset (tiny, minimax-m3, minimax-m3:L); "
                                                 "default: the embedded model")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-weights", action="store_true", help="deterministic random weights for a preset")
    p.add_argument("--quantization", choices=["fp8", "mxfp8", "nvfp4"], default=None,
                   help="storage format of random weights (the published split)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8", "nvfp4"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--route", choices=["off", "auto", "require"], default=None,
                   help="Triton catalog routing (default: auto on CUDA, off on CPU)")


def build_llm(args, **extra):
    import os
    from m3serve.llm import LLM, default_model
    model = args.model or default_model()
    drafter = os.path.join(model, "eagle3")
    if getattr(args, "speculative_tokens", 0) and os.path.exists(os.path.join(drafter, "config.json")):
        extra.setdefault("speculative_config", {"method": "eagle3", "model": drafter,
                                                "num_speculative_tokens": args.speculative_tokens})
    return LLM(model, device=args.device, dtype=args.dtype, seed=args.seed,
               random_weights=True if args.random_weights else None, quantization=args.quantization,
               kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len, route=args.route, **extra)


def cmd_generate(args) -> int:
    from m3serve.engine.sampling_params import SamplingParams
    from m3serve.server.detok import TextStream
    t0 = time.perf_counter()
    llm = build_llm(args)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    tok = llm.tokenizer
    if args.prompt_ids:
        ids, prompt = [int(x) for x in args.prompt_ids.split(",")], None
    elif tok is None:
        ids, prompt = [llm.model.cfg.bos_token_id or 1, 5, 17, 42], None
        print(f"(model has no tokenizer: prompting with token ids {ids})", file=sys.stderr)
    else:
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if args.chat:
            from m3serve.tokenizer import chat_token_ids
            ids = chat_token_ids(tok, [{"role": "user", "content": prompt}])
        else:
            ids = tok.encode(prompt)
    eng = llm.engine
    req = eng.add_request(ids, params, prompt)
    if prompt is not None and not args.chat:
        sys.stdout.write(prompt)
    stream = TextStream(tok, params.stop, params)      # each step decodes its new tokens only (DecodeStream)
    seen = 0
    t1 = time.perf_counter()
    while not req.is_finished:
        eng.step()
        if tok is not None:
            new, seen = req.output_token_ids[seen:], len(req.output_token_ids)
            if req.is_finished:
                sys.stdout.write(stream.finish(None, new, req.finish_reason, req.stop_reason))
            else:
                sys.stdout.write(stream.push(new))
        elif req.output_token_ids:
            sys.stdout.write(f" {req.output_token_ids[-1]}")
        sys.stdout.flush()
    dt = time.perf_counter() - t1
    n = len(req.output_token_ids)
    print()
    spec = getattr(req, "spec_metrics", None)
    spec_note = f"; Eagle3 acceptance length {spec['acceptance_length']:.2f}" if spec else ""
    print(f"[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):.1f} tok/s; load {load_s:.1f} s; finish: "
          f"{req.finish_reason}; device {llm.device}, {llm.dtype}{spec_note}]", file=sys.stderr)
    eng.release(req)
    return 0


def cmd_quantize(args) -> int:
    import torch
    from m3serve.model.checkpoint import save_checkpoint
    from m3serve.model.loader import load_model
    model = load_model(args.input, device="cpu", dtype=torch.float32, keep_quantized=False)
    save_checkpoint(model, model.cfg, args.output, layout="original", quantization=args.format,
                    dtype=torch.bfloat16)
    import os
    import shutil
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if os.path.exists(os.path.join(args.input, f)):
            shutil.copy(os.path.join(args.input, f), os.path.join(args.output, f))
    print(f"wrote {args.format} checkpoint to {args.output}")
    return 0


def cmd_calibrate_kv(args) -> int:
    from m3serve.kv.calibrate import calibrate_model_dir
    path, calib = calibrate_model_dir(args.model_dir, args.out, num_items=args.items, seed=args.seed,
                                      factor=args.fp8_factor, fp8_overrides=args.fp8_overrides,
                                      rotation_seed=None if args.no_rotation else args.rotation_seed)
    for layer, (k, v) in sorted(calib.layers.items()):
        print(f"layer {layer}: K amax {k.amax:.4g} (max|k| {k.observed_amax:.4g}, rel MSE {k.mse / k.mean_square:.4g})  "
              f"V amax {v.amax:.4g} (max|v| {v.observed_amax:.4g}, rel MSE {v.mse / v.mean_square:.4g})")
    if calib.sensitivity is not None:
        print(calib.sensitivity.reason())
        print(f"FP8 layers of the hybrid cache: {list(calib.fp8_layers) or 'none (every sparse layer NVFP4)'}")
    if calib.rotation_seed is not None:
        print(f"K/V rotation: randomized Hadamard, seed {calib.rotation_seed}")
    print(f"wrote {path} ({calib.calibration['texts']} texts, {calib.calibration['tokens']} tokens)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3serve", description=__doc__)
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="stream a completion (default: the embedded model)")
    _add_model_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--speculative-tokens", type=int, default=3,
                   help="Eagle3 draft length when the model ships a drafter in <model>/eagle3 (0: off)")
    g.set_defaults(fn=cmd_generate)

    q = sub.add_parser("quantize", help="write an MXFP8 or NVFP4 (published split) checkpoint")
    q.add_argument("input")
    q.add_argument("output")
    q.add_argument("--format", choices=["nvfp4", "mxfp8"], required=True)
    q.set_defaults(fn=cmd_quantize)

    c = sub.add_parser("calibrate-kv", help="per-layer NVFP4 KV-cache K/V amax (MSE-optimal) and the sparse layers "
                                            "to keep in FP8 -> kv_scales.json")
    c.add_argument("model_dir")
    c.add_argument("--out", default=None, help="output file (default: MODEL_DIR/kv_scales.json, which LLM loads)")
    c.add_argument("--items", type=int, default=256, help="calibration chats (synthetic problems)")
    c.add_argument("--seed", type=int, default=1, help="seed of the calibration problems (the eval uses 0)")
    c.add_argument("--fp8-factor", type=float, default=2.0,
                   help="a sparse layer goes FP8 when NVFP4 on it alone costs more than this many times the whole "
                        "FP8 cache's KL (m3serve.kv.calibrate.measure_layer_sensitivity); with --fp8-overrides only")
    c.add_argument("--fp8-overrides", action="store_true",
                   help="write the sparse layers the --fp8-factor rule picks as fp8_layers (the FP8 escape; default: "
                        "every sparse layer NVFP4)")
    c.add_argument("--rotation-seed", type=int, default=31,
                   help="seed of the randomized Hadamard K/V rotation the amaxes are calibrated for (m3serve.kv.rotation)")
    c.add_argument("--no-rotation", action="store_true", help="calibrate for an unrotated NVFP4 cache")
    c.set_defaults(fn=cmd_calibrate_kv)

    import importlib
    import importlib.util
    for module in ("m3serve.server.cli", "m3serve.bench.cli", "m3serve.eval.cli", "m3serve.targets.explain_cli"):
        parent = module.rsplit(".", 1)[0]
        if importlib.util.find_spec(parent) and importlib.util.find_spec(module):  # subcommands living elsewhere
            importlib.import_module(module).register(sub)

    import logging
    log = logging.getLogger("m3serve")   # start-up reports (KV cache pages, tokens, bytes per token per role)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[m3serve] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["generate"]
    args = parser.parse_args(argv)
    fn = getattr(args, "fn", None) or getattr(args, "func", None)
    if fn is None:
        parser.print_help()
        return 2
    return fn(args)


if __name__ == "__main__":
    sys.exit(main())
