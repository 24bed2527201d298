"""Device helpers."""

from __future__ import annotations

import torch


def canonical_device(device) -> torch.device:
    """`cuda` -> `cuda:<current>` so that devices compare equal to the ones tensors report."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d
