"""Catalog entries spec.inputs, spec.accept, spec.commit: the integer bookkeeping of one speculative step on the
device (m3serve.runtime.spec_graphs), one launch each instead of ~65 small torch ops per step.

One step of S sequences, K drafts each, K1 = K + 1 verify rows per sequence, T = S K1 (see spec_graphs for the
step as a whole and spec_verify for why greedy acceptance is exact):

    spec.inputs   per sequence i, from the staged upload or, where the host staged pos0 = -1, from what the
                  table row's previous step left on the device:
                      n = pos0, [x, d_1..d_K] = ids; positions n..n+K (int64, and int32 into the stage for
                      the one-op table expansion); seq_len = n + K1 for device rows (the staged one otherwise)
    spec.accept   after the verify argmax t_0..t_K:
                      a = forced count (>= 0, clamped to K) or the longest prefix j with d_{j+1} = t_j
                      emitted e_j = d_{j+1} (j < a), e_a = t_a; the result row [e_0..e_K | a + 1 | ...]
                      last = i K1 + a (the verify row whose draft state proposes d'_1)
                      c = n + a + 1 -> next_pos[row]; draft pass j = 2..K (one row per sequence) at position
                      p = c + j - 2: its token slot (slot_table[i, p // P] P + p % P, -1 when the sequence is
                      padding or the page lies past the table) and its key count p + 1 (0 for padding)
    spec.commit   after the K draft passes d'_1..d'_K: next_ids[row] = [e_a, d'_1..d'_K] and the result's
                  last K columns = d'_1..d'_K

Shape legend: S sequences, K drafts, K1 = K + 1, T = S K1, R block-table rows (max_seqs + 1: the padding
row), B table width (pages), W = 2K + 2 result columns. Every output is exact (integers): the compares demand
equality, and every output element starts poisoned (INT_POISON) so an unwritten one fails. Inputs and
outputs may alias where the step program reuses a buffer in place (each program reads its own elements
before writing them); the cases keep them apart so the reference reads the unmodified inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels._jit import kernel
from m3serve.kernels.catalog import Case, Cell, Entry, check_tensor

ENABLED = True  # the one switch: False makes the speculative target refuse (SpecSteps needs these three)

INT_POISON = -0x5EED5  # never a token id, position, slot, count or length


@kernel
def _spec_inputs_kernel(rows_ptr, staged_ids_ptr, staged_lens_ptr, staged_pos_ptr, next_pos_ptr, next_ids_ptr,
                        ids_ptr, pos_ptr, stage_pos_ptr, lens_ptr, pos0_ptr, K1: tl.constexpr, BK: tl.constexpr):
    i = tl.program_id(0)
    j = tl.arange(0, BK)
    m = j < K1
    row = tl.load(rows_ptr + i).to(tl.int64)
    staged = tl.load(staged_pos_ptr + i).to(tl.int64)
    from_device = staged < 0
    pos0 = tl.where(from_device, tl.load(next_pos_ptr + row), staged)
    dev_ids = tl.load(next_ids_ptr + row * K1 + j, mask=m, other=0)
    host_ids = tl.load(staged_ids_ptr + i * K1 + j, mask=m, other=0).to(tl.int64)
    tl.store(ids_ptr + i * K1 + j, tl.where(from_device, dev_ids, host_ids), mask=m)
    positions = pos0 + j
    tl.store(pos_ptr + i * K1 + j, positions, mask=m)
    tl.store(stage_pos_ptr + i * K1 + j, positions.to(tl.int32), mask=m)
    lens = tl.where(from_device, pos0 + K1, tl.load(staged_lens_ptr + i).to(tl.int64))
    tl.store(lens_ptr + i, lens.to(tl.int32))
    tl.store(pos0_ptr + i, pos0)


@kernel
def _spec_accept_kernel(ids_ptr, target_ptr, forced_ptr, pos0_ptr, lens_ptr, rows_ptr, slot_ptr, stride_slot, B,
                        PAGE, next_pos_ptr, emitted_ptr, last_ptr, dpos_ptr, dmap_ptr, dlens_ptr, result_ptr, S,
                        K: tl.constexpr, BK: tl.constexpr):
    K1: tl.constexpr = K + 1
    W: tl.constexpr = 2 * K + 2
    i = tl.program_id(0)
    j = tl.arange(0, BK)
    target = tl.load(target_ptr + i * K1 + j, mask=j < K1, other=0)
    given = tl.load(ids_ptr + i * K1 + j + 1, mask=j < K, other=0)           # d_{j+1}
    mismatch = (j < K) & (given != target)
    a = tl.min(tl.where(mismatch, j, K), axis=0)                              # first mismatch, or K
    forced = tl.load(forced_ptr + i).to(tl.int64)
    a = tl.where(forced >= 0, tl.minimum(forced, K), a)
    emitted = tl.where(j < a, given, target)
    tl.store(emitted_ptr + i * K1 + j, emitted, mask=j < K1)
    tl.store(result_ptr + i * W + j, emitted, mask=j < K1)
    tl.store(result_ptr + i * W + K1, a + 1)
    tl.store(last_ptr + i, i * K1 + a)
    c = tl.load(pos0_ptr + i) + a + 1
    tl.store(next_pos_ptr + tl.load(rows_ptr + i).to(tl.int64), c)
    live = tl.load(lens_ptr + i) > 0
    for jj in tl.static_range(K - 1):                                         # draft pass jj + 2
        p = c + jj
        page = p // PAGE
        ok = live & (page < B)
        slot = tl.load(slot_ptr + i * stride_slot + page, mask=ok, other=0).to(tl.int64)
        tl.store(dpos_ptr + jj * S + i, p)
        tl.store(dmap_ptr + jj * S + i, tl.where(ok, slot * PAGE + p % PAGE, -1))
        tl.store(dlens_ptr + jj * S + i, tl.where(live, p + 1, 0).to(tl.int32))


@kernel
def _spec_commit_kernel(result_ptr, drafted_ptr, rows_ptr, next_ids_ptr, S, K: tl.constexpr, BK: tl.constexpr):
    K1: tl.constexpr = K + 1
    W: tl.constexpr = 2 * K + 2
    i = tl.program_id(0)
    j = tl.arange(0, BK)
    m = j < K
    a = tl.load(result_ptr + i * W + K1) - 1
    e_a = tl.load(result_ptr + i * W + a)
    drafts = tl.load(drafted_ptr + j * S + i, mask=m, other=0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tl.store(next_ids_ptr + row * K1, e_a)
    tl.store(next_ids_ptr + row * K1 + 1 + j, drafts, mask=m)
    tl.store(result_ptr + i * W + K1 + 1 + j, drafts, mask=m)


# --- raw calls ------------------------------------------------------------------------------------------------


def _check(name: str, t, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device,
           contiguous: bool = True) -> None:
    check_tensor(name, t, dtype, shape, device)
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, found strides {tuple(t.stride())}")


def _drafts_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
        raise ValueError(f"k: expected 1..16 drafts per sequence, found {k!r}")
    return k


def spec_inputs(rows, staged_ids, staged_lens, staged_pos, next_pos, next_ids, ids_out, positions_out,
                stage_positions_out, lens_out, pos0_out):
    """Raw call of spec.inputs: rows/staged_* int32 views of the step's upload ([S], [T], [S], [S]); next_pos
    int64 [R], next_ids int64 [R, K1] (the device state); writes ids_out / positions_out int64 [T],
    stage_positions_out int32 [T] (the upload's positions, which the table expansion reads), lens_out int32
    [S] (may alias staged_lens), pos0_out int64 [S]; returns them."""
    dev = rows.device
    s = rows.shape[0] if isinstance(rows, torch.Tensor) and rows.dim() == 1 else -1
    _check("rows", rows, torch.int32, (s,), dev)
    _check("next_pos", next_pos, torch.int64, (next_pos.shape[0],), dev)
    if next_ids.dim() != 2:
        raise ValueError(f"next_ids: expected [R, K1], found shape {tuple(next_ids.shape)}")
    r, k1 = next_ids.shape
    _drafts_k(k1 - 1)
    t = s * k1
    _check("next_ids", next_ids, torch.int64, (next_pos.shape[0], k1), dev)
    _check("staged_ids", staged_ids, torch.int32, (t,), dev)
    _check("staged_lens", staged_lens, torch.int32, (s,), dev)
    _check("staged_pos", staged_pos, torch.int32, (s,), dev)
    _check("ids_out", ids_out, torch.int64, (t,), dev)
    _check("positions_out", positions_out, torch.int64, (t,), dev)
    _check("stage_positions_out", stage_positions_out, torch.int32, (t,), dev)
    _check("lens_out", lens_out, torch.int32, (s,), dev)
    _check("pos0_out", pos0_out, torch.int64, (s,), dev)
    if s:
        _spec_inputs_kernel[(s,)](rows, staged_ids, staged_lens, staged_pos, next_pos, next_ids, ids_out,
                                  positions_out, stage_positions_out, lens_out, pos0_out, K1=k1,
                                  BK=triton.next_power_of_2(k1), num_warps=1)
    return ids_out, positions_out, stage_positions_out, lens_out, pos0_out


def spec_accept(ids, target, forced, pos0, lens, rows, slot_table, page_size: int, next_pos, emitted_out,
                last_out, draft_pos_out, draft_map_out, draft_lens_out, result):
    """Raw call of spec.accept: ids / target int64 [S, K1] (verify inputs, verify argmax), forced int32 [S] (-1:
    verify), pos0 int64 [S], lens int32 [S] (0: padding), rows int32 [S], slot_table int32 [S, B] (unit column
    stride); writes next_pos int64 [R] at rows, emitted_out int64 [S, K1], last_out int64 [S], the draft passes'
    draft_pos_out / draft_map_out int64 and draft_lens_out int32 [K-1, S], and result int64 [S, 2K+2] columns
    0..K1; returns (emitted_out, last_out, draft_pos_out, draft_map_out, draft_lens_out, result, next_pos)."""
    dev = ids.device
    if ids.dim() != 2:
        raise ValueError(f"ids: expected [S, K1], found shape {tuple(ids.shape)}")
    s, k1 = ids.shape
    k = _drafts_k(k1 - 1)
    _check("ids", ids, torch.int64, (s, k1), dev)
    _check("target", target, torch.int64, (s, k1), dev)
    for name, t, dt in (("forced", forced, torch.int32), ("pos0", pos0, torch.int64), ("lens", lens, torch.int32),
                        ("rows", rows, torch.int32), ("last_out", last_out, torch.int64)):
        _check(name, t, dt, (s,), dev)
    check_tensor("slot_table", slot_table, torch.int32, None, dev)
    if slot_table.dim() != 2 or slot_table.shape[0] != s or slot_table.stride(1) != 1:
        raise ValueError(f"slot_table: expected [S = {s}, B] with unit column stride, found shape "
                         f"{tuple(slot_table.shape)} strides {tuple(slot_table.stride())}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, found {page_size!r}")
    _check("next_pos", next_pos, torch.int64, (next_pos.shape[0],), dev)
    _check("emitted_out", emitted_out, torch.int64, (s, k1), dev)
    _check("draft_pos_out", draft_pos_out, torch.int64, (k - 1, s), dev)
    _check("draft_map_out", draft_map_out, torch.int64, (k - 1, s), dev)
    _check("draft_lens_out", draft_lens_out, torch.int32, (k - 1, s), dev)
    _check("result", result, torch.int64, (s, 2 * k + 2), dev)
    if s:
        _spec_accept_kernel[(s,)](ids, target, forced, pos0, lens, rows, slot_table, slot_table.stride(0),
                                  slot_table.shape[1], page_size, next_pos, emitted_out, last_out, draft_pos_out,
                                  draft_map_out, draft_lens_out, result, s, K=k, BK=triton.next_power_of_2(k1),
                                  num_warps=1)
    return emitted_out, last_out, draft_pos_out, draft_map_out, draft_lens_out, result, next_pos


def spec_commit(result, drafted, rows, next_ids):
    """Raw call of spec.commit: result int64 [S, 2K+2] (columns 0..K1 from spec.accept; writes K1+1..),
    drafted int64 [K, S] (pass j's proposals in row j-1), rows int32 [S]; writes next_ids int64 [R, K1] at
    rows. Returns (result, next_ids)."""
    dev = result.device
    if drafted.dim() != 2:
        raise ValueError(f"drafted: expected [K, S], found shape {tuple(drafted.shape)}")
    k, s = drafted.shape
    _drafts_k(k)
    _check("drafted", drafted, torch.int64, (k, s), dev)
    _check("result", result, torch.int64, (s, 2 * k + 2), dev)
    _check("rows", rows, torch.int32, (s,), dev)
    _check("next_ids", next_ids, torch.int64, (next_ids.shape[0], k + 1), dev)
    if s:
        _spec_commit_kernel[(s,)](result, drafted, rows, next_ids, s, K=k, BK=triton.next_power_of_2(k),
                                  num_warps=1)
    return result, next_ids


# --- references (the step program's torch form; they return fresh tensors and never write their inputs) -----


def spec_inputs_reference(rows, staged_ids, staged_lens, staged_pos, next_pos, next_ids, *outs):
    s, k1 = rows.shape[0], next_ids.shape[1]
    r = rows.long()
    from_device = staged_pos < 0
    pos0 = torch.where(from_device, next_pos[r], staged_pos.long())
    ids = torch.where(from_device[:, None], next_ids[r], staged_ids.long().view(s, k1)).reshape(-1)
    positions = (pos0[:, None] + torch.arange(k1, device=rows.device)).reshape(-1)
    lens = torch.where(from_device, pos0 + k1, staged_lens.long()).int()
    return ids, positions, positions.int(), lens, pos0


def spec_accept_reference(ids, target, forced, pos0, lens, rows, slot_table, page_size, next_pos, *outs):
    """Returns the outputs in the raw call's order; next_pos as the values written at `rows`."""
    s, k1 = ids.shape
    k = k1 - 1
    given = ids[:, 1:]
    a = (given == target[:, :k]).long().cumprod(dim=1).sum(dim=1)            # longest matching prefix
    a = torch.where(forced >= 0, forced.long().clamp(max=k), a)
    j = torch.arange(k1, device=ids.device)
    emitted = torch.where(j < a[:, None], torch.cat((given, given[:, :1]), dim=1), target)
    last = torch.arange(s, device=ids.device) * k1 + a
    c = pos0 + a + 1
    live = lens > 0
    b = slot_table.shape[1]
    p = c[None, :] + torch.arange(k - 1, device=ids.device)[:, None]          # [K-1, S]
    page = p // page_size
    ok = live[None, :] & (page < b)
    slots = slot_table.long().gather(1, page.clamp(max=b - 1).t()).t()
    dmap = torch.where(ok, slots * page_size + p % page_size, -1)
    dlens = torch.where(live[None, :], p + 1, 0).int()
    result = torch.full((s, 2 * k + 2), INT_POISON, dtype=torch.int64, device=ids.device)
    result[:, :k1] = emitted
    result[:, k1] = a + 1
    return emitted, last, p, dmap, dlens, result, c


def spec_commit_reference(result, drafted, rows, next_ids):
    """(result with its last K columns = the drafts, the next_ids rows [S, K1] written at `rows`)."""
    k, s = drafted.shape
    out = result.clone()
    out[:, k + 2:] = drafted.t()
    a = result[:, k + 1] - 1
    e_a = result.gather(1, a[:, None])
    return out, torch.cat((e_a, drafted.t()), dim=1)


def _written_rows(name: str, table: torch.Tensor, rows: torch.Tensor, want: torch.Tensor) -> None:
    """table[rows] == want, and every other row still holds the poison."""
    r = rows.long()
    if not torch.equal(table[r], want):
        bad = int(torch.nonzero((table[r] != want).reshape(len(r), -1).any(dim=1))[0])
        raise AssertionError(f"{name}: row {int(r[bad])} holds {table[r][bad].tolist()}, expected "
                             f"{want[bad].tolist()}")
    other = torch.ones(table.shape[0], dtype=torch.bool, device=table.device)
    other[r] = False
    if bool((table[other] != INT_POISON).any()):
        raise AssertionError(f"{name}: a row outside `rows` was written")


def _equal(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(ref.shape) or not torch.equal(out.to(ref.dtype), ref):
        diff = (out.to(ref.dtype) != ref) if out.shape == ref.shape else None
        where = tuple(int(x) for x in torch.nonzero(diff)[0]) if diff is not None else "shape"
        raise AssertionError(f"{name}: differs from the reference at {where} (exact integers expected)")


def spec_inputs_compare(out, ref, case: Case) -> None:
    for name, o, r in zip(("ids", "positions", "stage positions", "lens", "pos0"), out, ref):
        _equal(f"spec.inputs {name}", o, r)


def spec_accept_compare(out, ref, case: Case) -> None:
    for name, o, r in zip(("emitted", "last", "draft positions", "draft slots", "draft lengths", "result"),
                          out[:6], ref[:6]):
        _equal(f"spec.accept {name}", o, r)
    _written_rows("spec.accept next_pos", out[6], case.args[5], ref[6])


def spec_commit_compare(out, ref, case: Case) -> None:
    _equal("spec.commit result", out[0], ref[0])
    _written_rows("spec.commit next_ids", out[1], case.args[2], ref[1])


# --- cases and cells ------------------------------------------------------------------------------------------


def _ints(shape, device) -> torch.Tensor:
    return torch.full(shape, INT_POISON, dtype=torch.int64, device=device)


def _rows(s: int, r: int, gen) -> torch.Tensor:
    """s distinct block-table rows out of r (the engine's rows of one step are distinct)."""
    if gen is None:
        return torch.arange(s, dtype=torch.int32)
    return torch.randperm(r, generator=gen)[:s].int()


def _state(cell: Cell, rows: int) -> tuple[int, int, int, int]:
    """(K, K1, block-table rows R: a few more than the step's sequences, vocabulary)."""
    k = cell.shape[0]
    return k, k + 1, rows + 3, cell.config["vocab"]


def inputs_make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    k, k1, r, vocab = _state(cell, rows)
    s, t = rows, rows * k1
    g = gen if gen is not None else torch.Generator().manual_seed(0)
    tab = _rows(s, r, gen)
    staged_pos = torch.randint(0, 4000, (s,), generator=g).int()
    staged_pos[torch.rand(s, generator=g) < 0.5] = -1                          # half the rows from the device
    args = (tab, torch.randint(0, vocab, (t,), generator=g).int(), torch.randint(0, 4000, (s,), generator=g).int(),
            staged_pos, torch.randint(0, 4000, (r,), generator=g), torch.randint(0, vocab, (r, k1), generator=g))
    args = tuple(a.to(device) for a in args) + (
        _ints((t,), device), _ints((t,), device), torch.full((t,), INT_POISON, dtype=torch.int32, device=device),
        torch.full((s,), INT_POISON, dtype=torch.int32, device=device), _ints((s,), device))
    return Case(args=args, kwargs={}, bytes_moved=0)


def accept_make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    k, k1, r, vocab = _state(cell, rows)
    s, page, b = rows, cell.config["page"], 24
    g = gen if gen is not None else torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (s, k1), generator=g)
    # targets agreeing with the drafts for a random prefix, so every accepted count 0..K occurs
    target = torch.randint(0, vocab, (s, k1), generator=g)
    agree = torch.randint(0, k1, (s,), generator=g)
    for i in range(s):
        target[i, :int(agree[i])] = ids[i, 1:int(agree[i]) + 1]
    forced = torch.where(torch.rand(s, generator=g) < 0.3, torch.randint(0, k + 3, (s,), generator=g), -1).int()
    pos0 = torch.randint(0, b * page - 2 * k1 - 1, (s,), generator=g)
    pos0[0] = b * page - k1 - 1                                               # draft passes past the table
    lens = torch.where(torch.rand(s, generator=g) < 0.2, 0, pos0 + k1).int()  # some padding
    slot_table = torch.randint(0, 1000, (s, b + 3), generator=g).int()[:, :b]  # a strided view
    args = tuple(x.to(device) for x in (ids, target, forced, pos0, lens, _rows(s, r, gen), slot_table)) + (
        page, _ints((r,), device), _ints((s, k1), device), _ints((s,), device), _ints((k - 1, s), device),
        _ints((k - 1, s), device), torch.full((k - 1, s), INT_POISON, dtype=torch.int32, device=device),
        _ints((s, 2 * k + 2), device))
    return Case(args=args, kwargs={}, bytes_moved=0)


def commit_make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    k, k1, r, vocab = _state(cell, rows)
    s = rows
    g = gen if gen is not None else torch.Generator().manual_seed(0)
    result = _ints((s, 2 * k + 2), torch.device("cpu"))
    result[:, :k1] = torch.randint(0, vocab, (s, k1), generator=g)
    result[:, k1] = torch.randint(1, k1 + 1, (s,), generator=g)
    args = (result.to(device), torch.randint(0, vocab, (k, s), generator=g).to(device), _rows(s, r, gen).to(device),
            _ints((r, k1), device))
    return Case(args=args, kwargs={}, bytes_moved=0)


# rows = S sequences; shape = (K,). One program per sequence, so the row count only sizes the grid; certified for
# 1-256 sequences (the largest default graph bucket) at every K so the table covers one row range for all shapes.
STEP = {"vocab": 200064, "page": 128}
MAX_SEQS = 256
CELLS = tuple(Cell(rows=(1, MAX_SEQS), shape=(k,), config=STEP,
                   why=f"speculative step, K = {k} drafts, 1-{MAX_SEQS} sequences") for k in range(1, 9))
INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(3,), config={"vocab": 50, "page": 4}, why="interpreter: K = 3, tiny pages"),
    Cell(rows=(2, 2), shape=(1,), config={"vocab": 50, "page": 4}, why="interpreter: K = 1 (no later passes)"),
    Cell(rows=(2, 2), shape=(5,), config={"vocab": 50, "page": 4}, why="interpreter: K = 5, K1 not a power of 2"),
)


def _warmup(make, call):
    def warm(device: torch.device) -> None:
        for c in CELLS:
            case = make(c, c.rows[1], device, None)
            call(*case.args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return warm


def _entry(name: str, call, reference, compare, make) -> Entry:
    return Entry(name=name, kind=name, raw_call=call, reference=reference, compare=compare, make_case=make,
                 cells=CELLS, interp_cells=INTERP_CELLS, warmup=_warmup(make, call), enabled=lambda: ENABLED,
                 stock=reference)


ENTRIES = (
    _entry("spec.inputs", spec_inputs, spec_inputs_reference, spec_inputs_compare, inputs_make_case),
    _entry("spec.accept", spec_accept, spec_accept_reference, spec_accept_compare, accept_make_case),
    _entry("spec.commit", spec_commit, spec_commit_reference, spec_commit_compare, commit_make_case),
)
