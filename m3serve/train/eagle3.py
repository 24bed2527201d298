"""Train an Eagle3 drafter for a trained target (the embedded m3-tiny-verse model) and measure its acceptance.

    python -m m3serve.train.eagle3 --target <model dir> --data <corpus dir> --out <drafter dir> --device cuda
    python -m m3serve.train.eagle3 --eval --target <model dir> --drafter <drafter dir> --data <corpus dir>

Recipe (EAGLE-3, Li et al. 2025), matched step for step to the serving draft loop (engine/speculative.py):
- features: the frozen target's residual streams entering the capture layers (forward pre-hooks on those
  layers' input norms during `forward_train`, i.e. the serving convention of ForwardBatch.capture_layers),
  fused by the drafter's fc_norm + fc (trained);
- training-time test (TTT), unrolled over S >= 3 steps. At anchor p (every position of a window):
    step 0 input (token x_{p+1}, fused target features at p), RoPE position p;
    step s input (token x_{p+s+1}, the drafter's own pre-norm output of step s-1), RoPE position p+s;
    step s attends to the step-0 keys at positions <= p (the draft KV that serving rebuilds from target
    features) and to the step-1..s keys of the same anchor (the draft KV serving writes at p+1..p+s);
- loss: sum_s w^s * CE(draft logits at step s, softmax(target logits at p+s+1)): soft labels from the frozen
  target, since acceptance is agreement with the target, not with the corpus; w = 0.8;
- data: random windows of the prepared corpus's training text plus the synthetic chats (the target's training
  mix), tokenized with the target's tokenizer; the held-out plays are never trained on;
- the drafter shares the target's (frozen) embedding; its own LM head starts as a copy of the target's;
  AdamW, warm-up then cosine, bf16 autocast on CUDA, grad clip; a wall-clock cap ends training early.

Shape legend: B windows, T positions per window, H hidden, Hq/Hk heads, D head dim, V vocab, S TTT steps.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.speculative import speculative_engine
from m3serve.llm import parse_dtype
from m3serve.model.eagle3 import Eagle3Config, Eagle3Drafter, LlamaRMSNorm, default_capture_layers, save_drafter
from m3serve.model.loader import load_model
from m3serve.train.data import load_corpus
from m3serve.train.stream import TokenStream, encode_chats, encode_documents
from m3serve.train.synthetic import make_split
from m3serve.train.tokenizer import chat_prompt

REPORT = "train_report.json"


# ---------------------------------------------------------------------- features
def pick_capture_layers(num_layers: int) -> tuple[int, ...]:
    """The default (2, L//2, L-3) when its ids are distinct; small models (L < 8 or so) get three distinct
    low / middle / high streams instead (e.g. (1, 3, 5) for 6 layers)."""
    d = default_capture_layers(num_layers)
    if len(set(d)) == len(d):
        return d
    alt = (1, num_layers // 2, num_layers - 1)
    if len(set(alt)) == 3 and min(alt) >= 0:
        return alt
    return tuple(int(round(x)) for x in np.linspace(0, num_layers, 3))


class FeatureTap:
    """Records the residual stream entering target layer i (input of its input norm; i = L: the final norm's
    input) during any forward of the target, e.g. `forward_train`."""

    def __init__(self, target, layers: tuple[int, ...]):
        self.out: dict[int, torch.Tensor] = {}
        n = target.cfg.num_hidden_layers
        self._handles = []
        for i in sorted(set(layers)):
            mod = target.layers[i].input_norm if i < n else target.norm
            self._handles.append(mod.register_forward_pre_hook(self._hook(i)))

    def _hook(self, i: int):
        def fn(_mod, args):
            self.out[i] = args[0]
        return fn

    def close(self) -> None:
        for h in self._handles:
            h.remove()


# ---------------------------------------------------------------------- TTT forward and loss
def _ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                   causal: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, D]; ks/vs: per step s <= current, [B, T, Hk, D]. Step-0 keys causally (key <= anchor), then
    the diagonal (same anchor) of every later step. -> [B, T, Hq, D] fp32."""
    b, t, hq, d = q.shape
    hk = ks[0].shape[2]
    qg = q.float().view(b, t, hk, hq // hk, d)
    s0 = torch.einsum("bthgd,blhd->bhgtl", qg, ks[0].float()) * scale              # [B, Hk, G, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [torch.einsum("bthgd,bthd->bhgt", qg, k.float()) * scale for k in ks[1:]]
    scores = torch.cat([s0] + [x.unsqueeze(-1) for x in diag], dim=-1)
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhgtl,blhd->bthgd", p[..., :t], vs[0].float())
    for i, v in enumerate(vs[1:]):
        o = o + torch.einsum("bhgt,bthd->bthgd", p[..., t + i], v.float())
    return o.reshape(b, t, hq, d)


def ttt_logits(drafter: Eagle3Drafter, tokens: torch.Tensor, fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """tokens [B, T+1] (the window), fused [B, T, H] (target features at positions 0..T-1) -> S logits
    [B, T, Vd]: entry s at anchor p is the drafter's proposal for token x_{p+s+2} (valid for p+s+1 <= T-1)."""
    b, t1 = tokens.shape
    t = t1 - 1
    layer = drafter.midlayer
    dev = tokens.device
    pos = torch.arange(t, device=dev)
    causal = pos.view(1, t) <= pos.view(t, 1)                                       # [T (query), T (key)]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    hidden = fused
    out = []
    for s in range(steps):
        tok = tokens[:, (pos + s + 1).clamp(max=t)]
        q, k, v, residual = layer.project(drafter.embed(tok), hidden, (pos + s).expand(b, t))
        ks.append(k)
        vs.append(v)
        o = _ttt_attention(q, ks, vs, layer.self_attn.scale, causal)
        normed, hidden = layer.finish(o, residual, drafter.norm)
        out.append(drafter.logits(normed))
    return out


def ttt_loss(step_logits: list[torch.Tensor], target_logits: torch.Tensor, decay: float = 0.8
             ) -> tuple[torch.Tensor, list[float], list[float]]:
    """Soft-label CE per step (weights decay^s) -> (loss, per-step CE, per-step top-1 agreement with the
    target's argmax = greedy acceptance of that step given the previous ones)."""
    t = target_logits.shape[1]
    loss = target_logits.new_zeros(())
    ces, accs = [], []
    for s, lg in enumerate(step_logits):
        n = t - 1 - s
        if n <= 0:
            break
        tgt = target_logits[:, s + 1:].float()
        logq = torch.log_softmax(lg[:, :n].float(), dim=-1)
        ce = -(torch.softmax(tgt, dim=-1) * logq).sum(-1).mean()
        loss = loss + decay ** s * ce
        ces.append(float(ce.detach()))
        accs.append(float((lg[:, :n].argmax(-1) == tgt.argmax(-1)).float().mean()))
    return loss, ces, accs


# ---------------------------------------------------------------------- model construction
def new_drafter(target, capture_layers: tuple[int, ...] | None = None, seed: int = 0, std: float = 0.02,
                own_lm_head: bool = True) -> Eagle3Drafter:
    """A fresh drafter for `target`: Llama norms at 1, linears N(0, std), and either its own LM head copied from
    the target's (trained) or the target's head itself (frozen, not saved)."""
    cfg = Eagle3Config.for_target(target.cfg, capture_layers=capture_layers or
                                  pick_capture_layers(target.cfg.num_hidden_layers))
    net = Eagle3Drafter(cfg, own_lm_head=own_lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, torch.nn.Linear) and m is not net.lm_head:
                m.weight.copy_(std * torch.randn(m.weight.shape, generator=g))
        if own_lm_head:
            net.lm_head.weight.copy_(target.lm_head.dense_weight(torch.float32).cpu())
    return net.to(target.device).attach_target(target)


# ---------------------------------------------------------------------- data
def _streams(target_dir: str | Path, data_dir: str | Path, n_syn_train: int, n_syn_held: int, seed: int,
             train: bool = True):
    from tokenizers import Tokenizer


    tok_file = Path(target_dir) / "tokenizer.json"
    if not tok_file.exists():
        raise FileNotFoundError(f"--target {target_dir}: no tokenizer.json (the drafter trains on the target's tokens)")
    tok = Tokenizer.from_file(str(tok_file))
    corpus = load_corpus(data_dir)
    syn_train, syn_held = make_split(n_syn_train, n_syn_held, seed)
    out = {"text_heldout": TokenStream(encode_documents(tok, [d.text for d in corpus.heldout]), "text_heldout"),
           "chat_heldout": TokenStream(encode_chats(tok, syn_held), "chat_heldout")}
    if train:
        out["text_train"] = TokenStream(encode_documents(tok, [d.text for d in corpus.train]), "text_train")
        out["chat_train"] = TokenStream(encode_chats(tok, syn_train), "chat_train")
    return out


# ---------------------------------------------------------------------- training
@dataclass
class DrafterTrainConfig:
    steps: int = 3000
    max_seconds: float = 150.0      # wall-clock cap of the training loop (the run must fit in 3 minutes)
    batch_size: int = 32
    seq_len: int = 512
    ttt_steps: int = 3
    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss_decay: float = 0.8
    syn_fraction: float = 0.25
    n_syn_train: int = 20_000
    n_syn_heldout: int = 500
    seed: int = 0
    device: str = "cuda"
    autocast: bool = True
    log_every: int = 50
    capture_layers: tuple[int, ...] | None = None
    share_lm_head: bool = False     # use the target's (frozen) head: a smaller drafter, usually lower acceptance

    def validate(self) -> None:
        if self.ttt_steps < 3:
            raise ValueError(f"ttt_steps: expected >= 3 (training-time test length), found {self.ttt_steps}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, found {getattr(self, name)}")
        if self.seq_len <= self.ttt_steps:
            raise ValueError(f"seq_len: expected > ttt_steps ({self.ttt_steps}), found {self.seq_len}")


def _lr(step: int, elapsed: float, tc: DrafterTrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine to min_lr_ratio. Progress is the larger of the step and the
    wall-clock fraction, so a run cut short by max_seconds still ends annealed."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    frac = max((step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps), elapsed / tc.max_seconds)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _autocast(device: torch.device, on: bool):
    import contextlib
    return torch.autocast("cuda", dtype=torch.bfloat16) if on and device.type == "cuda" else contextlib.nullcontext()


def _batch(streams: dict, tc: DrafterTrainConfig, gen: torch.Generator) -> torch.Tensor:
    n_syn = int(round(tc.batch_size * tc.syn_fraction)) if len(streams["chat_train"]) > tc.seq_len + 1 else 0
    rows = []
    if tc.batch_size > n_syn:
        rows.append(streams["text_train"].sample(tc.batch_size - n_syn, tc.seq_len, gen))
    if n_syn:
        rows.append(streams["chat_train"].sample(n_syn, tc.seq_len, gen))
    return torch.cat(rows)


def _step_tensors(target, drafter, tap, x: torch.Tensor, tc: DrafterTrainConfig, dev: torch.device):
    t = x.shape[1] - 1
    with torch.no_grad(), _autocast(dev, tc.autocast):
        tlogits, _ = target.forward_train(x[:, :t])
    states = [tap.out[i].detach() for i in drafter.cfg.capture_layers]
    with _autocast(dev, tc.autocast):
        fused = drafter.fuse(states)
        logits = ttt_logits(drafter, x, fused, tc.ttt_steps)
    return logits, tlogits.float()


@torch.no_grad()
def heldout_agreement(target, drafter: Eagle3Drafter, windows: torch.Tensor, tc: DrafterTrainConfig,
                      batch_size: int = 8) -> dict:
    """Offline TTT metrics on held-out windows [k, T+1]: per-step CE and top-1 agreement with the target."""
    dev = target.device
    tap = FeatureTap(target, drafter.cfg.capture_layers)
    ces, accs, n = np.zeros(tc.ttt_steps), np.zeros(tc.ttt_steps), 0
    try:
        for s in range(0, windows.shape[0], batch_size):
            x = windows[s:s + batch_size].to(dev)
            logits, tl = _step_tensors(target, drafter, tap, x, tc, dev)
            _, ce, acc = ttt_loss(logits, tl, tc.loss_decay)
            ces[:len(ce)] += np.asarray(ce) * x.shape[0]
            accs[:len(acc)] += np.asarray(acc) * x.shape[0]
            n += x.shape[0]
    finally:
        tap.close()
    acc = accs / max(n, 1)
    # Expected greedy acceptance length if step s is accepted with prob acc_s given the previous ones.
    al = 1.0 + float(np.sum(np.cumprod(acc)))
    return {"ce_per_step": (ces / max(n, 1)).tolist(), "top1_agreement_per_step": acc.tolist(),
            "offline_acceptance_length": al}


def train_drafter(target_dir: str | Path, data_dir: str | Path, out_dir: str | Path, tc: DrafterTrainConfig,
                  log: Callable[[str], None] = print, target=None) -> dict:
    """Train and save a drafter for the target checkpoint in `target_dir`; returns the report."""
    tc.validate()
    t0 = time.perf_counter()
    dev = torch.device(tc.device)
    torch.manual_seed(tc.seed)
    if target is None:
        target = load_model(str(target_dir), device=dev, dtype=torch.float32)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    streams = _streams(target_dir, data_dir, tc.n_syn_train, tc.n_syn_heldout, tc.seed)
    t_data = time.perf_counter() - t0
    drafter = new_drafter(target, tc.capture_layers, tc.seed, own_lm_head=not tc.share_lm_head)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95),
                            fused=dev.type == "cuda")
    n_params = sum(p.numel() for p in params)
    log(f"drafter: {n_params} trainable parameters, capture layers {drafter.cfg.capture_layers}, "
        f"TTT {tc.ttt_steps} steps, batch {tc.batch_size}x{tc.seq_len}, up to {tc.steps} steps / "
        f"{tc.max_seconds:.0f} s on {dev}; data {t_data:.1f} s")
    gen = torch.Generator().manual_seed(tc.seed)
    tap = FeatureTap(target, drafter.cfg.capture_layers)
    curve = []
    t_train = time.perf_counter()
    step = 0
    try:
        for step in range(tc.steps):
            lr = _lr(step, time.perf_counter() - t_train, tc)
            for g in opt.param_groups:
                g["lr"] = lr
            x = _batch(streams, tc, gen).to(dev, non_blocking=True)
            logits, tl = _step_tensors(target, drafter, tap, x, tc, dev)
            loss, ces, accs = ttt_loss(logits, tl, tc.loss_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            elapsed = time.perf_counter() - t_train
            last = step == tc.steps - 1 or elapsed > tc.max_seconds
            if step % tc.log_every == 0 or last:
                rec = {"step": step, "lr": lr, "loss": float(loss.detach()), "ce": ces, "top1": accs,
                       "grad_norm": float(gnorm), "elapsed_s": round(elapsed, 2)}
                curve.append(rec)
                log(f"step {step:5d}  loss {rec['loss']:.4f}  top1 {' '.join(f'{a:.3f}' for a in accs)}  "
                    f"lr {lr:.2e}  {elapsed:.1f} s")
                if not math.isfinite(rec["loss"]):
                    raise FloatingPointError(f"drafter training diverged at step {step}: loss {rec['loss']}")
            if last:
                break
    finally:
        tap.close()
    train_s = time.perf_counter() - t_train
    drafter.eval()
    held = streams["text_heldout"]
    windows = held.fixed_windows(16, min(tc.seq_len, max(8, len(held) // 2 - 1)))
    agreement = heldout_agreement(target, drafter, windows, tc)
    report = {
        "recipe": {**asdict(tc), "capture_layers": list(drafter.cfg.capture_layers), "steps_run": step + 1,
                   "command": "python -m m3serve.train.eagle3 --target <model dir> --data <corpus dir> --out <dir>"},
        "parameters": n_params,
        "curve": curve,
        "heldout_text": agreement,
        "timing_s": {"data": round(t_data, 2), "train": round(train_s, 2),
                     "total": round(time.perf_counter() - t0, 2)},
        "versions": {"torch": torch.__version__},
    }
    out = Path(out_dir)
    save_drafter(drafter, str(out), meta={"target": str(target_dir), "steps": step + 1,
                                          "heldout_offline_acceptance_length": agreement["offline_acceptance_length"]})
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out text: top-1 agreement per step {[round(a, 3) for a in agreement['top1_agreement_per_step']]}, "
        f"offline AL {agreement['offline_acceptance_length']:.3f}; trained {step + 1} steps in {train_s:.1f} s; "
        f"wrote {out}")
    return report


# ---------------------------------------------------------------------- acceptance length in the engine
def _run(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], float, int]:
    reqs = [engine.add_request(p, params) for p in prompts]
    t = time.perf_counter()
    while any(not r.is_finished for r in reqs):
        engine.step()
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    toks = [list(r.output_token_ids) for r in reqs]
    for r in reqs:
        engine.release(r)
    return toks, dt, sum(len(x) for x in toks)


def _chat_prompts(target_dir: str | Path, n: int, seed: int) -> list[list[int]]:
    """Held-out synthetic questions (the target's held-out split) as single-turn chat prompts."""
    from tokenizers import Tokenizer


    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    _, held = make_split(0, n, seed)
    return [tok.encode(chat_prompt(p.question), add_special_tokens=False).ids for p in held]


def measure_acceptance(target_dir: str | Path, drafter_dir: str | Path, data_dir: str | Path, *,
                       device: str = "cpu", dtype: str = "auto", k: int = 3, num_prompts: int = 16,
                       prompt_len: int = 64, max_tokens: int = 64, temperatures: tuple[float, ...] = (0.0, 0.8),
                       sources: tuple[str, ...] = ("text",), seed: int = 0, log: Callable[[str], None] = print,
                       target=None) -> dict:
    """AL (mean tokens per verify step) of the real speculative engine at K = k, greedy and sampled, plus
    end-to-end tokens/s of plain vs speculative decoding on the same prompts. Sources: "text" = windows of
    prompt_len tokens of the held-out plays, continued for max_tokens; "chat" = held-out synthetic questions as
    chat prompts, answered until <|eos|> or max_tokens."""
    bad = set(sources) - {"text", "chat"}
    if bad:
        raise ValueError(f"sources: expected 'text' and/or 'chat', found {sorted(bad)}")
    dev = torch.device(device)
    dt = parse_dtype(dtype, dev)
    if target is None:
        target = load_model(str(target_dir), device=dev, dtype=dt)
    prompt_sets = {}
    if "text" in sources:
        held = _streams(target_dir, data_dir, 0, 0, seed, train=False)["text_heldout"]
        prompt_sets["text"] = [w[:prompt_len].tolist() for w in held.fixed_windows(num_prompts, prompt_len)]
    if "chat" in sources:
        prompt_sets["chat"] = _chat_prompts(target_dir, num_prompts, seed)
    longest = max(len(p) for ps in prompt_sets.values() for p in ps)
    ecfg = EngineConfig(max_num_seqs=max(num_prompts, 1), max_num_batched_tokens=max(2048, longest * num_prompts),
                        seed=seed, kv_cache_bytes=(1 << 30) if dev.type == "cuda" else 64 << 20)  # 2 engines, 1 GPU
    plain = LLMEngine(target, ecfg)
    # acceptance is measured at every batch size: the batch-size policy would decode large batches plainly
    spec = speculative_engine(target, ecfg, speculative_config={"method": "eagle3", "model": str(drafter_dir),
                                                                 "num_speculative_tokens": k,
                                                                 "disable_by_batch_size": None})
    out: dict = {"k": k, "num_prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
                 "device": str(dev), "dtype": str(dt), "runs": {}}
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = next(iter(prompt_sets.values()))
    _run(plain, first[:2], warm)
    _run(spec, first[:2], warm)
    for source, prompts in prompt_sets.items():
        out["runs"][source] = {}
        for temp in temperatures:
            params = SamplingParams(max_tokens=max_tokens, temperature=temp, ignore_eos=source == "text", seed=seed)
            ref, t_plain, n_plain = _run(plain, prompts, params)
            spec.speculation.reset_stats()
            got, t_spec, n_spec = _run(spec, prompts, params)
            st = spec.stats()["spec_decode"]
            run = {"acceptance_length": st["acceptance_length"],
                   "acceptance_rate_per_position": st["acceptance_rate_per_position"],
                   "verify_steps": st["verify_steps"], "tokens": n_spec,
                   "plain_tokens_per_s": n_plain / t_plain, "spec_tokens_per_s": n_spec / t_spec,
                   "speedup": (n_spec / t_spec) / (n_plain / t_plain)}
            if temp == 0.0:
                # Exact in fp32; in bf16 the batched verify rows may round differently from single-row decode.
                run["greedy_identical_requests"] = sum(a == b for a, b in zip(ref, got)) / len(ref)
            out["runs"][source][f"temperature_{temp}"] = run
            al = st["acceptance_length"]
            log(f"{source}, K={k}, temperature {temp}: AL {al:.3f}" if al is not None else
                f"{source}, K={k}, temperature {temp}: no verify step")
            rates = [round(x, 3) if x is not None else None for x in run["acceptance_rate_per_position"]]
            log(f"  per-position acceptance {rates}, {n_spec / t_spec:.1f} tok/s speculative vs "
                f"{n_plain / t_plain:.1f} plain")
    return out


# ---------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m m3serve.train.eagle3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="trained target checkpoint directory (with tokenizer.json)")
    ap.add_argument("--data", required=True, help="prepared corpus directory (python -m m3serve.train.data)")
    ap.add_argument("--out", help="drafter directory to write (training)")
    ap.add_argument("--eval", action="store_true", help="measure acceptance length of --drafter instead of training")
    ap.add_argument("--drafter", help="drafter directory (--eval; default: --out)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    d = DrafterTrainConfig()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--max-seconds", type=float, default=d.max_seconds, help="wall-clock cap of the training loop")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--capture-layers", default=None, help="comma-separated ids (residual entering layer i)")
    ap.add_argument("--share-lm-head", action="store_true", help="use the target's LM head (frozen, not saved)")
    ap.add_argument("--no-autocast", action="store_true")
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--no-eval", action="store_true", help="skip the engine AL measurement after training")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens for --eval")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="serving dtype for --eval (auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--sources", default="text", help="comma-separated: text (held-out plays), chat (held-out "
                                                      "synthetic questions)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.eval:
        drafter = args.drafter or args.out
        if not drafter:
            raise SystemExit("--eval needs --drafter <dir>")
        res = measure_acceptance(args.target, drafter, args.data, device=args.device, dtype=args.dtype, k=args.k,
                                 num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                                 max_tokens=args.max_tokens, sources=tuple(args.sources.split(",")), seed=args.seed)
        print(json.dumps(res, indent=2))
        return 0
    if not args.out:
        raise SystemExit("training needs --out <dir>")
    caps = tuple(int(x) for x in args.capture_layers.split(",")) if args.capture_layers else None
    tc = DrafterTrainConfig(steps=args.steps, max_seconds=args.max_seconds, batch_size=args.batch_size,
                            seq_len=args.seq_len, ttt_steps=args.ttt_steps, lr=args.lr, seed=args.seed,
                            device=args.device, autocast=not args.no_autocast, log_every=args.log_every,
                            capture_layers=caps, share_lm_head=args.share_lm_head)
    report = train_drafter(args.target, args.data, args.out, tc)
    if not args.no_eval:
        res = measure_acceptance(args.target, args.out, args.data, device=args.device, dtype=args.dtype, k=args.k,
                                 num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                                 max_tokens=args.max_tokens, sources=tuple(args.sources.split(",")), seed=args.seed)
        report["engine_acceptance"] = res
        (Path(args.out) / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
