"""Per-layer NVFP4 KV-cache calibration: the K and V clip bounds (amax) behind each layer's global scale, and
the sparse layers too sensitive for NVFP4, which the hybrid cache then keeps in FP8 (KVCacheSpec.fp8_layers).

Shape legend:
    tokens    int64 [T]        one calibration sequence (the model runs one sequence at a time)
    k, v      fp32 [N, Hk, D]  a layer's keys (after k_norm and RoPE: what the cache stores) and values over
                               all N calibration tokens
    amax      float            clip bound; the cache's NVFP4 encode scale is gs = 448*6/amax
                               (m3serve.quant.nvfp4.nvfp4_global_scale)
    logp      fp32 [T, V]      next-token log-probabilities of one sequence (row t predicts token t+1)

Method. The stock model runs in fp32 over a fixed calibration text set (synthetic arithmetic chats drawn with
their own seed, minus every question of the eval's held-out file). For each layer and tensor we evaluate the
exact cache codec (m3serve.kv.codec) at a grid of amax candidates around the observed max|x| and keep the one
with the least round-trip MSE. Every 16-value block has its own E4M3 scale, so the global scale only acts
through E4M3's range: too small an amax saturates the largest blocks (E4M3 tops out at 448), too large an
amax pushes small blocks into E4M3's subnormals. Between the two the MSE is flat up to the E4M3 rounding
ripple (about 1 %), so candidates within REL_TOL of the best count as ties and the largest of them wins: the
widest clip bound at no measurable cost leaves headroom for outliers the calibration text did not show.

FP8 overrides. The amax only moves the clip bound; NVFP4's own precision (E2M1 values, 2-3 significant bits) is
what costs accuracy, and not equally on every layer: on the embedded model the held-out ablation
(bench/kv_quant_ablation.py) loses 7 points with NVFP4 on the first sparse layer (layer 2, mostly its K) alone
and nothing measurable on layers 3-5. `measure_layer_sensitivity` finds such layers without the eval's items:
see its docstring for the proxy and the threshold.

Files. `kv_scales.json` beside a checkpoint (written by `m3serve calibrate-kv`) holds per-layer K and V amax
plus the text set and method, and optionally `fp8_layers` (the sparse layers the hybrid cache stores in FP8)
with the measured reason and the per-layer sensitivities. A checkpoint may instead carry per-layer `k_scale` / `v_scale` tensors (ModelOpt,
compressed-tensors, vLLM names; see m3serve.model.weights.read_kv_cache_scales). `LLM` applies, in this
order of preference, kv_scales.json, then the checkpoint's scales, to every NVFP4 layer of its cache, and
takes kv_scales.json's `fp8_layers` as its default `kv_fp8_layers`.

Rotation. A rotated hybrid cache (KVCacheSpec.kv_rotation_seed) stores each NVFP4 layer's K and V through the
randomized Hadamard rotation of m3serve.kv.rotation, so its amaxes are chosen on the rotated values and the
sensitivity proxy runs the rotated codec. The file records the rotation (`rotation`: kind, seed, head dim,
Hadamard block and the sign vector), which LLM then applies to its cache: amaxes calibrated in one basis are
never used in the other. Since the rotation, every sparse layer of the embedded model stays in NVFP4 by
default: `fp8_layers` is written only when asked for (`fp8_overrides`, `m3serve calibrate-kv --fp8-overrides`);
the sensitivity is measured and recorded either way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from m3serve.eval.tasks import load_task
from m3serve.kv import codec, rotation
from m3serve.kv.cache import DEFAULT_NVFP4_KV_AMAX
from m3serve.kv.scales import FILE_FORMAT, FILE_VERSION, KV_SCALES_FILE, rotation_record
from m3serve.model.loader import load_model
from m3serve.quant.nvfp4 import nvfp4_global_scale
from m3serve.tokenizer import load_tokenizer
from m3serve.train.synthetic import make_split
from m3serve.train.tokenizer import chat_prompt, render_chat

log = logging.getLogger("m3serve")

METHOD = "nvfp4-roundtrip-mse-grid"
# Candidates: observed amax * 2^(i/8), i in [-8, 16]: from half (clipping the largest blocks) to 4x.
GRID_STEPS_PER_OCTAVE = 8
GRID_OCTAVES = (-1, 2)
# MSE differences below 1 % are the E4M3 rounding ripple of the block scales, not a real preference.
REL_TOL = 1e-2
CALIBRATION_SEED = 1          # the eval's held-out synthetic items come from seed 0 (m3serve.eval.cli)
CALIBRATION_ITEMS = 256
SENSITIVITY_METRIC = "completion-token KL(fp32 cache || candidate cache), nats per token"
# A sparse layer goes FP8 when NVFP4 on it alone costs more than this many times the whole FP8 cache
# (see measure_layer_sensitivity for why), and at least MIN_OVERRIDE_KL nats per token.
FP8_OVERRIDE_FACTOR = 2.0
MIN_OVERRIDE_KL = 1e-3


# ----------------------------------------------------------------------------- calibration text
def calibration_texts(num_items: int = CALIBRATION_ITEMS, seed: int = CALIBRATION_SEED,
                      exclude_questions: Iterable[str] = ()) -> list[str]:
    """Chat transcripts (question, worked answer) of synthetic problems drawn with `seed`, none of whose
    questions is in `exclude_questions` (pass the eval's held-out questions)."""
    return [prompt + completion for prompt, completion in calibration_chats(num_items, seed, exclude_questions)]


def calibration_chats(num_items: int = CALIBRATION_ITEMS, seed: int = CALIBRATION_SEED,
                      exclude_questions: Iterable[str] = ()) -> list[tuple[str, str]]:
    """The same transcripts split as (generation prompt, completion): the prompt is exactly what the eval feeds
    the model (chat_prompt(question)), the completion the worked answer and its end-of-turn token."""
    if not isinstance(num_items, int) or num_items <= 0:
        raise ValueError(f"num_items: expected a positive int, found {num_items!r}")
    banned = set(exclude_questions)
    chats: list[tuple[str, str]] = []
    seen: set[str] = set()
    want = num_items
    while len(chats) < num_items:
        if want > 64 * num_items:
            raise ValueError(f"num_items: only {len(chats)} distinct allowed questions among {want // 2} drawn "
                             f"with seed {seed}; expected {num_items}")
        # The train stream of one seed is deterministic and only grows with n, so asking for more
        # items extends the same list; duplicates and banned questions are skipped.
        train, _ = make_split(want, 0, seed=seed)
        chats, seen = [], set()
        for p in train:
            if p.question in banned or p.question in seen:
                continue
            seen.add(p.question)
            prompt = chat_prompt(p.question)
            full = render_chat([{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}])
            if not full.startswith(prompt):
                raise AssertionError(f"chat template: the transcript does not start with the generation prompt "
                                     f"{prompt!r}")
            chats.append((prompt, full[len(prompt):]))
            if len(chats) == num_items:
                break
        want *= 2
    return chats


def heldout_questions(model_dir: str) -> set[str]:
    """The questions `m3serve eval --task synthetic` scores for this checkpoint (never calibrated on)."""
    return {it.question for it in load_task("synthetic", model_dir, None)}


# ----------------------------------------------------------------------------- K/V capture
KVHook = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]


