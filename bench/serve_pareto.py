"""Serving sweeps for the no-cliffs goals: one `m3serve bench serve` run per server configuration (each launching
its own server), combined into one Pareto file and one chart (`m3serve bench pareto`).

    python bench/serve_pareto.py --out bench/results/serve/serve-pareto-h200.json \
        --runs embedded:plain embedded:spec minimax-m3:5:plain:nvfp4 minimax-m3:5:spec:nvfp4

A run is MODEL:MODE[:QUANT]; MODEL "embedded" is the embedded model (its trained Eagle3 drafter for spec);
a preset takes random weights and, for spec, a random drafter with forced acceptance (--forced-al) and
token-id prompts. MODE is plain, spec (the server's default batch-size policy), spec-auto (the measured
policy, `--speculative-disable-by-batch-size auto`), spec-auto2 (the measured policy up to 2 requests in the engine,
plain above: `auto:2`) or spec-always (no policy: every step speculates,
`--speculative-disable-by-batch-size none`); a "-pg" suffix (plain-pg, spec-always-pg, ...) also replays eager steps of
up to 1024 tokens as prefill graphs (`--prefill-graph-tokens 1024`), and "-aw" (after it, if both) holds arrivals
back up to 4 ms while requests decode so that several share a prefill step (`--admission-wait-ms 4`), and "-t8k" sets
an 8192-token step budget (`--max-num-batched-tokens 8192`, the plain target's default; speculation's is 2048), and
"-pyd" leaves the server's start-up heap to the garbage collector (`--no-gc-freeze`), "-si" sets a 0.2 ms GIL switch
interval (`--switch-interval-ms 0.2`). A mode without
"-pg" passes `--prefill-graph-tokens 0`, so that a mode means the same server whatever the default. Every run:
--input-len / --output-len tokens, concurrency levels --concurrency.

--repeats N runs the list N times, interleaved (a b a b, so that a drift of the machine lands on both), each run
marked with its "repeat". The file's "spec_vs_plain" then sets every speculative mode beside the plain mode of the
same model, quantization and suffixes, per concurrency: the median over repeats of tokens/s per user
(output tokens/s / concurrency) and of total output tokens/s, and their ratios (single runs moved by 20-40 % at 16
users and more on the H200).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.server.interpreter import SHORT_SWITCH_INTERVAL_MS  # noqa: E402


MODES = ("plain", "spec", "spec-auto", "spec-auto2", "spec-always")
POLICY = {"spec-auto": "auto", "spec-auto2": "auto:2", "spec-always": "none"}     # mode -> the server's --speculative-disable-by-batch-size


PG_SUFFIX, PG_TOKENS = "-pg", 1024
AW_SUFFIX, AW_MS = "-aw", 4.0
STEP_SUFFIX, STEP_TOKENS = "-t8k", 8192
PY_SUFFIX, SI_SUFFIX = "-pyd", "-si"
# mode suffix -> the server flags it adds (prefill graphs; admission batching; an 8192-token step budget; the
# start-up heap left to the collector, as before the server froze it; a 0.2 ms GIL switch interval)
SUFFIXES = {PG_SUFFIX: ["--prefill-graph-tokens", str(PG_TOKENS)], AW_SUFFIX: ["--admission-wait-ms", str(AW_MS)],
            STEP_SUFFIX: ["--max-num-batched-tokens", str(STEP_TOKENS)],
            PY_SUFFIX: ["--no-gc-freeze"], SI_SUFFIX: ["--switch-interval-ms", str(SHORT_SWITCH_INTERVAL_MS)]}
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
        raise SystemExit(f"--runs {text!r}: expected MODEL:{'|'.join(MODES)}[{PG_SUFFIX}][{AW_SUFFIX}][{STEP_SUFFIX}][{PY_SUFFIX}][{SI_SUFFIX}]"
                         "[:QUANT]")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def spec_vs_plain(runs: list[dict]) -> list[dict]:
    """Each speculative mode beside its plain counterpart (same model, quantization and suffixes; a spec "-t8k" beside
    the plain mode without it when the file has no plain "-t8k"), per concurrency:
    median tokens/s per user (output tokens/s / concurrency; and 1000 / P90 TPOT, the chart's y) and total tokens/s
    over the repeats of each, and spec / plain. `runs`: the combined
    file's runs, each with "model", "quantization", "run_mode" and its "results" rows."""
    groups: dict[tuple, list[list[dict]]] = {}
    for r in runs:
        groups.setdefault((r["model"], r.get("quantization"), r["run_mode"]), []).append(r["results"])

    def medians(rows_of_runs: list[list[dict]]) -> dict[int, tuple[float, float, int]]:
        by_c: dict[int, list[dict]] = {}
        for rows in rows_of_runs:
            for row in rows:
                if row.get("completed"):
                    by_c.setdefault(row["concurrency"], []).append(row)
        return {c: (statistics.median(x["output_tokens_per_s"] / c for x in xs),
                    statistics.median(x["output_tokens_per_s"] for x in xs),
                    statistics.median(x["interactivity_tpot_p90"] for x in xs), len(xs)) for c, xs in by_c.items()}

    out = []
    for (model, quant, mode), spec_runs in groups.items():
        base, suffixes = split_mode(mode)
        # "-t8k" gives a speculative server the plain target's default step budget (8192 tokens on the GPU): its
        # counterpart is the plain mode without it, unless the file ran a plain "-t8k" too
        same = "plain" + "".join(suffixes)
        plain_mode = same if same in {m for (md, q, m) in groups if (md, q) == (model, quant)} else \
            "plain" + "".join(x for x in suffixes if x != STEP_SUFFIX)
        plain_runs = groups.get((model, quant, plain_mode))
        if base == "plain" or plain_runs is None:
            continue
        sm, pm = medians(spec_runs), medians(plain_runs)
        rows = []
        for c in sorted(set(sm) & set(pm)):
            (su, st, si, sn), (pu, pt, pi, pn) = sm[c], pm[c]
            rows.append({"concurrency": c, "spec_per_user": su, "plain_per_user": pu, "per_user_ratio": su / pu,
                         "spec_total": st, "plain_total": pt, "total_ratio": st / pt,
                         "spec_tpot_p90_per_user": si, "plain_tpot_p90_per_user": pi, "tpot_p90_ratio": si / pi,
                         "repeats": [sn, pn]})
        out.append({"model": model, "quantization": quant, "spec_mode": mode, "plain_mode": plain_mode,
                    "levels": rows})
    return out


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
    ap.add_argument("--repeats", type=int, default=1, help="run the list this many times, interleaved")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats: expected >= 1, found {args.repeats}")
    meta = run_metadata()
    base = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    files = []
    plan = [(rep, text) for rep in range(args.repeats) for text in args.runs]
    for rep, text in plan:
        model, mode, quant = parse_run(text)
        target, extra = server_args(model, mode, quant, args)
        tag = f"{model}-{mode}-{quant or 'bf16'}-r{rep}".replace(":", "_")
        out = f"{base}.{tag}.json"
        cmd = [sys.executable, "-m", "m3serve.bench", "serve", "--launch", target, "--server-args", shlex.join(extra),
               "--concurrency", args.concurrency, "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--requests-per-user", str(args.requests_per_user), "--timeout",
               str(args.timeout), "--label", f"{model} {mode} {quant or 'bf16'}" + (f" r{rep}" if args.repeats > 1 else ""), "--out", out, "--no-progress"]
        t0 = time.perf_counter()
        print("$", shlex.join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=ROOT)
        print(f"[{text}: rc {rc} in {time.perf_counter() - t0:.0f} s]", flush=True)
        if os.path.exists(out):
            files.append((model, mode, rep, out, f"{out}:{mode.split('-')[0]}:{quant or 'none'}"))
    if not files:
        return 1
    cmd = [sys.executable, "-m", "m3serve.bench", "pareto", *[f[4] for f in files], "--out", args.out, "--plot", base + ".png",
           "--commit", meta["commit"], "--gpu", str(meta["gpu"])]
    subprocess.check_call(cmd, cwd=ROOT)
    with open(args.out) as f:
        doc = json.load(f)
    doc.update({"command": meta["command"], "date": meta["date"], "host": meta["host"]})
    for r, (model, mode, rep, _, _) in zip(doc["runs"], files):
        r["model"], r["run_mode"], r["repeat"] = model, mode, rep
        base, suffixes = split_mode(mode)
        if base in POLICY:
            r["policy"] = POLICY[base]
        r["prefill_graph_tokens"] = PG_TOKENS if PG_SUFFIX in suffixes else 0
        if AW_SUFFIX in suffixes:
            r["admission_wait_ms"] = AW_MS
        if STEP_SUFFIX in suffixes:
            r["max_num_batched_tokens"] = STEP_TOKENS
        r["gc_freeze"] = PY_SUFFIX not in suffixes
        if SI_SUFFIX in suffixes:
            r["switch_interval_ms"] = SHORT_SWITCH_INTERVAL_MS
        r.pop("meta", None)
    doc["repeats"] = args.repeats
    doc["spec_vs_plain"] = spec_vs_plain(doc["runs"])
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    for _, _, _, path, _ in files:              # the per-run files are folded into the combined one
        os.remove(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
