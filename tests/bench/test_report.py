"""bench/report.py turns bench/results/<bench>/*.json into docs/results.md's tables and the README's headline block.

Each formatter is fed a synthetic results file (written to a tmp folder, rows deliberately out of order) and the
rendered markdown is checked cell by cell against figures worked out by hand from the synthetic values; the
number formatter is checked on random values against its contract (digits, error bound). The CLI's --write /
--check round trip (one file with both blocks), the marker errors, unrecognised / broken files and bad fields are
exercised, and the real README and docs/results.md blocks must match the real results folder (a hand-edited figure
fails here). Pure Python, about 1 s.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = mod      # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


PROVENANCE = {"commit": "0123456789abcdef0123456789abcdef01234567", "gpu": "NVIDIA H200",
              "date": "2026-12-01T10:20:30+00:00"}


def write(folder: Path, name: str, data) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def table_rows(markdown: str, first_header: str) -> list[list[str]]:
    """The body rows of the first table whose first header cell is `first_header`."""
    lines = markdown.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def headers_of(markdown: str, first_header: str) -> list[str]:
    line = next(line for line in markdown.split("\n") if line.startswith(f"| {first_header} |"))
    return [c.strip() for c in line.strip("|").split(" | ")]


# ------------------------------------------------------------------------------------------------- numbers

def test_sig_keeps_the_requested_digits_on_random_values(report):
    """Contract: `digits` significant digits for |x| < 10**digits (whole integer part above), round half up
    on the decimal text, error at most half a unit in the last kept place."""
    rng = random.Random(1234)
    for _ in range(2000):
        x = rng.choice([-1, 1]) * 10 ** rng.uniform(-5, 6)
        digits = rng.choice([1, 2, 3, 4])
        text = report.sig(x, digits)
        assert "e" not in text.lower(), text
        mag = math.floor(math.log10(abs(x)))
        last_place = 10.0 ** min(mag - digits + 1, 0)   # units once the integer part has `digits` digits
        assert abs(float(text) - x) <= 0.5 * last_place * (1 + 1e-9) + 1e-12, (x, digits, text)
        significant = text.lstrip("-").replace(".", "").lstrip("0")
        if abs(x) < 10 ** (digits - 1):   # below that the integer part alone has more digits
            assert len(significant) == digits, (x, digits, text)


@pytest.mark.parametrize("x,digits,want", [(0.0773719, 3, "0.0774"), (77.37, 3, "77.4"), (189.27, 3, "189"),
                                           (2.25, 2, "2.3"), (9.996, 3, "10.0"), (0.99995, 2, "1.0"),
                                           (14335.6, 3, "14336"), (0, 3, "0"), (-0.00123456, 2, "-0.0012")])
def test_sig_known_values(report, x, digits, want):
    assert report.sig(x, digits) == want


@pytest.mark.parametrize("frac,want", [(0.3583, "36 %"), (0.745, "75 %"), (0.0064, "0.6 %"), (0.005, "0.5 %"),
                                       (0.00996, "1 %"), (0.0, "0 %"), (1.0, "100 %")])
def test_percent(report, frac, want):
    assert report.pct(frac) == want


# ------------------------------------------------------------------------------------------------- formatters

def decode_target_file():
    """The decode-target schema: three routes, two batches, rows shuffled."""
    def row(route, batch, median_s, busy_s, launches, agree):
        return {"model": "minimax-m3:5", "route": route, "batch": batch, "context": 512, "median_s": median_s,
                "tokens_per_s": batch / median_s, "gpu_busy_s": busy_s, "launches_per_step": launches,
                "fraction_of_roofline": 0.0123 * (1 if route == "off" else 3),
                "greedy_agreement_vs_off": agree}
    rows = [row("target", 8, 0.0125, 0.0112, 3.25, 0.9375), row("off", 1, 0.0774, 0.05, 4100.0, None),
            row("auto", 1, 0.0359, 0.021, 950.0, 1.0), row("target", 1, 0.0155, 0.0141, 2.0, 1.0),
            row("off", 8, 0.1893, 0.12, 4120.0, None), row("auto", 8, 0.0693, 0.04, 960.0, 0.96875)]
    return {"bench": "decode", **PROVENANCE, "command": "python bench/decode.py --models minimax-m3:5",
            "copy_bandwidth_Bps": 4.19e12, "quantization": "nvfp4", "kv_cache_dtype": "nvfp4",
            "results": rows}


def test_decode_target_schema(report, tmp_path):
    write(tmp_path, "decode-target-h200.json", decode_target_file())
    out = report.render_report(tmp_path)
    assert headers_of(out, "model") == ["model", "batch", "context", "route", "ms/step", "tok/s", "GPU busy ms",
                                        "launches/step", "% of roofline", "speedup vs off",
                                        "greedy agreement vs off"]
    rows = table_rows(out, "model")
    assert [(r[1], r[3]) for r in rows] == [("1", "off"), ("1", "auto"), ("1", "target"),
                                            ("8", "off"), ("8", "auto"), ("8", "target")]
    # batch 1, target: 15.5 ms, 1/0.0155 = 64.5 tok/s, busy 14.1 ms, 2 launches, 3.69 % -> 4 %, 77.4/15.5 = 5.0x
    assert rows[2] == ["minimax-m3:5", "1", "512", "target", "15.5", "64.5", "14.1", "2", "4 %", "5.0×", "100 %"]
    assert rows[0][-2:] == ["—", "—"]                               # off is the baseline
    assert rows[5][7:] == ["3.25", "4 %", "15×", "94 %"]             # 3.69 %; 189.3/12.5 = 15.1; 0.9375
    assert rows[3][8] == "1 %"                                          # off: 1.23 %
    assert "**minimax-m3:5: routes off, auto, target (NVFP4 weights, nvfp4 KV for presets), greedy**" in out
    assert ("source `decode-target-h200.json` · NVIDIA H200 · commit 0123456789ab · 2026-12-01 10:20 UTC · "
            "copy bandwidth 4.19 TB/s · `python bench/decode.py --models minimax-m3:5`") in out
    sampled = decode_target_file()
    sampled["sampling"] = {"temperature": 1.0, "top_p": 0.9, "top_k": 0, "seed": 1}
    write(tmp_path, "decode-target-sampled-h200.json", sampled)
    out = report.render_report(tmp_path)
    assert "for presets), sampled: temperature 1.0, top_p 0.9, top_k 0**" in out
    tiny = decode_target_file()
    for r in tiny["results"]:
        r["model"] = "m3-tiny-verse"
    write(tmp_path, "decode-target-tiny-h200.json", tiny)
    # the embedded model is BF16 whatever the file's preset flags say: they are left out of its caption
    assert "**m3-tiny-verse: routes off, auto, target, greedy**" in report.render_report(tmp_path)


def test_decode_gpu_time_by_class(report, tmp_path):
    """A file whose rows carry gpu_s_by_class gets one more column, classes by time, largest first."""
    f = decode_target_file()
    f["results"][2]["gpu_s_by_class"] = {"attention": 0.0003, "moe": 0.0021, "gemm": 0.0014}
    write(tmp_path, "decode-target-h200.json", f)
    out = report.render_report(tmp_path)
    assert headers_of(out, "model")[-1] == "GPU ms per step by kernel class"
    rows = table_rows(out, "model")
    assert sorted(r[-1] for r in rows) == ["moe 2.10, gemm 1.40, attention 0.300"] + ["—"] * 5


def test_decode_old_schema_takes_the_model_from_the_preset(report, tmp_path):
    rows = [{"route": r, "batch": 4, "context": 1024, "median_s": s, "tokens_per_s": 4 / s,
             "fraction_of_roofline": 0.0085} for r, s in (("auto", 0.0693), ("off", 0.1893))]
    write(tmp_path, "decode-h200-old.json", {"bench": "decode", "preset": "minimax-m3:8", "results": rows,
                                             "commit": "abc1234", "date": "2026-11-30T07:39:38.493628"})
    out = report.render_report(tmp_path)
    assert headers_of(out, "model") == ["model", "batch", "context", "route", "ms/step", "tok/s", "% of roofline",
                                        "speedup vs off"]
    assert table_rows(out, "model") == [["minimax-m3:8", "4", "1024", "off", "189", "21.1", "0.9 %", "—"],
                                        ["minimax-m3:8", "4", "1024", "auto", "69.3", "57.7", "0.9 %", "2.7×"]]
    assert "GPU not recorded · commit abc1234 · 2026-11-30 07:39 · command not recorded" in out


def test_attention_schema(report, tmp_path):
    data = {**PROVENANCE, "command": "python bench/attention.py", "copy_bandwidth_Bps": 4.2e12,
            "results": [{"entry": "attn.paged", "batch": 8, "context": 4096, "query_tokens": 1, "us": 41.26,
                         "bytes": 1, "frac_copy": 0.614, "tflops": 12.345},
                        {"entry": "attn.paged", "batch": 1, "context": 4096, "query_tokens": 1, "us": 9.871,
                         "bytes": 1, "frac_copy": 0.2049},
                        {"entry": "attn.prefill", "batch": 1, "context": 2048, "query_tokens": 2048, "us": 812.4,
                         "bytes": 1, "frac_copy": 0.0304, "tflops": 301.7}],
            "decode_step": [{"model": "m3-tiny-verse", "context": 512, "batch": 8, "median_s": 0.004567},
                            {"model": "m3-tiny-verse", "context": 512, "batch": 1, "median_s": 0.003011}]}
    write(tmp_path, "attention-h200.json", data)
    out = report.render_report(tmp_path)
    assert headers_of(out, "entry") == ["entry", "batch", "context", "query tokens", "µs", "% of copy BW", "TFLOP/s"]
    assert table_rows(out, "entry") == [["attn.paged", "1", "4096", "1", "9.87", "20 %", "—"],
                                        ["attn.paged", "8", "4096", "1", "41.3", "61 %", "12.3"],
                                        ["attn.prefill", "1", "2048", "2048", "812", "3 %", "302"]]
    assert table_rows(out, "model") == [["m3-tiny-verse", "512", "1", "3.01"], ["m3-tiny-verse", "512", "8", "4.57"]]


def kernels_file():
    def row(entry, shape, rows, us, frac, stock):
        return {"entry": entry, "shape": shape, "rows": rows, "us": us, "frac_copy": frac, "speedup_vs_stock": stock,
                "bytes": 1, "why": "q|k|v"}
    return {"gpu": "NVIDIA H200", "git_commit": "5d6df23", "command": "bench/kernels.py --quick",
            "date": "2026-11-30T08:36:42.003622+00:00", "copy_bandwidth_Bps": 4182214723090.4,
            "results": [row("linear.mxfp8", [24576, 6144], 1, 49.42, 0.7541, 34.3),
                        row("linear.mxfp8", [8192, 6144], 1, 22.51, 0.5531, 29.8),
                        row("linear.mxfp8", [512, 6144], 1, 8.531, 0.0911, 28.7),
                        row("moe.nvfp4", [128, 6144, 3072, 0], 4, 790.5, 0.1437, 37.36)],
            "goals": [{"goal": ">= 70%", "entry": "linear.mxfp8", "rows": 1, "met": m, "value": 0, "target": 0.7}
                      for m in (True, False, False)]}


def test_kernels(report, tmp_path):
    write(tmp_path, "kernels-h200-x.json", kernels_file())
    out = report.render_report(tmp_path)
    assert table_rows(out, "entry") == [
        ["linear.mxfp8", "1", "3", "8.53–49.4", "9–75 %", "24576×6144 (75 %)", "29–34×", "1/3"],
        ["moe.nvfp4", "4", "1", "791", "14 %", "128×6144×3072×0 (14 %)", "37×", "—"]]
    assert "Kernels vs copy bandwidth (4.18 TB/s measured)" in out
    assert "commit 5d6df23 · 2026-11-30 08:36 UTC · `bench/kernels.py --quick`" in out


def test_gemv_variants(report, tmp_path):
    results = [{"entry": "linear.nvfp4", "shape": [8, 8], "rows": 1, "variant": v, "ok": True, "det": d,
                "us": 1.0, "frac_copy": 0.1} for v, d in (("cell", True), ("g16x512w4/s1", True),
                                                          ("g32x256w4/s2", False))]
    summary = [{"entry": "linear.nvfp4", "rows": 1, "variant": "cell", "n_shapes": 7, "geomean_frac_copy": 0.1089},
               {"entry": "linear.nvfp4", "rows": 1, "variant": "g16x512w4", "n_shapes": 7,
                "geomean_frac_copy": 0.2469},
               {"entry": "linear.nvfp4", "rows": 1, "variant": "g32x256w4", "n_shapes": 7,
                "geomean_frac_copy": 0.2253},
               {"entry": "linear.nvfp4", "shape": [8, 8], "rows": 1, "best": "g16x512w4/s1"}]
    write(tmp_path, "gemv_variants-h200.json", {"gpu": "NVIDIA H200", "command": "bench/gemv_variants.py",
                                                "results": results, "summary": summary, "skipped": []})
    out = report.render_report(tmp_path)
    # 0.2469 / 0.1089 = 2.27 -> 2.3x; one run of three was not deterministic
    assert table_rows(out, "entry") == [["linear.nvfp4", "1", "7", "11 %", "g16x512w4", "25 %", "2.3×", "2/3"]]


def test_host_overhead(report, tmp_path):
    def row(batch, context, per_request, step, two_call=None):
        r = {"batch": batch, "context": context, "per_request_us": per_request, "step_us_median": step}
        return r | ({"two_call_us_median": two_call} if two_call is not None else {})
    rows = [row(64, 131072, 3.352, 214.51, 409.99), row(1, 1024, 216.801, 216.8, 423.95),
            row(64, 1024, 3.613, 231.21, 428.34), row(1, 131072, 112.17, 112.17, 233.35)]
    write(tmp_path, "host_overhead-h200.json", {
        "benchmark": "host_overhead", "device": "cuda", "machine": {"gpu": "NVIDIA H200", "cpu_count": 16},
        "git": {"commit": "none (no commit yet)", "kv_files_dirty": True}, "command": "python3 bench/host_overhead.py",
        "date": "2026-11-30T08:40:16+00:00", "results": rows,
        "summary": {"batch64_per_request_us_max": 3.613, "batch64_goal_5us_met": True, "batch64_context_ratio": 0.93}})
    out = report.render_report(tmp_path)
    assert headers_of(out, "batch") == ["batch", "µs/request @ 1k", "µs/request @ 128k", "step µs @ 128k",
                                        "two calls µs/request @ 128k"]
    # two calls per request at batch 64: 409.99 / 64 = 6.406
    assert table_rows(out, "batch") == [["1", "217", "112", "112", "233"], ["64", "3.61", "3.35", "215", "6.41"]]
    assert ("summary (from the file): batch64_context_ratio: 0.93; batch64_goal_5us_met: yes; "
            "batch64_per_request_us_max: 3.613") in out
    assert "NVIDIA H200 · commit none (no commit yet) + uncommitted kv/ changes" in out


def test_sampler_host(report, tmp_path):
    rows = [{"vocab": 512, "case": "sampled_plain", "penalised_rows": 0, "ops_per_step": 30, "host_us_median": 147.2},
            {"vocab": 512, "case": "greedy_plain", "penalised_rows": 0, "ops_per_step": 1, "host_us_median": 7.691}]
    write(tmp_path, "sampler_host-cpu.json", {"meta": {"command": "python3 bench/sampler_host.py", "commit": "abc",
                                                       "date": "2026-12-01T00:00:00+00:00"},
                                              "batch": 8, "device": "cpu", "results": rows})
    out = report.render_report(tmp_path)
    assert headers_of(out, "vocab") == ["vocab", "case", "penalised rows", "device ops / step",
                                        "host µs / step (median)"]
    assert table_rows(out, "vocab") == [["512", "greedy_plain", "0", "1", "7.69"],
                                        ["512", "sampled_plain", "0", "30", "147"]]
    assert "batch 8" in out and "unrendered" not in out


def test_kv_ablation(report, tmp_path):
    plans = {"hybrid": {"layers": {}, "exact_match": 0.74, "correct": 370, "b": 55, "c": 18, "p_value": 1.69e-05},
             "exact": {"layers": {}, "exact_match": 0.814, "correct": 407, "b": 0, "c": 0, "p_value": 1.0}}
    write(tmp_path, "kv-quant-ablation-cpu.json", {"command": "python3 bench/kv_quant_ablation.py", "commit": "abc",
                                                   "date": "2026-12-01T01:22:00+00:00", "n": 500, "plans": plans})
    out = report.render_report(tmp_path)
    assert table_rows(out, "plan (what is quantized)") == [["exact", "81.4 % (407)", "0 / 0", "1.0"],
                                                           ["hybrid", "74.0 % (370)", "55 / 18", "1.7e-05"]]
    assert "500 held-out items" in out and "unrendered" not in out


def test_tp(report, tmp_path):
    data = {"bench": "tp", "date": "2026-11-30T08:22:56+00:00", "commit": "HEAD", "dirty": True,
            "command": "python bench/tp.py --preset minimax-m3:12", "gpu": "NVIDIA H200",
            "model": {"preset": "minimax-m3:12", "quantization": "nvfp4"},
            "workload": {"prompt_tokens": 2176, "batch": 1},
            "tp1": {"decode_ms": {"median": 129.133}, "peak_allocated_gb": 49.466},
            "tp2": {"decode_ms": {"median": 88.8596}, "peak_allocated_gb": 29.917},
            "decode_speedup_tp2_over_tp1": 1.4532, "accuracy": {"pass": True},
            "allreduce_12kb": {"bytes": 12288, "world_size": 2,
                               "symm_mem_one_shot": {"synced_us_median": 19.259, "back_to_back_us": 8.279,
                                                     "cuda_graph_us": 6.3632},
                               "nccl": {"synced_us_median": 29.919, "cuda_graph_us": 18.7994}}}
    write(tmp_path, "tp-h200x2.json", data)
    out = report.render_report(tmp_path)
    assert table_rows(out, "preset") == [["minimax-m3:12", "nvfp4", "2176", "1", "129", "88.9", "1.5×", "49.5",
                                          "29.9", "pass", "`tp-h200x2.json`"]]
    assert table_rows(out, "all-reduce") == [["nccl", "12 KiB", "29.9", "—", "18.8", "`tp-h200x2.json`"],
                                             ["symm_mem_one_shot", "12 KiB", "19.3", "8.28", "6.36",
                                              "`tp-h200x2.json`"]]
    assert "2× NVIDIA H200 · commit HEAD + uncommitted changes" in out


def test_spec_decode(report, tmp_path):
    def row(batch, temp, plain, spec, al, same=None):
        r = {"batch": batch, "temperature": temp, "plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain,
             "spec_stats": {"acceptance_length": al}}
        return r | ({"greedy_identical": same} if same is not None else {})
    write(tmp_path, "spec-decode-h200.json", {
        "bench": "spec_decode", **PROVENANCE, "command": "python3 bench/spec_decode.py", "model": "m3-tiny-verse",
        "k": 3, "max_tokens": 96,
        "results": [row(8, 0.8, 130.27, 222.70, 3.7854), row(1, 0.0, 39.357, 113.40, 3.4286, True),
                    row(8, 0.0, 142.94, 321.70, 3.4141, False)]})
    out = report.render_report(tmp_path)
    assert table_rows(out, "batch") == [["1", "0", "39.4", "113", "2.9×", "3.43", "yes"],
                                        ["8", "0", "143", "322", "2.3×", "3.41", "no"],
                                        ["8", "0.8", "130", "223", "1.7×", "3.79", "—"]]
    assert "Eagle3 speculative decoding: m3-tiny-verse, K = 3, 96 new tokens per request" in out


def test_serve(report, tmp_path):
    def level(c, out_tps, ttft, itl):
        return {"concurrency": c, "requests": 4 * c, "completed": 4 * c, "failed": 0, "output_tokens_per_s": out_tps,
                "total_tokens_per_s_per_gpu": 3 * out_tps, "ttft_ms": {"p50": ttft, "p90": 1.5 * ttft},
                "itl_ms": {"p50": itl, "p90": 2 * itl}, "interactivity_x90": 1000 / (2 * itl)}
    write(tmp_path, "serve-tiny-cpu.json", {
        "meta": {"model": "tiny", "workload": "fixed", "input_len": 32, "output_len": 16,
                 "created": "2026-11-30T08:25:59+0000"},
        "results": [level(16, 425.27, 76.25, 17.5), level(1, 132.82, 14.40, 3.5)]})
    out = report.render_report(tmp_path)
    assert table_rows(out, "concurrency") == [["1", "4/4", "0", "133", "398", "14.4 / 21.6", "3.50 / 7.00", "143"],
                                              ["16", "64/64", "0", "425", "1276", "76.3 / 114", "17.5 / 35.0",
                                               "28.6"]]
    assert "Serving benchmark: model tiny, workload fixed, 32 input / 16 output tokens" in out
    assert "2026-11-30 08:25 UTC · command not recorded" in out


def test_eval_kv(report, tmp_path):
    def comparison(other, em_other, b, c, p):
        return {"n": 500, "order": ["engine:kv=bf16", f"engine:kv={other}"], "items": [],
                "configs": {"engine:kv=bf16": {"exact_match_strict": 0.814, "correct_strict": 407},
                            f"engine:kv={other}": {"exact_match_strict": em_other,
                                                   "correct_strict": round(500 * em_other)}},
                "paired": {"strict": {"b": b, "c": c, "p_value": p}}}
    write(tmp_path, "eval-kv-bf16-vs-nvfp4-cpu.json", comparison("nvfp4", 0.74, 56, 19, 2.242964e-05))
    write(tmp_path, "eval-kv-bf16-vs-fp8-cpu.json", comparison("fp8", 0.802, 13, 7, 0.263176))
    target = comparison("fp8", 0.81, 2, 0, 0.5)
    target.update(order=["engine:kv=bf16", "engine:kv=fp8"], agreement={"tokens": 0.99467, "identical": 0.992},
                  agreement_unit="tokens")
    write(tmp_path, "eval-stock-vs-target.json", target)
    out = report.render_report(tmp_path)
    assert table_rows(out, "A") == [
        ["engine:kv=bf16", "81.4 % (407)", "engine:kv=fp8", "80.2 % (401)", "500", "13 / 7", "0.26",
         "not significant", "—", "`eval-kv-bf16-vs-fp8-cpu.json`"],
        ["engine:kv=bf16", "81.4 % (407)", "engine:kv=fp8", "81.0 % (405)", "500", "2 / 0", "0.50",
         "not significant", "99.5 % of tokens", "`eval-stock-vs-target.json`"],
        ["engine:kv=bf16", "81.4 % (407)", "engine:kv=nvfp4", "74.0 % (370)", "500", "56 / 19", "2.2e-05",
         "significant", "—", "`eval-kv-bf16-vs-nvfp4-cpu.json`"]]


def test_generic_files_list_their_top_level_scalars(report, tmp_path):
    write(tmp_path, "server-hardening-cpu.json", {"zeta": 0.123456, "alpha": True, "nested": {"x": 1},
                                                  "rows": [1, 2], "name": "limits", "none": None,
                                                  "command": "pytest tests/server"})
    write(tmp_path, "server-hardening-h200.json", {"bench": "spec_decode", "speedup": 2.5, "gpu": "NVIDIA H200"})
    out = report.render_report(tmp_path)
    blocks = out.split("**server-hardening-cpu.json")[1].split("**server-hardening-h200.json")
    assert table_rows(blocks[0], "field") == [["`alpha`", "yes"], ["`command`", "pytest tests/server"],
                                              ["`name`", "limits"], ["`none`", "None"], ["`zeta`", "0.1235"]]
    # a "bench" key naming a known kind does not send this file to that kind's formatter
    assert table_rows(blocks[1], "field") == [["`bench`", "spec_decode"], ["`gpu`", "NVIDIA H200"],
                                              ["`speedup`", "2.5"]]
    assert "unrendered" not in out


def test_unrecognised_and_broken_files_are_listed_and_logs_ignored(report, tmp_path):
    write(tmp_path, "mystery-h200.json", {"whatever": 1})
    write(tmp_path, "reverted/decode-x.json", {"bench": "decode"})   # would raise if it were read (no results)
    write(tmp_path, "broken.json", "{not json")
    write(tmp_path, "a-list.json", [1, 2])
    write(tmp_path, "logs/spec-decode-old.json", {"bench": "spec_decode"})   # would raise if it were read
    write(tmp_path, "kernels-h200-x.json", kernels_file())
    out = report.render_report(tmp_path)
    assert "decode-x" not in out and "decode-x" not in report.render_summary(tmp_path)
    assert out.endswith("unrendered results: `a-list.json` (unrecognised), `broken.json` (not valid JSON: "
                        "JSONDecodeError), `mystery-h200.json` (unrecognised)")
    assert "Kernels vs copy bandwidth" in out


def test_output_is_deterministic(report, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    files = [("kernels-h200-x.json", kernels_file()), ("decode-target-h200.json", decode_target_file())]
    for name, data in files:
        write(first, name, data)
    for name, data in reversed(files):
        data = dict(data, results=list(reversed(data["results"])))
        write(second, name, data)
    assert report.render_report(first) == report.render_report(second)
    text = report.render_report(first)
    assert text.index("### Decode step") < text.index("### Kernels")


@pytest.mark.parametrize("mutate,error,words", [
    (lambda d: d["results"][1].pop("median_s"), ValueError, ["decode-target-h200.json.results[1].median_s",
                                                            "missing"]),
    (lambda d: d["results"][0].update(batch="8"), TypeError, ["results[0].batch", "expected int", "str"]),
    (lambda d: d["results"][2].update(median_s=float("nan")), ValueError, ["results[2].median_s", "finite"]),
    (lambda d: [r.pop("model") for r in d["results"]], ValueError, ["results[0].model", "preset"]),
    (lambda d: d["results"].clear(), ValueError, ["decode-target-h200.json.results", "at least one row"]),
])
def test_bad_fields_raise_naming_file_and_field(report, tmp_path, mutate, error, words):
    data = decode_target_file()
    mutate(data)
    write(tmp_path, "decode-target-h200.json", data)
    with pytest.raises(error) as info:
        report.render_report(tmp_path)
    for w in words:
        assert w in str(info.value)


# ------------------------------------------------------------------------------------------------ the README

README = "# title\n\nintro 1.23 ms\n\n<!-- report:begin -->\nold figure 9.99 ms\n<!-- report:end -->\n\ntail\n"


def test_write_then_check_round_trip(report, tmp_path, capsys):
    results = tmp_path / "results"
    write(results, "spec-decode-h200.json", {"bench": "spec_decode", "model": "m", "k": 2, "results": [
        {"batch": 1, "temperature": 0.0, "plain_tok_s": 10.0, "spec_tok_s": 25.0, "speedup": 2.5,
         "spec_stats": {"acceptance_length": 2.5}}]})
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert report.main(["--results", str(results), "--check", str(readme)]) == 1
    assert "old figure 9.99 ms" in capsys.readouterr().err
    assert report.main(["--results", str(results), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nintro 1.23 ms\n\n<!-- report:begin -->\n<!-- generated by")
    assert text.endswith("<!-- report:end -->\n\ntail\n") and "old figure" not in text
    assert "| 1 | 0 | 10.0 | 25.0 | 2.5× | 2.50 | — |" in text
    assert report.main(["--results", str(results), "--check", str(readme)]) == 0
    assert report.main(["--results", str(results), "--write", str(readme)]) == 0     # idempotent
    assert readme.read_text() == text
    readme.write_text(text.replace("| 25.0 |", "| 26.0 |"))                           # a hand-edited figure
    assert report.main(["--results", str(results), "--check", str(readme)]) == 1
    assert "-| 1 | 0 | 10.0 | 26.0 |" in capsys.readouterr().err


@pytest.mark.parametrize("text,words", [
    ("no markers\n", ["exactly one line '<!-- report:begin -->'", "found 0"]),
    ("<!-- report:begin -->\nx\n", ["exactly one line '<!-- report:end -->'", "found 0"]),
    ("<!-- report:end -->\n<!-- report:begin -->\n", ["comes before"]),
    ("<!-- report:begin -->\n<!-- report:begin -->\n<!-- report:end -->\n", ["found 2"]),
])
def test_marker_errors(report, tmp_path, capsys, text, words):
    with pytest.raises(ValueError) as info:
        report.replace_block(text, "block", "README.md")
    for w in words:
        assert w in str(info.value)
    readme = tmp_path / "README.md"
    readme.write_text(text)
    write(tmp_path / "results", "x.json", {"a": 1})
    assert report.main(["--results", str(tmp_path / "results"), "--write", str(readme)]) == 2
    assert words[0] in capsys.readouterr().err
    assert readme.read_text() == text


def test_real_readme_matches_the_real_results(report):
    """docs/results.md's tables and the README's headline block are what bench/results gives: run
    `python bench/report.py --write docs/results.md` and `--write README.md` after adding or changing a results
    file, never edit the figures by hand."""
    block = report.render_report(report.RESULTS_DIR)
    assert "unrendered results" not in block, block.rsplit("\n", 1)[-1]
    assert report.block_diff((ROOT / "docs" / "results.md").read_text(), block, "docs/results.md") == ""
    summary = report.render_summary(report.RESULTS_DIR)
    markers = (report.SUMMARY_BEGIN_MARKER, report.SUMMARY_END_MARKER)
    assert report.block_diff((ROOT / "README.md").read_text(), summary, "README.md", markers) == ""


def test_results_follow_the_naming_rule(report):
    """bench/results/<bench>/<name>.json: every results file sits in the folder of the bench that wrote it (a
    bench script bench/<bench>.py, or `serve` / `eval` for the m3serve subcommands); no loose files at the top."""
    benches = {p.stem for p in (ROOT / "bench").glob("*.py")} | {"serve", "eval"}
    files, _ = report.load_results(report.RESULTS_DIR)
    assert files
    for rf in files:
        parts = rf.name.split("/")
        assert len(parts) == 2 and parts[0] in benches, rf.name


def test_summary_picks_the_fastest_batch_1_rows_and_every_accuracy_comparison(report, tmp_path, capsys):
    decode = {"bench": "decode", **PROVENANCE, "results": [
        {"model": "m", "route": "off", "batch": 1, "context": 512, "median_s": 0.01, "tokens_per_s": 100.0},
        {"model": "m", "route": "target", "batch": 1, "context": 512, "median_s": 0.004, "tokens_per_s": 250.0},
        {"model": "m", "route": "target", "batch": 8, "context": 512, "median_s": 0.005, "tokens_per_s": 1600.0}]}
    write(tmp_path / "results", "decode/decode-a.json", decode)
    slower = dict(decode, results=[dict(decode["results"][1], tokens_per_s=240.0)])
    write(tmp_path / "results", "decode/decode-b.json", slower)
    write(tmp_path / "results", "eval/eval-x.json", {"n": 10, "order": ["A", "B"], "configs": {
        "A": {"exact_match_strict": 0.8, "correct_strict": 8}, "B": {"exact_match_strict": 0.7, "correct_strict": 7}},
        "paired": {"strict": {"b": 2, "c": 1, "p_value": 1.0}}})
    out = report.render_summary(tmp_path / "results")
    assert table_rows(out, "figure") == [
        ["decode step, batch 1, route target", "m", "250 tok/s", "`decode/decode-a.json`"],
        ["accuracy, 10 items", "A vs B", "80.0 % vs 70.0 % exact match (p 1.0)", "`eval/eval-x.json`"]]
    both = tmp_path / "both.md"
    both.write_text(f"{report.SUMMARY_BEGIN_MARKER}\n{report.SUMMARY_END_MARKER}\nx\n"
                    f"{report.BEGIN_MARKER}\n{report.END_MARKER}\n")
    assert report.main(["--results", str(tmp_path / "results"), "--check", str(both)]) == 1
    assert report.main(["--results", str(tmp_path / "results"), "--write", str(both)]) == 0
    text = both.read_text()
    assert "| 250 tok/s |" in text and "### Decode step" in text       # both blocks written
    assert report.main(["--results", str(tmp_path / "results"), "--check", str(both)]) == 0


def test_spec_target_rows(report, tmp_path):
    base = {"model": "m", "batch": 1, "forced_al": None, "acceptance_length": None, "identical_to_plain": None}
    write(tmp_path, "spec-target-h200.json", {"bench": "spec_target", "commit": "abc", "gpu": "NVIDIA H200",
          "results": [{**base, "mode": "plain", "k": 0, "tokens_per_s_per_user": 1000.0},
                      {**base, "mode": "spec", "k": 3, "tokens_per_s_per_user": 1500.0, "speedup_vs_plain": 1.5,
                       "acceptance_length": 3.5, "identical_to_plain": True},
                      {**base, "mode": "spec", "k": 3, "batch": 4, "tokens_per_s_per_user": 800.0,
                       "speedup_vs_plain": 0.8, "acceptance_length": 2.76, "forced_al": 2.78}]})
    out = report.render_report(tmp_path)
    assert table_rows(out, "model") == [["m", "1", "0", "plain", "1000", "—", "—", "—"],
                                        ["m", "1", "3", "spec", "1500", "1.5×", "3.50", "yes"],
                                        ["m", "4", "3", "spec", "800", "0.80×", "2.76 (forced 2.78)", "—"]]


def test_moe_decode_once(report, tmp_path):
    """bench/moe_grouped.py --decode-once rows: a BF16 row has no decode-once columns; the file is not taken for
    a kernels file though its name starts like one."""
    rows = [{"fmt": "nvfp4", "rows": 8192, "in_register_total_ms": 19.88, "decode_once_total_ms": 15.12,
             "decode_once_decode_ms": 6.78, "decode_once_gemm_ms": 7.65, "speedup": 1.3148},
            {"fmt": "bf16", "rows": 8192, "in_register_total_ms": 8.83}]
    write(tmp_path, "kernels/kernels-moe-grouped-decode-once-h200.json",
          {**PROVENANCE, "command": "bench/moe_grouped.py --decode-once", "results": rows})
    out = report.render_report(tmp_path)
    assert table_rows(out, "experts") == [["nvfp4", "8192", "19.88", "15.12", "6.78", "7.65", "1.31x"],
                                          ["bf16", "8192", "8.83", "—", "—", "—", "—"]]


def test_summary_prefill_and_serving_rows(report, tmp_path):
    """The README summary: each m3serve TTFT, with its ratio to transformers' only when the same file (one run)
    measured transformers at that length; each serving run at 64 users."""
    write(tmp_path, "prefill/prefill-h200.json", {**PROVENANCE, "bench": "prefill", "command": "bench/prefill.py",
          "results": [{"engine": "m3serve", "model": "minimax-m3:5", "quantization": "nvfp4", "tokens": 8192,
                       "chunk": 8192, "ttft_s": 0.0947, "frac_bf16_peak": 0.45},
                      {"engine": "m3serve", "model": "minimax-m3:5", "quantization": "nvfp4", "tokens": 1024,
                       "chunk": 8192, "ttft_s": 0.02, "frac_bf16_peak": 0.2},
                      {"engine": "transformers", "model": "minimax-m3:5", "quantization": "none", "tokens": 8192,
                       "chunk": 8192, "ttft_s": 0.1731, "frac_bf16_peak": 0.25}]})
    point = {"concurrency": 64, "failed": 0, "total_tokens_per_s_per_gpu": 45694.4, "ttft_ms": {"p50": 62.9, "p90": 85.2},
             "itl_ms": {"p50": 1.87, "p90": 2.25}, "interactivity_x90": 443.8, "interactivity_tpot_p90": 418.0}
    write(tmp_path, "serve/serve-pareto-h200.json", {**PROVENANCE, "command": "bench/serve_pareto.py", "runs": [
        {"model": "embedded", "mode": "plain", "results": [{**point, "concurrency": 1}, point]}]})
    rows = table_rows(report.render_summary(tmp_path), "figure")
    assert ["prefill TTFT, 8192 tokens, NVFP4 weights", "minimax-m3:5",
            "94.7 ms (0.55x transformers' BF16 173 ms, same run)", "`prefill/prefill-h200.json`"] in rows
    assert ["prefill TTFT, 1024 tokens, NVFP4 weights", "minimax-m3:5", "20.0 ms", "`prefill/prefill-h200.json`"] in rows
    assert ["served, plain, 64 users", "embedded (BF16 weights)", "ITL p50 1.87 ms, 418 tok/s per user, 45694 tok/s in all",
            "`serve/serve-pareto-h200.json`"] in rows
    assert sum(r[0].startswith("served") for r in rows) == 1


def test_generate_main_job_and_prefill_graph_rows(report, tmp_path):
    """The main job's runs (cold, then warm Triton cache) in their table, the warm one in the summary; a prefill row
    with prefill graphs says so in both."""
    runs = [{"tokens": 64, "decode_s": 1.24, "tok_s": 51.6, "load_s": 29.2, "finish": "length", "device": "cuda",
             "process_wall_s": 41.03, "triton_cache": "cold"},
            {"tokens": 64, "decode_s": 0.05, "tok_s": 1392.3, "load_s": 6.31, "finish": "length", "device": "cuda",
             "process_wall_s": 11.5, "triton_cache": "warm"}]
    write(tmp_path, "generate_main_job/generate-h200.json", {**PROVENANCE, "bench": "generate_main_job",
          "command": "bench/generate_main_job.py --runs 2", "generate_args": [], "runs": runs})
    write(tmp_path, "prefill/prefill-graphs-ttft-h200.json", {**PROVENANCE, "bench": "prefill", "command": "x",
          "results": [{"engine": "m3serve", "model": "minimax-m3:5", "quantization": "nvfp4", "tokens": 128,
                       "chunk": 8192, "ttft_s": 0.0123, "frac_bf16_peak": 0.01, "prefill_graph_tokens": 1024},
                      {"engine": "m3serve", "model": "minimax-m3:5", "quantization": "nvfp4", "tokens": 128,
                       "chunk": 8192, "ttft_s": 0.0311, "frac_bf16_peak": 0.004, "prefill_graph_tokens": 0}]})
    out = report.render_report(tmp_path)
    assert table_rows(out, "run") == [["1", "cold", "29.2", "64", "51.6", "41.0"],
                                      ["2", "warm", "6.31", "64", "1392", "11.5"]]
    assert [r[0] for r in table_rows(out, "engine")] == ["m3serve (prefill graphs to 1024 tokens)", "m3serve"]
    assert "unrecognised" not in out
    rows = table_rows(report.render_summary(tmp_path), "figure")
    assert ["`m3serve generate` (no arguments), warm Triton cache", "embedded model", "load 6.31 s, 1392 tok/s "
            "(64 tokens)", "`generate_main_job/generate-h200.json`"] in rows
    assert ["prefill TTFT, 128 tokens, NVFP4 weights, prefill graphs", "minimax-m3:5", "12.3 ms",
            "`prefill/prefill-graphs-ttft-h200.json`"] in rows


def test_prefill_attention_variants(report, tmp_path):
    tiles = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 1, "pv_split": True, "heads": 2, "f16": True}
    write(tmp_path, "prefill_attention_variants/prefill-attention-variants-fp8-h200.json",
          {**PROVENANCE, "bench": "prefill_attention_variants", "command": "x", "n": 8192, "ctx": 122880,
           "flops": 1, "results": [{"kv_bits": 8, "tiles": tiles, "ms": 150.25, "tflops": 231.7, "check": "ok"},
                                   {"kv_bits": 16, "tiles": "torch sdpa", "ms": 99.5, "tflops": 350.0}]})
    out = report.render_report(tmp_path)
    assert table_rows(out, "pages") == [["FP8", "128 x 64, 8 warps, 1 stages, 2 heads, fp16 operands", "150.250",
                                         "232", "ok"], ["BF16", "torch sdpa", "99.500", "350", "—"]]
    assert "8192-token chunk after 122880 keys" in out and "unrecognised" not in out


def test_msa_scores_prefill(report, tmp_path):
    """bench/msa_index_bw.py --prefill-chunk: one row per tiling / tile (a failed variant shows its error), then the
    select timings per warp count."""
    tile = {"bq": 32, "split_blocks": 256, "num_warps": 8, "num_stages": 2}
    write(tmp_path, "msa_index_bw/msa-scores-prefill-h100.json",
          {**PROVENANCE, "command": "x", "prefill": {
              "chunk": 16384, "context": 114688, "seq_len": 131072, "blocks": 1024, "hk": 4, "di": 128, "p": 128,
              "topk": 16, "flops": 1, "default_tile": tile,
              "scores": [{"fmt": "bf16", "variant": "decode", "tiling": "decode", "tile": {"bq": 16, "qchunks": 8},
                          "check": "ok", "ms": 5.17, "tflops": 398.6, "vs_decode": "is the baseline"},
                         {"fmt": "fp8", "variant": "prefill-default", "tiling": "prefill", "tile": tile,
                          "error": "OutOfResources: shared memory"}],
              "select": [{"rows": 16384, "blocks": 1024, "num_warps": 4, "default": True, "ms": 0.86},
                         {"rows": 16384, "blocks": 1024, "num_warps": 1, "default": False, "error": "x"},
                         {"rows": 16384, "blocks": 1024, "table_width": 1025, "num_warps": 4, "default": True,
                          "same_as_default": True, "ms": 0.9},
                         {"rows": 16384, "blocks": 1024, "table_width": 8192, "num_warps": 8, "default": True,
                          "same_as_default": False, "ms": 1.2}]}})
    out = report.render_report(tmp_path)
    assert table_rows(out, "index-K") == [
        ["bf16", "decode", "bq 16, qchunks 8", "5.170", "399", "ok; is the baseline"],
        ["fp8", "prefill-default", "bq 32, split_blocks 256, num_warps 8, num_stages 2", "—", "—",
         "failed: OutOfResources: shared memory"]]
    assert ("msa.select on the same rows: 4 warps (default): 0.86 ms; in a 1025-block table, 4 warps (default): "
            "0.90 ms; in a 8192-block table, 8 warps (default): 1.20 ms (SELECTION DIFFERS)\n") in out
    assert "16384-token chunk after 114688 tokens of context (1024 blocks, Hk 4, top-16)" in out
    assert "unrecognised" not in out


def test_prefill_rows_name_the_msa_prefill_path(report, tmp_path):
    """bench/prefill.py --sparse-prefill on,off: each row says which kernel served MSA layers' prefill rows, in the
    prefill table and the summary; a sparse-top-k variants file says it is an MSA layer."""
    rows = [{"engine": "m3serve", "model": "minimax-m3:24", "quantization": "nvfp4", "tokens": 8192, "chunk": 8192,
             "ttft_s": t, "frac_bf16_peak": 0.4, "sparse_prefill": mode} for t, mode in ((0.5, "on"), (0.574, "off"))]
    write(tmp_path, "prefill/prefill-m3_24-8k-sparse-prefill-h200.json",
          {**PROVENANCE, "bench": "prefill", "command": "x", "results": rows})
    write(tmp_path, "prefill_attention_variants/prefill-attention-variants-sparse-h200.json",
          {**PROVENANCE, "bench": "prefill_attention_variants", "command": "x", "n": 8192, "ctx": 0, "flops": 1,
           "sparse_topk": 16, "results": [{"kv_bits": 16, "tiles": "sparse top-16 (random): attn.paged (4 splits)",
                                           "ms": 5.2, "tflops": 80.0}]})
    out = report.render_report(tmp_path)
    assert [r[0] for r in table_rows(out, "engine")] == ["m3serve, MSA prefill through attn.prefill_sparse",
                                                         "m3serve, MSA prefill through attn.paged"]
    assert "M3 TP1 MSA layer, top-16 blocks" in out and "unrecognised" not in out
    summary = table_rows(report.render_summary(tmp_path), "figure")
    assert ["prefill TTFT, 8192 tokens, NVFP4 weights, MSA prefill through attn.paged", "minimax-m3:24", "574 ms",
            "`prefill/prefill-m3_24-8k-sparse-prefill-h200.json`"] in summary


def test_prefill_rows_name_the_fp8_context_path(report, tmp_path):
    """bench/prefill.py --fp8-context bf16,direct: each row says how dense layers' FP8 pages were read."""
    rows = [{"engine": "m3serve", "model": "minimax-m3:5", "quantization": "nvfp4", "tokens": 131072, "chunk": 16384,
             "ttft_s": t, "frac_bf16_peak": 0.4, "sparse_prefill": "off", "fp8_context": ctx, "kv_cache_dtype": kv,
             "lazy_rescale": lazy}
            for t, ctx, kv, lazy in ((3.9, "bf16", "nvfp4", "off"), (4.3, "direct", "nvfp4", "off"),
                                     (4.1, "direct", "auto", "off"), (3.8, "bf16", "auto", "on"))]
    write(tmp_path, "prefill/prefill-nvfp4-128k-fp8-context-h200.json",
          {**PROVENANCE, "bench": "prefill", "command": "x", "results": rows})
    out = report.render_report(tmp_path)
    assert [r[0] for r in table_rows(out, "engine")] == [
        "m3serve, MSA prefill through attn.paged, hybrid NVFP4 / FP8 KV cache, FP8 pages decoded to bf16 per step",
        "m3serve, MSA prefill through attn.paged, hybrid NVFP4 / FP8 KV cache, FP8 pages read directly",
        # a BF16 cache has no FP8 pages: the setting is named as having had no effect
        "m3serve, MSA prefill through attn.paged, fp8_context direct (no FP8 pages: no effect)",
        "m3serve, MSA prefill through attn.paged, fp8_context bf16 (no FP8 pages: no effect), attn.prefill lazy rescale"]
    summary = table_rows(report.render_summary(tmp_path), "figure")
    assert ["prefill TTFT, 131072 tokens, NVFP4 weights, MSA prefill through attn.paged, hybrid NVFP4 / FP8 KV cache, "
            "FP8 pages read directly", "minimax-m3:5", "4300 ms",
            "`prefill/prefill-nvfp4-128k-fp8-context-h200.json`"] in summary


