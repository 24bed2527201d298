"""Catalog entry sample.race: the decode step's draw for rows that sample at a temperature, with or without top-p
(no top-k), and greedy rows beside them, in a few small launches over the logits.

The torch sampler (m3serve.engine.sampler.sample_rows) runs, for every row whatever it asks for, two full sorts of
the vocabulary (top-k's k-th value, top-p's nucleus), a softmax, a cumulative sum, a scatter, and builds the keyed
noise in int64 and fp64 tensor ops: about 0.4 ms at one row and 1 ms at eight on an H100 for a 200k vocabulary
(bench/results/decode/*-race-sampled.json, route target-torch-sampler). For a row with top_k off the draw is

    greedy (T = 0):  token = first argmax_v logits[v]
    otherwise:       x_v = logits[v] / T                      fp32, IEEE division
                     m = max_v x_v,  s = sum_v exp(x_v - m)     fp32, the softmax's max and sum
                     p_v = exp(x_v - m) / s                     torch's softmax value for value
      top_p < 1:     kept = {v : mass of the tokens strictly more likely than v < top_p}   (tie-inclusive nucleus)
                     p_v = p_v / S for kept v (S = their mass), 0 for the others
                     E_v = fp32(-log((b_v + 0.5) * 2**-24))     b_v = mix32(seed + v * golden) >> 8 (keyed_noise)
                     token = first argmax_v p_v / E_v           IEEE division

with seed = row_seed(key, counter) and counter = position + 1, the index in its sequence of the token being drawn
(m3serve.keyed_noise). That is sample_rows op for op: exp is libdevice's expf (what torch's softmax calls), the log
is fp64 as in keyed_noise, every division correctly rounded (a plain `/` compiles to the approximate div.full.f32).
What differs is the order in which sums are taken: s, the nucleus masses and S. The compare allows for it (below).

The nucleus without a sort: the kept set is {p_v >= tau} for the smallest probability tau whose mass strictly above
is below top_p. tau is found digit by digit on the fp32 bits of p (non-negative, so their integer order is their
value order), 8 bits a pass from the top: a pass histograms the mass of the tokens that share the digits found so
far by their next digit (each program its own 256 bins, summed in program order: no float atomics, the same bits on
every replay), then one program a row walks the bins from the top, keeping bins while the mass above them stays
below top_p, and fixes the digit. After four passes tau's bits are known, and S = the mass at or above tau.

Launches (grid (P, R), P = cdiv(V, BLOCK) programs a row, each over BLOCK vocabulary entries; the walks grid (R,)):
    race_max      partial maxima of x                                         pmax [R, P]
    race_sum      m from the P partials; partial sums of exp(x - m)           psum [R, P]
    4 x (race_nucleus_hist, race_nucleus_walk)   tau and S of the rows with top_p < 1 (the others return at once)
    race_argmax   s = the P partial sums in program order; each program's best p / E and its first index
    argmax_reduce (head/_argmax.py) the row's best over the P partials, ties to the smaller index -> tokens

Shape legend:
    logits       [R, V]  fp32 (unit column stride)
    temperature  [R]     fp32; 0 = greedy (the decode step's staged temperature bits, viewed as fp32)
    top_p        [R]     fp32 in (0, 1]; 1 = no nucleus
    key_lo, key_hi [R]   int32 halves of the row's 63-bit sampling key
    positions    [R]     int32 the position of the row's input token (its draw's counter is position + 1)
    tokens       [R]     int64 out
    hist         [R, P, 256] fp32 a pass's per-program bin masses;  state [R, 4] int32: tau's bits so far, the mass
                 above them (fp32 bits), S (fp32 bits)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from m3serve.keyed_noise import noise_from_seeds, row_seed
from m3serve.kernels._jit import helper, is_compiled, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.catalog import FP32_U, Case, Cell, Entry, check_tensor, device_rng, true_fp32
from m3serve.kernels.head._argmax import argmax_reduce

ENABLED = True  # the one switch: False leaves the decode graphs' sampling variant on the torch sampler

GOLDEN = tl.constexpr(0x9E3779B9)
MIX_A = tl.constexpr(0x7FEB352D)
MIX_B = tl.constexpr(0x846CA68B)


@dataclass(frozen=True)
class RaceConfig:
    BLOCK: int = 2048       # vocabulary entries per program (P = cdiv(V, BLOCK) programs a row)
    SUB: int = 32           # a nucleus pass's entries per step of its bin loop ([SUB, 256] compares in registers)
    num_warps: int = 4


@helper
def _exp(x, CUDA: tl.constexpr):
    """expf: libdevice's full-precision __nv_expf compiled (torch's exp on the GPU; tl.exp compiles to the
    approximate ex2), numpy's exp interpreted."""
    if CUDA:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@helper
