"""Serving sweeps for the no-cliffs goals: one `m3serve bench serve` run per server configuration (each launching
its own server), combined into one Pareto file and one chart (`m3serve bench pareto`).

    python bench/serve_pareto.py --out bench/results/serve/serve-pareto-h200.json \
        --runs embedded:plain embedded:spec minimax-m3:5:plain:nvfp4 minimax-m3:5:spec:nvfp4

A run is MODEL:MODE[:QUANT]; MODEL "embedded" is the embedded model (its trained Eagle3 drafter for spec);
a preset takes random weights and, for spec, a random drafter with forced acceptance (--forced-al) and
token-id prompts. MODE is plain, spec (the server's default batch-size policy), spec-auto (the measured
policy, `--speculative-disable-by-batch-size auto`) or spec-always (no policy: every step speculates,
`--speculative-disable-by-batch-size none`); a "-pg" suffix (plain-pg, spec-always-pg, ...) also replays eager steps of
up to 1024 tokens as prefill graphs (`--prefill-graph-tokens 1024`), and "-aw" (after it, if both) holds arrivals
back up to 4 ms while requests decode so that several share a prefill step (`--admission-wait-ms 4`), and "-t8k" sets
an 8192-token step budget (`--max-num-batched-tokens 8192`, the plain target's default; speculation's is 2048). A mode without
"-pg" passes `--prefill-graph-tokens 0`, so that a mode means the same server whatever the default. Every run:
--input-len / --output-len tokens, concurrency levels --concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from m3serve.benchmeta import run_metadata  # noqa: E402


MODES = ("plain", "spec", "spec-auto", "spec-always")
POLICY = {"spec-auto": "auto", "spec-always": "none"}     # mode -> the server's --speculative-disable-by-batch-size


PG_SUFFIX, PG_TOKENS = "-pg", 1024
AW_SUFFIX, AW_MS = "-aw", 4.0
STEP_SUFFIX, STEP_TOKENS = "-t8k", 8192
# mode suffix -> the server flags it adds (prefill graphs; admission batching; an 8192-token step budget)
SUFFIXES = {PG_SUFFIX: ["--prefill-graph-tokens", str(PG_TOKENS)], AW_SUFFIX: ["--admission-wait-ms", str(AW_MS)],
            STEP_SUFFIX: ["--max-num-batched-tokens", str(STEP_TOKENS)]}
NO_PG = ["--prefill-graph-tokens", "0"]


def split_mode(mode: str) -> tuple[str, list[str]]:
    """'spec-always-pg-aw' -> ('spec-always', ['-pg', '-aw'])."""
    found = []
    while any(mode.endswith(x) for x in SUFFIXES):
        x = next(x for x in SUFFIXES if mode.endswith(x))
        found.insert(0, x)
        mode = mode[:-len(x)]
    return mode, found


def server_args(model: str, mode: str, quant: str | None, args) -> tuple[str, list[str]]:
    extra = ["--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    mode, suffixes = split_mode(mode)
    for x in suffixes:
        extra += SUFFIXES[x]
    if PG_SUFFIX not in suffixes:
        extra += NO_PG
    if args.max_model_len:
        extra += ["--max-model-len", str(args.max_model_len)]
    if mode in POLICY:
        extra += ["--speculative-disable-by-batch-size", POLICY[mode]]
    if model == "embedded":
        from m3serve.llm import default_model
        target = default_model()
        if mode != "plain":
            extra += ["--speculative-tokens", str(args.k)]
        return target, extra
    if quant:
        extra += ["--quantization", quant]
    if mode != "plain":
        cfg = {"method": "eagle3", "model": None, "num_speculative_tokens": args.k,
               "forced_acceptance": args.forced_al}
        extra += ["--speculative-config", json.dumps(cfg)]
    return model, extra


def parse_run(text: str) -> tuple[str, str, str | None]:
    parts = text.split(":")
    # presets contain a colon themselves (minimax-m3:5)
    if parts[0] == "minimax-m3" and len(parts) > 1 and parts[1].isdigit():
        parts = [parts[0] + ":" + parts[1]] + parts[2:]
    if len(parts) not in (2, 3) or split_mode(parts[1])[0] not in MODES:
        raise SystemExit(f"--runs {text!r}: expected MODEL:{'|'.join(MODES)}[{PG_SUFFIX}][{AW_SUFFIX}][{STEP_SUFFIX}]"
                         "[:QUANT]")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--concurrency", default="1,4,16,64,128")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-user", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--forced-al", type=float, default=2.78, help="forced acceptance length for random drafters")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    meta = run_metadata()
    base = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    files = []
    for text in args.runs:
        model, mode, quant = parse_run(text)
        target, extra = server_args(model, mode, quant, args)
        tag = f"{model}-{mode}-{quant or 'bf16'}".replace(":", "_")
        out = f"{base}.{tag}.json"
        cmd = [sys.executable, "-m", "m3serve.bench", "serve", "--launch", target, "--server-args", shlex.join(extra),
               "--concurrency", args.concurrency, "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--requests-per-user", str(args.requests_per_user), "--timeout",
               str(args.timeout), "--label", f"{model} {mode} {quant or 'bf16'}", "--out", out, "--no-progress"]
        t0 = time.perf_counter()
        print("$", shlex.join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=ROOT)
        print(f"[{text}: rc {rc} in {time.perf_counter() - t0:.0f} s]", flush=True)
        if os.path.exists(out):
            files.append((model, mode, out, f"{out}:{mode.split('-')[0]}:{quant or 'none'}"))
    if not files:
        return 1
    cmd = [sys.executable, "-m", "m3serve.bench", "pareto", *[f[3] for f in files], "--out", args.out, "--plot", base + ".png",
           "--commit", meta["commit"], "--gpu", str(meta["gpu"])]
    subprocess.check_call(cmd, cwd=ROOT)
    with open(args.out) as f:
        doc = json.load(f)
    doc.update({"command": meta["command"], "date": meta["date"], "host": meta["host"]})
    for r, (model, mode, _, _) in zip(doc["runs"], files):
        r["model"] = model
        base, suffixes = split_mode(mode)
        if base in POLICY:
            r["policy"] = POLICY[base]
        r["prefill_graph_tokens"] = PG_TOKENS if PG_SUFFIX in suffixes else 0
        if AW_SUFFIX in suffixes:
            r["admission_wait_ms"] = AW_MS
        if STEP_SUFFIX in suffixes:
            r["max_num_batched_tokens"] = STEP_TOKENS
        r.pop("meta", None)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    for _, _, path, _ in files:              # the per-run files are folded into the combined one
        os.remove(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