def test_attn_tma_ws_probe(report, tmp_path):
    """bench/attn_prefill_tma_ws_probe.py: one row per variant (a NaN error is shown as such, a failed build
    names its error), then attn.prefill's line."""
    variants = [{"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "warp_specialize": False,
                 "max_err": 0.00086, "ms": 191.7, "tflops": 321.1},
                {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "warp_specialize": True,
                 "max_err": float("nan"), "ms": 349.6, "tflops": 176.1},
                {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "warp_specialize": True,
                 "error": "CompilationError: x"}]
    write(tmp_path, "attn_prefill_tma_ws_probe/attn-prefill-tma-ws-probe-h100.json",
          {**PROVENANCE, "bench": "attn_prefill_tma_ws_probe", "command": "x", "n": 16384, "ctx": 114688,
           "variants": variants, "attn_prefill": {"ms": 225.1, "tflops": 293.0}})
    out = report.render_report(tmp_path)
    assert table_rows(out, "tiles") == [
        ["64 x 64, 4 warps, 3 stages", "no", "0.00086", "191.7", "321", ""],
        ["64 x 64, 4 warps, 3 stages", "yes", "NaN", "349.6", "176", ""],
        ["128 x 128, 8 warps, 2 stages", "yes", "—", "—", "—", "failed: CompilationError: x"]]
    assert "attn.prefill (default tiles, the chunk's causal diagonal included): 225.1 ms, 293 TFLOP/s" in out
    assert "unrecognised" not in out