def _log(x, CUDA: tl.constexpr):
    """fp64 log: libdevice's __nv_log compiled (torch's log on the GPU), numpy's interpreted."""
    if CUDA:
        return libdevice.log(x)
    else:
        return tl.log(x)


@helper
def _mix32(x):
    """keyed_noise.mix32 on uint32 (products wrap mod 2**32, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], MIX_A, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], MIX_B, tl.uint32)
    return x ^ (x >> 16)


@helper
def _row_seed(key_lo_ptr, key_hi_ptr, pos_ptr, row):
    """keyed_noise.row_seed for the 63-bit key (key_hi & 0x7FFFFFFF, key_lo) and the counter position + 1, whose
    high word is 0 (positions are int32)."""
    k_lo = tl.load(key_lo_ptr + row).to(tl.uint32, bitcast=True)
    k_hi = (tl.load(key_hi_ptr + row) & 0x7FFFFFFF).to(tl.uint32, bitcast=True)
    counter = (tl.load(pos_ptr + row) + 1).to(tl.uint32, bitcast=True)
    return _mix32(_mix32(_mix32(k_lo) ^ k_hi) ^ counter)


@helper
def _exp_noise(seed, cols, CUDA: tl.constexpr):
    """keyed_noise.noise_from_seeds for vocabulary ids `cols`: Exp(1) draws, fp32, strictly positive."""
    h = _mix32(seed + cols.to(tl.uint32, bitcast=True) * tl.full([], GOLDEN, tl.uint32)) >> 8
    u = (h.to(tl.float64) + 0.5) * tl.full([], 5.9604644775390625e-08, tl.float64)   # (b + 0.5) * 2**-24, exact
    return (-_log(u, CUDA)).to(tl.float32)


@helper
def _tempered(logits_ptr, temp_ptr, row, cols, V, stride_l):
    """x = logits / T over this program's columns (-inf past V); greedy rows (T = 0) divide by 1 (exact)."""
    t = tl.load(temp_ptr + row)
    t = tl.where(t == 0.0, 1.0, t)
    lg = tl.load(logits_ptr + row * stride_l + cols, mask=cols < V, other=float("-inf"))
    return tl.div_rn(lg, tl.zeros_like(lg) + t)


@helper
def _row_max(pmax_ptr, row, P, BLOCK_P: tl.constexpr):
    pp = tl.arange(0, BLOCK_P)
    return tl.max(tl.load(pmax_ptr + row * P + pp, mask=pp < P, other=float("-inf")), axis=0)


