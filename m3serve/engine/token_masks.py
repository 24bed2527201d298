"""Allowed-token masks on the device, one bitmask row per PenaltyState row: what a structured-output grammar
(m3serve.engine.structured) lets a request sample next.

    words   int32 [S+1, W]   bit v % 32 of word v // 32 set = token v allowed; row S (neutral) allows every token
apply(scores, rows) is a fixed sequence of tensor ops on `rows` (no branch on data, no host sync), so the decode
graphs' processed variant runs it with `rows` in its staged buffer, right after the penalties. The host writes a
row through a pinned staging row (write_row) before the step that reads it.

Shape legend: S max_num_seqs (state rows), V vocab, W = ceil(V / 32) words, R rows sampled this step.
"""

from __future__ import annotations

import torch


class TokenMaskRows:
    def __init__(self, max_rows: int, vocab: int, device: torch.device | str):
        if max_rows < 1 or vocab < 1:
            raise ValueError(f"TokenMaskRows: expected max_rows >= 1 and vocab >= 1, found {max_rows}, {vocab}")
        self.vocab, self.words, self.device = vocab, -(-vocab // 32), torch.device(device)
        self.neutral = max_rows
        # normal tensors even when first built under inference mode: rows are rewritten in place later
        with torch.inference_mode(False):
            self.masks = torch.full((max_rows + 1, self.words), -1, dtype=torch.int32, device=self.device)
            self.host = torch.full((max_rows + 1, self.words), -1, dtype=torch.int32,
                                   pin_memory=self.device.type == "cuda")
            self._shifts = torch.arange(32, dtype=torch.int32, device=self.device)

    def write_row(self, row: int) -> None:
        """Upload host[row] (filled by the caller) to the device row. Callers read the step's tokens back
        before refilling the same host row, so the asynchronous copy has finished by then."""
        self.masks[row].copy_(self.host[row], non_blocking=True)

    def clear_row(self, row: int) -> None:
        """Allow every token in `row` again (its request ended or lost the row)."""
        self.host[row].fill_(-1)
        self.write_row(row)

    def allowed(self, rows: torch.Tensor) -> torch.Tensor:
        """bool [R, V]: the rows' masks unpacked."""
        bits = (self.masks[rows].unsqueeze(-1) >> self._shifts) & 1            # [R, W, 32]
        return bits.reshape(rows.shape[0], self.words * 32)[:, :self.vocab].bool()

    def apply(self, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """scores [R, V] -> fp32 scores with each row's disallowed tokens at -inf."""
        if scores.dim() != 2 or scores.shape[1] != self.vocab or rows.shape != (scores.shape[0],):
            raise ValueError(f"scores/rows: expected [R, {self.vocab}] / [R], found {tuple(scores.shape)} / "
                             f"{tuple(rows.shape)}")
        return scores.float().masked_fill(~self.allowed(rows), float("-inf"))


def reference_apply(scores: torch.Tensor, allowed_ids: list[list[int]]) -> torch.Tensor:
    """Plain reference: row r keeps exactly the ids in allowed_ids[r], everything else -inf."""
    out = torch.full_like(scores.float(), float("-inf"))
    for r, ids in enumerate(allowed_ids):
        idx = torch.tensor(ids, dtype=torch.int64)
        out[r, idx] = scores[r, idx].float()
    return out