def test_serve_pareto_repeats_and_spec_vs_plain(report, tmp_path):
    """A file of interleaved repeats: each run's rows name their repeat, and the spec-vs-plain medians get a table."""
    point = {"concurrency": 4, "failed": 0, "total_tokens_per_s_per_gpu": 20000.0, "ttft_ms": {"p50": 3.1, "p90": 4.2},
             "itl_ms": {"p50": 0.31, "p90": 0.4}, "interactivity_x90": 2500.0, "interactivity_tpot_p90": 2600.0}
    runs = [{"model": "embedded", "mode": m, "run_mode": m + "-pg", "repeat": rep, "prefill_graph_tokens": 1024,
             "results": [point]} for rep in (0, 1) for m in ("plain", "spec")]
    cmp = [{"model": "embedded", "quantization": None, "spec_mode": "spec-pg", "plain_mode": "plain-pg",
            "levels": [{"concurrency": 4, "spec_per_user": 2710.0, "plain_per_user": 2650.0, "per_user_ratio": 1.0226,
                        "spec_total": 10840.0, "plain_total": 10600.0, "total_ratio": 1.0226,
                        "spec_tpot_p90_per_user": 2700.0, "plain_tpot_p90_per_user": 2600.0,
                        "tpot_p90_ratio": 1.0385, "repeats": [2, 2]}]}]
    write(tmp_path, "serve/serve-pareto-h200.json", {**PROVENANCE, "command": "bench/serve_pareto.py --repeats 2",
          "repeats": 2, "runs": runs, "spec_vs_plain": cmp})
    out = report.render_report(tmp_path)
    modes = [r[1] for r in table_rows(out, "model") if len(r) == 10]
    assert modes == ["plain (prefill graphs to 1024 tokens)", "spec (prefill graphs to 1024 tokens)",
                     "plain (prefill graphs to 1024 tokens, repeat 2)", "spec (prefill graphs to 1024 tokens, repeat 2)"]
    assert "medians over 2 interleaved repeats" in out
    assert ["served, spec-pg vs plain-pg, medians of 2 interleaved repeats", "embedded (BF16 weights)",
            "tok/s per user 1.02× at 4 users; total tok/s 1.02× at 4", "`serve/serve-pareto-h200.json`"] in \
        table_rows(report.render_summary(tmp_path), "figure")
    versus = out.split("Speculation against plain serving")[1]
    assert table_rows(versus, "model") == [["embedded", "spec-pg vs plain-pg", "4", "2710 / 2650", "1.02×", "1.04×",
                                           "1.02×", "2 / 2"]]


