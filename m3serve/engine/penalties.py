"""Penalties, logit bias and min_tokens on the device, batched over the step's requests (vLLM's definitions).

For a row with bias b, token counts c over the output so far, s = [token in the prompt or c > 0]:
    x = logits + b
    x[stop ids] = -inf                    while fewer than min_tokens tokens are out (EOS unless ignore_eos)
    x = where(s, where(x > 0, x / r, x * r), x)          repetition_penalty r (prompt + output)
    x = x - f * c - p * [c > 0]                          frequency f, presence p (output only)
Logprobs stay those of the raw logits (vLLM's default); only the token choice sees x.

Per-request state lives in preallocated device tensors, one state row per running request that needs it;
batch rows without processing point at the neutral row S:
    counts      fp32 [S+1, V]     output token counts (exact integers below 2^24)
    seen        bool [S+1, V]     token occurs in the prompt or the output
    bias        fp32 [S+1, V]
    stop_mask   bool [S+1, V]     ids forbidden before min_tokens
    coef        fp32 [S+1, 3, 1]  (r, f, p)
    remaining   fp32 [S+1, 1]     min_tokens - tokens out (stop ids are forbidden while > 0)
A step is apply(logits, rows) then record(rows, tokens): a fixed sequence of ~20 + 5 device ops whatever is
enabled and however many rows use it, no host sync, the sampled ids counted in place (index_add_) -
so it can run inside a captured CUDA graph with `rows` in a static buffer. The host writes a request's row once
(its prompt, its output so far, its parameters), not per token; a batch without any processed request skips
all of it (rows_for returns None). The neutral row has bias 0, r = 1, f = p = 0, remaining <= 0: every rule is
the identity there for any counts (x / 1, x * 1, x - 0 are exact), so record() counts into it too rather than
spend ops on masking it out.

Shape legend: S max_num_seqs (state rows), V vocab, R rows sampled this step.
"""

from __future__ import annotations

import torch

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
        self._owner[row] = req
        self._row_of[req.request_id] = row
        self._epoch += 1
        return row

    def release(self, req: Request) -> None:
        """The request is done: its row is free for the next one (a no-op for requests without a row)."""
        row = self._row_of.pop(req.request_id, None)
        if row is not None:
            self._owner[row] = None
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
        return x - freq * counts - pres * counts.clamp(max=1.0)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the sampled tokens [R] into their rows, in place (neutral-row duplicates accumulate harmlessly)."""
        # index_add_ on flat views: on CUDA, index_put_(accumulate=True) launches a sort and costs ~4x the host time
        r = rows.shape[0]
        self.counts.view(-1).index_add_(0, rows * self.vocab + tokens, self._one.expand(r))
        self.seen.index_put_((rows, tokens), self._true)
        self.remaining.view(-1).index_add_(0, rows, self._minus_one.expand(r))


def reference_process(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params: SamplingParams,
                      eos_ids) -> torch.Tensor:
    """Plain fp32 reference for one row [V]: a Python loop over tokens, written from the definitions above
    independently of PenaltyState (tests compare the two)."""
    x = logits.detach().float().clone()
    for tok, b in (params.logit_bias or {}).items():
        x[tok] += b
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
    return x


__all__ = ["PenaltyState", "reference_process", "stop_ids_before_min_tokens"]
