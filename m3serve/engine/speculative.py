"""One-model Eagle3 speculative decoding on the stock path: verify math, device RNG, and the engine step.

One `SpeculativeEngine.step()`:
  1. schedule as usual; every decode request that holds K' <= K drafts from the previous step gets pages for
     K' more tokens (blocks.append_slots; if that fails it verifies no drafts this step, which stays exact);
  2. target forward over [last token, d1..dK'] per decode request (plus any prefill chunks), capturing the
     drafter's layers (the residual stream entering layer i);
  3. verification -> a accepted drafts + one target token per request (greedy or rejection sampling, below);
     acceptance only moves lengths: num_computed += 1 + a. Target KV written for rejected drafts sits beyond
     num_computed, is never read (reads stop at the sequence length) and is overwritten later (append-only);
  4. draft loop, its KV written and read through the cache's DraftKVView (the shared pool's draft layer):
     iteration 0 runs the draft layer over every row whose next token is now known, with input
     (token at p+1, fused target states at p) at RoPE position p. This rewrites the draft KV of the accepted
     positions with target features (overwriting what the previous draft loop wrote there from draft features).
     Its last row (position c-1, c = num_computed) proposes d1; iterations j = 2..K run one token per request
     at position c+j-2 from (d_{j-1}, the previous iteration's pre-norm output) and propose dj.
  Invariant between steps: target and draft KV are valid for positions < num_computed = num_tokens - 1.
  Notes: a decode request verifies 1 + K' tokens but the scheduler's token budget counts it as 1. Prefix-cache
  pages carry the draft layer too; the draft entry of a page's last position was computed from the token after
  the page, which a request reusing the page may not share (drafts only get worse there: outputs stay exact).

Greedy verify. t_j = argmax p_j for j = 0..K' (p_j: the target at row j, i.e. after [x_n, d1..dj]).
  a = the longest prefix with d_i == t_{i-1}; emit t_0..t_a (= d1..da, then the correction/bonus t_a).
  Every emitted token is the target's argmax given exactly the tokens before it, so the output is token for
  token that of plain greedy decoding (up to fp rounding differences of batched vs single-row matmuls).

Sampled verify (Leviathan et al. 2023; Chen et al. 2023). p_j = the target's processed distribution at row j
  (temperature / top-k / top-p, sampler.processed_probs), q_i = the draft distribution that d_i was sampled
  from (same processing; one-hot for greedy rows and greedy drafts).
    for i = 1..K': draw u_i ~ U[0,1); accept d_i iff u_i * q_i(d_i) < p_{i-1}(d_i)  (probability min(1, p/q))
    a = number of leading accepts
    a < K': emit d1..da, then y ~ normalize(max(0, p_a - q_{a+1}))       (the residual)
    a = K': emit d1..dK', then y ~ p_K'                                   (the bonus)
  Why it is exact: P(emit y at a step position) = q(y) min(1, p(y)/q(y)) + P(reject) * residual(y)
  = min(q(y), p(y)) + (1 - sum_z min(p(z), q(z))) * max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z)) = p(y),
  because 1 - sum min(p, q) = sum max(0, p - q). Greedy rows: p and q one-hot make this exactly the greedy rule.

Random numbers: a counter-based hash RNG on the device. State int64 [2] = (seed, offset); a draw of n values
  reads the state on the device and advances the offset in place (no host sync, stable addresses: ready for
  CUDA graphs). value = mix32(mix32(mix32(seed) ^ key_row) ^ counter_lo) mixed again with counter_hi, where
  key_row is the request's seed (SamplingParams.seed, else a per-request id) and counter = offset + element.
  Categorical draws use the exponential race argmax(w / E), E ~ Exp(1): exact for unnormalised w, no cumsum,
  zero-weight tokens are never chosen.

Forced acceptance (benchmarks, like TensorRT-LLM's TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS):
  speculative_config["forced_acceptance"] = AL in [1, K+1], the mean tokens emitted per verify step. A request's
  i-th verify step accepts a_i = floor((i+1) f) - floor(i f) drafts, f = AL - 1 (in exact integer arithmetic),
  so any N consecutive steps accept floor(N f) +- 1 drafts: deterministic, mean exactly f in the limit. The
  emitted tokens are d1..da then the target's token at row a: output is NOT the target's distribution.

Shape legend: R requests that sample this step, K' <= K drafts of a request, V target vocab, Vd draft vocab,
  H hidden, T packed tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.request import Request
from m3serve.engine.sampler import processed_probs, top_logprobs
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.eagle3 import Eagle3Drafter, load_drafter, random_drafter
from m3serve.model.m3 import ForwardBatch, M3ForCausalLM, SeqSpan

log = logging.getLogger("m3serve")

_M32 = 0xFFFFFFFF


# ====================================================================== device RNG
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): split c in 16-bit halves so no product leaves int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class DeviceRNG:
    """Counter-based uniforms on the device; see the module docstring. state: int64 [2] = (seed, offset)."""

    def __init__(self, seed: int, device: torch.device | str):
        self.state = torch.tensor([int(seed) & _M32, 0], dtype=torch.int64, device=device)

    def _bits(self, rows: int, cols: int, keys: torch.Tensor) -> torch.Tensor:
        """int64 [rows, cols] of 24 random bits; advances the offset by rows*cols in place."""
        if keys.shape != (rows,) or keys.dtype != torch.int64:
            raise ValueError(f"keys: expected int64 [{rows}], found {keys.dtype} {tuple(keys.shape)}")
        dev = self.state.device
        ctr = self.state[1] + torch.arange(rows * cols, device=dev, dtype=torch.int64).view(rows, cols)
        k = mix32(((keys ^ (keys >> 32)) & _M32).to(dev) ^ mix32(self.state[0] & _M32))
        h = mix32(mix32(k[:, None] ^ (ctr & _M32)) ^ ((ctr >> 32) & _M32))
        self.state[1] += rows * cols
        return h >> 8

    def uniform(self, rows: int, cols: int, keys: torch.Tensor) -> torch.Tensor:
        """fp32 [rows, cols] in [0, 1 - 2^-24] (multiples of 2^-24)."""
        return self._bits(rows, cols, keys).float() * 2.0 ** -24

    def exponential(self, rows: int, cols: int, keys: torch.Tensor) -> torch.Tensor:
        """fp32 [rows, cols] Exp(1) draws, strictly positive (uniform taken at bin centres in (0, 1))."""
        u = (self._bits(rows, cols, keys).double() + 0.5) * 2.0 ** -24
        return (-torch.log(u)).float()


def sample_categorical(weights: torch.Tensor, rng: DeviceRNG, keys: torch.Tensor) -> torch.Tensor:
    """weights [R, V] >= 0 (unnormalised) -> int64 [R] ~ weights / sum: the race argmax(w / E), E ~ Exp(1)."""
    e = rng.exponential(weights.shape[0], weights.shape[1], keys)
    return (weights.float() / e).argmax(-1)


# ====================================================================== verification
def verify_greedy(target_ids: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [R, K+1] (argmax of each row), drafts [R, K], num_drafts [R] -> (tokens [R, K+1], num_emitted [R]).

    Draft i (1-based) is accepted iff d_1..d_i == t_0..t_{i-1} and i <= num_drafts; a = number accepted.
    The emitted tokens are t_0..t_a (the accepted drafts equal the target's tokens), num_emitted = a + 1."""
    r, k = drafts.shape
    if target_ids.shape != (r, k + 1) or num_drafts.shape != (r,):
        raise ValueError(f"target_ids/num_drafts: expected [{r}, {k + 1}] / [{r}], found "
                         f"{tuple(target_ids.shape)} / {tuple(num_drafts.shape)}")
    live = torch.arange(k, device=drafts.device) < num_drafts[:, None]
    match = (drafts == target_ids[:, :k]) & live
    a = match.long().cumprod(dim=1).sum(dim=1)
    return target_ids, a + 1


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                   rng: DeviceRNG, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection sampling (module docstring). p [R, K+1, V] target distributions, q [R, K, V] draft
    distributions (each row sums to 1; rows past num_drafts are ignored), drafts [R, K] with d_i ~ q_i,
    num_drafts [R] in [0, K], keys [R] per-request RNG keys.
    Returns (tokens [R, K+1]: the first num_emitted are the output, num_emitted [R] = accepted + 1)."""
    r, k1, v = p.shape
    k = k1 - 1
    if q.shape != (r, k, v) or drafts.shape != (r, k) or num_drafts.shape != (r,):
        raise ValueError(f"q/drafts/num_drafts: expected [{r}, {k}, {v}] / [{r}, {k}] / [{r}], found "
                         f"{tuple(q.shape)} / {tuple(drafts.shape)} / {tuple(num_drafts.shape)}")
    dev = p.device
    rows = torch.arange(r, device=dev)
    if k > 0:
        u = rng.uniform(r, k, keys)                                               # u_i ~ U[0, 1)
        d = drafts.unsqueeze(-1)
        p_d = p[:, :k].gather(-1, d).squeeze(-1)                                  # p_{i-1}(d_i)
        q_d = q.gather(-1, d).squeeze(-1)                                         # q_i(d_i)
        # accept iff u < p/q, written without the division (q(d) > 0 whenever d ~ q)
        accept = (u * q_d < p_d) & (torch.arange(k, device=dev) < num_drafts[:, None])
        a = accept.long().cumprod(dim=1).sum(dim=1)                               # leading accepts
        rejected = a < num_drafts
        p_a = p[rows, a]                                                          # [R, V]
        q_next = q[rows, a.clamp(max=k - 1)]                                      # q_{a+1}
        residual = (p_a - q_next).clamp_min(0.0)
        # The residual has mass sum max(0, p - q) = TV(p, q) > 0 whenever a rejection was possible; fall back
        # to p_a only for the fp-degenerate case of an all-zero residual.
        ok = residual.sum(-1, keepdim=True) > 0
        weights = torch.where(rejected[:, None] & ok, residual, p_a)
    else:
        a = torch.zeros(r, dtype=torch.long, device=dev)
        weights = p[:, 0]
    y = sample_categorical(weights, rng, keys)
    tokens = torch.cat((drafts, drafts.new_zeros(r, 1)), dim=1)
    tokens[rows, a] = y
    return tokens, a + 1


def forced_accepts(step: int, mean_accepted: float, scale: int = 1_000_000) -> int:
    """Drafts accepted at a request's `step`-th verify step so that the running mean is `mean_accepted`:
    floor((step+1) f) - floor(step f), in integer arithmetic (f quantised to 1/scale)."""
    f = round(mean_accepted * scale)
    return ((step + 1) * f) // scale - (step * f) // scale


# ====================================================================== configuration and per-request state
@dataclass
class SpecConfig:
    method: str = "eagle3"
    model: str | None = None              # drafter directory; None: random weights shaped for the target
    num_speculative_tokens: int = 3
    forced_acceptance: float | None = None  # mean acceptance length (tokens per verify step) to force
    draft_seed: int = 0                   # random drafter weights

    @classmethod
    def from_dict(cls, d: dict | SpecConfig) -> SpecConfig:
        if isinstance(d, SpecConfig):
            cfg = d
        else:
            if not isinstance(d, dict):
                raise TypeError(f"speculative_config: expected a dict, found {type(d).__name__}")
            unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; expected some of "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
            cfg = cls(**d)
        if cfg.method != "eagle3":
            raise ValueError(f"speculative_config.method: expected 'eagle3', found {cfg.method!r}")
        k = cfg.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens: expected an int in [1, 16], found {k!r}")
        fa = cfg.forced_acceptance
        if fa is not None and (not isinstance(fa, (int, float)) or not 1.0 <= fa <= k + 1):
            raise ValueError(f"speculative_config.forced_acceptance: expected a mean acceptance length in "
                             f"[1, {k + 1}] (num_speculative_tokens + 1), found {fa!r}")
        if cfg.model is not None and not isinstance(cfg.model, str):
            raise TypeError(f"speculative_config.model: expected a directory path or None, found "
                            f"{type(cfg.model).__name__}")
        return cfg


@dataclass
class _SpecState:
    drafts: list[int] = field(default_factory=list)    # proposals for positions num_tokens .. (target ids)
    q: torch.Tensor | None = None                       # [len(drafts), V] their draft distributions (sampled)
    anchor: int = -1                                    # num_tokens when proposed
    preemptions: int = 0
    verify_steps: int = 0                               # decode verify steps with >= 1 draft
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    proposed_per_pos: list[int] = field(default_factory=list)

    def metrics(self) -> dict:
        n = self.verify_steps
        return {"verify_steps": n, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_length": 1.0 + self.accepted / n if n else None,
                "accepted_per_position": list(self.accepted_per_pos),
                "proposed_per_position": list(self.proposed_per_pos)}


@dataclass
class _Item:
    """One request's share of the target batch."""
    req: Request
    pos0: int                 # position of its first row
    tokens: list[int]         # its input tokens this step
    row0: int                 # first row in the packed batch
    sample: bool              # ends the request's known tokens: a token is sampled after it
    drafts: list[int]         # drafts verified this step (decode requests)
    logit_row0: int = -1      # first row of its logits (sample=True)