def test_decode_gpu_idle_between_kernels(report, tmp_path):
    """A file whose rows carry gpu_idle_s (bench/decode.py's kernel_gaps) gets its column after GPU busy; rows
    without it show a dash, and files without it keep their columns."""
    f = decode_target_file()
    f["results"][3]["gpu_idle_s"] = 0.00042
    write(tmp_path, "decode-target-h200.json", f)
    out = report.render_report(tmp_path)
    assert headers_of(out, "model")[6:8] == ["GPU busy ms", "GPU idle between kernels ms"]
    rows = table_rows(out, "model")
    assert [r[7] for r in rows] == ["—", "—", "0.420", "—", "—", "—"]


def test_memory_plan_startup(report, tmp_path):
    """The plan against what start-up took, one row per configuration, with the hand-added caveat shown."""
    row = {"model": "minimax-m3:5", "mode": "spec", "quantization": "nvfp4", "max_num_seqs": 128, "k": 3,
           "planned_working_bytes": 16 << 30, "measured_working_bytes": 9 << 30, "measured_over_planned": 9 / 16,
           "plan": "16.00 GiB (eager step 3.00, spec graphs 8.00, driver 1.00)",
           "graph_memory_bytes": {"speculative": 7 << 30, "decode": 1 << 30}, "kv_pages": 56516}
    write(tmp_path, "memory_plan_startup/memory-plan-startup-h200.json", {**PROVENANCE, "bench": "memory_plan_startup",
          "command": "x", "caveat": "by hand", "results": [row]})
    out = report.render_report(tmp_path)
    assert table_rows(out, "model") == [["minimax-m3:5", "spec", "nvfp4", "128", row["plan"], "9.00", "0.56",
                                         "decode 1.00, speculative 7.00", "56516"]]
    assert "**Caveat:** by hand" in out and "unrecognised" not in out


