"""Would smoothing K/V before NVFP4 close the embedded model's NVFP4-KV gap? Per sparse (MSA) layer: K/V round-trip
relative error and attention-output relative error of the NVFP4 cache vs the BF16 cache, plain / rotated /
smoothed / smoothed + rotated, on the embedded model's real activations; and how large the common component is.

Smoothing. Subtract a calibrated per-(layer, KV head, channel) mean from K and from V before the cache quantizes
them and add it back when they are read:

    stored   y_k = Q(k - mu_k),  y_v = Q(v - mu_v)           (Q: the cache codec's NVFP4 round trip, rotated or not)
    read     k^ = y_k + mu_k,    v^ = y_v + mu_v

Exact in exact arithmetic however the kernel uses it: softmax over keys is invariant to q.mu_k (the same for every
key of one query, whichever keys MSA selects), so a kernel may attend over y_k directly; and the attention weights
of a query sum to 1, so sum_j p_j v^_j = sum_j p_j y_v_j + mu_v (a kernel may add mu_v to its output instead). Here
both are added back on read (what the stock cache would do); the measured error is Q's alone.

Method. The fp32 stock model runs `m3serve calibrate-kv`'s calibration text (synthetic chats, --calib-seed, every
held-out eval question excluded); each sparse layer's K and V (post k_norm and RoPE: what the cache stores) give
mu = their mean over all calibration tokens per (KV head, channel), and every variant's NVFP4 amax is chosen there
in that variant's basis (choose_nvfp4_amax, as calibrate-kv does). The error is measured on other chats (--seed,
excluding the held-out questions and every calibration question), one sequence at a time: each layer's attention
(MSA selection from the unchanged indexer + exact fp32 softmax, Attention.core, TF32 off) is recomputed with K/V
as each variant's cache would hand them back, against the BF16 cache as reference:

    rel_err(layer) = sqrt(sum_seq ||o_variant - o_bf16||^2 / sum_seq ||o_bf16||^2)   over every token and head

Also per layer: the share of K's and V's energy in the mean (||mu||^2 / E||x||^2 over heads), the median and max
|mu| / std per channel, and the attention error with only K (or only V) quantized, smoothed+rotated vs rotated.

Usage: python bench/kv_smoothing.py [--model DIR] [--calib-items 256] [--items 128] [--json OUT]
Shape legend: k, v [N, Hk, D] (N calibration tokens); mu, std [Hk, D]; q [T, Hq, D], o [T, Hq, D].
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.catalog import true_fp32  # noqa: E402
from m3serve.kv import rotation  # noqa: E402
from m3serve.kv.calibrate import (CALIBRATION_ITEMS, CALIBRATION_SEED, cache_roundtrip,  # noqa: E402
                                  calibration_chats, choose_nvfp4_amax, collect_kv, encode_calibration_texts,
                                  heldout_questions)
from m3serve.model.loader import load_model  # noqa: E402
from m3serve.quant.nvfp4 import nvfp4_global_scale  # noqa: E402
from m3serve.tokenizer import load_tokenizer  # noqa: E402

VARIANTS = (("nvfp4", False, False), ("nvfp4_rotated", True, False), ("nvfp4_smoothed", False, True),
            ("nvfp4_smoothed_rotated", True, True))


def capture(model, ids: torch.Tensor, layers) -> dict:
    """{layer: (q, k, v, iq, ik)} of one sequence's stock forward (batch row 0)."""
    store: dict = {}

    def wrap(layer, original):
        def project(x, cos, sin, detach_indexer=False, positions=None):
            out = original(x, cos, sin, detach_indexer, positions=positions)
            store[layer] = tuple(None if t is None else t.detach()[0] for t in out)
            return out
        return project

    try:
        for i in layers:
            model.layers[i].attn.project = wrap(i, model.layers[i].attn.project)
        with torch.no_grad():
            model.forward_train(ids[None])
    finally:
        for i in layers:
            del model.layers[i].attn.project
    return store


def attention(attn, q, k, v, iq, ik) -> torch.Tensor:
    pos = torch.arange(q.shape[0], device=q.device)[None]
    with true_fp32():
        return attn.core(q[None].float(), k[None].float(), v[None].float(), iq[None].float(), ik[None].float(),
                         pos)[0]


