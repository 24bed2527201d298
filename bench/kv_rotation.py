"""Real-dims effect of the K/V rotation: attention-output error of the NVFP4 KV cache vs the BF16 KV cache, per
sparse (MSA) layer, without and with the randomized Hadamard rotation (m3serve.kv.rotation).

Method. A model with random weights (a preset, generated on the device) runs one prompt of random token ids
through the stock forward; each sparse layer's q, K, V and indexer inputs are captured. Every layer's attention
(MSA selection + exact fp32 softmax attention, Attention.core, TF32 off) is then recomputed three times with K/V
as the cache would hand them back: BF16 (the reference), NVFP4 through the cache codec, and NVFP4 through the
rotated codec (rotate, encode, decode, un-rotate: exactly PagedKVCache.write / read). Each variant's NVFP4 global
scales are calibrated as m3serve calibrate-kv does (choose_nvfp4_amax, in that variant's basis) on a second,
independent prompt, so the measured prompt is never the calibration text.

    rel_err(layer) = ||o_nvfp4 - o_bf16||_F / ||o_bf16||_F    over every query token and head

Usage:
    python bench/kv_rotation.py [--preset minimax-m3:5] [--device cuda] [--tokens 4096] [--json OUT]
    python bench/kv_rotation.py --preset tiny --device cpu --tokens 96      (a CPU smoke run)
    python bench/kv_rotation.py --preset m3serve/assets/m3-tiny-verse --device cpu --tokens 512   (trained weights)
Writes (with --json) the per-layer figures, the mean over layers and the unrotated / rotated ratio.

Shape legend: q [T, Hq, D], k / v [T, Hk, D], iq [T, Hk, Di], ik [T, Di], o [T, Hq, D].
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kernels.catalog import true_fp32  # noqa: E402
from m3serve.kv import rotation  # noqa: E402
from m3serve.kv.calibrate import cache_roundtrip, choose_nvfp4_amax  # noqa: E402
from m3serve.model.loader import load_model  # noqa: E402
from m3serve.quant.nvfp4 import nvfp4_global_scale  # noqa: E402


@contextlib.contextmanager
def capture_projections(model, layers, store: dict):
    """Within the block, each of `layers`' attention records (q, k, v, iq, ik) of its projection in store[layer]."""
    def wrap(layer, original):
        def project(x, cos, sin, detach_indexer=False, positions=None):
            out = original(x, cos, sin, detach_indexer, positions=positions)
            store[layer] = tuple(None if t is None else t.detach()[0] for t in out)  # batch row 0
            return out
        return project

    try:
        for i in layers:
            attn = model.layers[i].attn
            attn.project = wrap(i, attn.project)
        yield
    finally:
        for i in layers:
            del model.layers[i].attn.project


def projections(model, ids: torch.Tensor, layers) -> dict:
    store: dict = {}
    with capture_projections(model, layers, store), torch.no_grad():
        model.forward_train(ids[None])
    return store


