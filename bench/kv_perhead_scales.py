"""Would per-head NVFP4 global scales help the rotated hybrid cache? Round-trip relative MSE of each sparse layer's
rotated K and V with one calibrated amax per tensor (what the cache does) vs one per KV head, on the calibration
text of `m3serve calibrate-kv` (never the eval items). The amax only moves E4M3's range; the 16-value block
scales do the rest, so on unit-scale K/V the two should agree.

Usage: python bench/kv_perhead_scales.py [--model DIR] [--items 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from m3serve.benchmeta import run_metadata  # noqa: E402
from m3serve.kv import rotation  # noqa: E402
from m3serve.kv.calibrate import (calibration_chats, choose_nvfp4_amax, collect_kv,  # noqa: E402
                                  encode_calibration_texts, heldout_questions)
from m3serve.model.loader import load_model  # noqa: E402
from m3serve.tokenizer import load_tokenizer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join("m3serve", "assets", "m3-tiny-verse"))
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--rotation-seed", type=int, default=rotation.DEFAULT_ROTATION_SEED)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(args.model, device="cpu", dtype=torch.float32)
    seqs, _ = encode_calibration_texts(load_tokenizer(args.model),
                                       calibration_chats(args.items, 1, heldout_questions(args.model)))
    sparse = [i for i in range(len(model.layers)) if model.layers[i].attn.sparse]
    signs = rotation.rotation_signs(model.cfg.head_dim, args.rotation_seed)
    layers = {}
    for i, (k, v) in collect_kv(model, seqs, sparse).items():
        for name, x in (("k", k), ("v", v)):
            x = rotation.rotate(x, signs)
            ms = float(x.pow(2).mean())
            per_tensor = choose_nvfp4_amax(x).mse / ms
            per_head = sum(choose_nvfp4_amax(x[:, h]).mse * x[:, h].numel() for h in range(x.shape[1])) / (
                x.numel() * ms)
            layers[f"{i}.{name}"] = {"rel_mse_per_tensor_amax": per_tensor, "rel_mse_per_head_amax": per_head}
            print(f"layer {i} {name}: rel MSE per-tensor amax {per_tensor:.5f}, per-head amax {per_head:.5f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_metadata(), "model": args.model, "items": args.items, "tokens": sum(s.numel() for s in seqs),
                       "rotation_seed": args.rotation_seed, "layers": layers}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