@kernel
def race_max(logits_ptr, temp_ptr, pmax_ptr, V, stride_l, P, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    c = tl.program_id(0)
    row = tl.program_id(1)
    x = _tempered(logits_ptr, temp_ptr, row, c * BLOCK + tl.arange(0, BLOCK), V, stride_l)
    tl.store(pmax_ptr + row * P + c + tl.arange(0, 1), tl.zeros([1], tl.float32) + tl.max(x, axis=0))


@kernel
def race_sum(logits_ptr, temp_ptr, pmax_ptr, psum_ptr, V, stride_l, P, BLOCK: tl.constexpr,
             BLOCK_P: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    c = tl.program_id(0)
    row = tl.program_id(1)
    m = _row_max(pmax_ptr, row, P, BLOCK_P)
    x = _tempered(logits_ptr, temp_ptr, row, c * BLOCK + tl.arange(0, BLOCK), V, stride_l)
    e = _exp(x - m, CUDA)          # exp(-inf) = 0 past V
    tl.store(psum_ptr + row * P + c + tl.arange(0, 1), tl.zeros([1], tl.float32) + tl.sum(e, axis=0))


@helper
def _row_sum(psum_ptr, row, P, BLOCK_P: tl.constexpr):
    """s: the row's partial sums in one fixed order (every program of the row gets the same s)."""
    pp = tl.arange(0, BLOCK_P)
    return tl.sum(tl.load(psum_ptr + row * P + pp, mask=pp < P, other=0.0), axis=0)


@helper
def _nucleus_row(temp_ptr, top_p_ptr, row):
    """Whether the row draws from a nucleus: it samples (T > 0) with top_p < 1."""
    return (tl.load(temp_ptr + row) != 0.0) & (tl.load(top_p_ptr + row) < 1.0)


@kernel
def race_nucleus_hist(logits_ptr, temp_ptr, top_p_ptr, pmax_ptr, psum_ptr, state_ptr, hist_ptr, V, stride_l, P,
                      SHIFT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, SUB: tl.constexpr,
                      CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    c = tl.program_id(0)
    row = tl.program_id(1)
    if _nucleus_row(temp_ptr, top_p_ptr, row):
        m = _row_max(pmax_ptr, row, P, BLOCK_P)
        s = _row_sum(psum_ptr, row, P, BLOCK_P)
        bins = tl.arange(0, 256)
        if SHIFT == 24:
            prefix = 0
        else:
            prefix = tl.load(state_ptr + row * 4)
        mass = tl.zeros([256], tl.float32)
        for sub in range(0, BLOCK, SUB):
            cols = c * BLOCK + sub + tl.arange(0, SUB)
            x = _tempered(logits_ptr, temp_ptr, row, cols, V, stride_l)
            p = tl.div_rn(_exp(x - m, CUDA), tl.zeros_like(x) + s)
            bits = p.to(tl.int32, bitcast=True)        # p >= 0: integer order = value order
            if SHIFT == 24:
                live = cols < V
            else:
                live = (cols < V) & ((bits >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            digit = (bits >> SHIFT) & 255
            mass += tl.sum(tl.where((digit[:, None] == bins[None, :]) & live[:, None], p[:, None], 0.0), axis=0)
        tl.store(hist_ptr + (row * P + c) * 256 + bins, mass)


@kernel
def race_nucleus_walk(temp_ptr, top_p_ptr, hist_ptr, state_ptr, P, SHIFT: tl.constexpr, CP: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    row = tl.program_id(0)
    if _nucleus_row(temp_ptr, top_p_ptr, row):
        bins = tl.arange(0, 256)
        total = tl.zeros([256], tl.float32)
        for c0 in range(0, P, CP):             # the programs' bins in program order
            cc = c0 + tl.arange(0, CP)
            total += tl.sum(tl.load(hist_ptr + (row * P + cc[:, None]) * 256 + bins[None, :],
                                    mask=(cc < P)[:, None], other=0.0), axis=0)
        if SHIFT == 24:
            prefix = 0
            above = 0.0
        else:
            prefix = tl.load(state_ptr + row * 4)
            above = tl.load(state_ptr + row * 4 + 1).to(tl.float32, bitcast=True)
        top_p = tl.load(top_p_ptr + row)
        at_or_above = tl.flip(tl.cumsum(tl.flip(total, 0), 0), 0)     # mass of bins >= b (in this prefix)
        # bin b stays while the mass strictly above it, above + at_or_above[b + 1], is below top_p: the lowest
        # such b is the digit (bins above it stay whole); at_or_above[256] = 0, and above < top_p always
        j = tl.min(tl.where(above + at_or_above < top_p, bins, 256), axis=0)
        digit = tl.maximum(j - 1, 0)
        over = tl.sum(tl.where(bins == digit + 1, at_or_above, 0.0), axis=0)       # mass of bins > digit
        here = tl.sum(tl.where(bins == digit, at_or_above, 0.0), axis=0)           # mass of bins >= digit
        st = tl.arange(0, 4)
        vals = tl.where(st == 0, prefix | (digit << SHIFT),
                        tl.where(st == 1, (above + over).to(tl.int32, bitcast=True),
                                 (above + here).to(tl.int32, bitcast=True)))
        tl.store(state_ptr + row * 4 + st, vals, mask=st < 3)


@kernel
def race_argmax(logits_ptr, temp_ptr, top_p_ptr, key_lo_ptr, key_hi_ptr, pos_ptr, pmax_ptr, psum_ptr, state_ptr,
                pval_ptr, pidx_ptr, V, stride_l, P, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, CUDA: tl.constexpr,
                PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    c = tl.program_id(0)
    row = tl.program_id(1)
    m = _row_max(pmax_ptr, row, P, BLOCK_P)
    s = _row_sum(psum_ptr, row, P, BLOCK_P)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = _tempered(logits_ptr, temp_ptr, row, cols, V, stride_l)
    p = tl.div_rn(_exp(x - m, CUDA), tl.zeros_like(x) + s)
    if _nucleus_row(temp_ptr, top_p_ptr, row):
        tau = tl.load(state_ptr + row * 4)
        mass = tl.load(state_ptr + row * 4 + 2).to(tl.float32, bitcast=True)
        p = tl.where(p.to(tl.int32, bitcast=True) >= tau, tl.div_rn(p, tl.zeros_like(p) + mass), 0.0)
    q = tl.div_rn(p, _exp_noise(_row_seed(key_lo_ptr, key_hi_ptr, pos_ptr, row), cols, CUDA))
    # greedy rows: the argmax of the logits themselves (sample_rows' one-hot row over noise 1)
    q = tl.where(tl.load(temp_ptr + row) == 0.0, x, q)
    q = tl.where(cols < V, q, float("-inf"))
    best = tl.max(q, axis=0)
    arg = tl.argmax(q, axis=0, tie_break_left=True)
    tl.store(pval_ptr + row * P + c + tl.arange(0, 1), tl.zeros([1], tl.float32) + best)
    tl.store(pidx_ptr + row * P + c + tl.arange(0, 1), tl.zeros([1], tl.int32) + c * BLOCK + arg)


def _check(logits, temperature, top_p, key_lo, key_hi, positions, tokens) -> tuple[int, int]:
    check_tensor("logits", logits, torch.float32)
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"logits: expected [R >= 1, V >= 1] with unit column stride, found shape "
                         f"{tuple(logits.shape)} strides {tuple(logits.stride())}")
    r, v = logits.shape
    if v >= 2 ** 31:
        raise ValueError(f"logits: vocabulary {v} exceeds the int32 ids this kernel writes")
    check_tensor("temperature", temperature, torch.float32, (r,), logits.device)
    check_tensor("top_p", top_p, torch.float32, (r,), logits.device)
    for name, t in (("key_lo", key_lo), ("key_hi", key_hi), ("positions", positions)):
        check_tensor(name, t, torch.int32, (r,), logits.device)
    check_tensor("tokens", tokens, torch.int64, (r,), logits.device)
    return r, v


NUCLEUS_SHIFTS = (24, 16, 8, 0)   # tau's fp32 bits, a byte a pass from the top


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, key_lo: torch.Tensor,
                key_hi: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                config: RaceConfig = RaceConfig()) -> torch.Tensor:
    """Raw call: one token per row (module docstring). The rows must not ask for top-k (the caller routes those
    elsewhere: temperature and top_p are read). top_p is read as given: values >= 1 mean no nucleus. Writes and
    returns tokens. No host sync: graph-safe."""
    r, v = _check(logits, temperature, top_p, key_lo, key_hi, positions, tokens)
    p = triton.cdiv(v, config.BLOCK)
    block_p = max(triton.next_power_of_2(p), 2)
    dev = logits.device
    part = torch.empty(3, r, p, dtype=torch.float32, device=dev)     # pmax, psum, pval
    pidx = torch.empty(r, p, dtype=torch.int32, device=dev)
    hist = torch.empty(r, p, 256, dtype=torch.float32, device=dev)
    state = torch.empty(r, 4, dtype=torch.int32, device=dev)
    best = torch.empty(r, dtype=torch.float32, device=dev)
    cuda = is_compiled(logits)
    grid = (p, r)
    w = config.num_warps
    race_max[grid](logits, temperature, part[0], v, logits.stride(0), p, BLOCK=config.BLOCK, num_warps=w)
    race_sum[grid](logits, temperature, part[0], part[1], v, logits.stride(0), p, BLOCK=config.BLOCK,
                   BLOCK_P=block_p, CUDA=cuda, num_warps=w)
    for shift in NUCLEUS_SHIFTS:
        race_nucleus_hist[grid](logits, temperature, top_p, part[0], part[1], state, hist, v, logits.stride(0), p,
                                SHIFT=shift, BLOCK=config.BLOCK, BLOCK_P=block_p, SUB=config.SUB, CUDA=cuda,
                                num_warps=w)
        race_nucleus_walk[(r,)](temperature, top_p, hist, state, p, SHIFT=shift, CP=min(block_p, 32), num_warps=4)
    race_argmax[grid](logits, temperature, top_p, key_lo, key_hi, positions, part[0], part[1], state, part[2], pidx,
                      v, logits.stride(0), p, BLOCK=config.BLOCK, BLOCK_P=block_p, CUDA=cuda, num_warps=w)
    argmax_reduce[(r,)](part[2], pidx, tokens, best, p, 0, BLOCK=min(block_p, 1024), num_warps=4)
    return tokens


def nucleus_band(vocab: int) -> float:
    """How far the kernel's and the reference's nucleus masses may sit apart: both sum the same non-negative p
    (at most 1 in all) in other orders, each within (V - 1) u of the exact sum, and each p_v may differ by an ulp or
    two (s summed in other orders): 4 V u."""
    return 4.0 * vocab * FP32_U


def race_bounds(logits, temperature, top_p, key_lo, key_hi, positions) -> tuple[torch.Tensor, ...]:
    """(scores, sure, possible) [R, V]: scores = p_v / E_v, whose first argmax over the kept tokens is the row's
    token (greedy rows: the logits); sure / possible: the tokens the nucleus keeps whatever order the masses are
    summed in / keeps in some order (within nucleus_band of top_p). Written from the definitions, apart from
    engine/sampler.py: p by torch's softmax in true fp32, each probability's mass strictly above summed in fp64 over
    groups of equal probability (torch.unique), the noise from m3serve.keyed_noise."""
    r, v = logits.shape
    greedy = temperature == 0
    keys = (key_hi.long() << 32) | (key_lo.long() & 0xFFFFFFFF)
    with true_fp32():
        x = logits.float() / torch.where(greedy, 1.0, temperature).unsqueeze(1)
        p = torch.softmax(x, dim=-1)
        scores = p / noise_from_seeds(row_seed(keys, positions.long() + 1), v)
    scores = torch.where(greedy.unsqueeze(1), logits.float(), scores)
    sure = torch.ones(r, v, dtype=torch.bool, device=logits.device)
    possible = sure.clone()
    band = nucleus_band(v)
    for i in range(r):
        if bool(greedy[i]) or float(top_p[i]) >= 1.0:
            continue
        values, group = torch.unique(p[i].double(), return_inverse=True)      # ascending
        mass = torch.zeros_like(values).scatter_add_(0, group, p[i].double())
        above = (mass.flip(0).cumsum(0).flip(0) - mass)[group]                 # mass of the larger groups
        sure[i] = above < float(top_p[i]) - band
        possible[i] = above < float(top_p[i]) + band
    return scores, sure, possible


def race_reference(logits, temperature, top_p, key_lo, key_hi, positions, tokens=None, config=None) -> torch.Tensor:
    """The scores of the tokens the nucleus may keep, -inf for those it drops whatever the summation order."""
    scores, _, possible = race_bounds(logits, temperature, top_p, key_lo, key_hi, positions)
    return torch.where(possible, scores, float("-inf"))


def race_stock(logits, temperature, top_p, key_lo, key_hi, positions, tokens=None, config=None) -> torch.Tensor:
    """Without this kernel: the scores in torch, then argmax over the surely kept tokens."""
    scores, sure, _ = race_bounds(logits, temperature, top_p, key_lo, key_hi, positions)
    return torch.where(sure, scores, float("-inf")).argmax(-1)


SCORE_ULPS = 8


def compare(tokens: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """The token must be one the nucleus may keep, and score within SCORE_ULPS fp32 ulps of the best score among
    the tokens it surely keeps. Why: the kernel sums s, the nucleus masses and S in other orders, so s and every
    p_v = exp(x_v - m) / s may sit an ulp or two from the reference's, and q_v another ulp (exp and log are the
    same functions on both sides on the GPU, libdevice, which torch's CUDA kernels compile to; numpy's vs torch's
    on the CPU, each within an ulp); a token whose nucleus mass lies within nucleus_band of top_p may be kept or
    dropped. S scales every kept score alike, so the ranking is taken before it. A near-tie inside these bands may
    go either way; outside them the tokens are equal."""
    scores, sure, _ = race_bounds(*case.args[:6])
    r, v = scores.shape
    t = tokens.long()
    if bool(((t < 0) | (t >= v)).any()):
        raise AssertionError(f"sample.race: tokens outside [0, {v}): {t.tolist()[:16]}")
    rows = torch.arange(r, device=scores.device)
    top = torch.where(sure, scores, float("-inf")).max(dim=1).values
    picked = ref[rows, t]
    short = top - picked - SCORE_ULPS * FP32_U * top.abs()
    if bool((short > 0).any()):
        i = int(torch.argmax(short))
        raise AssertionError(f"sample.race: row {i} drew {int(t[i])} (score {float(picked[i]):.9g}, -inf: outside "
                             f"the nucleus) but the best reference score is {float(top[i]):.9g}")


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    """LM-like logits (a few peaked rows, a flat tail, bf16 values as the heads write them: many ties) at
    temperatures from near-greedy to hot, nuclei from 0.1 to none, a greedy row when there are several, fresh keys
    and positions."""
    (v,) = cell.shape
    if gen is None:
        logits = torch.linspace(-4.0, 4.0, v, device=device).expand(rows, v).contiguous()
        temperature = torch.ones(rows, device=device)
        top_p = torch.full((rows,), 0.9, device=device)
        ints = torch.arange(1, rows + 1, dtype=torch.int32, device=device)
        key_lo, key_hi, positions = ints, ints, ints
    else:
        g = device_rng(gen, device)
        scale = torch.tensor([1.0, 3.0, 8.0], device=device)[torch.randint(0, 3, (rows, 1), generator=g, device=device)]
        logits = (torch.randn(rows, v, generator=g, device=device) * scale).to(torch.bfloat16).float()
        temps = torch.tensor([0.05, 0.3, 0.7, 1.0, 1.5, 4.0], device=device)
        temperature = temps[torch.randint(0, len(temps), (rows,), generator=g, device=device)]
        if rows > 1:
            temperature[torch.randint(0, rows, (1,), generator=g, device=device)] = 0.0
        nuclei = torch.tensor([1.0, 1.0, 0.95, 0.8, 0.5, 0.1], device=device)
        top_p = nuclei[torch.randint(0, len(nuclei), (rows,), generator=g, device=device)]
        key_lo, key_hi = (torch.randint(-2 ** 31, 2 ** 31 - 1, (rows,), generator=g, device=device,
                                        dtype=torch.int32) for _ in range(2))
        positions = torch.randint(0, 2 ** 20, (rows,), generator=g, device=device, dtype=torch.int32)
    tokens = torch.full((rows,), -1, dtype=torch.int64, device=device)
    return Case(args=(logits, temperature, top_p, key_lo, key_hi, positions, tokens, cell.config["race"]), kwargs={},
                bytes_moved=3 * rows * v * 4)


VOCAB_M3 = 200064
CELLS = (
    Cell(rows=(1, 512), shape=(VOCAB_M3,), why="M3 vocabulary: the decode graphs' sampling variant, buckets 1-512",
         config={"race": RaceConfig()}),
    Cell(rows=(1, 512), shape=(3840,), why="embedded model's vocabulary: its decode graphs' sampling variant",
         config={"race": RaceConfig(BLOCK=1024)}),
)
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(1000,), why="interpreter: 4 programs a row, masked tail, greedy rows beside hot ones, "
         "nuclei",
         config={"race": RaceConfig(BLOCK=256)}),
    Cell(rows=(5, 5), shape=(3840,), why="interpreter: the embedded vocabulary, one program a row",
         config={"race": RaceConfig(BLOCK=4096, SUB=128)}),
)


def warmup(device: torch.device) -> None:
    for c in CELLS:
        sample_race(*make_case(c, c.rows[1], device, None).args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ENTRY = Entry(
    name="sample.race", kind="sample.race", raw_call=sample_race, reference=race_reference, compare=compare,
    make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup, enabled=lambda: ENABLED,
    stock=race_stock,
)
ENTRIES = (ENTRY,)
