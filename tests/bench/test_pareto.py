"""`m3serve bench pareto`: several serve runs into one file (and chart), rows kept unchanged."""

from __future__ import annotations

import json

import pytest

from m3serve.bench import pareto
from m3serve.bench.cli import main


def _run(path, label, scale):
    rows = [{"concurrency": c, "interactivity_x90": 1000.0 / (c * scale), "total_tokens_per_s_per_gpu": 500.0 * c,
             "failed": 0} for c in (1, 4, 16)]
    path.write_text(json.dumps({"meta": {"label": label, "model": "m"}, "results": rows}))
    return rows


def test_pareto_combines_runs_with_modes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    ra, rb = _run(a, "plain", 1.0), _run(b, "eagle3", 0.5)
    out = tmp_path / "front.json"
    png = tmp_path / "front.png"
    assert main(["pareto", f"{a}:plain:nvfp4", f"{b}:spec", "--out", str(out), "--plot", str(png),
                 "--commit", "abc", "--gpu", "H200"]) == 0
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc" and doc["gpu"] == "H200"
    assert [r["mode"] for r in doc["runs"]] == ["plain", "spec"]
    assert doc["runs"][0]["quantization"] == "nvfp4" and doc["runs"][1]["quantization"] is None
    assert doc["runs"][0]["results"] == ra and doc["runs"][1]["results"] == rb
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_pareto_rejects_an_unknown_mode(tmp_path):
    a = tmp_path / "a.json"
    _run(a, "x", 1.0)
    with pytest.raises(ValueError, match="mode"):
        pareto.describe_run(pareto.load(str(a)), "turbo")


