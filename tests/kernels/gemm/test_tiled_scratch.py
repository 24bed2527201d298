"""The prefill GEMMs' process-wide scratch (gemm/_tiled._scratch, shared with the MoE's decode-once band)."""

from __future__ import annotations

import torch

from m3serve.kernels.gemm._tiled import _SCRATCH, _scratch


def test_scratch_made_inside_inference_mode_is_writable_outside_it():
    """Made first inside an engine step (inference mode), then written by the next LLM's routing warm-up in the
    same process (outside it): on the H200 the second model's warm-up raised 'Inplace update to inference tensor
    outside InferenceMode'."""
    key = (torch.device("cpu"), torch.float64)     # a dtype no kernel uses: this test's own buffer
    _SCRATCH.pop(key, None)
    try:
        with torch.inference_mode():
            made = _scratch(torch.device("cpu"), torch.float64, 64)
        assert not made.is_inference()
        made.fill_(1.0)
        grown = _scratch(torch.device("cpu"), torch.float64, 128)
        assert grown.numel() == 128 and not grown.is_inference()
    finally:
        _SCRATCH.pop(key, None)
