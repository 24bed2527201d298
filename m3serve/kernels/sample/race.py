"""Catalog entry sample.race: the decode step's draw for rows that sample at a temperature without top-k / top-p,
and greedy rows beside them, in four small launches over the logits.

The torch sampler (m3serve.engine.sampler.sample_rows) runs, for every row whatever it asks for, two full sorts of
the vocabulary (top-k's k-th value, top-p's nucleus), a softmax, a cumulative sum and a scatter, and builds the
keyed noise in int64 and fp64 tensor ops: about 0.45 ms at one row and 1.1 ms at eight on an H100 for a 200k vocabulary
(bench/results/decode/decode-target-h100-m3_5-race-sampled.json, the step on route target-torch-sampler against
this kernel's). For a row with top_k off and top_p = 1 every one of those
passes is the identity except the softmax and the noise, so the draw reduces to

    greedy (T = 0):  token = first argmax_v logits[v]
    otherwise:       x_v = logits[v] / T                      fp32, IEEE division
                     m = max_v x_v,  s = sum_v exp(x_v - m)     fp32, the softmax's max and sum
                     p_v = exp(x_v - m) / s                     torch's softmax value for value
                     E_v = fp32(-log((b_v + 0.5) * 2**-24))     b_v = mix32(seed + v * golden) >> 8 (keyed_noise)
                     token = first argmax_v p_v / E_v           IEEE division

with seed = row_seed(key, counter) and counter = position + 1, the index in its sequence of the token being drawn
(m3serve.keyed_noise). That is sample_rows op for op: exp is libdevice's expf (what torch's softmax calls), the log
is fp64 as in keyed_noise, every division correctly rounded (a plain `/` compiles to the approximate div.full.f32),
so the only difference is the order in which s is summed. The compare allows for it: the kernel's token must score
within a few fp32 ulps of the reference's best (an s one ulp off moves every p_v by at most an ulp).

Launches (grid (P, R), P = cdiv(V, BLOCK) programs a row, each over BLOCK vocabulary entries):
    race_max      partial maxima of x                                         pmax [R, P]
    race_sum      m from the P partials; partial sums of exp(x - m)           psum [R, P]
    race_argmax   s = the P partial sums in program order; each program's best p / E and its first index
    argmax_reduce (head/_argmax.py) the row's best over the P partials, ties to the smaller index -> tokens

Shape legend:
    logits       [R, V]  fp32 (unit column stride)
    temperature  [R]     fp32; 0 = greedy (the decode step's staged temperature bits, viewed as fp32)
    key_lo, key_hi [R]   int32 halves of the row's 63-bit sampling key
    positions    [R]     int32 the position of the row's input token (its draw's counter is position + 1)
    tokens       [R]     int64 out
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


@kernel
def race_argmax(logits_ptr, temp_ptr, key_lo_ptr, key_hi_ptr, pos_ptr, pmax_ptr, psum_ptr, pval_ptr, pidx_ptr, V,
                stride_l, P, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    c = tl.program_id(0)
    row = tl.program_id(1)
    m = _row_max(pmax_ptr, row, P, BLOCK_P)
    pp = tl.arange(0, BLOCK_P)
    # every program of the row sums the same partials with the same code: one s per row
    s = tl.sum(tl.load(psum_ptr + row * P + pp, mask=pp < P, other=0.0), axis=0)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = _tempered(logits_ptr, temp_ptr, row, cols, V, stride_l)
    p = tl.div_rn(_exp(x - m, CUDA), tl.zeros_like(x) + s)
    q = tl.div_rn(p, _exp_noise(_row_seed(key_lo_ptr, key_hi_ptr, pos_ptr, row), cols, CUDA))
    # greedy rows: the argmax of the logits themselves (sample_rows' one-hot row over noise 1)
    q = tl.where(tl.load(temp_ptr + row) == 0.0, x, q)
    q = tl.where(cols < V, q, float("-inf"))
    best = tl.max(q, axis=0)
    arg = tl.argmax(q, axis=0, tie_break_left=True)
    tl.store(pval_ptr + row * P + c + tl.arange(0, 1), tl.zeros([1], tl.float32) + best)
    tl.store(pidx_ptr + row * P + c + tl.arange(0, 1), tl.zeros([1], tl.int32) + c * BLOCK + arg)


def _check(logits, temperature, key_lo, key_hi, positions, tokens) -> tuple[int, int]:
    check_tensor("logits", logits, torch.float32)
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"logits: expected [R >= 1, V >= 1] with unit column stride, found shape "
                         f"{tuple(logits.shape)} strides {tuple(logits.stride())}")
    r, v = logits.shape
    if v >= 2 ** 31:
        raise ValueError(f"logits: vocabulary {v} exceeds the int32 ids this kernel writes")
    check_tensor("temperature", temperature, torch.float32, (r,), logits.device)
    for name, t in (("key_lo", key_lo), ("key_hi", key_hi), ("positions", positions)):
        check_tensor(name, t, torch.int32, (r,), logits.device)
    check_tensor("tokens", tokens, torch.int64, (r,), logits.device)
    return r, v


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor,
                positions: torch.Tensor, tokens: torch.Tensor, config: RaceConfig = RaceConfig()) -> torch.Tensor:
    """Raw call: one token per row (module docstring). The rows must not ask for top-k / top-p (the caller routes
    those elsewhere: temperature alone is read). Writes and returns tokens. No host sync: graph-safe."""
    r, v = _check(logits, temperature, key_lo, key_hi, positions, tokens)
    p = triton.cdiv(v, config.BLOCK)
    block_p = max(triton.next_power_of_2(p), 2)
    dev = logits.device
    part = torch.empty(3, r, p, dtype=torch.float32, device=dev)     # pmax, psum, pval
    pidx = torch.empty(r, p, dtype=torch.int32, device=dev)
    best = torch.empty(r, dtype=torch.float32, device=dev)
    cuda = is_compiled(logits)
    grid = (p, r)
    race_max[grid](logits, temperature, part[0], v, logits.stride(0), p, BLOCK=config.BLOCK,
                   num_warps=config.num_warps)
    race_sum[grid](logits, temperature, part[0], part[1], v, logits.stride(0), p, BLOCK=config.BLOCK,
                   BLOCK_P=block_p, CUDA=cuda, num_warps=config.num_warps)
    race_argmax[grid](logits, temperature, key_lo, key_hi, positions, part[0], part[1], part[2], pidx, v,
                      logits.stride(0), p, BLOCK=config.BLOCK, BLOCK_P=block_p, CUDA=cuda,
                      num_warps=config.num_warps)
    argmax_reduce[(r,)](part[2], pidx, tokens, best, p, 0, BLOCK=min(block_p, 1024), num_warps=4)
    return tokens


def race_scores(logits, temperature, key_lo, key_hi, positions) -> torch.Tensor:
    """The scores whose first argmax is each row's token, as sample_rows computes them for rows without top-k /
    top-p, in true fp32 (fp64 noise): fp32 [R, V]; greedy rows: the logits."""
    greedy = temperature == 0
    keys = (key_hi.long() << 32) | (key_lo.long() & 0xFFFFFFFF)
    with true_fp32():
        x = logits.float() / torch.where(greedy, 1.0, temperature).unsqueeze(1)
        q = torch.softmax(x, dim=-1) / noise_from_seeds(row_seed(keys, positions.long() + 1), logits.shape[1])
    return torch.where(greedy.unsqueeze(1), logits.float(), q)


def race_reference(logits, temperature, key_lo, key_hi, positions, tokens=None, config=None) -> torch.Tensor:
    return race_scores(logits, temperature, key_lo, key_hi, positions)


def race_stock(logits, temperature, key_lo, key_hi, positions, tokens=None, config=None) -> torch.Tensor:
    """Without this kernel: the scores in torch, then argmax (what sample_rows does for such rows, minus its
    sorts)."""
    return race_scores(logits, temperature, key_lo, key_hi, positions).argmax(-1)


SCORE_ULPS = 8


def compare(tokens: torch.Tensor, scores: torch.Tensor, case: Case) -> None:
    """The kernel's token must score within SCORE_ULPS fp32 ulps of the row's best reference score. Why: the
    kernel sums s in another order, so s and with it every p_v = exp(x_v - m) / s may sit an ulp or two from the
    reference's, and q_v = p_v / E_v another ulp; exp and log are the same functions on both sides on the GPU
    (libdevice, which torch's CUDA kernels compile to), numpy's vs torch's on the CPU (each within an ulp). A
    near-tie of the top two scores inside that band may go either way; outside it the tokens are equal."""
    r, v = scores.shape
    t = tokens.long()
    if bool(((t < 0) | (t >= v)).any()):
        raise AssertionError(f"sample.race: tokens outside [0, {v}): {t.tolist()[:16]}")
    rows = torch.arange(r, device=scores.device)
    top = scores.max(dim=1).values
    picked = scores[rows, t]
    short = top - picked - SCORE_ULPS * FP32_U * top.abs()
    if bool((short > 0).any()):
        i = int(torch.argmax(short))
        raise AssertionError(f"sample.race: row {i} drew {int(t[i])} (score {float(picked[i]):.9g}) but the best "
                             f"reference score is {float(top[i]):.9g} at {int(scores[i].argmax())}")


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    """LM-like logits (a few peaked rows, a flat tail, bf16 values as the heads write them) at temperatures from
    near-greedy to hot, a greedy row when there are several, fresh keys and positions."""
    (v,) = cell.shape
    if gen is None:
        logits = torch.linspace(-4.0, 4.0, v, device=device).expand(rows, v).contiguous()
        temperature = torch.ones(rows, device=device)
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
        key_lo, key_hi = (torch.randint(-2 ** 31, 2 ** 31 - 1, (rows,), generator=g, device=device,
                                        dtype=torch.int32) for _ in range(2))
        positions = torch.randint(0, 2 ** 20, (rows,), generator=g, device=device, dtype=torch.int32)
    tokens = torch.full((rows,), -1, dtype=torch.int64, device=device)
    return Case(args=(logits, temperature, key_lo, key_hi, positions, tokens, cell.config["race"]), kwargs={},
                bytes_moved=3 * rows * v * 4)


VOCAB_M3 = 200064
CELLS = (
    Cell(rows=(1, 512), shape=(VOCAB_M3,), why="M3 vocabulary: the decode graphs' sampling variant, buckets 1-512",
         config={"race": RaceConfig()}),
    Cell(rows=(1, 512), shape=(3840,), why="embedded model's vocabulary: its decode graphs' sampling variant",
         config={"race": RaceConfig(BLOCK=1024)}),
)
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(1000,), why="interpreter: 4 programs a row, masked tail, greedy rows beside hot ones",
         config={"race": RaceConfig(BLOCK=256)}),
    Cell(rows=(5, 5), shape=(3840,), why="interpreter: the embedded vocabulary, one program a row",
         config={"race": RaceConfig(BLOCK=4096)}),
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