def _serve_pareto():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "serve_pareto.py")
    spec = importlib.util.spec_from_file_location("serve_pareto", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_pareto_modes_ask_the_server_for_their_policy():
    sp = _serve_pareto()
    args = type("A", (), {"max_num_seqs": 64, "max_model_len": None, "k": 3, "forced_al": 2.78})()
    assert sp.parse_run("minimax-m3:5:spec-auto:nvfp4") == ("minimax-m3:5", "spec-auto", "nvfp4")
    _, extra = sp.server_args("minimax-m3:5", "spec-auto", "nvfp4", args)
    i = extra.index("--speculative-disable-by-batch-size")
    assert extra[i + 1] == "auto" and json.loads(extra[extra.index("--speculative-config") + 1])["forced_acceptance"] == 2.78
    _, extra = sp.server_args("embedded", "spec-auto", None, args)
    assert "--speculative-tokens" in extra and "auto" in extra
    _, bounded = sp.server_args("minimax-m3:5", "spec-auto2-pg", "nvfp4", args)
    assert bounded[bounded.index("--speculative-disable-by-batch-size") + 1] == "auto:2"
    _, plain = sp.server_args("embedded", "plain", None, args)
    assert "--speculative-tokens" not in plain and "--speculative-disable-by-batch-size" not in plain
    _, spec = sp.server_args("embedded", "spec", None, args)
    assert "--speculative-disable-by-batch-size" not in spec
    _, always = sp.server_args("embedded", "spec-always", None, args)
    assert always[always.index("--speculative-disable-by-batch-size") + 1] == "none"
    # a mode without -pg says 0, so that it means the same server whatever EngineConfig's default
    assert always[always.index("--prefill-graph-tokens") + 1] == "0"
    assert sp.parse_run("embedded:spec-always-pg") == ("embedded", "spec-always-pg", None)
    _, pg = sp.server_args("embedded", "spec-always-pg", None, args)
    assert pg[pg.index("--prefill-graph-tokens") + 1] == "1024" and "--speculative-tokens" in pg and "none" in pg
    _, pg = sp.server_args("embedded", "plain-pg", None, args)
    assert "--prefill-graph-tokens" in pg and "--speculative-tokens" not in pg
    assert sp.split_mode("spec-always-pg-aw") == ("spec-always", ["-pg", "-aw"])
    _, both = sp.server_args("embedded", "spec-always-pg-aw", None, args)
    assert both[both.index("--admission-wait-ms") + 1] == "4.0" and "--prefill-graph-tokens" in both
    _, big = sp.server_args("embedded", "spec-pg-t8k", None, args)
    assert big[big.index("--max-num-batched-tokens") + 1] == "8192" and "--speculative-tokens" in big
    assert "--max-num-batched-tokens" not in pg
    # "-pyd": the start-up heap left to the collector; "-si": a 0.2 ms GIL switch interval (interpreter A/B)
    assert sp.split_mode("spec-pg-t8k-pyd") == ("spec", ["-pg", "-t8k", "-pyd"])
    _, pyd = sp.server_args("embedded", "plain-pg-pyd", None, args)
    assert "--no-gc-freeze" in pyd and "--switch-interval-ms" not in pyd
    _, si = sp.server_args("embedded", "plain-pg-si", None, args)
    assert si[si.index("--switch-interval-ms") + 1] == "0.2" and "--no-gc-freeze" not in si
    assert "--switch-interval-ms" not in pg and "--no-gc-freeze" not in pg
    with pytest.raises(SystemExit, match="spec-auto"):
        sp.parse_run("embedded:spec-fast-pg")
    with pytest.raises(SystemExit, match="plain|spec|spec-auto"):
        sp.parse_run("embedded:fast")


def _row(c: int, total: float, tpot_user: float) -> dict:
    return {"concurrency": c, "completed": 4 * c, "output_tokens_per_s": total, "interactivity_tpot_p90": tpot_user}


def test_spec_vs_plain_pairs_modes_and_takes_medians_over_repeats():
    """Each spec mode beside the plain mode with the same suffixes, model and weights; medians over the repeats
    (three of them: the middle value, not the mean); a spec mode without its plain counterpart is left out."""
    sp = _serve_pareto()

    def run(mode, model, totals, tpot, quant=None):
        return {"model": model, "quantization": quant, "run_mode": mode,
                "results": [_row(1, totals[0], tpot), _row(4, totals[1], tpot)]}
    runs = [run("plain-pg", "embedded", (100, 400), 10), run("spec-pg", "embedded", (150, 300), 20),
            run("plain-pg", "embedded", (110, 360), 12), run("spec-pg", "embedded", (130, 320), 30),
            run("plain-pg", "embedded", (90, 1000), 14), run("spec-pg", "embedded", (900, 340), 25),
            run("spec-always-pg", "embedded", (1, 1), 1),            # paired with plain-pg too
            run("spec-pg-t8k", "embedded", (2, 2), 2),               # plain's own step budget: plain-pg
            run("spec", "minimax-m3:5", (50, 50), 5, "nvfp4"),       # no plain of m3:5: left out
            run("plain", "minimax-m3:5", (60, 60), 6, None)]         # other weights: not its counterpart
    cmp = {(c["model"], c["spec_mode"]): c for c in sp.spec_vs_plain(runs)}
    assert set(cmp) == {("embedded", "spec-pg"), ("embedded", "spec-always-pg"), ("embedded", "spec-pg-t8k")}
    assert cmp[("embedded", "spec-pg-t8k")]["plain_mode"] == "plain-pg"
    lv = {r["concurrency"]: r for r in cmp[("embedded", "spec-pg")]["levels"]}
    assert cmp[("embedded", "spec-pg")]["plain_mode"] == "plain-pg"
    assert lv[1]["spec_per_user"] == 150 and lv[1]["plain_per_user"] == 100 and lv[1]["per_user_ratio"] == 1.5
    assert lv[4]["spec_total"] == 320 and lv[4]["plain_total"] == 400 and lv[4]["total_ratio"] == 0.8
    assert lv[4]["spec_per_user"] == 80 and lv[4]["plain_per_user"] == 100
    assert lv[1]["tpot_p90_ratio"] == 25 / 12 and lv[1]["repeats"] == [3, 3]


def test_spec_t8k_pairs_with_a_plain_t8k_when_the_file_ran_one():
    sp = _serve_pareto()
    runs = [{"model": "embedded", "quantization": None, "run_mode": m, "results": [_row(1, t, 1)]}
            for m, t in (("plain-pg", 100), ("plain-pg-t8k", 200), ("spec-pg-t8k", 300))]
    (cmp,) = sp.spec_vs_plain(runs)
    assert cmp["plain_mode"] == "plain-pg-t8k" and cmp["levels"][0]["per_user_ratio"] == 1.5