@contextlib.contextmanager
def kv_hooks(model, layers: Sequence[int], hook: KVHook) -> Iterator[None]:
    """Within the block, each of `layers`' attention sends the K and V it would write to the cache through
    hook(layer, k, v) -> (k, v) (k, v [..., T, Hk, D]) and attends over what the hook returns: the cache's
    quantize-on-write / dequantize-on-read seen from the attention. `project` is restored on exit, even on error."""
    originals = {}

    def wrap(layer, original):
        def project(x, cos, sin, detach_indexer=False, positions=None):
            q, k, v, iq, ik = original(x, cos, sin, detach_indexer, positions=positions)
            k, v = hook(layer, k, v)
            return q, k, v, iq, ik
        return project

    try:
        for i in layers:
            attn = model.layers[i].attn
            # Remember whether `project` was already overridden on the instance, to restore exactly that.
            originals[i] = (vars(attn).get("project"), "project" in vars(attn))
            attn.project = wrap(attn.layer, attn.project)
        yield
    finally:
        for i, (original, on_instance) in originals.items():
            attn = model.layers[i].attn
            if on_instance:
                attn.project = original
            else:
                del attn.project          # the class method shows through again


def _check_fp32_model(model) -> None:
    if getattr(model, "dtype", None) != torch.float32:
        raise ValueError(f"model: calibration runs the stock model in fp32, found dtype {getattr(model, 'dtype', None)}")