class Codec:
    """One variant's cache round trip x [T, Hk, D] -> what the cache reads back, with its calibrated amax."""

    def __init__(self, calib: torch.Tensor, mu: torch.Tensor | None, signs: torch.Tensor | None):
        self.mu, self.signs = mu, signs
        basis = calib if mu is None else calib - mu
        basis = basis if signs is None else rotation.rotate(basis, signs)
        self.amax = choose_nvfp4_amax(basis).amax
        self.gs = nvfp4_global_scale(self.amax)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mu is None:
            return cache_roundtrip("nvfp4", x, self.gs, self.signs)
        return cache_roundtrip("nvfp4", x - self.mu, self.gs, self.signs) + self.mu


def mean_stats(x: torch.Tensor, mu: torch.Tensor) -> dict:
    xd = x.double()
    std = xd.std(0)
    ratio = mu.double().abs() / std
    return {"mean_energy_share": float(mu.double().pow(2).sum() / xd.pow(2).mean(0).sum()),
            "abs_mu_over_std_median": float(ratio.median()), "abs_mu_over_std_max": float(ratio.max()),
            "rms": float(xd.pow(2).mean().sqrt()), "rms_after_smoothing": float((xd - mu.double()).pow(2).mean().sqrt()),
            "max_abs": float(xd.abs().max()), "max_abs_after_smoothing": float((xd - mu.double()).abs().max())}


