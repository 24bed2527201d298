"""Device block tables built from the manager's host rows with one device operation per step.

Shape legend (S = batch size, B = max_blocks_per_seq):
    host_table    int32 [max_seqs, B]     BlockManager.host_table (-1 = unallocated); source of truth
    mirror        int32 [max_seqs + 1, B] device copy of host rows, refreshed only for changed rows; the last
                                          row is the padding row of graph buckets (always -1)
    slot_table    int32 [S, B]            slot ids of each batch row, -1 -> 0
    subpage_table int32 [S, 2, B]         [:, 0] K = slot*index_scale, [:, 1] V = K + kv_offset;
                                          unallocated -> 0 (a safe page: kernels never read past kv_len)

Per step, build(seq_ids):
  1. rows and row versions are looked up in numpy (no Python loop body over requests or blocks);
  2. the batch rows plus the rows whose version changed since their last upload are packed into
     one pinned staging buffer of a ring (staging.py), and sent with ONE async H2D copy;
  3. changed rows are scattered into the device mirror, then ONE expansion op (a single Triton
     launch on CUDA; torch ops on CPU) writes slot_table and subpage_table for the whole batch
     into persistent buffers, so the outputs are stable addresses (CUDA-graph friendly).
All device work is enqueued on the current stream, which orders it against the kernels that
read the previous step's tables.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from m3serve.device import canonical_device
from m3serve.kv.block_manager import BlockManager
from m3serve.kv.staging import Event, NullEvent, StagingRing


def _expand_torch(mirror: Tensor, rows: Tensor, index_scale: int, kv_offset: int, slot_out: Tensor,
                  sub_out: Tensor) -> None:
    sel = mirror.index_select(0, rows)
    torch.clamp_min(sel, 0, out=slot_out)
    k, v = sub_out[:, 0], sub_out[:, 1]
    torch.mul(slot_out, index_scale, out=k)  # unallocated: 0 * scale = 0
    torch.add(k, kv_offset, out=v)
    v.masked_fill_(sel < 0, 0)


def _prepare_torch(mirror: Tensor, stage: Tensor, s: int, t: int, b: int, page_size: int, index_scale: int,
                   kv_offset: int, offsets: tuple[int, int, int, int], slot_out: Tensor, sub_out: Tensor,
                   map_out: Tensor) -> None:
    """The same semantics as the Triton prepare kernel, in torch ops (CPU)."""
    off_change, off_data, off_tok, off_pos = offsets
    rows = stage[:s].long()
    change = stage[off_change:off_change + s].long()
    n = int((change >= 0).sum())
    data = stage[off_data:off_data + n * b].view(n, b)
    changed = change >= 0
    if n:
        mirror[rows[changed]] = data[change[changed]]
    _expand_torch(mirror, rows, index_scale, kv_offset, slot_out, sub_out)
    if t:
        tok = stage[off_tok:off_tok + t].long()
        pos = stage[off_pos:off_pos + t].long()
        page = mirror[rows[tok], pos // page_size].long()
        map_out.copy_(torch.where(page >= 0, page * page_size + pos % page_size, torch.full_like(pos, -1)))


def _triton_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return importlib.util.find_spec("triton") is not None


class DeviceBlockTables:
    def __init__(self, manager: BlockManager, device: torch.device | str, index_scale: int, kv_offset: int = 1,
                 ring_size: int = 3, *, event_factory: Callable[[], Event] | None = None,
                 use_triton: bool | None = None, max_tokens: int | None = None) -> None:
        if not isinstance(manager, BlockManager):
            raise TypeError(f"manager: expected BlockManager, found {type(manager).__name__}")
        for name, val, lo in (("index_scale", index_scale, 1), ("kv_offset", kv_offset, 0)):
            if not isinstance(val, int) or val < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, found {val!r}")
        if (manager.num_slots - 1) * index_scale + kv_offset > np.iinfo(np.int32).max:
            raise ValueError(f"index_scale: {index_scale} overflows int32 sub-page ids for {manager.num_slots} slots")
        self.manager = manager
        self.device = canonical_device(device)
        self.index_scale = index_scale
        self.kv_offset = kv_offset
        on_cuda = self.device.type == "cuda"
        s, b = manager.max_seqs, manager.max_blocks_per_seq
        self.max_blocks = b
        # One extra row past the manager's rows, never written: the padding row of graph buckets (all -1, so a
        # padded sequence gets slot 0 everywhere and its tokens get slot -1: nothing is read or written for it).
        self.pad_row = s
        self.mirror = torch.full((s + 1, b), -1, dtype=torch.int32, device=self.device)
        self._uploaded = np.full(s, -1, dtype=np.int64)  # row_version at the last upload of each row
        # build() staging: [S batch rows | n changed row ids | n changed rows x B].
        # prepare() staging: [S batch rows | S change index | n changed rows x B | T token seq | T positions].
        self.max_tokens = max_tokens if max_tokens is not None else 8 * s
        # prepare() also carries the caller's int32 payload (`extra`): at most 2 * max_tokens + 8 * s + 1 values
        # (a decode graph step stages 7 per sequence: token id, sequence length and its sampling parameters).
        self.max_extra = 2 * self.max_tokens + 8 * s + 1
        stage_numel = s * (b + 2) + 2 * self.max_tokens + self.max_extra
        # On CPU copies are synchronous: one buffer and a no-op event, unless a test injects events.
        if event_factory is None and not on_cuda:
            ring_size, event_factory = 1, NullEvent
        elif event_factory is None:
            event_factory = torch.cuda.Event
        self.ring = StagingRing(stage_numel, torch.int32, ring_size, pin_memory=on_cuda, event_factory=event_factory)
        self._dev_stage = torch.empty(stage_numel, dtype=torch.int32, device=self.device)
        self.slot_table = torch.zeros(s, b, dtype=torch.int32, device=self.device)
        self.subpage_table = torch.zeros(s, 2, b, dtype=torch.int32, device=self.device)
        self.use_triton = _triton_usable(self.device) if use_triton is None else use_triton
        self.slot_mapping_out = torch.empty(self.max_tokens, dtype=torch.int64, device=self.device)
        self._batch_rows: Tensor = self._dev_stage[:0]
        self.last_num_uploaded_rows = 0  # rows staged by the last build (for tests / benchmarks)

    def build(self, seq_ids: list[int]) -> tuple[Tensor, Tensor]:
        """(slot_table [S, B], subpage_table [S, 2, B]) for the batch, as views of persistent buffers."""
        mgr = self.manager
        rows = mgr.rows_of(seq_ids)
        s, b = rows.shape[0], self.max_blocks
        if s > mgr.max_seqs:
            raise ValueError(f"seq_ids: expected at most max_seqs = {mgr.max_seqs} sequences, found {s}")
        ver = mgr.row_version[rows]
        stale = self._uploaded[rows] != ver
        changed = np.unique(rows[stale]) if stale.any() else rows[:0]
        n = changed.shape[0]
        i = self.ring.acquire()
        buf = self.ring.arrays[i]
        buf[:s] = rows
        buf[s:s + n] = changed
        total = s + n + n * b
        np.take(mgr.host_table, changed, axis=0, out=buf[s + n:total].reshape(n, b))
        self._dev_stage[:total].copy_(self.ring.buffers[i][:total], non_blocking=True)
        self.ring.release(i)
        self._uploaded[changed] = mgr.row_version[changed]
        self.last_num_uploaded_rows = n
        stage = self._dev_stage
        if n:
            self.mirror[stage[s:s + n]] = stage[s + n:total].view(n, b)
        self._batch_rows = stage[:s]
        slot_out, sub_out = self.slot_table[:s], self.subpage_table[:s]
        if self.use_triton:
            from m3serve.kv._expand_triton import expand_triton

            expand_triton(self.mirror, self._batch_rows, self.index_scale, self.kv_offset, slot_out, sub_out)
        else:
            _expand_torch(self.mirror, self._batch_rows, self.index_scale, self.kv_offset, slot_out, sub_out)
        return slot_out, sub_out

    def prepare(self, seq_ids: list[int], token_seq_idx: np.ndarray, positions: np.ndarray,
                extra: np.ndarray | None = None, pad_to: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """stage() then expand_staged(): one step's tables and token slots from one upload and one device op."""
        return self.expand_staged(*self.stage(seq_ids, token_seq_idx, positions, extra=extra, pad_to=pad_to))

    def stage(self, seq_ids: list[int], token_seq_idx: np.ndarray, positions: np.ndarray,
              extra: np.ndarray | None = None, pad_to: int | None = None) -> tuple[int, int, tuple[int, ...]]:
        """The host half of prepare(): pack one step into a pinned buffer and queue ONE H2D copy of it.

        token_seq_idx / positions: host int arrays [T] (batch position and absolute position of each token
        of the step). Returns (S, T, offsets) for expand_staged, whose outputs are views of persistent
        buffers: slot table [S, B], sub-page table [S, 2, B] and the flat slot of every token [T] (int64, -1
        where the page is unallocated).

        extra: an int32 payload (token ids, sequence lengths, ...) that rides in the same upload; its device
        copy is `last_extra` afterwards. pad_to: pad the batch to this many sequences (a CUDA-graph bucket):
        padded sequences use the never-written padding row (slot 0 everywhere), so a padded token's slot is
        -1. Stage layout, fixed-size parts first so a bucket's views sit at the same addresses every step:
            [rows S | change S | token seq T | positions T | extra E | changed rows n x B]"""
        mgr = self.manager
        rows = mgr.rows_of(seq_ids)
        s_real = rows.shape[0]
        s = s_real if pad_to is None else pad_to
        b, t = self.max_blocks, len(positions)
        if s > mgr.max_seqs or s < s_real:
            raise ValueError(f"seq_ids: {s_real} sequences padded to {s}; expected at most max_seqs = "
                             f"{mgr.max_seqs} and pad_to >= the sequence count")
        if t > self.max_tokens or len(token_seq_idx) != t:
            raise ValueError(f"positions: {t} tokens ({len(token_seq_idx)} sequence indices); the step holds at "
                             f"most max_tokens = {self.max_tokens} with one index per token")
        e = 0 if extra is None else len(extra)
        if e > self.max_extra:
            raise ValueError(f"extra: {e} values; the staging buffer holds at most {self.max_extra}")
        pos = np.asarray(positions)
        tsi = np.asarray(token_seq_idx)
        if t:
            # one unsigned compare per array checks both bounds (a negative value wraps to a huge one)
            if pos.astype(np.uint64, copy=False).max() >= b * mgr.page_size:
                raise ValueError(f"positions: expected values in [0, {b * mgr.page_size}), found "
                                 f"[{pos.min()}, {pos.max()}]")
            if tsi.astype(np.uint64, copy=False).max() >= s:
                raise ValueError(f"token_seq_idx: expected batch positions in [0, {s}), found "
                                 f"[{tsi.min()}, {tsi.max()}]")
        stale = self._uploaded[rows] != mgr.row_version[rows]
        changed_pos = np.flatnonzero(stale)
        n = changed_pos.shape[0]
        i = self.ring.acquire()
        buf = self.ring.arrays[i]
        off_change = s
        off_tok = 2 * s
        off_pos = off_tok + t
        off_extra = off_pos + t
        off_data = off_extra + e
        buf[:s_real] = rows
        buf[s_real:s] = self.pad_row
        change = buf[off_change:off_tok]
        change[:] = -1
        buf[off_tok:off_pos] = tsi
        buf[off_pos:off_extra] = pos
        if e:
            buf[off_extra:off_data] = extra
        total = off_data + n * b
        if n:   # steady decode changes no row: nothing more to pack
            changed_rows = rows[changed_pos]
            change[changed_pos] = np.arange(n)
            np.take(mgr.host_table, changed_rows, axis=0, out=buf[off_data:total].reshape(n, b))
        self._dev_stage[:total].copy_(self.ring.buffers[i][:total], non_blocking=True)
        self.ring.release(i)
        if n:
            self._uploaded[changed_rows] = mgr.row_version[changed_rows]
        self.last_num_uploaded_rows = n
        stage = self._dev_stage
        self._batch_rows = stage[:s]
        self.last_extra = stage[off_extra:off_data]
        return s, t, (off_change, off_data, off_tok, off_pos)

    def expand_staged(self, s: int, t: int, offsets: tuple[int, int, int, int]) -> tuple[Tensor, Tensor, Tensor]:
        """The device half of prepare(): ONE op turns the staged upload of a step of s sequences and t tokens
        into the slot table [s, B], sub-page table [s, 2, B] and token slots [t]. Its arguments depend only on
        (s, t, the payload size), so a CUDA graph of a fixed bucket can capture it and replay it after every
        stage() of that bucket."""
        slot_out, sub_out, map_out = self.slot_table[:s], self.subpage_table[:s], self.slot_mapping_out[:t]
        page = self.manager.page_size
        if self.use_triton:
            from m3serve.kv._expand_triton import prepare_triton
            prepare_triton(self.mirror, self._dev_stage, s, t, page, self.index_scale, self.kv_offset, offsets,
                           slot_out, sub_out, map_out)
        else:
            _prepare_torch(self.mirror, self._dev_stage, s, t, self.max_blocks, page, self.index_scale,
                           self.kv_offset, offsets, slot_out, sub_out, map_out)
        return slot_out, sub_out, map_out

    def slot_mapping(self, token_seq_idx: Tensor, positions: Tensor) -> Tensor:
        """Flat token slots (slot*page_size + offset; -1 where the page is unallocated) of tokens at
        `positions` (int64 [T]) of batch sequences `token_seq_idx` (int64 [T]) of the last build()."""
        for name, t in (("token_seq_idx", token_seq_idx), ("positions", positions)):
            if t.dtype != torch.int64 or canonical_device(t.device) != self.device:
                raise TypeError(f"{name}: expected int64 on {self.device}, found {t.dtype} on {t.device}")
        p = self.manager.page_size
        rows = self._batch_rows[token_seq_idx].long()
        page = self.mirror[rows, positions // p]
        return torch.where(page >= 0, page.long() * p + positions % p, torch.full_like(positions, -1))


def build_block_tables_reference(host_table: np.ndarray, rows: list[int] | np.ndarray, index_scale: int,
                                 kv_offset: int) -> tuple[Tensor, Tensor]:
    """Plain per-entry reference of DeviceBlockTables.build for tests (CPU int32 tensors)."""
    rows = [int(r) for r in rows]
    b = host_table.shape[1]
    slot = torch.zeros(len(rows), b, dtype=torch.int32)
    sub = torch.zeros(len(rows), 2, b, dtype=torch.int32)
    for i, r in enumerate(rows):
        for j in range(b):
            page = int(host_table[r, j])
            if page >= 0:
                slot[i, j] = page
                sub[i, 0, j] = page * index_scale
                sub[i, 1, j] = page * index_scale + kv_offset
    return slot, sub
