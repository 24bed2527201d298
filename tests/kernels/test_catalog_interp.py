"""Every catalog entry at its interpreter cells: raw call (Triton interpreter on CPU tensors) vs
the plain-torch reference through the entry's own compare, fresh random inputs per row count,
outputs poisoned with NaN. Plus: each compare must reject a wrong output."""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.catalog import all_entries

CPU = torch.device("cpu")
ENTRIES = all_entries()
CASES = [(name, i, rows) for name, e in ENTRIES.items() for i, c in enumerate(e.interp_cells) for rows in c.row_counts()]


def _run(name: str, i: int, rows: int, seed: int):
    e = ENTRIES[name]
    cell = e.interp_cells[i]
    case = e.make_case(cell, rows, CPU, torch.Generator().manual_seed(seed))
    out = e.raw_call(*case.args, **case.kwargs)
    ref = e.reference(*case.args, **case.kwargs)
    return e, case, out, ref


@pytest.mark.parametrize("name,i,rows", CASES, ids=[f"{n}-c{i}-r{r}" for n, i, r in CASES])
def test_interp_cell_matches_reference(name: str, i: int, rows: int) -> None:
    e, case, out, ref = _run(name, i, rows, seed=1000 * i + rows)
    e.compare(out, ref, case)


def _first_output(out):
    return out[0] if isinstance(out, tuple) else out


# One representative cell per entry is enough to prove each compare can fail.
NEG = [(name, 0, e.interp_cells[0].rows[1]) for name, e in ENTRIES.items()]


@pytest.mark.parametrize("name,i,rows", NEG, ids=[n for n, _, _ in NEG])
def test_compare_rejects_a_corrupted_output(name: str, i: int, rows: int) -> None:
    e, case, out, ref = _run(name, i, rows, seed=7)
    o = _first_output(out)
    if e.kind.startswith("spec."):  # exact integers: move one by one
        o.view(-1)[0] += 1
    elif o.dtype == torch.int64:  # token ids: point row 0 at its least likely token instead
        offset = int(o[0]) - int(torch.argmax(ref[0]))
        o[0] = int(torch.argmin(ref[0])) + offset
    else:
        flat = o.view(-1)
        flat[flat.numel() // 2] = flat[flat.numel() // 2].float() * 1.5 + 1.0
    with pytest.raises(AssertionError):
        e.compare(out, ref, case)


@pytest.mark.parametrize("name", ["linear.nvfp4", "linear.mxfp8", "linear.fp8", "qkv.nvfp4", "norm.add_rms",
                                  "moe.nvfp4", "moe.grouped", "head.bf16", "head.head12",
                                  "head.head12_logits"])
def test_compare_rejects_an_unwritten_element(name: str) -> None:
    """The poison must be caught: NaN left in a float output, -1 left in the ids."""
    e, case, out, ref = _run(name, 0, ENTRIES[name].interp_cells[0].rows[1], seed=11)
    o = _first_output(out)
    o.view(-1)[-1] = -1 if o.dtype == torch.int64 else float("nan")
    with pytest.raises(AssertionError):
        e.compare(out, ref, case)