def run(args) -> dict:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = load_model(args.model, device="cpu", dtype=torch.float32)
    tok = load_tokenizer(args.model)
    sparse = [i for i in range(len(model.layers)) if model.layers[i].attn.sparse]
    if not sparse:
        raise ValueError(f"--model {args.model}: no sparse (MSA) layer, so no NVFP4 K/V to measure")
    heldout = heldout_questions(args.model)
    calib_chats = calibration_chats(args.calib_items, args.calib_seed, heldout)
    calib_q = {p for p, _ in calib_chats}
    meas_chats = [c for c in calibration_chats(args.items * 2, args.seed, heldout) if c[0] not in calib_q][:args.items]
    if len(meas_chats) < args.items:
        raise ValueError(f"--items {args.items}: only {len(meas_chats)} measurement chats of seed {args.seed} are "
                         f"neither held-out nor calibration questions")
    calib_seqs, _ = encode_calibration_texts(tok, calib_chats)
    meas_seqs, _ = encode_calibration_texts(tok, meas_chats)
    signs = rotation.rotation_signs(model.cfg.head_dim, args.rotation_seed)
    calib = collect_kv(model, calib_seqs, sparse)
    codecs, stats = {}, {}
    for i, (ck, cv) in calib.items():
        mu_k, mu_v = ck.mean(0), cv.mean(0)
        stats[i] = {"k": mean_stats(ck, mu_k), "v": mean_stats(cv, mu_v)}
        codecs[i] = {name: (Codec(ck, mu_k if sm else None, signs if rot else None),
                            Codec(cv, mu_v if sm else None, signs if rot else None)) for name, rot, sm in VARIANTS}
    # sums[layer][variant] = [attn err^2, K err^2, V err^2]; ref[layer] = [||o||^2, ||k||^2, ||v||^2]
    # (K-only / V-only variants: the attention error with one tensor quantized, the other BF16)
    only = ("k_only_rotated", "k_only_smoothed_rotated", "v_only_rotated", "v_only_smoothed_rotated")
    sums = {i: {name: [0.0, 0.0, 0.0] for name in [v[0] for v in VARIANTS] + list(only)} for i in sparse}
    ref = {i: [0.0, 0.0, 0.0] for i in sparse}
    tokens = 0
    for ids in meas_seqs:
        tokens += ids.numel()
        cap = capture(model, ids, sparse)
        for i in sparse:
            q, k, v, iq, ik = cap[i]
            kb, vb = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
            attn = model.layers[i].attn
            o_ref = attention(attn, q, kb, vb, iq, ik)
            ref[i][0] += float(o_ref.double().pow(2).sum())
            ref[i][1] += float(kb.double().pow(2).sum())
            ref[i][2] += float(vb.double().pow(2).sum())
            recon = {}
            for name, _, _ in VARIANTS:
                kc, vc = codecs[i][name]
                kq, vq = kc(k), vc(v)
                recon[name] = (kq, vq)
                o = attention(attn, q, kq, vq, iq, ik)
                acc = sums[i][name]
                acc[0] += float((o.double() - o_ref.double()).pow(2).sum())
                acc[1] += float((kq.double() - kb.double()).pow(2).sum())
                acc[2] += float((vq.double() - vb.double()).pow(2).sum())
            for name in only:
                src = recon["nvfp4_" + name.split("_only_")[1]]
                kq, vq = (src[0], vb) if name.startswith("k_") else (kb, src[1])
                o = attention(attn, q, kq, vq, iq, ik)
                sums[i][name][0] += float((o.double() - o_ref.double()).pow(2).sum())
    layers = {}
    for i in sparse:
        row = {"mean_component": stats[i]}
        for name, acc in sums[i].items():
            errs = {"attn_out_rel_err": (acc[0] / ref[i][0]) ** 0.5}
            if not name.endswith(tuple(["only_rotated", "only_smoothed_rotated"])):
                errs.update({"k_rel_err": (acc[1] / ref[i][1]) ** 0.5, "v_rel_err": (acc[2] / ref[i][2]) ** 0.5,
                             "k_amax": codecs[i][name][0].amax, "v_amax": codecs[i][name][1].amax})
            row[name] = errs
        row["ratio_rotated_over_smoothed_rotated"] = (row["nvfp4_rotated"]["attn_out_rel_err"]
                                                      / row["nvfp4_smoothed_rotated"]["attn_out_rel_err"])
        layers[str(i)] = row
        print(f"layer {i}: attn rel err plain {row['nvfp4']['attn_out_rel_err']:.4f}  rotated "
              f"{row['nvfp4_rotated']['attn_out_rel_err']:.4f}  smoothed {row['nvfp4_smoothed']['attn_out_rel_err']:.4f}"
              f"  smoothed+rotated {row['nvfp4_smoothed_rotated']['attn_out_rel_err']:.4f} "
              f"({row['ratio_rotated_over_smoothed_rotated']:.2f}x)   K {row['nvfp4_rotated']['k_rel_err']:.4f} -> "
              f"{row['nvfp4_smoothed_rotated']['k_rel_err']:.4f}  V {row['nvfp4_rotated']['v_rel_err']:.4f} -> "
              f"{row['nvfp4_smoothed_rotated']['v_rel_err']:.4f}   mean energy K "
              f"{stats[i]['k']['mean_energy_share']:.3f} V {stats[i]['v']['mean_energy_share']:.3f}")
    names = [v[0] for v in VARIANTS] + list(only)
    mean = {name: sum(r[name]["attn_out_rel_err"] for r in layers.values()) / len(layers) for name in names}
    doc = {**run_metadata(), "model": args.model, "device": "cpu", "model_dtype": "float32",
           "calibration": {"text_set": "m3serve calibrate-kv's synthetic chats (held-out questions excluded)",
                           "seed": args.calib_seed, "items": args.calib_items,
                           "tokens": int(sum(s.numel() for s in calib_seqs))},
           "measured": {"text_set": "synthetic chats of another seed, held-out and calibration questions excluded",
                        "seed": args.seed, "items": args.items, "tokens": tokens},
           "rotation_seed": args.rotation_seed, "head_dim": model.cfg.head_dim,
           "method": ("mu = per-(KV head, channel) mean of K / V over the calibration tokens; smoothed variants store "
                      "Q(x - mu) and read Q(x - mu) + mu; per-variant NVFP4 amax chosen on the calibration tokens in "
                      "the variant's basis; attention (MSA selection + fp32 softmax, TF32 off) per measured sequence "
                      "vs the BF16 cache; errors pooled over sequences"),
           "wall_s": time.perf_counter() - t0, "layers": layers, "mean_attn_out_rel_err": mean,
           "mean_ratio_rotated_over_smoothed_rotated": mean["nvfp4_rotated"] / mean["nvfp4_smoothed_rotated"]}
    print("mean over sparse layers: " + "  ".join(f"{n} {mean[n]:.4f}" for n in names))
    print(f"rotated / smoothed+rotated: {doc['mean_ratio_rotated_over_smoothed_rotated']:.2f}x")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join("m3serve", "assets", "m3-tiny-verse"))
    ap.add_argument("--calib-items", type=int, default=CALIBRATION_ITEMS)
    ap.add_argument("--calib-seed", type=int, default=CALIBRATION_SEED)
    ap.add_argument("--items", type=int, default=128, help="measured chats")
    ap.add_argument("--seed", type=int, default=2, help="the measured chats' seed (not the calibration's)")
    ap.add_argument("--rotation-seed", type=int, default=rotation.DEFAULT_ROTATION_SEED)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.seed == args.calib_seed:
        raise ValueError(f"--seed: expected a seed other than --calib-seed {args.calib_seed}")
    doc = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
