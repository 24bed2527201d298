"""Penalties, logit bias and min_tokens on the device, batched over the step's requests (vLLM's definitions).

For a row with bias b, token counts c over the output so far, s = [token in the prompt or c > 0]:
    x = logits + b
    x[stop ids] = -inf                    while fewer than min_tokens tokens are out (EOS unless ignore_eos)
    x = where(s, where(x > 0, x / r, x * r), x)          repetition_penalty r (prompt + output)
    x = x - f * c - p * [c > 0]                          frequency f, presence p (output only)
    x[v] = -inf where x[v] - max(x) < floor              min_p (floor = T ln min_p; m3serve.engine.token_filters)
allowed_token_ids and bad words are -inf entries of the bias row (a bad word of several tokens: written by the
host before each step where the output ends with its other tokens, see refresh).
Logprobs stay those of the raw logits (vLLM's default); only the token choice sees x.

Per-request state lives in preallocated device tensors, one state row per running request that needs it;
batch rows without processing point at the neutral row S:
    counts      fp32 [S+1, V]     output token counts (exact integers below 2^24)
    seen        bool [S+1, V]     token occurs in the prompt or the output
    bias        fp32 [S+1, V]
    stop_mask   bool [S+1, V]     ids forbidden before min_tokens
    coef        fp32 [S+1, 3, 1]  (r, f, p)
    remaining   fp32 [S+1, 1]     min_tokens - tokens out (stop ids are forbidden while > 0)
    floor       fp32 [S+1, 1]     min_p's floor on x - max(x) (-inf: off)
A step is apply(logits, rows) then record(rows, tokens): a fixed sequence of ~20 + 5 device ops whatever is
enabled and however many rows use it, no host sync, the sampled ids counted in place (index_add_) -
so it can run inside a captured CUDA graph with `rows` in a static buffer. The host writes a request's row once
(its prompt, its output so far, its parameters), not per token; a batch without any processed request skips
all of it (rows_for returns None). The neutral row has bias 0, r = 1, f = p = 0, remaining <= 0, floor -inf: every rule
is the identity there for any counts (x / 1, x * 1, x - 0 are exact), so record() counts into it too rather than
spend ops on masking it out.

Shape legend: S max_num_seqs (state rows), V vocab, R rows sampled this step.
"""

from __future__ import annotations

import math

import torch

from m3serve.engine import token_filters
from m3serve.engine.request import Request, Status
from m3serve.engine.sampling_params import SamplingParams


