"""Dense random initialisation of a TP-1 model in place (training start, tests): the same deterministic
tensors `random_tensors` builds, loaded through the ordinary checkpoint path."""

from __future__ import annotations

import torch

from m3serve.model.checkpoint import random_tensors
from m3serve.model.weights import DictSource, load_checkpoint


def init_dense_random(model, seed: int, std: float, nontrivial_norms: bool) -> None:
    device = model.device
    tensors = random_tensors(model.cfg, seed, None, device, torch.float32, std=std,
                             nontrivial_norms=nontrivial_norms)
    load_checkpoint(model, DictSource(tensors), keep_quantized=False, dtype=model.dtype, device=device)
    for p in model.parameters():
        p.requires_grad_(True)