# ====================================================================== the engine
class SpeculativeEngine(LLMEngine):
    def __init__(self, model: M3ForCausalLM, config: EngineConfig, tokenizer=None, *,
                 speculative_config: dict | SpecConfig, drafter: Eagle3Drafter | None = None):
        self.spec = SpecConfig.from_dict(speculative_config)
        if drafter is None:
            if self.spec.model is None:
                drafter = random_drafter(model.cfg, seed=self.spec.draft_seed, dtype=model.dtype, device=model.device)
            else:
                drafter = load_drafter(self.spec.model, model.cfg, dtype=model.dtype, device=model.device)
        self.drafter = drafter.to(device=model.device, dtype=model.dtype).attach_target(model).eval()
        super().__init__(model, config, tokenizer)
        self.view = self.kv.draft_view(self.blocks)
        self.rng = DeviceRNG(config.seed, model.device)
        self.capture = tuple(sorted(set(drafter.cfg.capture_layers)))
        self._state: dict[int, _SpecState] = {}
        k = self.spec.num_speculative_tokens
        self._totals = _SpecState(accepted_per_pos=[0] * k, proposed_per_pos=[0] * k)
        self._forced_step: dict[int, int] = {}

    def _kv_spec(self, model: M3ForCausalLM, config: EngineConfig, **extra) -> KVCacheSpec:
        """The base cache plus the shared Eagle3 draft layer (K/V sub-pages in every slot)."""
        return super()._kv_spec(model, config, num_draft_layers=1,
                                draft_num_kv_heads=self.drafter.cfg.num_key_value_heads, **extra)

    # ------------------------------------------------------------------ bookkeeping
    def _st(self, req: Request) -> _SpecState:
        st = self._state.get(req.request_id)
        if st is None:
            k = self.spec.num_speculative_tokens
            st = self._state[req.request_id] = _SpecState(accepted_per_pos=[0] * k, proposed_per_pos=[0] * k,
                                                          preemptions=req.num_preemptions)
            req.spec_metrics = st.metrics()
        return st

    def _key(self, req: Request) -> int:
        s = req.params.seed
        return s if s is not None else (self.config.seed * 1_000_003 + req.request_id) % (2 ** 63)

    def _slots(self, req: Request) -> torch.Tensor:
        return torch.tensor(self.blocks.slot_ids(req.request_id), dtype=torch.int64, device=self.model.device)

    def abort(self, request_id: int) -> None:
        self._state.pop(request_id, None)
        self._forced_step.pop(request_id, None)
        super().abort(request_id)

    def release(self, req: Request) -> None:
        self._state.pop(req.request_id, None)
        self._forced_step.pop(req.request_id, None)
        super().release(req)

    def stats(self) -> dict:
        out = super().stats()
        t = self._totals
        m = t.metrics()
        m["num_speculative_tokens"] = self.spec.num_speculative_tokens
        m["forced_acceptance"] = self.spec.forced_acceptance
        m["acceptance_rate_per_position"] = [a / p if p else None
                                             for a, p in zip(t.accepted_per_pos, t.proposed_per_pos)]
        out["spec_decode"] = m
        return out

    def reset_spec_stats(self) -> None:
        k = self.spec.num_speculative_tokens
        self._totals = _SpecState(accepted_per_pos=[0] * k, proposed_per_pos=[0] * k)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Request]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return self._unschedulable()
        with torch.inference_mode():
            items = self._plan(chunks)
            batch = self._target_batch(items)
            logits = self.model(batch)
            fused = self.drafter.fuse([batch.captured[i] for i in self.drafter.cfg.capture_layers])
            sampled = [it for it in items if it.sample]
            emitted = self._verify(sampled, logits) if sampled else []
            out = self._commit(items, sampled, emitted, logits)
            self._draft(items, fused)
        return out

    def _plan(self, chunks) -> list[_Item]:
        """Attach last step's drafts to decode chunks (allocating their pages) and lay out the packed rows."""
        items, row = [], 0
        for c in chunks:
            r = c.request
            st = self._st(r)
            if st.preemptions != r.num_preemptions:          # KV was dropped: its drafts' context is gone
                st.drafts, st.q, st.preemptions = [], None, r.num_preemptions
            drafts: list[int] = []
            if c.reaches_end and c.num_tokens == 1 and st.drafts and st.anchor == r.num_tokens:
                n = r.num_computed
                k = min(len(st.drafts), self.max_model_len - 1 - n)   # verify writes positions n..n+k
                if k > 0 and not self.blocks.append_slots(r.request_id, n + 1 + k):
                    k = 0
                drafts = st.drafts[:k]
            elif st.drafts:                                    # not a decode of the state they were made for
                st.drafts, st.q = [], None
            toks = r.all_token_ids[r.num_computed:r.num_computed + c.num_tokens] + drafts
            items.append(_Item(r, r.num_computed, toks, row, c.reaches_end, drafts))
            row += len(toks)
        return items

    def _target_batch(self, items: list[_Item]) -> ForwardBatch:
        """Pack the step; logits only for the rows that verify or sample (each item's logit_row0 is set)."""
        page = self.kv.page_size
        ids, pos, slot_map, spans, rows = [], [], [], [], []
        for it in items:
            n = len(it.tokens)
            p = np.arange(it.pos0, it.pos0 + n)
            slots = np.asarray(self.blocks.slot_ids(it.req.request_id), dtype=np.int64)
            ids.extend(it.tokens)
            pos.append(p)
            slot_map.append(slots[p // page] * page + p % page)
            spans.append(SeqSpan(it.row0, n, it.pos0 + n, torch.from_numpy(slots).to(self.model.device)))
            if it.sample:
                it.logit_row0 = len(rows)
                first = it.row0 + n - 1 - len(it.drafts)    # the row of the request's last known token
                rows.extend(range(first, it.row0 + n))
        dev = self.model.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(pos)).to(dev),
            seqs=spans, slot_mapping=torch.from_numpy(np.concatenate(slot_map)).to(dev), kv=self.kv,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=dev), capture_layers=self.capture)
        return batch

    # ------------------------------------------------------------------ verification
    def _verify(self, sampled: list[_Item], logits: torch.Tensor) -> list[list[int]]:
        """Tokens each sampling request emits this step (before stop checks)."""
        dev = logits.device
        r = len(sampled)
        k = max(len(it.drafts) for it in sampled)
        nd = [len(it.drafts) for it in sampled]
        # Row (request i, j) of the padded [R, K+1] view -> its logits row; padding repeats the last real row.
        idx = torch.tensor([[it.logit_row0 + min(j, len(it.drafts)) for j in range(k + 1)] for it in sampled],
                           dtype=torch.int64, device=dev)
        drafts = torch.tensor([it.drafts + [0] * (k - len(it.drafts)) for it in sampled], dtype=torch.int64,
                              device=dev).view(r, k)
        num_drafts = torch.tensor(nd, dtype=torch.int64, device=dev)
        params = [it.req.params for it in sampled]
        greedy = all(p.greedy for p in params)
        keys = None if greedy else torch.tensor([self._key(it.req) for it in sampled], dtype=torch.int64, device=dev)
        if self.spec.forced_acceptance is not None:
            return self._forced(sampled, logits, idx, greedy, keys)
        if greedy:
            tokens, n_emit = verify_greedy(logits.argmax(-1)[idx], drafts, num_drafts)
        else:
            p = processed_probs(logits, self._row_params(sampled, logits.shape[0]))[idx]   # [R, K+1, V]
            q = self._draft_q(sampled, drafts, k, p.shape[-1])
            tokens, n_emit = verify_sampled(p, q, drafts, num_drafts, self.rng, keys)
        tokens, n_emit = tokens.tolist(), n_emit.tolist()
        return [tokens[i][:n_emit[i]] for i in range(r)]

    @staticmethod
    def _row_params(sampled: list[_Item], n_rows: int) -> list:
        params = [None] * n_rows
        for it in sampled:
            for j in range(len(it.drafts) + 1):
                params[it.logit_row0 + j] = it.req.params
        return params

    def _draft_q(self, sampled: list[_Item], drafts: torch.Tensor, k: int, v: int) -> torch.Tensor:
        """[R, K, V] draft distributions: stored ones for sampled drafts, one-hot for greedy drafts."""
        q = torch.zeros(len(sampled), k, v, dtype=torch.float32, device=drafts.device)
        if k == 0:
            return q
        q.scatter_(2, drafts.unsqueeze(-1), 1.0)
        for i, it in enumerate(sampled):
            st = self._state[it.req.request_id]
            if it.drafts and st.q is not None:
                q[i, :len(it.drafts)] = st.q[:len(it.drafts)]
        return q

    def _forced(self, sampled: list[_Item], logits: torch.Tensor, idx: torch.Tensor, greedy: bool,
                keys: torch.Tensor | None) -> list[list[int]]:
        """Benchmark mode: accept the forced count, then the target's own token at that row."""
        r, k1 = idx.shape
        if greedy:
            t = logits.argmax(-1)[idx]
        else:
            p = processed_probs(logits, self._row_params(sampled, logits.shape[0]))[idx]
            row_keys = keys.repeat_interleave(k1)
            t = sample_categorical(p.view(r * k1, -1), self.rng, row_keys).view(r, k1)
        t = t.tolist()
        out = []
        for i, it in enumerate(sampled):
            a = 0
            if it.drafts:
                rid = it.req.request_id
                step = self._forced_step.get(rid, 0)
                self._forced_step[rid] = step + 1
                a = min(forced_accepts(step, self.spec.forced_acceptance - 1.0), len(it.drafts))
            out.append(it.drafts[:a] + [t[i][a]])
        return out

    # ------------------------------------------------------------------ commit
    def _commit(self, items: list[_Item], sampled: list[_Item], emitted: list[list[int]], logits: torch.Tensor
                ) -> list[Request]:
        """Move lengths, append tokens with stop checks, record acceptance, commit full pages."""
        lp_by_item: dict[int, tuple] = {}
        want = max((it.req.params.logprobs for it in sampled if it.req.params.logprobs is not None), default=None)
        if want is not None:
            sel = [(i, j) for i, it in enumerate(sampled) if it.req.params.logprobs is not None
                   for j in range(len(emitted[i]))]
            rows = torch.tensor([sampled[i].logit_row0 + j for i, j in sel], dtype=torch.int64, device=logits.device)
            toks = torch.tensor([emitted[i][j] for i, j in sel], dtype=torch.int64, device=logits.device)
            lp = tuple(x.tolist() for x in top_logprobs(logits[rows], toks, want))
            for n, (i, j) in enumerate(sel):
                lp_by_item[(i, j)] = (lp[0][n], lp[1][n], lp[2][n])
        em = {id(it): (i, e) for i, (it, e) in enumerate(zip(sampled, emitted))}
        out = []
        for it in items:
            req = it.req
            if not it.sample:
                req.num_computed += len(it.tokens)
                continue
            i, toks = em[id(it)]
            a = len(toks) - 1
            req.num_computed += len(it.tokens) - len(it.drafts) + a
            if it.drafts:
                self._record(self._st(req), len(it.drafts), a)
            for j, tok in enumerate(toks):
                req.output_token_ids.append(tok)
                if req.params.logprobs is not None:
                    chosen, ids, vals = lp_by_item[(i, j)]
                    top = {tid: lv for tid, lv in zip(ids[:req.params.logprobs], vals[:req.params.logprobs])}
                    top[tok] = chosen
                    req.output_logprobs.append(top)
                self._check_stop(req, tok)
                if req.is_finished:
                    break
            if not req.is_finished:
                self.blocks.commit_full_pages(req.request_id, req.all_token_ids[:req.num_computed])
            else:
                st = self._st(req)
                st.drafts, st.q = [], None
            req.spec_metrics = self._st(req).metrics()
            out.append(req)
        return out

    def _record(self, st: _SpecState, k: int, a: int) -> None:
        for s in (st, self._totals):
            s.verify_steps += 1
            s.drafted += k
            s.accepted += a
            for i in range(k):
                s.proposed_per_pos[i] += 1
                s.accepted_per_pos[i] += int(i < a)

    # ------------------------------------------------------------------ the draft loop
    def _draft(self, items: list[_Item], fused: torch.Tensor) -> None:
        dev = self.model.device
        page = self.kv.page_size
        kmax = self.spec.num_speculative_tokens
        live = [it for it in items if not it.req.is_finished and it.req.allocated]
        if not live:
            return
        # Iteration 0: every row whose next token is known now: positions pos0 .. num_computed-1.
        ids, pos, rows, slot_map, spans, proposers = [], [], [], [], [], []
        start = 0
        for it in live:
            req = it.req
            n = req.num_computed - it.pos0
            toks = req.all_token_ids
            p = np.arange(it.pos0, req.num_computed)
            slots = np.asarray(self.blocks.slot_ids(req.request_id), dtype=np.int64)
            ids.extend(toks[it.pos0 + 1:req.num_computed + 1])
            pos.append(p)
            rows.append(np.arange(it.row0, it.row0 + n))
            slot_map.append(slots[p // page] * page + p % page)
            spans.append(SeqSpan(start, n, req.num_computed, torch.from_numpy(slots).to(dev)))
            if it.sample:
                k = min(kmax, self.max_model_len - 1 - req.num_computed)   # next verify: positions c..c+k
                if k > 0 and self.blocks.append_slots(req.request_id, req.num_computed + 1 + k):
                    proposers.append((it, start + n - 1, k))
                else:
                    st = self._st(req)
                    st.drafts, st.q = [], None
            start += n
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(pos)).to(dev), seqs=spans,
            slot_mapping=torch.from_numpy(np.concatenate(slot_map)).to(dev), kv=self.view)
        hidden = fused[torch.from_numpy(np.concatenate(rows)).to(dev)]
        normed, r2 = self.drafter(batch, hidden)
        if not proposers:
            return
        gather = torch.tensor([g for _, g, _ in proposers], dtype=torch.int64, device=dev)
        reqs = [it.req for it, _, _ in proposers]
        ks = [k for _, _, k in proposers]
        greedy = all(r.params.greedy for r in reqs)
        keys = None if greedy else torch.tensor([self._key(r) for r in reqs], dtype=torch.int64, device=dev)
        tok, q = self._propose(normed[gather], reqs, greedy, keys)
        props, qs = [tok], [q]
        h = r2[gather]
        slot_t = [self._slots(r) for r in reqs]
        for j in range(2, kmax + 1):
            act = [i for i, k in enumerate(ks) if k >= j]
            if not act:
                break
            sel = torch.tensor(act, dtype=torch.int64, device=dev)
            ppos = [reqs[i].num_computed + j - 2 for i in act]
            smap = [self.blocks.slot_ids(reqs[i].request_id)[p // page] * page + p % page for i, p in zip(act, ppos)]
            batch = ForwardBatch(
                input_ids=props[-1][sel], positions=torch.tensor(ppos, dtype=torch.int64, device=dev),
                seqs=[SeqSpan(n, 1, p + 1, slot_t[i]) for n, (i, p) in enumerate(zip(act, ppos))],
                slot_mapping=torch.tensor(smap, dtype=torch.int64, device=dev), kv=self.view)
            normed_j, r2_j = self.drafter(batch, h[sel])
            sub_keys = None if keys is None else keys[sel]
            tok_j, q_j = self._propose(normed_j, [reqs[i] for i in act], greedy, sub_keys)
            # scatter back into full-width tensors so later iterations index by request
            full_tok = props[-1].clone()
            full_tok[sel] = tok_j
            props.append(full_tok)
            if q_j is not None:
                full_q = torch.zeros_like(qs[-1])
                full_q[sel] = q_j
                qs.append(full_q)
            else:
                qs.append(None)
            h = h.clone()
            h[sel] = r2_j
        drafts = torch.stack(props, dim=1).tolist()                      # [n, steps]
        for i, (r, k) in enumerate(zip(reqs, ks)):
            st = self._st(r)
            st.drafts = drafts[i][:k]
            st.q = None if qs[0] is None else torch.stack([qq[i] for qq in qs[:k]])
            st.anchor = r.num_tokens

    def _propose(self, normed: torch.Tensor, reqs: list[Request], greedy: bool, keys: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens (target ids) [n] and, unless all greedy, their distributions over the target vocab
        [n, V] (one-hot for greedy requests). Tests override this to force particular proposals."""
        logits = self.drafter.logits(normed)
        if greedy:
            return self.drafter.to_target_ids(logits.argmax(-1)), None
        q = processed_probs(logits, [r.params for r in reqs])
        d = sample_categorical(q, self.rng, keys)
        return self.drafter.to_target_ids(d), self.drafter.to_target_probs(q)


__all__ = ["SpeculativeEngine", "SpecConfig", "DeviceRNG", "mix32", "sample_categorical", "verify_greedy",
           "verify_sampled", "forced_accepts"]