def stop_ids_before_min_tokens(params: SamplingParams, eos_ids, vocab: int) -> list[int]:
    """Token ids the sampler forbids while fewer than min_tokens are out: stop ids, and EOS unless ignore_eos
    (ids outside the vocabulary can never be sampled and are left out)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= set(eos_ids)
    return sorted(t for t in ids if 0 <= t < vocab)


class PenaltyState:
    def __init__(self, max_rows: int, vocab: int, device: torch.device | str, eos_ids):
        if max_rows < 1 or vocab < 1:
            raise ValueError(f"PenaltyState: expected max_rows >= 1 and vocab >= 1, found {max_rows}, {vocab}")
        self.max_rows, self.vocab, self.device = max_rows, vocab, torch.device(device)
        self.eos_ids = sorted(eos_ids)
        self.neutral = max_rows
        self._owner: list[Request | None] = [None] * max_rows
        self._row_of: dict[int, int] = {}
        self._epoch = 0                              # bumped whenever a row changes hands
        self._cached: tuple[tuple[int, ...], int, torch.Tensor] | None = None
        # rows whose bad words ban tokens only after some outputs: row -> (request, bans written now)
        self._dynamic: dict[int, tuple[Request, set[int]]] = {}
        self.counts = None                           # allocated on first use: no memory unless a request needs it

    def _allocate(self) -> None:
        # normal tensors even when first needed under inference mode (a graph capture): the host updates rows
        # in place later, outside it
        with torch.inference_mode(False):
            self._allocate_now()

    def _allocate_now(self) -> None:
        s, v, dev = self.max_rows + 1, self.vocab, self.device
        self.counts = torch.zeros(s, v, dtype=torch.float32, device=dev)
        self.seen = torch.zeros(s, v, dtype=torch.bool, device=dev)
        self.bias = torch.zeros(s, v, dtype=torch.float32, device=dev)
        self.stop_mask = torch.zeros(s, v, dtype=torch.bool, device=dev)
        self.coef = torch.tensor([[1.0, 0.0, 0.0]] * s, dtype=torch.float32, device=dev).unsqueeze(-1)
        self.remaining = torch.zeros(s, 1, dtype=torch.float32, device=dev)
        self.floor = torch.full((s, 1), -math.inf, dtype=torch.float32, device=dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self._minus_one = -self._one
        self._true = torch.ones((), dtype=torch.bool, device=dev)

    # ------------------------------------------------------------------ host: rows (once per request)
    def ensure_allocated(self) -> None:
        """Allocate the state now (before a CUDA graph that reads it is captured)."""
        if self.counts is None:
            self._allocate()

    def row_ids_for(self, reqs: list[Request]) -> list[int] | None:
        """The state row of each of this step's sampled requests (the neutral row for those without processing),
        or None when none needs processing. Rows are assigned on a request's first sampled step (its state is
        written then, on the device, from its prompt and output so far)."""
        if not any(r.logits_processing for r in reqs):
            return None
        self.ensure_allocated()
        rows = []
        for r in reqs:
            if not r.logits_processing:
                rows.append(self.neutral)
                continue
            row = self._row_of.get(r.request_id)
            if row is None or self._owner[row] is not r:
                row = self._assign(r)
            rows.append(row)
        return rows

    def rows_for(self, reqs: list[Request]) -> torch.Tensor | None:
        """row_ids_for as an int64 [R] device tensor, reused while the batch's requests and the row assignment
        are unchanged (steady decode)."""
        if not any(r.logits_processing for r in reqs):
            return None
        key = tuple(r.request_id for r in reqs)
        if self._cached is not None and self._cached[0] == key and self._cached[1] == self._epoch:
            return self._cached[2]
        rows = self.row_ids_for(reqs)
        t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._cached = (key, self._epoch, t)
        return t

    def _free_row(self) -> int:
        """A row with no owner, else one whose owner no longer runs (finished, or preempted: its row is rebuilt
        from its tokens when it samples again). At most max_num_seqs requests run, so one always exists."""
        for i, o in enumerate(self._owner):
            if o is None:
                return i
        for i, o in enumerate(self._owner):
            if o.status is not Status.RUNNING:
                del self._row_of[o.request_id]
                self._dynamic.pop(i, None)
                return i
        raise RuntimeError(f"PenaltyState: all {self.max_rows} rows belong to running requests (max_num_seqs)")

    def _assign(self, req: Request) -> int:
        row = self._free_row()
        p, dev = req.params, self.device
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.seen[row, torch.tensor(req.prompt_token_ids, dtype=torch.int64, device=dev)] = True
        if req.output_token_ids:
            out = torch.tensor(req.output_token_ids, dtype=torch.int64, device=dev)
            self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
            self.seen[row, out] = True
        self.bias[row].zero_()
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=dev)
            self.bias[row, ids] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=dev)
        self.stop_mask[row].zero_()
        stops = stop_ids_before_min_tokens(p, self.eos_ids, self.vocab) if p.min_tokens > 0 else []
        if stops:
            self.stop_mask[row, torch.tensor(stops, dtype=torch.int64, device=dev)] = True
        self.coef[row] = torch.tensor([[p.repetition_penalty], [p.frequency_penalty], [p.presence_penalty]],
                                      dtype=torch.float32, device=dev)
        self.remaining[row] = p.min_tokens - len(req.output_token_ids)
        self._write_filters(row, req)
        self._owner[row] = req
        self._row_of[req.request_id] = row
        self._epoch += 1
        return row

    def _write_filters(self, row: int, req: Request) -> None:
        """allowed_token_ids and one-token bad words into the bias row, min_p's floor (token_filters)."""
        p, dev = req.params, self.device
        static = token_filters.static_bans(p, req.bad_word_ids, self.vocab)
        if static:
            self.bias[row, torch.tensor(static, dtype=torch.int64, device=dev)] = -math.inf
        self.floor[row] = token_filters.min_p_floor(p)
        self._dynamic.pop(row, None)
        if token_filters.has_dynamic_bans(req.bad_word_ids):
            self._dynamic[row] = (req, set())
            self._refresh_row(row)

    def refresh(self) -> None:
        """Host, before a step samples: rewrite the bans of multi-token bad words for the rows that have them
        from their outputs so far (such requests never run in the overlap loop, so the host knows them)."""
        for row in list(self._dynamic):
            self._refresh_row(row)

    def _refresh_row(self, row: int) -> None:
        req, now = self._dynamic[row]
        want = token_filters.dynamic_bans(req.bad_word_ids, req.output_token_ids)
        if want == now:
            return
        dev = self.device
        lifted = sorted(now - want)
        if lifted:          # back to the row's own value: -inf if also banned statically, else its logit_bias
            bias = req.params.logit_bias or {}
            vals = [-math.inf if token_filters.banned_statically(req.params, req.bad_word_ids, t) else
                    bias.get(t, 0.0) for t in lifted]
            self.bias[row, torch.tensor(lifted, dtype=torch.int64, device=dev)] = \
                torch.tensor(vals, dtype=torch.float32, device=dev)
        added = sorted(want - now)
        if added:
            self.bias[row, torch.tensor(added, dtype=torch.int64, device=dev)] = -math.inf
        self._dynamic[row] = (req, want)

    def release(self, req: Request) -> None:
        """The request is done: its row is free for the next one (a no-op for requests without a row)."""
        row = self._row_of.pop(req.request_id, None)
        if row is not None:
            self._owner[row] = None
            self._dynamic.pop(row, None)
            self._epoch += 1

    # ------------------------------------------------------------------ device: every step
    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [R, V] (not modified) -> processed fp32 logits [R, V] (module docstring)."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab or rows.shape != (logits.shape[0],):
            raise ValueError(f"logits/rows: expected [R, {self.vocab}] / [R], found {tuple(logits.shape)} / "
                             f"{tuple(rows.shape)}")
        rep, freq, pres = self.coef[rows].unbind(1)                       # [R, 1] each
        x = logits.float() + self.bias[rows]
        x = x.masked_fill(self.stop_mask[rows] & (self.remaining[rows] > 0), float("-inf"))
        x = torch.where(self.seen[rows], torch.where(x > 0, x / rep, x * rep), x)
        counts = self.counts[rows]
        x = x - freq * counts - pres * counts.clamp(max=1.0)
        return x.masked_fill(x - x.amax(-1, keepdim=True) < self.floor[rows], float("-inf"))

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the sampled tokens [R] into their rows, in place (neutral-row duplicates accumulate harmlessly)."""
        # index_add_ on flat views: on CUDA, index_put_(accumulate=True) launches a sort and costs ~4x the host time
        r = rows.shape[0]
        self.counts.view(-1).index_add_(0, rows * self.vocab + tokens, self._one.expand(r))
        self.seen.index_put_((rows, tokens), self._true)
        self.remaining.view(-1).index_add_(0, rows, self._minus_one.expand(r))


def reference_process(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params: SamplingParams,
                      eos_ids, bad_word_ids: tuple = ()) -> torch.Tensor:
    """Plain fp32 reference for one row [V]: a Python loop over tokens, written from the definitions above
    independently of PenaltyState (tests compare the two). bad_word_ids: the bad words' token sequences."""
    x = logits.detach().float().clone()
    for tok, b in (params.logit_bias or {}).items():
        x[tok] += b
    if params.allowed_token_ids is not None:
        for tok in range(x.shape[0]):
            if tok not in params.allowed_token_ids:
                x[tok] = float("-inf")
    for seq in bad_word_ids:
        *head, last = seq
        if not head or (len(output_ids) >= len(head) and list(output_ids[len(output_ids) - len(head):]) == head):
            x[last] = float("-inf")
    if len(output_ids) < params.min_tokens:
        for tok in stop_ids_before_min_tokens(params, eos_ids, x.shape[0]):
            x[tok] = float("-inf")
    counts: dict[int, int] = {}
    for tok in output_ids:
        counts[tok] = counts.get(tok, 0) + 1
    r = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    for tok in set(prompt_ids) | set(counts):
        x[tok] = x[tok] / r if x[tok] > 0 else x[tok] * r
    f = torch.tensor(params.frequency_penalty, dtype=torch.float32)
    p = torch.tensor(params.presence_penalty, dtype=torch.float32)
    for tok, c in counts.items():
        x[tok] = x[tok] - f * float(c) - p
    if params.min_p > 0 and not params.greedy:      # in probability space, as the definition reads
        probs = torch.softmax(x / params.temperature, dim=-1)
        x = torch.where(probs < params.min_p * probs.max(), float("-inf"), x)
    return x


__all__ = ["PenaltyState", "reference_process", "stop_ids_before_min_tokens"]
