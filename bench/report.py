"""Regenerate the measured tables (docs/results.md) and the README's headline figures from the JSON files under
bench/results/ (no figure typed by hand).

    python bench/report.py                            print the generated tables
    python bench/report.py --write docs/results.md    replace every generated block of that file
    python bench/report.py --check README.md          exit 1 (and print a diff) if a block differs from the results

A file holds the full tables between `<!-- report:begin -->` / `<!-- report:end -->` and / or the headline
summary between `<!-- report:summary:begin -->` / `<!-- report:summary:end -->`; --write and --check handle
every block the file has (at least one).

Every JSON file under the results folder (sub-folders too, except logs/) is recognised by its content: a "bench"
/ "benchmark" key, else its file-name pattern, else the keys present. Each recognised file becomes a small table
plus one source line (file name, GPU, commit, date, command, all read from the file); a file that nothing
recognises is listed at the end ("unrendered results: ...") instead of being skipped. A recognised file that
lacks a field its table needs raises ValueError / TypeError naming the file, the field and what was found.

Schema legend (the fields each formatter reads; [x] optional):
    decode          {"bench": "decode", [preset], [quantization], [kv_cache_dtype], [copy_bandwidth_Bps],
                     results: [{[model], route, batch, context, median_s, tokens_per_s, [gpu_busy_s],
                                [launches_per_step], [fraction_of_roofline], [greedy_agreement_vs_off]}]}
    attention       attention-*.json: {[copy_bandwidth_Bps], results: [{entry, batch, context, query_tokens, us,
                     frac_copy, [tflops]}], [decode_step: [{model, context, batch, median_s}]]}
    kernels         kernels-*.json: {copy_bandwidth_Bps, results: [{entry, shape, rows, us, frac_copy,
                     [speedup_vs_stock]}], [goals: [{entry, rows, met}]]}
    gemv_variants   gemv_variants-*.json: {results: [{entry, rows, ok, [det]}],
                     summary: [{entry, rows, variant, n_shapes, geomean_frac_copy}, ...]}
    host_overhead   {"benchmark": "host_overhead", [summary: {scalars}], results: [{batch, context, per_request_us,
                     step_us_median, [two_call_us_median], [legacy_per_request_us]}]}
    tp              {"bench": "tp", model: {preset, quantization}, workload: {prompt_tokens, batch},
                     tp1/tp2: {decode_ms: {median}, [peak_allocated_gb]}, decode_speedup_tp2_over_tp1,
                     [accuracy: {pass}], [allreduce_12kb: {bytes, METHOD: {synced_us_median, [back_to_back_us],
                     [cuda_graph_us]}}]}
    spec_decode     {"bench": "spec_decode", model, k, results: [{batch, temperature, plain_tok_s, spec_tok_s,
                     speedup, spec_stats: {acceptance_length}, [greedy_identical]}]}
    serve           serve-*.json: {meta: {model, workload, input_len, output_len, [label], [created]},
                     results: [{concurrency, requests, completed, failed, output_tokens_per_s,
                     total_tokens_per_s_per_gpu, ttft_ms: {p50, p90}, itl_ms: {p50, p90}, interactivity_x90}]}
    eval_kv         eval-*.json: {n, order: [A, B], configs: {A|B: {exact_match_strict, correct_strict}},
                     paired: {strict: {b, c, p_value}}, [agreement: {tokens}, agreement_unit]}
    spec_target     {"bench": "spec_target", results: [{model, mode, batch, k, forced_al, acceptance_length,
                     tokens_per_s_per_user, [speedup_vs_plain], identical_to_plain}]}
    spec_divergence {"bench": "spec_divergence", batch, prompts, runs: [{overlap, differing_prompts, diffs: [{gap}]}]}
    stream_patterns stream-patterns-*.json: {copy_bandwidth_Bps, results: [{rows_per_instr, unroll, order, ctas, us,
                     frac_copy}]}
    tiled_layout    tiled-layout-*.json: {copy_bandwidth_Bps, results: [{shape, rows, variant, tiled, us_write_flush,
                     frac_copy_write_flush, frac_copy_read_flush, frac_copy_seq, [bit_identical_to_row_major]}]}
    generic         server-hardening*.json: every top-level scalar field, key: value
Rounding: times and rates to 3 significant digits (integers kept whole above 100), speedups to 2, percentages
to integers (one significant digit below 1 %) except task accuracy (one decimal), p-values to 2 significant digits.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import fnmatch
import json
import math
import re
import sys
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, Callable

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BEGIN_MARKER = "<!-- report:begin -->"
END_MARKER = "<!-- report:end -->"
SUMMARY_BEGIN_MARKER = "<!-- report:summary:begin -->"
SUMMARY_END_MARKER = "<!-- report:summary:end -->"
GENERATED_NOTE = ("<!-- generated by `python bench/report.py --write docs/results.md` from bench/results/*/*.json: "
                  "change those files or bench/report.py, not this block -->")
SUMMARY_NOTE = ("<!-- generated by `python bench/report.py --write README.md` from bench/results/*/*.json: "
                "change those files or bench/report.py, not this block -->")
# logs: raw console output (git-ignored); reverted: results of changes measured and then reverted, kept with their
# commit for the record but not rendered (the code they measured is no longer in the tree)
SKIPPED_DIRS = {"logs", "reverted"}
# bench/decode.py's side-by-side variants of the target (another weight layout, head, cell config or launch mode
# than the product binds): in the full tables, not in the README's headline figures
VARIANT_ROUTES = ("target-rows", "target-logits-head", "target-gate-up-whole", "target-split-router",
                  "target-shared-inline", "target-gate-up-split", "target-gate-up-split-r72", "target-down-uncapped",
                  "target-mma-gemv-uncapped", "target-splits-up", "target-gemv-split2x", "target-gate-up-stages3",
                  "target-index-gemv", "target-head12", "target-head-bf16", "target-opt-in", "target-round3",
                  "target-pdl", "target-nopdl", "target-head12-logits", "target-torch-sampler", "target-down-stages3",
                  "target-rings3", "target-pdl8")
# table row order: the product's routes, then the variants in the order above
ROUTE_ORDER = {r: n for n, r in enumerate(("off", "auto", "target") + VARIANT_ROUTES)}
NOT_RECORDED = "not recorded"
DASH = "—"


@dataclass(frozen=True)
class ResultFile:
    name: str    # path relative to the results folder, '/'-separated
    data: Any


# ----------------------------------------------------------------------------------------------- field access

def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def need(obj: Any, key: str, where: str, kind: str = "number") -> Any:
    """obj[key], checked: kind is 'number', 'int', 'str', 'bool', 'list', 'dict' or 'any'. `where` names the
    file and the path to obj, so the error says exactly which field of which file is wrong."""
    if not isinstance(obj, dict):
        raise TypeError(f"{where}: expected an object, found {_type_name(obj)}")
    if key not in obj:
        raise ValueError(f"{where}.{key}: field missing (expected {kind})")
    return _checked(obj[key], f"{where}.{key}", kind)


def opt(obj: dict, key: str, where: str, kind: str = "number") -> Any:
    """Like need() for an optional field: None when absent or null."""
    if obj.get(key) is None:
        return None
    return _checked(obj[key], f"{where}.{key}", kind)


def _checked(v: Any, where: str, kind: str) -> Any:
    ok = {"number": _is_number(v), "int": isinstance(v, int) and not isinstance(v, bool),
          "str": isinstance(v, str), "bool": isinstance(v, bool), "list": isinstance(v, list),
          "dict": isinstance(v, dict), "any": True}[kind]
    if not ok:
        raise TypeError(f"{where}: expected {kind}, found {_type_name(v)} {v!r:.60}")
    if kind == "number" and not math.isfinite(v):
        raise ValueError(f"{where}: expected a finite number, found {v!r}")
    return v


def rows_of(rf: ResultFile, key: str = "results") -> list[dict]:
    rows = need(rf.data, key, rf.name, "list")
    if not rows:
        raise ValueError(f"{rf.name}.{key}: expected at least one row, found an empty list")
    for i, r in enumerate(rows):
        _checked(r, f"{rf.name}.{key}[{i}]", "dict")
    return rows


# ---------------------------------------------------------------------------------------------- number format

def _round_half_up(x: float, decimals: int) -> Decimal:
    return Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)


def sig(x: float, digits: int = 3) -> str:
    """x to `digits` significant digits, never in scientific notation; the integer part is kept whole."""
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    decimals = max(digits - 1 - magnitude, 0)
    text = str(_round_half_up(x, decimals))
    # rounding can carry into a new digit (9.995 -> 10.00): drop the now-surplus decimal
    if decimals > 0 and len(text.lstrip("-").replace(".", "").lstrip("0")) > digits:
        text = str(_round_half_up(x, decimals - 1))
    return text


def pct(fraction: float) -> str:
    """A fraction as a percentage: integers, one significant digit below 1 % so a small value never reads 0."""
    v = fraction * 100.0
    if v != 0 and abs(v) < 1:
        return f"{sig(v, 1)} %"
    return f"{_round_half_up(v, 0)} %"


def accuracy_pct(fraction: float) -> str:
    """Task accuracy keeps one decimal: on a few hundred items a 1-point change is a handful of answers."""
    return f"{_round_half_up(fraction * 100.0, 1)} %"


def ratio2(x: float) -> str:
    """A ratio near 1 with two decimals (1.02×): where times' two significant digits would say 1.0×."""
    return f"{x:.2f}×"


def times(x: float) -> str:
    return f"{sig(x, 2)}×"


def count(x: float) -> str:
    """A mean count (launches per step): whole when it is whole."""
    return str(int(x)) if float(x).is_integer() else sig(x)


def ms(seconds: float) -> str:
    return sig(seconds * 1e3)


def p_value(p: float) -> str:
    return f"{p:.1e}" if 0 < p < 1e-3 else sig(p, 2)


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def pct_span(values: list[float]) -> str:
    lo, hi = pct(min(values)).removesuffix(" %"), pct(max(values)).removesuffix(" %")
    return f"{lo} %" if lo == hi else f"{lo}–{hi} %"


def tb_per_s(bps: float) -> str:
    return f"{sig(bps / 1e12)} TB/s"


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def or_dash(v: Any, fmt: Callable[[Any], str]) -> str:
    return DASH if v is None else fmt(v)


def yes_no(v: bool | None) -> str:
    return DASH if v is None else ("yes" if v else "no")


