"""The split-K ordered reduction shared by every weight-streaming kernel (_wstream, _gemv, moe/_nvfp4.py's
router and down projection): each program stores its fp32 partial, takes a ticket on its output
tile's counter, and the program that draws the LAST ticket sums the partials in the fixed order
0..SPLIT-1 (results never depend on arrival order), writes the epilogue, and resets the counter.

Shape legend (per output tile, any rank):
    part   [SPLIT, ...]   fp32 partials, split s at part_ptr + s * split_stride + offs
    offs   tile shape     element offsets of the tile inside one split's slab
    mask   tile shape     valid elements (masked ones read as 0 and are never stored)
    count  one int32 per output tile, zero between launches (CUDA-graph replays included)

Memory order: the partial stores and reads use .cg (L2, never a stale L1 line); a CTA barrier
makes every thread's partial store precede the ticket, and the acq_rel atomic publishes them to
the last arrival, which acquires everyone else's. The reset is relaxed: the next launch's
tickets are ordered after this launch ends (stream order).

    put_partial(part_ptr, pid_k, split_stride, offs, v, mask)
    is_last = take_ticket(count_ptr, arrivals)           # arrivals = programs sharing the counter
    if is_last:
        total = ordered_sum(part_ptr, split_stride, offs, mask, SPLIT)
        ...epilogue...
        release_ticket(count_ptr)
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels._jit import helper


@helper
def put_partial(part_ptr, pid_k, split_stride, offs, v, mask):
    tl.store(part_ptr + pid_k * split_stride + offs, v, mask=mask, cache_modifier=".cg")


@helper
def take_ticket(count_ptr, arrivals):
    """CTA barrier (all of this program's partial stores issued), then one acq_rel ticket:
    True in the program that arrives last of `arrivals`."""
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == arrivals - 1


@helper
def ordered_sum(part_ptr, split_stride, offs, mask, SPLIT):
    """fp32 sum of the SPLIT partials of the tile, always in the order 0..SPLIT-1. The partials are read four at a
    time, all four loads out before the first add: the last arrival's tail would otherwise be SPLIT L2 round trips
    back to back (the MoE router sums 16). A read past SPLIT is masked to +0.0, which adds exactly (the sum starts
    at +0.0 and so is never -0.0), so the result is the plain sequential sum bit for bit."""
    total = tl.zeros(offs.shape, tl.float32)
    for sp in range(0, SPLIT, 4):
        p0 = tl.load(part_ptr + sp * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
        p1 = tl.load(part_ptr + (sp + 1) * split_stride + offs, mask=mask & (sp + 1 < SPLIT), other=0.0,
                     cache_modifier=".cg")
        p2 = tl.load(part_ptr + (sp + 2) * split_stride + offs, mask=mask & (sp + 2 < SPLIT), other=0.0,
                     cache_modifier=".cg")
        p3 = tl.load(part_ptr + (sp + 3) * split_stride + offs, mask=mask & (sp + 3 < SPLIT), other=0.0,
                     cache_modifier=".cg")
        total = (((total + p0) + p1) + p2) + p3
    return total


@helper
def release_ticket(count_ptr):
    """Reset the counter for the next launch (done by the last arrival after its epilogue)."""
    tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