def _check_seq(j: int, ids) -> None:
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() == 0:
        found = (ids.dtype, tuple(ids.shape)) if isinstance(ids, Tensor) else type(ids).__name__
        raise TypeError(f"token_seqs[{j}]: expected a non-empty int64 [T] tensor, found {found}")


def collect_kv(model, token_seqs: Sequence[Tensor], layers: Sequence[int] | None = None
               ) -> dict[int, tuple[Tensor, Tensor]]:
    """{layer: (k, v)} as the cache would store them, from the stock model's full forward of each sequence.

    The model must be fp32 (the calibration reference). Its attention modules' `project` is wrapped for
    the duration of the call and restored afterwards, even on error.
    """
    _check_fp32_model(model)
    if not token_seqs:
        raise ValueError("token_seqs: expected at least one calibration sequence, found none")
    n_layers = len(model.layers)
    layers = list(range(n_layers)) if layers is None else [int(i) for i in layers]
    for i in layers:
        if not 0 <= i < n_layers:
            raise ValueError(f"layers: expected ids in [0, {n_layers}), found {i}")
    captured: dict[int, list[tuple[Tensor, Tensor]]] = {i: [] for i in layers}

    def record(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        d = k.shape[-1]
        captured[layer].append((k.detach().reshape(-1, k.shape[-2], d).clone(),
                                v.detach().reshape(-1, v.shape[-2], d).clone()))
        return k, v

    with kv_hooks(model, layers, record), torch.no_grad():
        for j, ids in enumerate(token_seqs):
            _check_seq(j, ids)
            model.forward_train(ids.to(model.device)[None])
    return {i: (torch.cat([c[0] for c in caps]), torch.cat([c[1] for c in caps])) for i, caps in captured.items()}


# ----------------------------------------------------------------------------- the amax search
def nvfp4_roundtrip_mse(x: Tensor, amax: float) -> float:
    """Mean squared error of x [..., D] through the cache's NVFP4 encode/decode with gs = 448*6/amax, in fp32."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a float tensor, found {getattr(x, 'dtype', type(x).__name__)}")
    if not (isinstance(amax, (int, float)) and math.isfinite(amax) and amax > 0):
        raise ValueError(f"amax: expected a finite positive float, found {amax!r}")
    gs = nvfp4_global_scale(float(amax))
    xf = x.float()
    data, scale = codec.encode("nvfp4", xf, gs)
    y = codec.decode("nvfp4", data, scale, gs, torch.float32)
    return float((y - xf).pow(2).mean())


@dataclass(frozen=True)
class AmaxChoice:
    amax: float                   # the chosen clip bound
    mse: float                    # round-trip MSE at `amax`
    observed_amax: float          # max|x| over the calibration tokens
    mean_square: float            # mean(x^2): relative MSE = mse / mean_square
    candidates: tuple[tuple[float, float], ...]   # (amax, mse) for every grid point


def amax_grid(observed_amax: float) -> list[float]:
    lo, hi = GRID_OCTAVES
    return [observed_amax * 2.0 ** (i / GRID_STEPS_PER_OCTAVE)
            for i in range(lo * GRID_STEPS_PER_OCTAVE, hi * GRID_STEPS_PER_OCTAVE + 1)]


def choose_nvfp4_amax(x: Tensor, rel_tol: float = REL_TOL) -> AmaxChoice:
    """The grid amax minimising x's NVFP4 round-trip MSE; ties (within rel_tol of the best) go to the largest."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a float tensor, found {getattr(x, 'dtype', type(x).__name__)}")
    if x.numel() == 0:
        raise ValueError("x: expected calibration values, found an empty tensor")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x: expected finite calibration values, found NaN or inf")
    observed = float(x.abs().max())
    if observed == 0.0:
        raise ValueError("x: every calibration value is 0; no clip bound can be chosen")
    table = tuple((a, nvfp4_roundtrip_mse(x, a)) for a in amax_grid(observed))
    best = min(m for _, m in table)
    amax, mse = max((a, m) for a, m in table if m <= best * (1.0 + rel_tol))
    return AmaxChoice(amax, mse, observed, float(x.float().pow(2).mean()), table)


# ----------------------------------------------------------------------------- per-layer NVFP4 sensitivity
# layer -> (storage format, K encode scale, V encode scale); layers not named keep the exact fp32 K/V.
CachePlan = dict[int, tuple[str, Tensor | None, Tensor | None]]


def cache_roundtrip(fmt: str, x: Tensor, gs: Tensor | None, signs: Tensor | None = None) -> Tensor:
    """x [..., D] through the cache codec's encode and decode in `fmt` (what attention reads back), in x's dtype;
    with `signs` an NVFP4 round trip is rotated before encoding and un-rotated after decoding (PagedKVCache)."""
    if signs is not None and fmt == "nvfp4":
        data, scale = codec.encode(fmt, rotation.rotate(x, signs), gs)
        return rotation.unrotate(codec.decode(fmt, data, scale, gs, torch.float32), signs).to(x.dtype)
    data, scale = codec.encode(fmt, x, gs)
    return codec.decode(fmt, data, scale, gs, x.dtype)


@dataclass(frozen=True)
class PlanCost:
    """A cache plan against the exact fp32 cache, averaged over the scored (completion) positions."""
    kl: float              # mean KL(p_fp32 || p_plan), nats per token: the proxy
    delta_nll: float       # mean increase of the calibration text's own next-token loss, nats per token
    top1_changed: float    # fraction of positions whose greedy (argmax) next token changes

    def to_json(self) -> dict:
        return {"kl": self.kl, "delta_nll": self.delta_nll, "top1_changed": self.top1_changed}


@dataclass(frozen=True)
class LayerSensitivity:
    layers: dict[int, PlanCost]          # sparse layer -> NVFP4 on that layer alone, every other layer exact
    fp8_cache: PlanCost                  # every layer FP8: the yardstick
    hybrid: PlanCost                     # the hybrid cache without overrides (sparse NVFP4, dense FP8)
    hybrid_with_fp8_layers: PlanCost     # ... with `fp8_layers` in FP8
    factor: float
    min_kl: float
    fp8_layers: tuple[int, ...]
    positions: int                       # scored positions over all calibration sequences

    @property
    def threshold(self) -> float:
        return max(self.factor * self.fp8_cache.kl, self.min_kl)

    def ratio(self, layer: int) -> float:
        """The layer's NVFP4 cost in units of the whole FP8 cache's (inf when the FP8 cache costs nothing)."""
        unit = self.fp8_cache.kl
        return self.layers[layer].kl / unit if unit > 0 else math.inf

    def reason(self) -> str:
        head = (f"NVFP4 on one sparse layer alone vs the whole FP8 cache's completion-token KL "
                f"{self.fp8_cache.kl:.3g} nats/token (threshold max({self.factor:g}x, {self.min_kl:g}) = "
                f"{self.threshold:.3g}): ")
        parts = [f"layer {i} {c.kl:.3g} ({self.ratio(i):.2f}x{', FP8' if i in self.fp8_layers else ''})"
                 for i, c in sorted(self.layers.items())]
        return head + ", ".join(parts)

    def to_json(self) -> dict:
        return {
            "metric": SENSITIVITY_METRIC,
            "rule": (f"a sparse layer is stored in FP8 when NVFP4 on it alone (its calibrated amax, every other "
                     f"layer exact) costs more than {self.factor:g} x the KL of the all-FP8 cache and more than "
                     f"{self.min_kl:g} nats/token"),
            "factor": self.factor, "min_kl": self.min_kl, "fp8_cache_kl": self.fp8_cache.kl,
            "threshold_kl": self.threshold,
            "positions": self.positions,
            "layers": {str(i): {**c.to_json(), "kl_over_fp8_cache": self.ratio(i)}
                       for i, c in sorted(self.layers.items())},
            "fp8_cache": self.fp8_cache.to_json(), "hybrid": self.hybrid.to_json(),
            "hybrid_with_fp8_layers": self.hybrid_with_fp8_layers.to_json(),
        }


def plan_costs(model, token_seqs: Sequence[Tensor], score_from: Sequence[int], plans: dict[str, CachePlan],
               signs: Tensor | None = None) -> tuple[dict[str, PlanCost], int]:
    """({plan name: its cost}, scored positions): each sequence runs once with the exact fp32 cache (the reference)
    and once per plan. Sequence j's scored targets are its tokens [score_from[j], T): the rows of logp that
    predict them are [score_from[j] - 1, T - 1). signs: the K/V rotation of the NVFP4 layers (None: unrotated)."""
    _check_fp32_model(model)
    if len(score_from) != len(token_seqs) or not token_seqs:
        raise ValueError(f"score_from: expected one start per calibration sequence ({len(token_seqs)}, at least "
                         f"one), found {len(score_from)}")
    active: CachePlan = {}

    def roundtrip(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if layer not in active:
            return k, v
        fmt, gs_k, gs_v = active[layer]
        return cache_roundtrip(fmt, k, gs_k, signs), cache_roundtrip(fmt, v, gs_v, signs)

    sums = {name: [0.0, 0.0, 0.0] for name in plans}          # KL, delta NLL, top-1 changes (float64 sums)
    positions = 0
    with kv_hooks(model, range(len(model.layers)), roundtrip), torch.no_grad():
        for j, (ids, start) in enumerate(zip(token_seqs, score_from)):
            _check_seq(j, ids)
            t = ids.numel()
            if not isinstance(start, int) or isinstance(start, bool) or not 1 <= start <= t:
                raise ValueError(f"score_from[{j}]: expected an int in [1, {t}] (the sequence's length), "
                                 f"found {start!r}")
            if start == t:
                continue                  # nothing of this sequence is scored
            ids = ids.to(model.device)
            targets = ids[start:, None]
            active.clear()
            ref = torch.log_softmax(model.forward_train(ids[None])[0][0, start - 1:t - 1].float(), -1)
            ref_nll = -ref.gather(-1, targets)
            ref_top1 = ref.argmax(-1)
            positions += t - start
            for name, plan in plans.items():
                active.clear()
                active.update(plan)
                got = torch.log_softmax(model.forward_train(ids[None])[0][0, start - 1:t - 1].float(), -1)
                acc = sums[name]
                acc[0] += float((ref.exp() * (ref - got)).sum(-1).double().sum())
                acc[1] += float((-got.gather(-1, targets) - ref_nll).double().sum())
                acc[2] += float((got.argmax(-1) != ref_top1).sum())
            active.clear()
    if positions == 0:
        raise ValueError("score_from: expected at least one scored position, found none (every sequence ends "
                         "at its score start)")
    return {name: PlanCost(*(x / positions for x in acc)) for name, acc in sums.items()}, positions


def measure_layer_sensitivity(model, token_seqs: Sequence[Tensor], score_from: Sequence[int],
                              amax: dict[int, tuple[float, float]], factor: float = FP8_OVERRIDE_FACTOR,
                              min_kl: float = MIN_OVERRIDE_KL, signs: Tensor | None = None,
                              choose: bool = True) -> LayerSensitivity:
    """Which sparse layers the hybrid cache should keep in FP8: those whose NVFP4 alone costs more than `factor`
    times the whole FP8 cache and more than `min_kl` (amax: the calibrated {layer: (k_amax, v_amax)} of every
    sparse layer; token_seqs / score_from: see plan_costs).

    The proxy. For each sparse layer, only that layer's K/V go through the NVFP4 cache codec (at its calibrated
    amax, every other layer exact fp32) and we measure the mean KL divergence KL(p_fp32 || p_nvfp4) of the next-
    token distributions at the calibration texts' completion positions (teacher-forced worked answers after the
    same chat prompt the eval uses; the texts come from another seed, minus every held-out question, so no
    eval item is seen). KL to the fp32-cache model measures how far the cache alone moves the model, independent
    of whether the model was right; the increase of the text's own loss and the share of changed greedy tokens
    are reported beside it. Completion positions only, because the eval scores greedy answers: prompt positions
    (predicting the question text) dilute the signal (on the embedded model all-position KL separates layer 2
    from the rest by 2.3x, completion-only by 4x). One layer at a time isolates each layer's share, which is what a
    per-layer override acts on; the plain and the overridden hybrid cache's totals are measured as well, for the
    record.

    The threshold. The unit is the KL of the whole FP8 cache, measured in the same run: FP8 is the format an
    overridden layer falls back to, and the FP8 cache is statistically indistinguishable from BF16 on the eval
    (80.2 % vs 81.4 %, McNemar p = 0.26, bench/results/eval/eval-kv-bf16-vs-fp8-cpu.json), so its KL is a cost the
    engine already accepts. A layer whose NVFP4 alone costs more than `factor` = 2 such units goes FP8. On the
    embedded model the layers measure 4.6x (layer 2), 1.16x, 0.28x and 0.03x (layers 3-5) and the held-out
    ablation (bench/results/kv_quant_ablation/kv-quant-ablation-cpu.json) found NVFP4 on layer 2 alone costs 7.0 points (p = 3e-6)
    and on each of 3-5 nothing (|delta| <= 0.2 point, p = 1): 2 separates them with margin on both sides (1.7x
    above layer 3, 2.3x below layer 2). The factor was set with that ablation's verdict in view; the proxy never
    reads the held-out items. A relative rule alone would flag layers of a model on which even the FP8 cache is
    free (a random-weights model: KL ~1e-7), so a layer must also cost more than `min_kl` = 1e-3 nats/token; below
    that the mean total-variation distance of a next-token distribution is under sqrt(1e-3 / 2) = 2.2 % (Pinsker),
    a change only greedy near-ties notice (the embedded model's layer 4, at 9.7e-4, changes 0.2 % of greedy answer
    tokens and no eval score). Limits: costs of many individually small layers add up, which a per-layer rule
    does not see (the hybrid totals in the result show it), and a model with no sensitive outlier gets no
    override.

    signs: the K/V rotation of a rotated cache (its NVFP4 round trips rotate first). choose=False measures and
    records every cost but chooses no override (fp8_layers stays empty: every sparse layer NVFP4).
    """
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor: expected a finite positive float, found {factor!r}")
    if not (isinstance(min_kl, (int, float)) and math.isfinite(min_kl) and min_kl >= 0):
        raise ValueError(f"min_kl: expected a finite float >= 0, found {min_kl!r}")
    n_layers = len(model.layers)
    sparse = [i for i in range(n_layers) if model.layers[i].attn.sparse]
    dense = [i for i in range(n_layers) if i not in sparse]
    if not sparse:
        raise ValueError("model: no sparse (MSA) layer: the hybrid cache has no NVFP4 layer to assess")
    missing = [i for i in sparse if i not in amax]
    if missing:
        raise ValueError(f"amax: expected the calibrated K/V amax of every sparse layer {sparse}, found none for "
                         f"{missing}")
    nvfp4: CachePlan = {i: ("nvfp4", nvfp4_global_scale(amax[i][0]), nvfp4_global_scale(amax[i][1]))
                        for i in sparse}
    fp8: CachePlan = {i: ("fp8", None, None) for i in range(n_layers)}
    hybrid = {**{i: fp8[i] for i in dense}, **nvfp4}
    plans = {f"layer{i}": {i: nvfp4[i]} for i in sparse}
    plans.update({"fp8_cache": fp8, "hybrid": hybrid})
    costs, positions = plan_costs(model, token_seqs, score_from, plans, signs)
    threshold = max(factor * costs["fp8_cache"].kl, min_kl)
    chosen = tuple(i for i in sparse if costs[f"layer{i}"].kl > threshold) if choose else ()
    if chosen:
        overridden = {**hybrid, **{i: fp8[i] for i in chosen}}
        with_fp8 = plan_costs(model, token_seqs, score_from, {"overridden": overridden}, signs)[0]["overridden"]
    else:
        with_fp8 = costs["hybrid"]
    return LayerSensitivity({i: costs[f"layer{i}"] for i in sparse}, costs["fp8_cache"], costs["hybrid"],
                            with_fp8, float(factor), float(min_kl), chosen, positions)


# ----------------------------------------------------------------------------- calibration result / file
@dataclass
class KVCalibration:
    num_layers: int
    layers: dict[int, tuple[AmaxChoice, AmaxChoice]]          # layer -> (K choice, V choice)
    default_amax: float                                       # the uncalibrated cache's amax, for comparison
    default_mse: dict[int, tuple[float, float]]               # layer -> round-trip MSE of K, V at default_amax
    calibration: dict = field(default_factory=dict)           # text set, seed, items, tokens, dtype
    sensitivity: LayerSensitivity | None = None               # None: not measured (no fp8_layers in the file)
    rotation_seed: int | None = None                          # the K/V rotation the amaxes were chosen under
    head_dim: int | None = None                               # (with rotation_seed) the rotated head dim

    def amax_table(self) -> dict[int, tuple[float, float]]:
        return {i: (k.amax, v.amax) for i, (k, v) in self.layers.items()}

    @property
    def fp8_layers(self) -> tuple[int, ...]:
        return () if self.sensitivity is None else self.sensitivity.fp8_layers

    def to_json(self) -> dict:
        def one(c: AmaxChoice, default_mse: float) -> dict:
            return {"amax": c.amax, "observed_amax": c.observed_amax, "rel_mse": c.mse / c.mean_square,
                    "rel_mse_at_default_amax": default_mse / c.mean_square}
        doc = {
            "format": FILE_FORMAT, "version": FILE_VERSION, "method": METHOD,
            "method_detail": (f"per layer and tensor: amax from observed_max * 2^(i/{GRID_STEPS_PER_OCTAVE}), "
                              f"i in [{GRID_OCTAVES[0] * GRID_STEPS_PER_OCTAVE}, "
                              f"{GRID_OCTAVES[1] * GRID_STEPS_PER_OCTAVE}], minimising the cache codec's NVFP4 "
                              f"round-trip MSE; ties within {REL_TOL:g} relative go to the largest amax"),
            "num_layers": self.num_layers,
            "calibration": self.calibration,
            "default_amax": self.default_amax,
            "layers": {str(i): {"k": one(k, self.default_mse[i][0]), "v": one(v, self.default_mse[i][1])}
                       for i, (k, v) in sorted(self.layers.items())},
        }
        if self.rotation_seed is not None:
            doc["rotation"] = rotation_record(self.head_dim, self.rotation_seed)
        if self.sensitivity is not None:
            doc["fp8_layers"] = list(self.sensitivity.fp8_layers)
            doc["fp8_layers_reason"] = self.sensitivity.reason()
            doc["sensitivity"] = self.sensitivity.to_json()
        return doc


def encode_calibration_texts(tokenizer, texts: Sequence[str | tuple[str, str]]) -> tuple[list[Tensor], list[int]]:
    """(token sequences, score_from): a str is scored at every position after its first token; a (prompt,
    completion) pair is encoded as prompt + completion and scored on the completion's tokens only."""
    if not texts:
        raise ValueError("texts: expected at least one calibration text, found none")
    seqs, score_from = [], []
    for j, t in enumerate(texts):
        prompt = ""
        if isinstance(t, tuple):
            if len(t) != 2 or not all(isinstance(x, str) and x for x in t):
                raise TypeError(f"texts[{j}]: expected a str or a (prompt, completion) pair of non-empty str, "
                                f"found {t!r:.80}")
            prompt, t = t[0], t[0] + t[1]
        if not isinstance(t, str) or not t:
            raise TypeError(f"texts[{j}]: expected a non-empty str, found {type(t).__name__} {t!r:.40}")
        ids = list(tokenizer.encode(t, add_special_tokens=False))
        start = 1
        if prompt:
            head = list(tokenizer.encode(prompt, add_special_tokens=False))
            if not head or ids[:len(head)] != head or len(head) >= len(ids):
                raise ValueError(f"texts[{j}]: expected the prompt's tokens to be a strict prefix of the whole "
                                 f"text's tokens (a merge across the boundary), found {len(head)} prompt tokens "
                                 f"not a prefix of {len(ids)}")
            start = len(head)
        seqs.append(torch.tensor(ids, dtype=torch.int64))
        score_from.append(start)
    return seqs, score_from


def calibrate_kv(model, tokenizer, texts: Sequence[str | tuple[str, str]], layers: Sequence[int] | None = None,
                 description: dict | None = None, sensitivity: bool = True,
                 factor: float = FP8_OVERRIDE_FACTOR, min_kl: float = MIN_OVERRIDE_KL,
                 rotation_seed: int | None = None, fp8_overrides: bool = True) -> KVCalibration:
    """Run `texts` through the fp32 stock model and choose every layer's K and V amax (see the module doc); with
    `sensitivity` (and a model with sparse layers), also measure each sparse layer's NVFP4 cost and, with
    `fp8_overrides`, choose the sparse layers to keep in FP8 (measure_layer_sensitivity, scored on the
    completions of (prompt, completion) texts). rotation_seed: calibrate for a rotated cache (the sparse layers'
    K/V, which the hybrid cache stores in NVFP4, are rotated before the amax search and in the proxy)."""
    seqs, score_from = encode_calibration_texts(tokenizer, texts)
    kv = collect_kv(model, seqs, layers)
    head_dim = model.cfg.head_dim
    signs = None if rotation_seed is None else rotation.rotation_signs(head_dim, rotation_seed)
    if signs is not None:
        kv = {i: ((rotation.rotate(k, signs), rotation.rotate(v, signs)) if model.layers[i].attn.sparse else (k, v))
              for i, (k, v) in kv.items()}
    chosen = {i: (choose_nvfp4_amax(k), choose_nvfp4_amax(v)) for i, (k, v) in kv.items()}
    default = {i: (nvfp4_roundtrip_mse(k, DEFAULT_NVFP4_KV_AMAX), nvfp4_roundtrip_mse(v, DEFAULT_NVFP4_KV_AMAX))
               for i, (k, v) in kv.items()}
    info = dict(description or {})
    info.update({"texts": len(seqs), "tokens": int(sum(s.numel() for s in seqs)), "model_dtype": "fp32"})
    sens = None
    sparse = [i for i in range(len(model.layers)) if model.layers[i].attn.sparse]
    if sensitivity and sparse:
        missing = [i for i in sparse if i not in chosen]
        if missing:
            raise ValueError(f"layers: the FP8-override search needs every sparse layer {sparse} calibrated, found "
                             f"{sorted(chosen)}; pass sensitivity=False to calibrate a subset")
        sens = measure_layer_sensitivity(model, seqs, score_from, {i: (c[0].amax, c[1].amax) for i, c in chosen.items()},
                                         factor, min_kl, signs=signs, choose=fp8_overrides)
        info["scored_positions"] = sens.positions
    return KVCalibration(len(model.layers), chosen, DEFAULT_NVFP4_KV_AMAX, default, info, sens, rotation_seed,
                         head_dim if rotation_seed is not None else None)


def save_kv_scales(path: str, calib: KVCalibration) -> None:
    with open(path, "w") as f:
        json.dump(calib.to_json(), f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------- end to end (m3serve calibrate-kv)
def calibrate_model_dir(model_dir: str, out: str | None = None, num_items: int = CALIBRATION_ITEMS,
                        seed: int = CALIBRATION_SEED, factor: float = FP8_OVERRIDE_FACTOR,
                        rotation_seed: int | None = rotation.DEFAULT_ROTATION_SEED, fp8_overrides: bool = False
                        ) -> tuple[str, KVCalibration]:
    """Calibrate a checkpoint directory's K/V amaxes (for the K/V rotation of `rotation_seed`; None: unrotated)
    and, with fp8_overrides, its FP8 layers, and write them to `out` (default <model_dir>/kv_scales.json)."""
    if not os.path.isdir(model_dir) or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model_dir: expected a checkpoint directory with config.json, found {model_dir!r}")
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"model_dir: {model_dir} has no tokenizer; calibration text cannot be encoded")
    if "OMP_NUM_THREADS" not in os.environ:
        # Thousands of tiny-batch forwards: on small shared CPUs OpenMP's thread hand-off dominates (as in LLM).
        torch.set_num_threads(1)
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    chats = calibration_chats(num_items, seed, heldout_questions(model_dir))
    description = {
        "text_set": ("synthetic arithmetic chats (m3serve.train.synthetic, train stream of the seed below), "
                     "rendered with the chat template as question + worked answer; every question of the "
                     "eval's held-out synthetic set excluded; the NVFP4-sensitivity proxy scores the answer tokens"),
        "seed": seed, "items": num_items,
    }
    calib = calibrate_kv(model, tokenizer, chats, description=description, factor=factor,
                         rotation_seed=rotation_seed, fp8_overrides=fp8_overrides)
    path = out or os.path.join(model_dir, KV_SCALES_FILE)
    save_kv_scales(path, calib)
    return path, calib
