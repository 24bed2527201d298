"""`m3serve serve`: the OpenAI-compatible HTTP server.

    m3serve serve [--model DIR|tiny] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]

The lead's m3serve/cli.py calls register(subparsers); `python -m m3serve.server` runs main() alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model directory or preset (same as --model)")
    p.add_argument("--model", default=None, help="checkpoint directory or preset name (default: the embedded "
                   "model when shipped, else the tiny preset)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' "
                   "(default: the model directory's base name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the URL is printed)")
    p.add_argument("--api-key", default=os.environ.get("M3SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $M3SERVE_API_KEY, else none)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (default: 8192 on the GPU decode target, 2048 with speculation and on the CPU path)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests beyond which new ones get 429 (default 1024)")
    p.add_argument("--admission-wait-ms", type=float, default=0.0,
                   help="while requests decode, hold new ones back up to this long so that several prefill in "
                        "one step (default 0: admit at once)")
    p.add_argument("--max-choices", type=int, default=64, help="prompts x n allowed in one request")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body (after decompression); larger ones get 413 before they are read "
                        "(default 32 MiB)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of one completion prompt or of a whole chat conversation, checked before "
                        "tokenizing (default: max_model_len x 32, a generous characters-per-token bound)")
    p.add_argument("--max-messages", type=int, default=None, help="messages in one chat request (default 2048)")
    p.add_argument("--max-request-chars", type=int, default=None,
                   help="characters of all prompts of one request times its candidates (n / best_of), checked "
                        "before tokenizing (default 4 x --max-prompt-chars)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5, as uvicorn / vLLM)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive once it started (default 10); then 408")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive (default 60); then 408")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (by default --api-key covers it)")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds requests in flight get to end after SIGTERM/SIGINT (a second signal exits at once)")
    p.add_argument("--dead-exit-delay", type=float, default=2.0,
                   help="after the engine died (e.g. a tensor-parallel worker exited): seconds of 503 answers "
                        "before the server exits with status 3 for its supervisor to restart it (default 2)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks (worker processes are started here)")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="Eagle3 draft length with the drafter in <model>/eagle3 (0: off)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s flag: e.g. \'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}\' '
                        '("model": null = a random drafter, with "forced_acceptance" for benchmarks)')
    p.add_argument("--speculative-disable-by-batch-size", default=None, metavar="N|none|auto|auto:N",
                   help="vLLM's flag: steps with more than N decoding requests run without speculation; 'none' "
                        "speculates at every batch size; 'auto' (experimental: served, it measured slower than the "
                        "default from 4 users up) runs, per batch bucket, the kind of step measured faster per "
                        "sequence while serving; 'auto:N' that measured choice up to N requests, plain above "
                        "(default: speculative_config's, 2 at TP 1, none under --tp)")
    p.add_argument("--route", choices=["off", "auto", "require"], default=None,
                   help="kernel routing: off = stock PyTorch, auto = certified Triton entries where they serve "
                        "(stock elsewhere), require = raise outside them (default: auto on CUDA, off on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="keep the kernels but run every step eagerly (no CUDA graphs), as vLLM's flag")
    p.add_argument("--prefill-graph-tokens", type=int, default=None, metavar="N",
                   help="replay eager steps (prefill chunks, alone or beside decoding rows) of up to N tokens as CUDA "
                        "graphs on the decode target (0: off; default: EngineConfig's, 1024; ignored with "
                        "--enforce-eager)")
    p.add_argument("--switch-interval-ms", type=float, default=None, metavar="MS",
                   help="the GIL's switch interval in this process: how long the engine thread may wait for the "
                        "HTTP thread (default: CPython's, 5; see m3serve/server/interpreter.py)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up heap in the garbage collector's passes (default: frozen once warm)")
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    from m3serve.engine.spec_config import policy_form
    from m3serve.llm import LLM, default_model
    from m3serve.server.app import build_app, model_name, serve
    from m3serve.server.interpreter import check_switch_interval, tune_for_serving

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_pos and args.model and args.model_pos != args.model:
        print(f"m3serve serve: MODEL {args.model_pos!r} and --model {args.model!r} disagree", file=sys.stderr)
        return 2
    if not args.dead_exit_delay >= 0:
        print(f"m3serve serve: --dead-exit-delay: expected seconds >= 0, found {args.dead_exit_delay}",
              file=sys.stderr)
        return 2
    if not args.admission_wait_ms >= 0:
        print(f"m3serve serve: --admission-wait-ms: expected >= 0, found {args.admission_wait_ms}", file=sys.stderr)
        return 2
    if not args.shutdown_grace >= 0:
        print(f"m3serve serve: --shutdown-grace: expected seconds >= 0, found {args.shutdown_grace}", file=sys.stderr)
        return 2
    if args.switch_interval_ms is not None:
        try:
            check_switch_interval(args.switch_interval_ms)
        except ValueError as e:
            print(f"m3serve serve: {e}", file=sys.stderr)
            return 2
    model = args.model or args.model_pos or default_model()
    extra = {}
    if args.tp != 1:
        extra["tensor_parallel_size"] = args.tp
    if args.speculative_config is not None:
        if args.speculative_tokens:
            print("m3serve serve: give --speculative-config or --speculative-tokens, not both", file=sys.stderr)
            return 2
        try:
            extra["speculative_config"] = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            print(f"m3serve serve: --speculative-config: not JSON ({e})", file=sys.stderr)
            return 2
        if not isinstance(extra["speculative_config"], dict):
            print("m3serve serve: --speculative-config: expected a JSON object", file=sys.stderr)
            return 2
    if args.speculative_tokens:
        drafter = os.path.join(model, "eagle3")
        if not os.path.exists(os.path.join(drafter, "config.json")):
            print(f"m3serve serve: --speculative-tokens needs a drafter at {drafter}", file=sys.stderr)
            return 2
        extra["speculative_config"] = {"method": "eagle3", "model": drafter,
                                       "num_speculative_tokens": args.speculative_tokens}
    if args.speculative_disable_by_batch_size is not None:
        spec = extra.get("speculative_config")
        if spec is None:
            print("m3serve serve: --speculative-disable-by-batch-size needs --speculative-tokens or "
                  "--speculative-config", file=sys.stderr)
            return 2
        raw = args.speculative_disable_by_batch_size
        try:
            limit = None if raw.lower() == "none" else raw.lower() if raw.lower().startswith("auto") else int(raw)
            policy_form(limit)
        except ValueError:
            print(f"m3serve serve: --speculative-disable-by-batch-size: expected an int >= 1, 'none', 'auto' or "
                  f"'auto:N', found {raw!r}", file=sys.stderr)
            return 2
        if spec.get("disable_by_batch_size", limit) != limit:
            print(f"m3serve serve: --speculative-disable-by-batch-size {raw} and --speculative-config's "
                  f"disable_by_batch_size {spec['disable_by_batch_size']!r} disagree", file=sys.stderr)
            return 2
        spec["disable_by_batch_size"] = limit     # SpecConfig validates it (an int < 1 is a ValueError there)
    if args.prefill_graph_tokens is not None:
        extra["prefill_graph_tokens"] = args.prefill_graph_tokens
    llm = LLM(model, **extra, device=args.device, dtype=args.dtype, seed=args.seed, quantization=args.quantization,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_bytes=args.kv_cache_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=not args.no_prefix_caching, max_queue=args.max_queue,
              admission_wait_s=args.admission_wait_ms / 1000, route=args.route, enforce_eager=args.enforce_eager)
    name = args.served_model_name or model_name(model)
    try:
        app = build_app(llm, served_model_name=name, api_key=args.api_key, max_choices=args.max_choices,
                        max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                        max_messages=args.max_messages, max_request_chars=args.max_request_chars,
                        public_metrics=args.public_metrics, timeout_keep_alive=args.timeout_keep_alive,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout)
    except ValueError as e:      # a limit flag out of range
        print(f"m3serve serve: {e}", file=sys.stderr)
        return 2

    # the engine is built and warm: what start-up allocated lives as long as the process
    tune_for_serving(args.switch_interval_ms, freeze_heap=not args.no_gc_freeze)

    def ready(url: str) -> None:
        print(f"m3serve: serving {name!r} at {url}  (OpenAI base_url {url}/v1)", flush=True)

    return serve(app, args.host, args.port, on_ready=ready, grace_s=args.shutdown_grace,
                 dead_exit_delay=args.dead_exit_delay)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to the top-level m3serve CLI's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                          "/metrics over HTTP (aiohttp).")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="m3serve serve")
    add_arguments(p)
    return run(p.parse_args(argv))