def test_summary_sample_race_row(report, tmp_path):
    """A sampled decode file with route target beside target-torch-sampler gives one summary row: the step-time ratio
    per batch both routes ran (a batch only one route ran is left out), the batch-1 times and the card."""
    rows = [{"model": "minimax-m3:5", "route": route, "batch": b, "context": 512, "median_s": t,
             "tokens_per_s": b / t}
            for route, b, t in (("target-torch-sampler", 8, 0.0032), ("target", 1, 0.0015), ("target", 8, 0.0020),
                                ("target-torch-sampler", 1, 0.0020), ("target", 32, 0.0060))]
    write(tmp_path, "decode/decode-race.json", {**PROVENANCE, "bench": "decode", "results": rows,
                                                "sampling": {"temperature": 1.0, "top_p": 1.0, "seed": 1}})
    write(tmp_path, "decode/decode-race-top-p.json", {**PROVENANCE, "bench": "decode", "results": rows[1:4],
                                                      "sampling": {"temperature": 0.7, "top_p": 0.95, "seed": 1}})
    got = [r for r in table_rows(report.render_summary(tmp_path), "figure") if "sample.race" in r[0]]
    assert got == [["sampled decode step (temperature 0.700, top-p 0.950), sample.race vs the torch sampler",
                    "minimax-m3:5", "0.75× the step time at batch 1 (1.50 vs 2.00 ms at batch 1, NVIDIA H200)",
                    "`decode/decode-race-top-p.json`"],
                   ["sampled decode step (temperature 1.00), sample.race vs the torch sampler", "minimax-m3:5",
                    "0.75× / 0.63× the step time at batch 1 / 8 (1.50 vs 2.00 ms at batch 1, NVIDIA H200)",
                    "`decode/decode-race.json`"]]