def scalar_text(v: Any) -> str:
    if isinstance(v, bool):
        return yes_no(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return repr(v)
        text = sig(v, 4)
        return text.rstrip("0").rstrip(".") if "." in text else text
    return str(v)


# ------------------------------------------------------------------------------------------- markdown helpers

def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


# ------------------------------------------------------------------------------------------------- provenance

def _commit(data: dict) -> str:
    git = data.get("git") if isinstance(data.get("git"), dict) else {}
    raw = data.get("commit") or data.get("git_commit") or git.get("commit")
    if not raw:
        return NOT_RECORDED
    text = str(raw)
    if re.fullmatch(r"[0-9a-f]{40}(-dirty)?", text):
        text = text[:12] + text[40:]
    if data.get("dirty") is True:
        text += " + uncommitted changes"
    if git.get("kv_files_dirty") is True:
        text += " + uncommitted kv/ changes"
    return text


def _gpu(data: dict) -> str:
    machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    gpu = data.get("gpu") or machine.get("gpu")
    if gpu:
        # a TP run records its world size with the all-reduce, not as gpu_count
        allreduce = data.get("allreduce_12kb") if isinstance(data.get("allreduce_12kb"), dict) else {}
        n = allreduce.get("world_size") or data.get("gpu_count")
        return f"{n}× {gpu}" if _is_number(n) and n > 1 else str(gpu)
    if data.get("device") == "cpu":
        cores = machine.get("cpu_count")
        return f"CPU ({cores} cores)" if cores else "CPU"
    return f"GPU {NOT_RECORDED}"


def _date(data: dict) -> str:
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    raw = data.get("date") or meta.get("created")
    if not raw:
        return f"date {NOT_RECORDED}"
    try:
        when = dt.datetime.fromisoformat(str(raw))
    except ValueError:
        return str(raw)
    if when.tzinfo is None:
        return when.strftime("%Y-%m-%d %H:%M")
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def source_line(rf: ResultFile, extra: str = "") -> str:
    data = rf.data
    command = data.get("command")
    parts = [f"source {code(rf.name)}", _gpu(data), f"commit {_commit(data)}", _date(data)]
    if extra:
        parts.append(extra)
    parts.append(code(command) if command else f"command {NOT_RECORDED}")
    return " · ".join(parts)


def file_block(caption: str, table: str, rf: ResultFile, extra: str = "") -> str:
    return f"**{caption}**\n\n{table}\n\n{source_line(rf, extra)}"


def copy_bw_note(rf: ResultFile) -> str:
    bw = opt(rf.data, "copy_bandwidth_Bps", rf.name)
    return f"copy bandwidth {tb_per_s(bw)}" if bw is not None else ""


# ------------------------------------------------------------------------------------------------- formatters

def render_decode(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        rows = rows_of(rf)
        preset = opt(rf.data, "preset", rf.name, "str")
        parsed = []
        for i, r in enumerate(rows):
            w = f"{rf.name}.results[{i}]"
            model = opt(r, "model", w, "str") or preset
            if model is None:
                raise ValueError(f"{w}.model: field missing and no top-level 'preset' (expected str)")
            parsed.append({
                "key": (model, need(r, "batch", w, "int"), need(r, "context", w, "int")),
                "route": need(r, "route", w, "str"), "median_s": need(r, "median_s", w),
                "tokens_per_s": need(r, "tokens_per_s", w), "busy": opt(r, "gpu_busy_s", w),
                "launches": opt(r, "launches_per_step", w), "idle": opt(r, "gpu_idle_s", w),
                "roofline": opt(r, "fraction_of_roofline", w),
                "agree": opt(r, "greedy_agreement_vs_off", w),
                "equal": opt(r, "tokens_equal_to_target", w),
                "classes": opt(r, "gpu_s_by_class", w, "dict")})
        off = {p["key"]: p["median_s"] for p in parsed if p["route"] == "off"}
        target = {p["key"]: p["median_s"] for p in parsed if p["route"] == "target"}
        parsed.sort(key=lambda p: (p["key"], ROUTE_ORDER.get(p["route"], len(ROUTE_ORDER)), p["route"]))
        has = {f: any(p[f] is not None for p in parsed)
               for f in ("busy", "idle", "launches", "roofline", "agree", "equal", "classes")}
        headers = ["model", "batch", "context", "route", "ms/step", "tok/s"]
        headers += [h for f, h in (("busy", "GPU busy ms"), ("idle", "GPU idle between kernels ms"),
                                   ("launches", "launches/step"), ("roofline", "% of roofline")) if has[f]]
        headers += ["speedup vs off"] + (["greedy agreement vs off"] if has["agree"] else [])
        headers += ["target's speedup over this route", "tokens equal to target's"] if has["equal"] else []
        headers += ["GPU ms per step by kernel class"] if has["classes"] else []
        table = []
        for p in parsed:
            row = [p["key"][0], p["key"][1], p["key"][2], p["route"], ms(p["median_s"]), sig(p["tokens_per_s"])]
            for field, fmt in (("busy", ms), ("idle", ms), ("launches", count), ("roofline", pct)):
                if has[field]:
                    row.append(or_dash(p[field], fmt))
            base = off.get(p["key"])
            row.append(times(base / p["median_s"]) if base is not None and p["route"] != "off" else DASH)
            if has["agree"]:
                row.append(DASH if p["agree"] is None or p["route"] == "off" else pct(p["agree"]))
            if has["equal"]:
                t = target.get(p["key"])
                row.append(times(p["median_s"] / t) if t is not None and p["equal"] is not None else DASH)
                row.append(or_dash(p["equal"], pct))
            if has["classes"]:
                c = p["classes"] or {}
                row.append(", ".join(f"{k} {ms(v)}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) or DASH)
            table.append(row)
        models = sorted({p["key"][0] for p in parsed})
        routes = sorted({p["route"] for p in parsed}, key=lambda r: (ROUTE_ORDER.get(r, len(ROUTE_ORDER)), r))
        quant = opt(rf.data, "quantization", rf.name, "str")
        kv = opt(rf.data, "kv_cache_dtype", rf.name, "str")
        # the quantization flags apply to presets only (the embedded model stays BF16), so say so
        presets = any(m != "m3-tiny-verse" for m in models)   # the embedded model is always BF16 with BF16 KV
        flags = [f"{quant.upper()} weights"] if quant and presets else []
        flags += [f"{kv} KV"] if kv and presets else []
        caption = f"{', '.join(models)}: routes {', '.join(routes)}"
        caption += f" ({', '.join(flags)}{' for presets' if kv else ''})" if flags else ""
        sampling = rf.data.get("sampling")
        if sampling:
            caption += ", sampled: " + ", ".join(f"{k} {v}" for k, v in sampling.items() if k != "seed")
        else:
            caption += ", greedy"
        blocks.append(file_block(caption, md_table(headers, table), rf, copy_bw_note(rf)) + caveat_note(rf))
    return "\n\n".join(blocks)


def render_attention(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        steps = opt(rf.data, "decode_step", rf.name, "list")
        rows = rows_of(rf) if rf.data.get("results") or not steps else []   # a decode-step-only run has no rows
        has_tflops = any(r.get("tflops") is not None for r in rows)
        parsed = []
        for i, r in enumerate(rows):
            w = f"{rf.name}.results[{i}]"
            parsed.append((need(r, "entry", w, "str"), need(r, "batch", w, "int"), need(r, "context", w, "int"),
                           need(r, "query_tokens", w, "int"), need(r, "us", w), need(r, "frac_copy", w),
                           opt(r, "tflops", w)))
        parsed.sort(key=lambda p: p[:4])
        headers = ["entry", "batch", "context", "query tokens", "µs", "% of copy BW"]
        headers += ["TFLOP/s"] if has_tflops else []
        table = [[e, b, c, q, sig(us), pct(f)] + ([or_dash(t, sig)] if has_tflops else [])
                 for e, b, c, q, us, f, t in parsed]
        text = md_table(headers, table) if rows else ""
        if steps:
            step_rows = []
            for i, r in enumerate(steps):
                w = f"{rf.name}.decode_step[{i}]"
                step_rows.append((need(r, "model", w, "str"), need(r, "context", w, "int"),
                                  need(r, "batch", w, "int"), need(r, "median_s", w)))
            step_rows.sort()
            text += ("\n\n" if text else "") + md_table(["model", "context", "batch", "decode ms/step"],
                                                       [[m, c, b, ms(s)] for m, c, b, s in step_rows])
        blocks.append(file_block("Attention kernels", text, rf, copy_bw_note(rf)))
    return "\n\n".join(blocks)


def render_paged_attention(files: list[ResultFile]) -> str:
    """bench/paged_attention.py: attn.paged per point and split count, the splits merged in the split kernel or by
    the separate combine launch (_paged_call.MERGE_IN_SPLIT_MAX decides by default), side by side where the run
    measured both."""
    blocks = []
    for rf in files:
        rows = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            launch = opt(r, "combine_launch", w, "bool")
            rows.append([need(r, "point", w, "str"), need(r, "num_splits", w, "int"),
                         DASH if launch is None else "combine launch" if launch else "in the split kernel",
                         sig(need(r, "us", w)), pct(need(r, "frac_copy", w))])
        blocks.append(file_block("attn.paged per point (one launch vs split + combine launches)",
                                 md_table(["point", "splits", "splits merged", "µs", "% of copy BW"], rows), rf,
                                 copy_bw_note(rf)))
    return "\n\n".join(blocks)


def _shape(shape: Any, where: str) -> str:
    _checked(shape, where, "list")
    return "×".join(str(_checked(d, where, "int")) for d in shape)


def render_kernels(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        groups: dict[tuple[str, int], list[tuple[str, float, float, float | None]]] = {}
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            key = (need(r, "entry", w, "str"), need(r, "rows", w, "int"))
            groups.setdefault(key, []).append((_shape(need(r, "shape", w, "list"), f"{w}.shape"),
                                               need(r, "us", w), need(r, "frac_copy", w),
                                               opt(r, "speedup_vs_stock", w)))
        goals = opt(rf.data, "goals", rf.name, "list")
        met: dict[tuple[str, int], list[bool]] = {}
        for i, g in enumerate(goals or []):
            w = f"{rf.name}.goals[{i}]"
            met.setdefault((need(g, "entry", w, "str"), need(g, "rows", w, "int")), []).append(
                need(g, "met", w, "bool"))
        has_stock = any(s is not None for items in groups.values() for *_, s in items)
        headers = ["entry", "rows", "shapes", "µs", "% of copy BW", "best shape"]
        headers += (["× vs stock torch"] if has_stock else []) + (["goals met"] if goals is not None else [])
        table = []
        for key in sorted(groups):
            items = groups[key]
            best = max(items, key=lambda it: (it[2], it[0]))
            row = [key[0], key[1], len(items), span([it[1] for it in items], sig),
                   pct_span([it[2] for it in items]), f"{best[0]} ({pct(best[2])})"]
            if has_stock:
                stock = [it[3] for it in items if it[3] is not None]
                row.append(span(stock, lambda x: sig(x, 2)) + "×" if stock else DASH)
            if goals is not None:
                g = met.get(key, [])
                row.append(f"{sum(g)}/{len(g)}" if g else DASH)
            table.append(row)
        bw = need(rf.data, "copy_bandwidth_Bps", rf.name)
        blocks.append(file_block(f"Kernels vs copy bandwidth ({tb_per_s(bw)} measured)", md_table(headers, table),
                                 rf))
    return "\n\n".join(blocks)


def render_gemv_variants(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        health: dict[tuple[str, int], list[bool]] = {}
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            good = need(r, "ok", w, "bool") and opt(r, "det", w, "bool") is not False
            health.setdefault((need(r, "entry", w, "str"), need(r, "rows", w, "int")), []).append(good)
        variants: dict[tuple[str, int], dict[str, tuple[float, int]]] = {}
        for i, s in enumerate(rows_of(rf, "summary")):
            if "variant" not in s:   # the per-shape 'best' rows share the list; the table uses the geomeans
                continue
            w = f"{rf.name}.summary[{i}]"
            variants.setdefault((need(s, "entry", w, "str"), need(s, "rows", w, "int")), {})[
                need(s, "variant", w, "str")] = (need(s, "geomean_frac_copy", w), need(s, "n_shapes", w, "int"))
        if not variants:
            raise ValueError(f"{rf.name}.summary: no rows with 'variant' and 'geomean_frac_copy' (expected one "
                             f"per entry, rows and variant)")
        table = []
        for key in sorted(variants):
            by_variant = variants[key]
            best_name, (best, n_shapes) = max(by_variant.items(), key=lambda kv: (kv[1][0], kv[0]))
            cell = by_variant.get("cell")
            ok = health.get(key, [])
            table.append([key[0], key[1], n_shapes, DASH if cell is None else pct(cell[0]), best_name, pct(best),
                          DASH if cell is None else times(best / cell[0]),
                          f"{sum(ok)}/{len(ok)}"])
        headers = ["entry", "rows", "shapes", "certified cell (geomean % of copy BW)", "best variant",
                   "best geomean %", "gain", "runs ok and deterministic"]
        blocks.append(file_block("GEMV variants vs the certified cell", md_table(headers, table), rf,
                                 copy_bw_note(rf)))
    return "\n\n".join(blocks)


def render_host_overhead(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        rows = rows_of(rf)
        cells: dict[int, dict[int, dict]] = {}
        for i, r in enumerate(rows):
            w = f"{rf.name}.results[{i}]"
            entry = {"per_request": need(r, "per_request_us", w), "step": need(r, "step_us_median", w),
                     "two_call": opt(r, "two_call_us_median", w), "legacy": opt(r, "legacy_per_request_us", w)}
            cells.setdefault(need(r, "batch", w, "int"), {})[need(r, "context", w, "int")] = entry
        contexts = sorted({c for per_batch in cells.values() for c in per_batch})
        longest = contexts[-1]
        has_two = any(e["two_call"] is not None for pb in cells.values() for e in pb.values())
        has_legacy = any(e["legacy"] is not None for pb in cells.values() for e in pb.values())
        headers = ["batch"] + [f"µs/request @ {context_label(c)}" for c in contexts]
        headers += [f"step µs @ {context_label(longest)}"]
        headers += [f"two calls µs/request @ {context_label(longest)}"] if has_two else []
        headers += [f"per-request rebuild µs/request @ {context_label(longest)}"] if has_legacy else []
        table = []
        for batch in sorted(cells):
            per = cells[batch]
            row = [batch] + [sig(per[c]["per_request"]) if c in per else DASH for c in contexts]
            last = per.get(longest)
            last = last or {"step": None, "two_call": None, "legacy": None}
            row.append(or_dash(last["step"], sig))
            if has_two:
                row.append(or_dash(last["two_call"], lambda us: sig(us / batch)))
            if has_legacy:
                row.append(or_dash(last["legacy"], sig))
            table.append(row)
        text = md_table(headers, table)
        summary = opt(rf.data, "summary", rf.name, "dict")
        if summary:
            items = [f"{k}: {scalar_text(v)}" for k, v in sorted(summary.items())
                     if isinstance(v, (str, int, float, bool))]
            text += "\n\nsummary (from the file): " + "; ".join(items)
        device = opt(rf.data, "device", rf.name, "str")
        caption = "Host time per step: block tables + slot mapping" + (f" ({device})" if device else "")
        blocks.append(file_block(caption, text, rf))
    return "\n\n".join(blocks)


def render_host_stream_cost(files: list[ResultFile]) -> str:
    """bench/host_stream_cost.py: server-thread CPU per stream and decode step (model compute replaced by a wait)."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf, "points")):
            w = f"{rf.name}.points[{i}]"
            table.append([count(need(r, "streams", w)), sig(need(r, "engine_thread_us_per_stream_step", w)),
                          sig(need(r, "loop_thread_us_per_stream_step", w)),
                          sig(need(r, "total_us_per_stream_step", w)), sig(need(r, "rows_per_step", w)),
                          pct(need(r, "sync_step_fraction", w)),
                          or_dash(opt(r, "client_output_tok_per_s", w), sig),
                          or_dash(opt(r, "client_itl_ms_p90", w), sig)])
        headers = ["streams", "engine thread µs", "event loop µs", "total µs per stream-step", "rows per step",
                   "synchronous steps", "client tok/s", "client ITL p90 ms"]
        label = opt(rf.data, "command", rf.name, "str") or ""
        setup = opt(rf.data, "setup", rf.name, "dict") or {}
        interpreter = ""
        if "frozen_objects" in setup:    # files since the server's interpreter settings (server/interpreter.py)
            interpreter = (f" — GIL switch interval {sig(setup['switch_interval_ms'])} ms, start-up heap "
                           + ("frozen" if setup["frozen_objects"] else "not frozen"))
        blocks.append(file_block("Host CPU per stream and decode step (server + engine + detokenizer, compute "
                                 "replaced by a fixed wait)" + (" — after" if "after" in label else
                                                                 " — before" if "before" in label else "")
                                 + interpreter, md_table(headers, table), rf))
    return "\n\n".join(blocks)


def render_tp(files: list[ResultFile]) -> str:
    step_rows, allreduce_rows = [], []
    for rf in files:
        d, n = rf.data, rf.name
        model, work = need(d, "model", n, "dict"), need(d, "workload", n, "dict")
        tp1, tp2 = need(d, "tp1", n, "dict"), need(d, "tp2", n, "dict")
        step1 = need(need(tp1, "decode_ms", f"{n}.tp1", "dict"), "median", f"{n}.tp1.decode_ms")
        step2 = need(need(tp2, "decode_ms", f"{n}.tp2", "dict"), "median", f"{n}.tp2.decode_ms")
        accuracy = opt(d, "accuracy", n, "dict")
        check = None if accuracy is None else ("pass" if need(accuracy, "pass", f"{n}.accuracy", "bool") else "FAIL")
        step_rows.append([need(model, "preset", f"{n}.model", "str"), need(model, "quantization", f"{n}.model", "str"),
                          need(work, "prompt_tokens", f"{n}.workload", "int"),
                          need(work, "batch", f"{n}.workload", "int"), sig(step1), sig(step2),
                          times(need(d, "decode_speedup_tp2_over_tp1", n)),
                          or_dash(opt(tp1, "peak_allocated_gb", f"{n}.tp1"), sig),
                          or_dash(opt(tp2, "peak_allocated_gb", f"{n}.tp2"), sig), or_dash(check, str), code(n)])
        allreduce = opt(d, "allreduce_12kb", n, "dict")
        if allreduce:
            nbytes = need(allreduce, "bytes", f"{n}.allreduce_12kb", "int")
            message = f"{nbytes // 1024} KiB" if nbytes % 1024 == 0 else f"{nbytes} B"
            for method in sorted(k for k, v in allreduce.items() if isinstance(v, dict)):
                w, m = f"{n}.allreduce_12kb.{method}", allreduce[method]
                allreduce_rows.append([method, message, sig(need(m, "synced_us_median", w)),
                                       or_dash(opt(m, "back_to_back_us", w), sig),
                                       or_dash(opt(m, "cuda_graph_us", w), sig), code(n)])
    text = md_table(["preset", "weights", "prompt tokens", "batch", "TP1 decode ms/step", "TP2 decode ms/step",
                     "TP2 speedup", "TP1 peak GB", "TP2 peak GB/rank", "TP2 vs TP1 logits check", "file"], step_rows)
    if allreduce_rows:
        text += "\n\n" + md_table(["all-reduce", "message", "synced µs (median)", "back-to-back µs",
                                   "in a CUDA graph µs", "file"], allreduce_rows)
    sources = "\n".join(f"- {source_line(rf)}" for rf in files)
    return f"**TP2 vs TP1 on one host**\n\n{text}\n\n{sources}"


def render_spec_decode(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            stats = need(r, "spec_stats", w, "dict")
            same = opt(r, "greedy_identical", w, "bool")
            table.append((need(r, "batch", w, "int"), need(r, "temperature", w), sig(need(r, "plain_tok_s", w)),
                          sig(need(r, "spec_tok_s", w)), times(need(r, "speedup", w)),
                          sig(need(stats, "acceptance_length", f"{w}.spec_stats")), yes_no(same)))
        table.sort(key=lambda row: row[:2])
        headers = ["batch", "temperature", "plain tok/s", "speculative tok/s", "speedup", "acceptance length",
                   "greedy output identical"]
        d = rf.data
        caption = (f"Eagle3 speculative decoding: {need(d, 'model', rf.name, 'str')}, "
                   f"K = {need(d, 'k', rf.name, 'int')}")
        max_tokens = opt(d, "max_tokens", rf.name, "int")
        caption += f", {max_tokens} new tokens per request" if max_tokens else ""
        blocks.append(file_block(caption, md_table(headers, [list(r[:1]) + [scalar_text(r[1])] + list(r[2:])
                                                             for r in table]), rf))
    return "\n\n".join(blocks)


# bench/prefill.py --sparse-prefill: the path of MSA layers' prefill rows
SPARSE_PREFILL = {"on": "MSA prefill through attn.prefill_sparse", "off": "MSA prefill through attn.paged"}
# bench/prefill.py --fp8-context: how attn.prefill reads dense layers' FP8 pages in long prefill steps
FP8_CONTEXT = {"bf16": "FP8 pages decoded to bf16 per step", "direct": "FP8 pages read directly"}
KV_CACHE = {"nvfp4": "hybrid NVFP4 / FP8", "fp8": "FP8", "bf16": "BF16"}
CONTEXT_COPY = {"on": "context copy read by TMA", "off": "pages read directly"}


def _fp8_context(r: dict, w: str) -> str:
    """The KV cache (when not the model dtype), how attn.prefill read the pages of long steps (context_copy; the
    earlier fp8_context only where the cache has FP8 pages) and its rescale."""
    kv = opt(r, "kv_cache_dtype", w, "str") or "auto"
    ctx = opt(r, "fp8_context", w, "str")
    copy = opt(r, "context_copy", w, "str")
    return ((f", {KV_CACHE.get(kv, kv)} KV cache" if kv != "auto" else "")
            + (f", {FP8_CONTEXT.get(ctx, 'fp8_context ' + ctx)}" if ctx and kv in ("fp8", "nvfp4") else "")
            + (f", fp8_context {ctx} (no FP8 pages: no effect)" if ctx and kv not in ("fp8", "nvfp4") else "")
            + (f", {CONTEXT_COPY.get(copy, 'context_copy ' + copy)}" if copy else "")
            + (", attn.prefill lazy rescale" if opt(r, "lazy_rescale", w, "str") == "on" else ""))


def render_prefill(files: list[ResultFile]) -> str:
    """bench/prefill.py: time to first token per engine, weight format and prompt length, one run per file."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            ttft, frac = opt(r, "ttft_s", w), opt(r, "frac_bf16_peak", w)
            graphs = opt(r, "prefill_graph_tokens", w, "int")
            sparse = opt(r, "sparse_prefill", w, "str")
            engine = (need(r, "engine", w, "str") + (f" (prefill graphs to {graphs} tokens)" if graphs else "")
                      + (f", {SPARSE_PREFILL.get(sparse, 'sparse_prefill ' + sparse)}" if sparse else "")
                      + _fp8_context(r, w))
            table.append([engine, need(r, "model", w, "str"), need(r, "quantization", w, "str"),
                          count(need(r, "tokens", w, "int")), count(need(r, "chunk", w, "int")),
                          or_dash(ttft, ms) if ttft is not None else (opt(r, "skipped", w, "str") or DASH),
                          or_dash(frac, pct)])
        headers = ["engine", "model", "weights", "prompt tokens", "chunk", "TTFT (ms)", "share of BF16 peak"]
        blocks.append(file_block("Prefill: time to first token (max_tokens 1, median after a warm-up run)",
                                 md_table(headers, table), rf))
    return "\n\n".join(blocks)


def render_generate_main_job(files: list[ResultFile]) -> str:
    """bench/generate_main_job.py: `m3serve generate` as fresh processes, cold then warm Triton cache."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(need(rf.data, "runs", rf.name, "list")):
            w = f"{rf.name}.runs[{i}]"
            table.append([str(i + 1), need(r, "triton_cache", w, "str"), sig(need(r, "load_s", w)),
                          count(need(r, "tokens", w, "int")), sig(need(r, "tok_s", w)),
                          sig(need(r, "process_wall_s", w))])
        blocks.append(file_block("The main job: `m3serve generate` with no arguments, each run a fresh process",
                                 md_table(["run", "Triton cache", "load (s)", "tokens", "tok/s (decode)",
                                           "process wall (s)"], table), rf))
    return "\n\n".join(blocks)


def caveat_note(rf: ResultFile) -> str:
    """The file's `caveat` (a note added by hand after its run, saying so) as a paragraph, and a note where the run
    was cut short (`complete` false: bench/decode.py writes after every row), or nothing."""
    caveat = opt(rf.data, "caveat", rf.name, "str")
    note = f"\n\n**Caveat:** {caveat}" if caveat else ""
    if opt(rf.data, "complete", rf.name, "bool") is False:
        note += "\n\n**Cut short:** the run ended (a time limit) before all its rows were measured; the rows shown are those it wrote."
    return note


def render_memory_plan_startup(files: list[ResultFile]) -> str:
    """bench/memory_plan_startup.py: the working memory planned before the KV cache against what start-up took."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            graphs = need(r, "graph_memory_bytes", w, "dict")
            table.append([need(r, "model", w, "str"), need(r, "mode", w, "str"), need(r, "quantization", w, "str"),
                          count(need(r, "max_num_seqs", w, "int")), need(r, "plan", w, "str"),
                          f"{need(r, 'measured_working_bytes', w) / 2**30:.2f}",
                          f"{need(r, 'measured_over_planned', w):.2f}",
                          ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(graphs.items())),
                          count(need(r, "kv_pages", w, "int"))])
        blocks.append(file_block("Memory plan: working memory planned before the KV cache vs taken by start-up (GiB)",
                                 md_table(["model", "mode", "weights", "max_num_seqs", "planned", "taken",
                                           "taken / planned", "graph pools", "KV pages"], table), rf)
                      + caveat_note(rf))
    return "\n\n".join(blocks)


def render_prefill_attention_variants(files: list[ResultFile]) -> str:
    """bench/prefill_attention_variants.py: attn.prefill tile configs, each checked against the entry's band, then
    timed on one chunk (and torch's SDPA on the same problem as a yardstick)."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            tiles = r.get("tiles")
            if isinstance(tiles, dict):
                t = tiles
                name = (f"{t['block_m']} x {t['block_n']}, {t['num_warps']} warps, {t['num_stages']} stages"
                        + (f", {t['heads']} heads" if t.get("heads", 1) > 1 else "")
                        + ("" if t.get("pv_split", True) else ", one bf16 p.v MMA")
                        + (", fp16 operands" if t.get("f16") else "")
                        + (", lazy rescale" if t.get("lazy") else ""))
            else:
                name = need(r, "tiles", w, "str")
            table.append(["FP8" if need(r, "kv_bits", w, "int") == 8 else "BF16", name, f"{need(r, 'ms', w):.3f}",
                          sig(need(r, "tflops", w)), opt(r, "check", w, "str") or DASH])
        n, ctx = need(rf.data, "n", rf.name, "int"), need(rf.data, "ctx", rf.name, "int")
        topk = opt(rf.data, "sparse_topk", rf.name, "int")
        layer = (f"M3 TP1 MSA layer, top-{topk} blocks: attn.prefill_sparse vs dense attn.prefill vs attn.paged"
                 if topk else "M3 TP1 dense layer")
        blocks.append(file_block(f"attn.prefill tile configs: one {count(n)}-token chunk after {count(ctx)} keys of "
                                 f"context ({layer})",
                                 md_table(["pages", "tiles", "ms", "TFLOP/s", "check"], table), rf))
    return "\n\n".join(blocks)


def render_msa_scores_prefill(files: list[ResultFile]) -> str:
    """bench/msa_index_bw.py --prefill-chunk: msa.scores' two tilings (and the prefill tiling's tile variants), each
    checked against the reference first, on one long chunk; then msa.select per warp count on the same rows."""
    blocks = []
    for rf in files:
        d = need(rf.data, "prefill", rf.name, "dict")
        table = []
        for i, r in enumerate(need(d, "scores", f"{rf.name}.prefill", "list")):
            w = f"{rf.name}.prefill.scores[{i}]"
            t = need(r, "tile", w, "dict")
            tile = ", ".join(f"{k} {v}" for k, v in t.items())
            if "error" in r:
                table.append([need(r, "fmt", w, "str"), need(r, "variant", w, "str"), tile, DASH, DASH,
                              "failed: " + str(r["error"])[:80]])
                continue
            table.append([need(r, "fmt", w, "str"), need(r, "variant", w, "str"), tile, f"{need(r, 'ms', w):.3f}",
                          sig(need(r, "tflops", w)), f"{need(r, 'check', w, 'str')}; {need(r, 'vs_decode', w, 'str')}"])
        sel = []
        for i, r in enumerate(need(d, "select", f"{rf.name}.prefill", "list")):
            w = f"{rf.name}.prefill.select[{i}]"
            if "ms" in r:
                width = opt(r, "table_width", w, "int")
                sel.append((f"in a {width}-block table, " if width else "")
                           + f"{need(r, 'num_warps', w, 'int')} warps{' (default)' if r.get('default') else ''}: "
                           f"{need(r, 'ms', w):.2f} ms"
                           + ("" if r.get("same_as_default", True) else " (SELECTION DIFFERS)"))
        title = (f"msa.scores on one {count(need(d, 'chunk', rf.name, 'int'))}-token chunk after "
                 f"{count(need(d, 'context', rf.name, 'int'))} tokens of context ({need(d, 'blocks', rf.name, 'int')} "
                 f"blocks, Hk {need(d, 'hk', rf.name, 'int')}, top-{need(d, 'topk', rf.name, 'int')})")
        body = md_table(["index-K", "variant", "tile", "ms", "TFLOP/s", "check; vs the decode tiling"], table) \
            if table else "(msa.select only: `--select-only`)"
        if sel:
            body += "\n\nmsa.select on the same rows: " + "; ".join(sel)
        blocks.append(file_block(title, body, rf))
    return "\n\n".join(blocks)


def render_attn_tma_ws_probe(files: list[ResultFile]) -> str:
    """bench/attn_prefill_tma_ws_probe.py: a TMA-fed flash-attention loop, with and without Triton's warp
    specialization, beside attn.prefill on the same chunk after the same context."""
    blocks = []
    for rf in files:
        d = rf.data
        table = []
        for i, r in enumerate(need(d, "variants", rf.name, "list")):
            w = f"{rf.name}.variants[{i}]"
            tile = (f"{need(r, 'block_m', w, 'int')} x {need(r, 'block_n', w, 'int')}, "
                    f"{need(r, 'num_warps', w, 'int')} warps, {need(r, 'num_stages', w, 'int')} stages")
            err = r.get("max_err")   # NaN is a measured outcome here (a miscompiled variant), not a bad file
            table.append([tile, "yes" if r.get("warp_specialize") else "no",
                          "—" if err is None else ("NaN" if err != err else f"{err:.2g}"),
                          or_dash(opt(r, "ms", w), lambda x: f"{x:.1f}"), or_dash(opt(r, "tflops", w), sig)]
                         + ([f"failed: {r['error'][:120]}"] if "error" in r else [""]))
        ap = need(d, "attn_prefill", rf.name, "dict")
        title = (f"TMA-fed attention loop vs attn.prefill: {count(need(d, 'n', rf.name, 'int'))} queries after "
                 f"{count(need(d, 'ctx', rf.name, 'int'))} keys (M3 TP1 dense layer)")
        body = md_table(["tiles", "warp_specialize=True", "max error (small case)", "ms", "TFLOP/s", ""], table)
        body += (f"\n\nattn.prefill (default tiles, the chunk's causal diagonal included): "
                 f"{need(ap, 'ms', rf.name):.1f} ms, {sig(need(ap, 'tflops', rf.name))} TFLOP/s")
        blocks.append(file_block(title, body, rf))
    return "\n\n".join(blocks)


def render_prefill_interference(files: list[ResultFile]) -> str:
    """bench/prefill_interference.py: per step budget, a long prompt's TTFT and the ITL of the streams beside it."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            itl, base = need(r, "itl_ms", w, "dict"), need(r, "baseline_itl_ms", w, "dict")
            table.append([need(r, "model", w, "str"), need(r, "quantization", w, "str"),
                          count(need(r, "prompt_tokens", w, "int")), count(need(r, "chunk", w, "int")),
                          count(need(r, "streams", w, "int")), ms(need(r, "ttft_s", w)),
                          count(need(r, "prefill_steps", w, "int")), sig(need(itl, "p50", w + ".itl_ms")),
                          sig(need(itl, "p99", w + ".itl_ms")), sig(need(base, "p50", w + ".baseline_itl_ms"))])
        headers = ["model", "weights", "prompt tokens", "step budget", "streams", "prompt TTFT (ms)", "prefill steps",
                   "stream ITL p50 (ms)", "stream ITL p99 (ms)", "ITL p50 before (ms)"]
        blocks.append(file_block("Chunked prefill beside decoding streams: the step budget (max_num_batched_tokens) "
                                 "trades the long prompt's TTFT against the streams' ITL", md_table(headers, table), rf))
    return "\n\n".join(blocks)


def render_spec_plain_step_cost(files: list[ResultFile]) -> str:
    """bench/spec_plain_step_cost.py: the plain engine's and the speculative engine's (policy: plain) decode steps."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            table.append([need(r, "engine", w, "str"), count(need(r, "batch", w, "int")),
                          sig(need(r, "median_ms", w)), sig(need(r, "p90_ms", w)), count(need(r, "steps", w, "int"))])
        blocks.append(file_block("Decode steps at a large batch, no server: the plain engine vs the speculative "
                                 "engine under its batch-size policy", md_table(["engine", "batch", "step median (ms)",
                                                                                "step p90 (ms)", "steps"], table), rf))
    return "\n\n".join(blocks)


def render_spec_serving_steps(files: list[ResultFile]) -> str:
    """bench/spec_serving_steps.py: the engine under a closed loop of C users, its steps by kind."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            kinds = need(r, "kinds", w, "dict")
            parts = []
            for name in sorted(kinds, key=lambda k: -need(kinds[k], "share", f"{w}.kinds.{k}")):
                kw = f"{w}.kinds.{name}"
                parts.append(f"{name} {need(kinds[name], 'share', kw) * 100:.0f} % "
                             f"({count(need(kinds[name], 'steps', kw, 'int'))} x {sig(need(kinds[name], 'median_ms', kw))} ms)")
            al = opt(r, "acceptance_length", w)
            builds = opt(r, "kernel_builds", w, "int")
            table.append([need(r, "engine", w, "str"), count(need(r, "users", w, "int")),
                          sig(need(r, "tokens_per_s_per_user", w)), sig(al) if al is not None else DASH,
                          "; ".join(parts), count(builds) if builds is not None else DASH])
        headers = ["engine", "users", "tok/s per user", "acceptance length", "time by step kind",
                   "kernel variants built in the loop"]
        if all(row[-1] == DASH for row in table):      # files from before the bench counted them
            headers, table = headers[:-1], [row[:-1] for row in table]
        blocks.append(file_block("The engine under a closed loop of C users (no server): tokens per second per user "
                                 "and where the loop's time goes, by kind of step (share of the time, steps x median)",
                                 md_table(headers, table), rf))
    return "\n\n".join(blocks)


def render_moe_decode_once(files: list[ResultFile]) -> str:
    """bench/moe_grouped.py --decode-once: one MoE layer at M3 dims, the in-register path vs the decode-once band."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            once = opt(r, "decode_once_total_ms", w)
            table.append([need(r, "fmt", w, "str"), count(need(r, "rows", w, "int")),
                          f"{need(r, 'in_register_total_ms', w):.2f}",
                          f"{once:.2f}" if once is not None else DASH,
                          f"{r['decode_once_decode_ms']:.2f}" if once is not None else DASH,
                          f"{r['decode_once_gemm_ms']:.2f}" if once is not None else DASH,
                          f"{r['speedup']:.2f}x" if once is not None else DASH])
        headers = ["experts", "tokens", "in-register (ms)", "decode-once (ms)", "of it decode", "of it GEMMs",
                   "speedup"]
        blocks.append(file_block("moe.grouped, one layer (E 128, H 6144, I 3072, top-4): the in-register decode vs "
                                 "decoding the experts once to bf16", md_table(headers, table), rf))
    return "\n\n".join(blocks)


def render_spec_target(files: list[ResultFile]) -> str:
    """bench/spec_target.py: the plain decode target vs SpecSteps graphs per model, batch and K, per user."""
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            mode = need(r, "mode", w, "str")
            forced = opt(r, "forced_al", w)
            al = opt(r, "acceptance_length", w)
            table.append((need(r, "model", w, "str"), need(r, "batch", w, "int"), need(r, "k", w, "int"), mode,
                          sig(need(r, "tokens_per_s_per_user", w)),
                          times(need(r, "speedup_vs_plain", w)) if mode == "spec" else DASH,
                          or_dash(al, sig) + (f" (forced {sig(forced)})" if forced is not None else ""),
                          yes_no(opt(r, "identical_to_plain", w, "bool")) if mode == "spec" and forced is None
                          else DASH))
        table.sort(key=lambda row: row[:3])
        headers = ["model", "batch", "K", "mode", "tok/s per user", "× vs plain", "acceptance length",
                   "greedy output identical"]
        temps = {opt(r, "temperature", f"{rf.name}.results[{i}]") for i, r in enumerate(rows_of(rf))} - {None, 0.0}
        how = f"sampled at temperature {', '.join(sig(t) for t in sorted(temps))}" if temps else "greedy"
        blocks.append(file_block(f"Eagle3 on the decode target (SpecSteps graphs) vs the plain decode target, {how}",
                                 md_table(headers, [list(r) for r in table]), rf))
    return "\n\n".join(blocks)


def render_spec_divergence(files: list[ResultFile]) -> str:
    """bench/spec_divergence.py: prompts whose speculative and plain greedy outputs part, and the target's top-2
    logit gap where they do."""
    blocks = []
    for rf in files:
        table = []
        for i, run in enumerate(need(rf.data, "runs", rf.name, "list")):
            w = f"{rf.name}.runs[{i}]"
            gaps = [sig(need(d, "gap", f"{w}.diffs[{j}]")) for j, d in enumerate(need(run, "diffs", w, "list"))]
            table.append([yes_no(need(run, "overlap", w, "bool")), need(run, "differing_prompts", w, "int"),
                          ", ".join(gaps) or DASH])
        caption = (f"Speculative vs plain greedy on the decode target: batch {need(rf.data, 'batch', rf.name, 'int')}, "
                   f"{need(rf.data, 'prompts', rf.name, 'int')} prompts")
        blocks.append(file_block(caption, md_table(["overlap loop", "prompts that differ",
                                                    "top-1 - top-2 logit gap at the first difference"], table), rf))
    return "\n\n".join(blocks)


def render_serve(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        meta = need(rf.data, "meta", rf.name, "dict")
        mw = f"{rf.name}.meta"
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            ttft, itl = need(r, "ttft_ms", w, "dict"), need(r, "itl_ms", w, "dict")
            table.append([need(r, "concurrency", w, "int"),
                          f"{need(r, 'completed', w, 'int')}/{need(r, 'requests', w, 'int')}",
                          need(r, "failed", w, "int"), sig(need(r, "output_tokens_per_s", w)),
                          sig(need(r, "total_tokens_per_s_per_gpu", w)),
                          f"{sig(need(ttft, 'p50', w + '.ttft_ms'))} / {sig(need(ttft, 'p90', w + '.ttft_ms'))}",
                          f"{sig(need(itl, 'p50', w + '.itl_ms'))} / {sig(need(itl, 'p90', w + '.itl_ms'))}",
                          sig(need(r, "interactivity_x90", w))])
        table.sort(key=lambda row: row[0])
        headers = ["concurrency", "completed", "failed", "output tok/s", "total tok/s per GPU",
                   "TTFT p50 / p90 ms", "ITL p50 / p90 ms", "tok/s per user (1000 / P90 ITL)"]
        caption = (f"Serving benchmark: model {need(meta, 'model', mw, 'str')}, workload "
                   f"{need(meta, 'workload', mw, 'str')}, {need(meta, 'input_len', mw, 'int')} input / "
                   f"{need(meta, 'output_len', mw, 'int')} output tokens")
        blocks.append(file_block(caption, md_table(headers, table), rf))
    return "\n\n".join(blocks)


def _run_mode(run: dict, where: str) -> str:
    """A serving run's mode, with the speculation policy and the prefill graphs when the run named them
    (bench/serve_pareto.py spec-auto, spec-always, -pg, -aw, -t8k, -pyd, -si)."""
    mode, policy = need(run, "mode", where, "str"), opt(run, "policy", where, "str")
    graphs = opt(run, "prefill_graph_tokens", where, "int")
    wait = opt(run, "admission_wait_ms", where)
    budget = opt(run, "max_num_batched_tokens", where, "int")
    rep = opt(run, "repeat", where, "int")
    frozen = opt(run, "gc_freeze", where, "bool")          # files since the server's interpreter settings
    switch = opt(run, "switch_interval_ms", where)
    notes = ([f"policy {policy}"] if policy else []) + ([f"prefill graphs to {graphs} tokens"] if graphs else []) \
        + ([f"admission wait {sig(wait)} ms"] if wait else []) + ([f"{budget}-token steps"] if budget else []) \
        + (["start-up heap not frozen"] if frozen is False else []) \
        + ([f"GIL switch interval {sig(switch)} ms"] if switch else []) + ([f"repeat {rep + 1}"] if rep else [])
    return f"{mode} ({', '.join(notes)})" if notes else mode


def render_serve_pareto(files: list[ResultFile]) -> str:
    """`m3serve bench pareto` files: several serving runs (model, plain / spec, weights) side by side."""
    blocks = []
    for rf in files:
        table = []
        for i, run in enumerate(need(rf.data, "runs", rf.name, "list")):
            w = f"{rf.name}.runs[{i}]"
            for j, r in enumerate(need(run, "results", w, "list")):
                wr = f"{w}.results[{j}]"
                ttft, itl = need(r, "ttft_ms", wr, "dict"), need(r, "itl_ms", wr, "dict")
                table.append([need(run, "model", w, "str"), _run_mode(run, w),
                              str(run.get("quantization") or "none"), need(r, "concurrency", wr, "int"),
                              need(r, "failed", wr, "int"), sig(need(r, "total_tokens_per_s_per_gpu", wr)),
                              f"{sig(need(ttft, 'p50', wr + '.ttft_ms'))} / {sig(need(ttft, 'p90', wr + '.ttft_ms'))}",
                              f"{sig(need(itl, 'p50', wr + '.itl_ms'))} / {sig(need(itl, 'p90', wr + '.itl_ms'))}",
                              sig(need(r, "interactivity_x90", wr)),
                              or_dash(opt(r, "interactivity_tpot_p90", wr), sig)])
        headers = ["model", "mode", "weights", "concurrency", "failed", "total tok/s per GPU", "TTFT p50 / p90 ms",
                   "ITL p50 / p90 ms", "tok/s per user (1000 / P90 ITL)", "tok/s per user (1000 / P90 TPOT)"]
        block = file_block("Serving sweeps (Pareto front file)", md_table(headers, table), rf)
        versus = _spec_vs_plain_table(rf)
        blocks.append(block + ("\n\n" + versus if versus else "") + caveat_note(rf))
    return "\n\n".join(blocks)


def _spec_vs_plain_table(rf: ResultFile) -> str:
    """bench/serve_pareto.py --repeats: each speculative mode beside its plain counterpart, medians over repeats."""
    cmp = opt(rf.data, "spec_vs_plain", rf.name, "list")
    if not cmp:
        return ""
    table = []
    for i, c in enumerate(cmp):
        w = f"{rf.name}.spec_vs_plain[{i}]"
        for j, r in enumerate(need(c, "levels", w, "list")):
            wr = f"{w}.levels[{j}]"
            reps = need(r, "repeats", wr, "list")
            table.append([need(c, "model", w, "str"), f"{need(c, 'spec_mode', w, 'str')} vs {need(c, 'plain_mode', w, 'str')}",
                          need(r, "concurrency", wr, "int"),
                          f"{sig(need(r, 'spec_per_user', wr))} / {sig(need(r, 'plain_per_user', wr))}",
                          ratio2(need(r, "per_user_ratio", wr)), ratio2(need(r, "tpot_p90_ratio", wr)),
                          ratio2(need(r, "total_ratio", wr)), " / ".join(str(x) for x in reps)])
    headers = ["model", "modes", "concurrency", "tok/s per user, spec / plain (output tok/s / users)", "ratio",
               "ratio of 1000 / P90 TPOT", "ratio of total tok/s", "runs (spec / plain)"]
    return (f"Speculation against plain serving in the same file (medians over "
            f"{need(rf.data, 'repeats', rf.name, 'int')} interleaved repeats):\n\n" + md_table(headers, table))


def render_eval_kv(files: list[ResultFile]) -> str:
    table = []
    for rf in files:
        d, n = rf.data, rf.name
        order = need(d, "order", n, "list")
        if len(order) != 2:
            raise ValueError(f"{n}.order: expected 2 configuration names, found {len(order)}")
        configs = need(d, "configs", n, "dict")
        scores = []
        for name in order:
            c = need(configs, _checked(name, f"{n}.order[]", "str"), f"{n}.configs", "dict")
            w = f"{n}.configs.{name}"
            exact, correct = need(c, "exact_match_strict", w), need(c, "correct_strict", w, "int")
            scores.append(f"{accuracy_pct(exact)} ({correct})")
        ws = f"{n}.paired.strict"
        strict = need(need(d, "paired", n, "dict"), "strict", f"{n}.paired", "dict")
        p = need(strict, "p_value", ws)
        agree = d.get("agreement") or {}
        agreement = (f"{accuracy_pct(need(agree, 'tokens', f'{n}.agreement'))} of "
                     f"{d.get('agreement_unit', 'tokens')}" if agree else "—")
        table.append([order[0], scores[0], order[1], scores[1], need(d, "n", n, "int"),
                      f"{need(strict, 'b', ws, 'int')} / {need(strict, 'c', ws, 'int')}",
                      p_value(p), "significant" if p < 0.05 else "not significant", agreement, code(n)])
    table.sort(key=lambda row: (row[0], row[2], row[-1]))
    headers = ["A", "A exact match (correct)", "B", "B exact match (correct)", "items",
               "discordant A-only / B-only", "McNemar exact p", "difference at 5 %", "greedy agreement", "file"]
    caption = "**Strict exact match of configuration A vs B on the same items**"
    return f"{caption}\n\n{md_table(headers, table)}\n\n" + "\n".join(f"- {source_line(rf)}" for rf in files)


def render_kv_rotation(files: list[ResultFile]) -> str:
    """bench/kv_rotation.py: attention-output error of NVFP4 vs BF16 KV per sparse layer, unrotated vs rotated;
    bench/kv_perhead_scales.py: round-trip MSE with per-tensor vs per-head global scales."""
    blocks = []
    for rf in files:
        d, n = rf.data, rf.name
        layers = need(d, "layers", n, "dict")
        if "preset" in d:
            table = []
            for layer, row in layers.items():
                w = f"{n}.layers.{layer}"
                plain, rot = need(row, "nvfp4", w, "dict"), need(row, "nvfp4_rotated", w, "dict")
                table.append([layer, f"{need(plain, 'attn_out_rel_err', w + '.nvfp4'):.4f}",
                              f"{need(rot, 'attn_out_rel_err', w + '.nvfp4_rotated'):.4f}",
                              f"{need(row, 'ratio_unrotated_over_rotated', w):.2f}x",
                              f"{need(plain, 'k_rel_err', w):.4f} / {need(rot, 'k_rel_err', w):.4f}",
                              f"{need(plain, 'v_rel_err', w):.4f} / {need(rot, 'v_rel_err', w):.4f}"])
            mean = need(d, "mean_attn_out_rel_err", n, "dict")
            table.append(["mean", f"{need(mean, 'nvfp4', n):.4f}", f"{need(mean, 'nvfp4_rotated', n):.4f}",
                          f"{need(d, 'mean_ratio_unrotated_over_rotated', n):.2f}x", "", ""])
            caption = (f"Attention-output error of NVFP4 vs BF16 KV, {need(d, 'preset', n, 'str')} "
                       f"({d.get('weights', 'random')} weights, {need(d, 'tokens', n, 'int')} tokens, D "
                       f"{need(d, 'head_dim', n, 'int')})")
            headers = ["sparse layer", "rel err NVFP4", "rel err rotated", "lower with rotation",
                       "K rel err (plain / rotated)", "V rel err (plain / rotated)"]
        else:
            table = [[key, f"{need(row, 'rel_mse_per_tensor_amax', n):.5f}", f"{need(row, 'rel_mse_per_head_amax', n):.5f}"]
                     for key, row in layers.items()]
            caption = "Rotated NVFP4 K/V round-trip relative MSE: per-tensor vs per-head global scale"
            headers = ["layer.tensor", "per-tensor amax", "per-head amax"]
        blocks.append(file_block(caption, md_table(headers, table), rf))
    return "\n\n".join(blocks)


def render_kv_smoothing(files: list[ResultFile]) -> str:
    """bench/kv_smoothing.py: NVFP4 attention-output error per sparse layer, plain / rotated / mean-smoothed /
    smoothed + rotated, and the share of K's and V's energy in their calibrated mean."""
    blocks = []
    variants = ("nvfp4", "nvfp4_rotated", "nvfp4_smoothed", "nvfp4_smoothed_rotated")
    for rf in files:
        d, n = rf.data, rf.name
        table = []
        for layer, row in need(d, "layers", n, "dict").items():
            w = f"{n}.layers.{layer}"
            errs = [need(need(row, v, w, "dict"), "attn_out_rel_err", f"{w}.{v}") for v in variants]
            rot, sm = need(row, "nvfp4_rotated", w, "dict"), need(row, "nvfp4_smoothed_rotated", w, "dict")
            mean = need(row, "mean_component", w, "dict")
            share = [need(need(mean, t, f"{w}.mean_component", "dict"), "mean_energy_share", f"{w}.mean_component.{t}")
                     for t in ("k", "v")]
            table.append([layer, *(f"{e:.4f}" for e in errs),
                          f"{need(row, 'ratio_rotated_over_smoothed_rotated', w):.2f}x",
                          f"{need(rot, 'k_rel_err', w):.4f} / {need(sm, 'k_rel_err', w):.4f}",
                          f"{need(rot, 'v_rel_err', w):.4f} / {need(sm, 'v_rel_err', w):.4f}",
                          f"{pct(share[0])} / {pct(share[1])}"])
        mean = need(d, "mean_attn_out_rel_err", n, "dict")
        table.append(["mean", *(f"{need(mean, v, n):.4f}" for v in variants),
                      f"{need(d, 'mean_ratio_rotated_over_smoothed_rotated', n):.2f}x", "", "", ""])
        meas = need(d, "measured", n, "dict")
        caption = (f"NVFP4 KV with per-(layer, head, channel) mean smoothing, {need(d, 'model', n, 'str')} "
                   f"({need(meas, 'items', f'{n}.measured', 'int')} measured chats, "
                   f"{need(meas, 'tokens', f'{n}.measured', 'int')} tokens, D {need(d, 'head_dim', n, 'int')}): "
                   f"attention-output rel err vs BF16 KV")
        headers = ["sparse layer", "plain", "rotated", "smoothed", "smoothed + rotated", "rotated / smoothed+rotated",
                   "K rel err (rotated / smoothed+rotated)", "V rel err (rotated / smoothed+rotated)",
                   "mean's energy share K / V"]
        blocks.append(file_block(caption, md_table(headers, table), rf))
    return "\n\n".join(blocks)


def render_generic(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        items = [[code(k), scalar_text(v)] for k, v in sorted(rf.data.items())
                 if v is None or isinstance(v, (str, int, float, bool))]
        blocks.append(file_block(f"{rf.name} (top-level fields; no dedicated formatter yet)",
                                 md_table(["field", "value"], items) if items else "(no scalar fields)", rf))
    return "\n\n".join(blocks)


# ------------------------------------------------------------------------------------------------ recognition

@dataclass(frozen=True)
class Kind:
    name: str
    title: str
    bench_keys: tuple[str, ...]     # values of "bench" / "benchmark" that name this kind
    name_patterns: tuple[str, ...]  # file-name globs
    has_keys: Callable[[dict], bool]
    render: Callable[[list[ResultFile]], str]


def _row_keys(data: dict, *keys: str) -> bool:
    rows = data.get("results")
    return (isinstance(rows, list) and bool(rows) and isinstance(rows[0], dict)
            and all(k in rows[0] for k in keys))


def render_sampler_host(files: list[ResultFile]) -> str:
    """bench/sampler_host.py: the sampler's device ops and host time per step, by case, at each vocabulary size."""
    blocks = []
    for rf in files:
        rows = rows_of(rf)
        table = []
        for i, r in enumerate(rows):
            w = f"{rf.name}.results[{i}]"
            table.append([need(r, "vocab", w, "int"), need(r, "case", w, "str"), need(r, "penalised_rows", w, "int"),
                          need(r, "ops_per_step", w, "int"), sig(need(r, "host_us_median", w))])
        table.sort(key=lambda row: (row[0], row[1]))
        text = md_table(["vocab", "case", "penalised rows", "device ops / step", "host µs / step (median)"], table)
        device = opt(rf.data, "device", rf.name, "str")
        caption = "Sampler per-step cost, batch " + str(opt(rf.data, "batch", rf.name) or "?") + \
            (f" ({device}; on CPU the host time includes the ops themselves)" if device == "cpu" else
             (f" ({device})" if device else ""))
        blocks.append(file_block(caption, text, rf))
    return "\n\n".join(blocks)


def render_kv_ablation(files: list[ResultFile]) -> str:
    """bench/kv_quant_ablation.py: exact match per storage plan against the exact (fp32) cache, McNemar's test."""
    blocks = []
    for rf in files:
        plans = need(rf.data, "plans", rf.name, "dict")
        table = []
        for name in sorted(plans):
            w = f"{rf.name}.plans.{name}"
            r = plans[name]
            table.append([name, f"{100 * need(r, 'exact_match', w):.1f} % ({need(r, 'correct', w, 'int')})",
                          f"{need(r, 'b', w, 'int')} / {need(r, 'c', w, 'int')}", p_value(need(r, "p_value", w))])
        text = md_table(["plan (what is quantized)", "exact match", "b / c vs exact", "McNemar p"], table)
        n = opt(rf.data, "n", rf.name)
        blocks.append(file_block(f"KV storage ablation on {n} held-out items (simulated formats)", text, rf))
    return "\n\n".join(blocks)


def render_kernel_variants(files: list[ResultFile]) -> str:
    """Per (group, case): the default variant's time, the fastest variant that passed its check, and how many
    variants failed their check or did not run."""
    blocks = []
    for rf in files:
        cases: dict[tuple[str, str], list[dict]] = {}
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            cases.setdefault((need(r, "group", w, "str"), need(r, "what", w, "str")), []).append(
                {"variant": need(r, "variant", w, "str"), "us": opt(r, "us", w), "frac": opt(r, "frac_copy", w),
                 "ok": bool(r.get("ok")), "default": bool(r.get("default")), "part": "launch" in r})
        table = []
        for (group, what), vs in cases.items():
            vs = [v for v in vs if not v["part"]]   # one launch of a multi-launch call is not a variant of it
            ran = [v for v in vs if v["ok"] and v["us"] is not None]
            base = next((v for v in vs if v["default"] and v["us"] is not None), None)
            best = min(ran, key=lambda v: v["us"], default=None)
            failed = sum(not v["ok"] for v in vs)
            table.append([group, what, or_dash(base and base["us"], sig), or_dash(base and base["frac"], pct),
                          best["variant"] if best else DASH, or_dash(best and best["us"], sig),
                          or_dash(best and best["frac"], pct), len(vs), failed])
        blocks.append(file_block("Kernel tile / schedule variants (default vs fastest that passed its check)",
                                 md_table(["group", "case", "default µs", "default % copy", "fastest variant", "µs",
                                           "% copy", "variants", "failed / not run"], table), rf, copy_bw_note(rf)))
    return "\n\n".join(blocks)


def render_stream_patterns(files: list[ResultFile]) -> str:
    blocks = []
    for rf in files:
        table = []
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            table.append([need(r, "rows_per_instr", w, "int"), need(r, "unroll", w, "int"), need(r, "order", w, "str"),
                          need(r, "ctas", w, "int"), sig(need(r, "us", w)), pct(need(r, "frac_copy", w))])
        blocks.append(file_block("Read-only streaming of a 24576 x 3072-byte matrix by access pattern",
                                 md_table(["rows per warp load", "loads per thread in flight", "order", "CTAs", "µs",
                                           "% of copy BW"], table), rf, copy_bw_note(rf)))
    return "\n\n".join(blocks)


def render_tiled_layout(files: list[ResultFile]) -> str:
    """bench/tiled_layout.py: per (shape, rows) the certified cell, the best row-major MMA GEMV and the best
    tiled one (write-flush goal figure; read flush and back to back beside it), and whether every tiled variant
    was bit-identical to its row-major twin."""
    blocks = []
    for rf in files:
        cases: dict[tuple, dict] = {}
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            key = (tuple(need(r, "shape", w, "list")), need(r, "rows", w, "int"))
            kind = "cell" if need(r, "variant", w, "str") == "cell" else "tiled" if r.get("tiled") else "row-major"
            c = cases.setdefault(key, {"same": True})
            if kind == "tiled":
                c["same"] &= bool(r.get("bit_identical_to_row_major"))
            f = need(r, "frac_copy_write_flush", w)
            if kind not in c or f > c[kind]["frac_copy_write_flush"]:
                c[kind] = r
        table = []
        for (shape, rows), c in cases.items():
            cells = []
            for kind in ("cell", "row-major", "tiled"):
                r = c.get(kind)
                cells += [or_dash(r and r["us_write_flush"], sig), or_dash(r and r["frac_copy_write_flush"], pct)]
            t = c.get("tiled")
            table.append([f"{shape[0]} x {shape[1]}", rows, *cells, t["variant"] if t else DASH,
                          or_dash(t and t["frac_copy_read_flush"], pct), or_dash(t and t["frac_copy_seq"], pct),
                          "yes" if c["same"] else "NO"])
        blocks.append(file_block("NVFP4 MMA GEMV: row-major vs the MMA tile layout (same weights, same run)",
                                 md_table(["shape (N x K)", "rows", "cell µs", "cell % copy", "row-major µs",
                                           "row-major % copy", "tiled µs", "tiled % copy", "best tiled variant",
                                           "tiled % (read flush)", "tiled % (back to back)", "bit-identical"],
                                          table), rf, copy_bw_note(rf)))
    return "\n\n".join(blocks)


# Section order in the README; the generic kind comes first in recognition (below) so that a known-but-unschemaed
# file never trips a dedicated formatter.
KINDS = (
    Kind("decode", "Decode step", ("decode",), ("decode-*.json",),
         lambda d: _row_keys(d, "route", "median_s", "batch"), render_decode),
    Kind("attention", "Attention", ("attention",), ("attention-*.json",),
         lambda d: _row_keys(d, "entry", "query_tokens", "us") or (bool(d.get("decode_step"))
                                                                   and d.get("results") == []), render_attention),
    Kind("paged_attention", "Paged attention kernel", (), ("paged-attention-*.json",),
         lambda d: _row_keys(d, "point", "num_splits", "us"), render_paged_attention),
    Kind("moe_decode_once", "MoE decode-once band", (), ("kernels-moe-grouped-decode-once*.json",),
         lambda d: _row_keys(d, "fmt", "in_register_total_ms"), render_moe_decode_once),
    Kind("kernels", "Kernels", ("kernels",), ("kernels-*.json",),
         lambda d: "goals" in d and _row_keys(d, "entry", "shape", "frac_copy"), render_kernels),
    Kind("kernel_variants", "Kernel variants", (), ("kernel-variants*.json",),
         lambda d: _row_keys(d, "group", "variant", "what"), render_kernel_variants),
    Kind("gemv_variants", "GEMV variants", ("gemv_variants",), ("gemv_variants-*.json",),
         lambda d: "summary" in d and _row_keys(d, "entry", "variant", "frac_copy"), render_gemv_variants),
    Kind("host_overhead", "Host overhead", ("host_overhead",), ("host_overhead-*.json",),
         lambda d: _row_keys(d, "per_request_us", "context"), render_host_overhead),
    Kind("host_stream_cost", "Host cost per stream", ("host_stream_cost",), ("host_stream_cost-*.json",),
         lambda d: isinstance(d.get("points"), list), render_host_stream_cost),
    Kind("tp", "Tensor parallelism", ("tp",), ("tp-*.json",),
         lambda d: {"tp1", "tp2", "decode_speedup_tp2_over_tp1"} <= d.keys(), render_tp),
    Kind("prefill_interference", "Prefill beside decoding streams", ("prefill_interference",),
         ("prefill-interference-*.json",), lambda d: _row_keys(d, "baseline_itl_ms", "chunk"),
         render_prefill_interference),
    Kind("prefill_attention_variants", "attn.prefill tile configs", ("prefill_attention_variants",), (),
         lambda d: False, render_prefill_attention_variants),
    Kind("msa_scores_prefill", "MSA indexer at a long prefill chunk", ("msa_index_bw",), ("msa-scores-prefill-*.json",),
         lambda d: isinstance(d.get("prefill"), dict) and "scores" in d["prefill"], render_msa_scores_prefill),
    Kind("memory_plan_startup", "Memory plan at start-up", ("memory_plan_startup",), ("memory-plan-startup-*.json",),
         lambda d: _row_keys(d, "planned_working_bytes", "measured_working_bytes"), render_memory_plan_startup),
    Kind("generate_main_job", "The main job", ("generate_main_job",), ("generate-*.json",),
         lambda d: isinstance(d.get("runs"), list) and "generate_args" in d, render_generate_main_job),
    Kind("attn_prefill_tma_ws_probe", "TMA and warp specialization probe for attn.prefill",
         ("attn_prefill_tma_ws_probe",), ("attn-prefill-tma-ws-probe-*.json",),
         lambda d: isinstance(d.get("variants"), list) and "attn_prefill" in d, render_attn_tma_ws_probe),
    Kind("prefill", "Prefill", ("prefill",), ("prefill-*.json",),
         lambda d: _row_keys(d, "engine", "ttft_s", "tokens"), render_prefill),
    Kind("spec_decode", "Speculative decoding", ("spec_decode",), ("spec-decode-*.json",),
         lambda d: _row_keys(d, "plain_tok_s", "spec_tok_s"), render_spec_decode),
    Kind("spec_target", "Speculative decoding on the decode target", ("spec_target",), ("spec-target-*.json",),
         lambda d: _row_keys(d, "mode", "tokens_per_s_per_user", "k"), render_spec_target),
    Kind("spec_plain_step_cost", "Speculative engine's plain steps", ("spec_plain_step_cost",),
         ("spec-plain-step-cost-*.json",), lambda d: _row_keys(d, "engine", "median_ms", "p90_ms"),
         render_spec_plain_step_cost),
    Kind("spec_serving_steps", "Speculative serving, step by step", ("spec_serving_steps",),
         ("spec-serving-steps-*.json",), lambda d: _row_keys(d, "engine", "users", "kinds"), render_spec_serving_steps),
    Kind("spec_divergence", "Speculative vs plain greedy", ("spec_divergence",), ("spec-divergence-*.json",),
         lambda d: isinstance(d.get("runs"), list), render_spec_divergence),
    Kind("serve_pareto", "Serving sweeps", ("serve_pareto",), ("serve-pareto-*.json",),
         lambda d: isinstance(d.get("runs"), list) and all("mode" in r for r in d["runs"]), render_serve_pareto),
    Kind("serve", "Serving", ("serve",), ("serve-*.json",),
         lambda d: "meta" in d and _row_keys(d, "concurrency", "itl_ms"), render_serve),
    Kind("sampler_host", "Sampler cost per step", ("sampler_host",), ("sampler_host-*.json",),
         lambda d: _row_keys(d, "ops_per_step", "case"), render_sampler_host),
    Kind("kv_ablation", "KV storage ablation", (), ("kv-quant-ablation*.json",),
         lambda d: "plans" in d, render_kv_ablation),
    Kind("eval_kv", "Accuracy of two configurations (KV formats, stock vs target)", (), ("eval-*.json",),
         lambda d: {"configs", "paired", "order"} <= d.keys(), render_eval_kv),
    Kind("stream_patterns", "Weight streaming by access pattern", (), ("stream-patterns-*.json",),
         lambda d: _row_keys(d, "rows_per_instr", "unroll"), render_stream_patterns),
    Kind("tiled_layout", "NVFP4 MMA tile layout", (), ("tiled-layout-*.json",),
         lambda d: _row_keys(d, "tiled", "frac_copy_write_flush"), render_tiled_layout),
    Kind("kv_smoothing", "NVFP4 KV mean smoothing: attention-output error", (), ("kv-smoothing-*.json",),
         lambda d: isinstance(d.get("layers"), dict) and "mean_ratio_rotated_over_smoothed_rotated" in d,
         render_kv_smoothing),
    Kind("kv_rotation", "NVFP4 KV rotation: attention-output error and global-scale granularity", (),
         ("kv-rotation-*.json", "kv-perhead-scales-*.json"), lambda d: isinstance(d.get("layers"), dict),
         render_kv_rotation),
    Kind("generic", "Other results", (), ("server-hardening*.json",),
         lambda d: False, render_generic),
)
KIND_BY_NAME = {k.name: k for k in KINDS}


def recognise(rf: ResultFile) -> Kind | None:
    """The kind of a results file, or None. Order: the generic file names, then a 'bench' / 'benchmark' value,
    then the file-name pattern, then the keys present."""
    data, base = rf.data, rf.name.rsplit("/", 1)[-1]
    if not isinstance(data, dict):
        return None
    generic = KIND_BY_NAME["generic"]
    if any(fnmatch.fnmatchcase(base, p) for p in generic.name_patterns):
        return generic
    tag = data.get("bench", data.get("benchmark"))
    for steps in (lambda k: tag in k.bench_keys,
                  lambda k: any(fnmatch.fnmatchcase(base, p) for p in k.name_patterns),
                  lambda k: k.has_keys(data)):
        for kind in KINDS:
            if steps(kind):
                return kind
    return None


def load_results(results_dir: Path) -> tuple[list[ResultFile], list[str]]:
    """Every *.json under results_dir except logs/ and reverted/, sorted by path; unreadable JSON is reported, not raised."""
    if not results_dir.is_dir():
        state = "not a folder" if results_dir.exists() else "missing"
        raise ValueError(f"results_dir: expected a folder, found {results_dir} ({state})")
    files, broken = [], []
    for path in sorted(results_dir.rglob("*.json")):
        rel = path.relative_to(results_dir)
        if rel.parts[0] in SKIPPED_DIRS and len(rel.parts) > 1:
            continue
        try:
            files.append(ResultFile(rel.as_posix(), json.loads(path.read_text())))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            broken.append(f"{code(rel.as_posix())} (not valid JSON: {type(e).__name__})")
    return files, broken


def render_report(results_dir: Path = RESULTS_DIR) -> str:
    """The markdown between the README markers (without the marker lines), deterministic for a given folder."""
    files, unrendered = load_results(results_dir)
    by_kind: dict[str, list[ResultFile]] = {}
    for rf in files:
        kind = recognise(rf)
        if kind is None:
            unrendered.append(f"{code(rf.name)} (unrecognised)")
        else:
            by_kind.setdefault(kind.name, []).append(rf)
    sections = [GENERATED_NOTE]
    for kind in KINDS:
        if kind.name in by_kind:
            sections.append(f"### {kind.title}\n\n{kind.render(by_kind[kind.name])}")
    if unrendered:
        sections.append("unrendered results: " + ", ".join(sorted(unrendered)))
    return "\n\n".join(sections)


def _prefill_summary(rf: ResultFile) -> list[list[str]]:
    """Each m3serve TTFT of a prefill file, beside transformers' BF16 TTFT at the same length when the same run
    measured it."""
    rows, hf = [], {}
    for i, r in enumerate(rows_of(rf)):
        w = f"{rf.name}.results[{i}]"
        if need(r, "engine", w, "str") == "transformers" and opt(r, "ttft_s", w) is not None:
            hf[need(r, "tokens", w, "int")] = r["ttft_s"]
    for i, r in enumerate(rows_of(rf)):
        w = f"{rf.name}.results[{i}]"
        ttft = opt(r, "ttft_s", w)
        if need(r, "engine", w, "str") != "m3serve" or ttft is None:
            continue
        n = need(r, "tokens", w, "int")
        vs = f" ({sig(ttft / hf[n], 2)}x transformers' BF16 {ms(hf[n])} ms, same run)" if n in hf else ""
        q = need(r, "quantization", w, "str")
        graphs = opt(r, "prefill_graph_tokens", w, "int")
        layout = opt(r, "weight_layout", w, "str")
        sparse = opt(r, "sparse_prefill", w, "str")
        rows.append([f"prefill TTFT, {count(n)} tokens, {'BF16' if q == 'none' else q.upper()} weights"
                     + (f" ({'MMA tile' if layout == 'mma_tile' else 'row-major'} layout)" if layout else "")
                     + (", prefill graphs" if graphs else "")
                     + (f", {SPARSE_PREFILL.get(sparse, 'sparse_prefill ' + sparse)}" if sparse else "")
                     + _fp8_context(r, w),
                     need(r, "model", w, "str"), f"{ms(ttft)} ms{vs}", code(rf.name)])
    return rows


def _generate_summary(rf: ResultFile) -> list[list[str]]:
    """The main job's warm run (the Triton cache a first run left): load time and decode tok/s."""
    rows = []
    for i, r in enumerate(need(rf.data, "runs", rf.name, "list")):
        w = f"{rf.name}.runs[{i}]"
        if need(r, "triton_cache", w, "str") == "warm":
            rows.append(["`m3serve generate` (no arguments), warm Triton cache", "embedded model",
                         f"load {sig(need(r, 'load_s', w))} s, {sig(need(r, 'tok_s', w))} tok/s "
                         f"({count(need(r, 'tokens', w, 'int'))} tokens)", code(rf.name)])
    return rows[:1]



def _race_summary(rf: ResultFile) -> list[list[str]]:
    """A sampled decode file with the sampling variant on sample.race (route target) beside the torch sampler
    (target-torch-sampler): the step-time ratio per batch, both routes on one engine."""
    rows = rows_of(rf)
    steps = {(need(r, "route", rf.name, "str"), need(r, "batch", rf.name, "int")): need(r, "median_s", rf.name)
             for r in rows}
    batches = sorted(b for route, b in steps if route == "target" and ("target-torch-sampler", b) in steps)
    if not batches:
        return []
    model = need(rows[0], "model", rf.name, "str")
    sampling = need(rf.data, "sampling", rf.name, "dict")
    temp, top_p = need(sampling, "temperature", rf.name), opt(sampling, "top_p", rf.name)
    how = f"temperature {sig(temp)}" + (f", top-p {sig(top_p)}" if top_p is not None and top_p < 1 else "")
    ratios = " / ".join(times(steps[("target", b)] / steps[("target-torch-sampler", b)]) for b in batches)
    b0 = batches[0]
    return [[f"sampled decode step ({how}), sample.race vs the torch sampler", model,
             f"{ratios} the step time at batch {' / '.join(str(b) for b in batches)} ({ms(steps[('target', b0)])} vs "
             f"{ms(steps[('target-torch-sampler', b0)])} ms at batch {b0}, {_gpu(rf.data)})", code(rf.name)]]


def _serve_summary(rf: ResultFile, concurrency: int = 64) -> list[list[str]]:
    """Each run of a Pareto file at `concurrency` users: ITL p50, per-user tok/s (1 / P90 TPOT), total tok/s."""
    rows = []
    for i, run in enumerate(need(rf.data, "runs", rf.name, "list")):
        w = f"{rf.name}.runs[{i}]"
        for j, r in enumerate(need(run, "results", w, "list")):
            wr = f"{w}.results[{j}]"
            if need(r, "concurrency", wr, "int") != concurrency:
                continue
            per_user = opt(r, "interactivity_tpot_p90", wr)
            rows.append([f"served, {_run_mode(run, w)}, {concurrency} users",
                         f"{need(run, 'model', w, 'str')} ({_weights(run.get('quantization'))} weights)",
                         f"ITL p50 {sig(need(need(r, 'itl_ms', wr, 'dict'), 'p50', wr + '.itl_ms'))} ms, "
                         + (f"{sig(per_user)} tok/s per user, " if per_user is not None else "")
                         + f"{sig(need(r, 'total_tokens_per_s_per_gpu', wr))} tok/s in all", code(rf.name)])
    return rows


def _weights(quantization: str | None) -> str:
    """A serving run's weight format for a summary row: no quantization ("none" or absent) is BF16."""
    return "BF16" if quantization in (None, "none") else quantization.upper()


def _spec_vs_plain_summary(rf: ResultFile) -> list[list[str]]:
    """A file of interleaved repeats: per speculative mode, its per-user ratio to plain at every level and the total
    ratio at 64 users (else the highest level) (the medians bench/serve_pareto.py wrote)."""
    rows = []
    for i, c in enumerate(opt(rf.data, "spec_vs_plain", rf.name, "list") or []):
        w = f"{rf.name}.spec_vs_plain[{i}]"
        levels = need(c, "levels", w, "list")
        if not levels:
            continue
        per_user = ", ".join(f"{ratio2(need(r, 'per_user_ratio', w))} at {need(r, 'concurrency', w, 'int')}"
                             for r in levels)
        top = next((r for r in levels if r.get("concurrency") == 64), levels[-1])    # 64: the serving goals' level
        rows.append([f"served, {need(c, 'spec_mode', w, 'str')} vs {need(c, 'plain_mode', w, 'str')}, medians of "
                     f"{need(rf.data, 'repeats', rf.name, 'int')} interleaved repeats",
                     f"{need(c, 'model', w, 'str')} ({_weights(c.get('quantization'))} weights)",
                     f"tok/s per user {per_user} users; total tok/s {ratio2(need(top, 'total_ratio', w))} at "
                     f"{need(top, 'concurrency', w, 'int')}", code(rf.name)])
    return rows


def render_summary(results_dir: Path = RESULTS_DIR) -> str:
    """The README's headline figures (without the marker lines): per model, the fastest decode step measured at
    batch 1 on a routed path (the product's routes: not bench/decode.py's side-by-side VARIANT_ROUTES) and the best
    speculative speedup at batch 1; every accuracy comparison. Each row
    names its file; the full tables are in docs/results.md."""
    files, _ = load_results(results_dir)
    best: dict[tuple[str, str], tuple[float, list[Any]]] = {}
    for rf in files:
        kind = recognise(rf)
        if kind is None or kind.name not in ("decode", "spec_target"):
            continue
        for i, r in enumerate(rows_of(rf)):
            w = f"{rf.name}.results[{i}]"
            if need(r, "batch", w, "int") != 1:
                continue
            if kind.name == "decode":
                route = need(r, "route", w, "str")
                if route == "off" or route in VARIANT_ROUTES:
                    continue
                model = r.get("model") or opt(rf.data, "preset", rf.name, "str") or NOT_RECORDED
                value = need(r, "tokens_per_s", w)
                row = [f"decode step, batch 1, route {route}", model, f"{sig(value)} tok/s", code(rf.name)]
            else:
                speedup = opt(r, "speedup_vs_plain", w)
                if need(r, "mode", w, "str") != "spec" or speedup is None:
                    continue
                model, value = need(r, "model", w, "str"), speedup
                row = [f"Eagle3 on the target, batch 1, K = {need(r, 'k', w, 'int')}", model,
                       f"{times(value)} tok/s per user vs plain", code(rf.name)]
            key = (kind.name, model)
            if key not in best or value > best[key][0]:
                best[key] = (value, row)
    rows = [row for _, (_, row) in sorted(best.items())]
    for rf in files:
        kind = recognise(rf)
        if kind is not None and kind.name == "prefill":
            rows += _prefill_summary(rf)
        elif kind is not None and kind.name == "generate_main_job":
            rows += _generate_summary(rf)
        elif kind is not None and kind.name == "serve_pareto":
            rows += _serve_summary(rf) + _spec_vs_plain_summary(rf)
        elif kind is not None and kind.name == "decode":
            rows += _race_summary(rf)
    for rf in files:
        kind = recognise(rf)
        if kind is not None and kind.name == "eval_kv":
            d, n = rf.data, rf.name
            order = need(d, "order", n, "list")
            configs = need(d, "configs", n, "dict")
            scores = [accuracy_pct(need(need(configs, c, f"{n}.configs", "dict"), "exact_match_strict",
                                        f"{n}.configs.{c}")) for c in order]
            p = need(need(need(d, "paired", n, "dict"), "strict", f"{n}.paired", "dict"), "p_value", f"{n}.paired.strict")
            rows.append([f"accuracy, {need(d, 'n', n, 'int')} items", f"{order[0]} vs {order[1]}",
                         f"{scores[0]} vs {scores[1]} exact match (p {p_value(p)})", code(n)])
    return "\n\n".join([SUMMARY_NOTE, md_table(["figure", "configuration", "measured", "file"], rows)])


# ------------------------------------------------------------------------------------------------- the README

def _marker_lines(lines: list[str], marker: str, path: str) -> int:
    found = [i for i, line in enumerate(lines) if line.strip() == marker]
    if len(found) != 1:
        raise ValueError(f"{path}: expected exactly one line '{marker}', found {len(found)}")
    return found[0]


def split_block(text: str, path: str = "README", markers: tuple[str, str] = (BEGIN_MARKER, END_MARKER)
                ) -> tuple[list[str], list[str], list[str]]:
    """(lines up to and including the begin marker, the block's lines, lines from the end marker on)."""
    lines = text.split("\n")
    (bm, em) = markers
    begin, end = _marker_lines(lines, bm, path), _marker_lines(lines, em, path)
    if end < begin:
        raise ValueError(f"{path}: '{em}' (line {end + 1}) comes before '{bm}' (line {begin + 1})")
    return lines[:begin + 1], lines[begin + 1:end], lines[end:]


def replace_block(text: str, block: str, path: str = "README",
                  markers: tuple[str, str] = (BEGIN_MARKER, END_MARKER)) -> str:
    head, _, tail = split_block(text, path, markers)
    return "\n".join(head + block.split("\n") + tail)


def block_diff(text: str, block: str, path: str = "README",
               markers: tuple[str, str] = (BEGIN_MARKER, END_MARKER)) -> str:
    """Unified diff from the file's block to the generated one; empty when they agree."""
    _, current, _ = split_block(text, path, markers)
    return "\n".join(difflib.unified_diff(current, block.split("\n"), f"{path} (block)", "bench/results (generated)",
                                          lineterm=""))


BLOCKS = (((BEGIN_MARKER, END_MARKER), render_report), ((SUMMARY_BEGIN_MARKER, SUMMARY_END_MARKER), render_summary))


def generated_blocks(text: str, results_dir: Path, path: str) -> list[tuple[tuple[str, str], str]]:
    """(markers, generated block) for every generated block `text` has; the full tables' marker errors when it
    has none (so a file without markers is told which lines to add)."""
    lines = {line.strip() for line in text.split("\n")}
    found = [(markers, render(results_dir)) for markers, render in BLOCKS if markers[0] in lines or markers[1] in lines]
    if not found:
        split_block(text, path)   # raises, naming the missing markers
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="results folder (default: bench/results)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="README", type=Path, help="replace the block between the markers")
    mode.add_argument("--check", metavar="README", type=Path, help="exit 1 if the block differs from the results")
    args = ap.parse_args(argv)
    try:
        if args.write is None and args.check is None:
            print(render_report(args.results))
            return 0
        path = args.write or args.check
        text = path.read_text()
        blocks = generated_blocks(text, args.results, str(path))
        if args.check is not None:
            diff = "\n".join(d for markers, block in blocks if (d := block_diff(text, block, str(path), markers)))
            if diff:
                print(f"{path}: the measured block differs from bench/results (run "
                      f"`python bench/report.py --write {path}`):\n{diff}", file=sys.stderr)
                return 1
            print(f"{path}: measured block matches bench/results")
            return 0
        new = text
        for markers, block in blocks:
            new = replace_block(new, block, str(path), markers)
        if new != text:
            path.write_text(new)
        print(f"{path}: measured block {'rewritten' if new != text else 'already up to date'}")
        return 0
    except (ValueError, TypeError, OSError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