def attention(attn, q, k, v, iq, ik) -> torch.Tensor:
    """The layer's stock attention (MSA selection from the unchanged indexer, fp32 softmax) -> o [T, Hq, D]."""
    t = q.shape[0]
    pos = torch.arange(t, device=q.device)[None]
    with true_fp32():
        return attn.core(q[None].float(), k[None].float(), v[None].float(), iq[None].float(), ik[None].float(),
                         pos)[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(args) -> dict:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    trained = os.path.isdir(args.preset)   # a checkpoint directory (e.g. the embedded model) instead of a preset
    model = load_model(args.preset, device=dev, dtype=dtype, random_weights=not trained, seed=args.seed)
    load_s = time.perf_counter() - t0
    cfg = model.cfg
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.layer_types[i] == "sparse"]
    if not sparse:
        raise ValueError(f"--preset {args.preset}: no sparse (MSA) layer, so no NVFP4 K/V to measure")
    signs = rotation.rotation_signs(cfg.head_dim, args.rotation_seed).to(dev)
    gen = torch.Generator().manual_seed(args.seed + 1)
    calib_ids, eval_ids = (torch.randint(0, cfg.vocab_size, (args.tokens,), generator=gen).to(dev) for _ in range(2))
    calib = projections(model, calib_ids, sparse)
    measured = projections(model, eval_ids, sparse)
    layers = {}
    for i in sparse:
        _, ck, cv, _, _ = calib[i]
        q, k, v, iq, ik = measured[i]
        k, v = k.float(), v.float()
        kb, vb = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        attn = model.layers[i].attn
        ref = attention(attn, q, kb, vb, iq, ik)
        row = {}
        for name, sg in (("nvfp4", None), ("nvfp4_rotated", signs)):
            basis_k = ck.float() if sg is None else rotation.rotate(ck, sg)
            basis_v = cv.float() if sg is None else rotation.rotate(cv, sg)
            gs_k = nvfp4_global_scale(choose_nvfp4_amax(basis_k).amax).to(dev)
            gs_v = nvfp4_global_scale(choose_nvfp4_amax(basis_v).amax).to(dev)
            kq, vq = cache_roundtrip("nvfp4", k, gs_k, sg), cache_roundtrip("nvfp4", v, gs_v, sg)
            out = attention(attn, q, kq, vq, iq, ik)
            row[name] = {"attn_out_rel_err": rel(out, ref), "k_rel_err": rel(kq, kb), "v_rel_err": rel(vq, vb)}
        row["ratio_unrotated_over_rotated"] = row["nvfp4"]["attn_out_rel_err"] / row["nvfp4_rotated"]["attn_out_rel_err"]
        layers[str(i)] = row
        print(f"layer {i}: attention-output rel err NVFP4 {row['nvfp4']['attn_out_rel_err']:.4g}  rotated "
              f"{row['nvfp4_rotated']['attn_out_rel_err']:.4g}  ({row['ratio_unrotated_over_rotated']:.2f}x)   "
              f"K {row['nvfp4']['k_rel_err']:.3g} -> {row['nvfp4_rotated']['k_rel_err']:.3g}   "
              f"V {row['nvfp4']['v_rel_err']:.3g} -> {row['nvfp4_rotated']['v_rel_err']:.3g}")
    mean = {name: sum(r[name]["attn_out_rel_err"] for r in layers.values()) / len(layers)
            for name in ("nvfp4", "nvfp4_rotated")}
    doc = {**run_metadata(), "preset": args.preset, "weights": "checkpoint" if trained else "random", "device": str(dev), "model_dtype": str(dtype).split(".")[-1],
           "tokens": args.tokens, "seed": args.seed, "rotation_seed": args.rotation_seed,
           "head_dim": cfg.head_dim, "hadamard_block": rotation.hadamard_block(cfg.head_dim),
           "method": ("random-weights model; one random-token prompt per layer's q/K/V; attention (MSA selection + "
                      "fp32 softmax, TF32 off) with BF16 K/V vs the cache codec's NVFP4 round trip, unrotated and "
                      "Hadamard-rotated, global scales calibrated per variant on an independent random prompt"),
           "load_s": load_s, "layers": layers, "mean_attn_out_rel_err": mean,
           "mean_ratio_unrotated_over_rotated": mean["nvfp4"] / mean["nvfp4_rotated"]}
    print(f"mean over {len(layers)} sparse layers: NVFP4 {mean['nvfp4']:.4g}, rotated {mean['nvfp4_rotated']:.4g} "
          f"({doc['mean_ratio_unrotated_over_rotated']:.2f}x lower with rotation)")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="minimax-m3:5")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (random token ids)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed; the prompts use seed + 1")
    ap.add_argument("--rotation-seed", type=int, default=rotation.DEFAULT_ROTATION_SEED)
    ap.add_argument("--json", default=None, help="write the result here (e.g. bench/results/kv_rotation/kv-rotation-h200.json)")
    args = ap.parse_args(argv)
    if args.tokens < 2:
        raise ValueError(f"--tokens: expected at least 2, found {args.tokens}")
    doc = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