def test_paged_attention_merge_side_by_side(report, tmp_path):
    """bench/paged_attention.py with --combine-launch both: each point's two merges in one table."""
    results = [{"point": "msa nvfp4 decode b1 512 (decode splits)", "num_splits": 16, "combine_launch": launch,
                "us": us, "kv_bytes": 1, "tb_s": 0.1, "frac_copy": f, "cfg": "c"}
               for launch, us, f in ((False, 10.04, 0.051), (True, 14.26, 0.036))]
    write(tmp_path, "paged-attention-h100-x.json", {"gpu": "NVIDIA H100", "command": "bench/paged_attention.py",
                                                    "copy_bandwidth_Bps": 3.0e12, "results": results})
    out = report.render_report(tmp_path)
    assert table_rows(out, "point") == [
        ["msa nvfp4 decode b1 512 (decode splits)", "16", "in the split kernel", "10.0", "5 %"],
        ["msa nvfp4 decode b1 512 (decode splits)", "16", "combine launch", "14.3", "4 %"]]
    assert "copy bandwidth 3.00 TB/s" in out


@pytest.mark.parametrize("complete", [False, True, None])
def test_decode_run_cut_short_is_said(report, tmp_path, complete):
    """bench/decode.py writes its file after every row with `complete` false until the last: a file a time limit cut
    short says so under its table; a finished one (or an older file without the field) does not."""
    f = decode_target_file()
    if complete is not None:
        f["complete"] = complete
    write(tmp_path, "decode-target-h200.json", f)
    out = report.render_report(tmp_path)
    assert len(table_rows(out, "model")) == 6
    assert ("**Cut short:**" in out) == (complete is False)
