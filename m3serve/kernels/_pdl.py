"""Programmatic dependent launch (Hopper): the next kernel of a decode step is launched while this one is
still running, so its launch latency, its CTAs' start and its first weight loads hide under this kernel's tail.

Contract of a kernel that declares a `PDL: tl.constexpr` parameter (_jit.DualKernel then launches it with
launch_pdl on CUDA tensors and passes PDL=True; on the CPU PDL=False and both helpers are no-ops):
    pdl_release(PDL)   lets the NEXT kernel launch once every CTA of this one has called it (or exited): the first
                       statement of short kernels, right after the main loop of the weight-streaming ones (their
                       dependents' waiting CTAs would otherwise share the SMs with the whole stream; measured slower)
    pdl_wait(PDL)      before the first global access to anything but constant weights: returns when the
                       previous kernel has completed and its writes are visible
Before pdl_wait a kernel may only read weights (never written during a step) and compute on registers; every
path through the kernel executes pdl_wait (also CTAs that find no work), so a kernel completes only after its
predecessor did and the ordering chains transitively through the step.
"""

from __future__ import annotations

import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from m3serve.kernels._jit import helper


@helper
def pdl_release(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@helper
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
