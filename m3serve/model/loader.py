"""Build a ready M3 model from a checkpoint directory or a preset with deterministic random weights."""

from __future__ import annotations

import os

import torch

from m3serve.config import M3Config, is_preset, preset
from m3serve.model.checkpoint import QUANTIZATIONS, random_tensors
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.parallel import SINGLE, TPGroup
from m3serve.model.weights import DictSource, SafetensorsSource, check_loaded, load_checkpoint


def resolve_config(model: str) -> M3Config:
    if os.path.isdir(model):
        return M3Config.from_file(model)
    if is_preset(model):
        return preset(model)
    raise FileNotFoundError(f"model {model!r} is neither a checkpoint directory nor a preset "
                            "(tiny, minimax-m3, minimax-m3:L)")


def load_model(model: str | M3Config, *, device="cpu", dtype: torch.dtype = torch.float32, tp: TPGroup = SINGLE,
               random_weights: bool = False, quantization: str | None = None, seed: int = 0,
               keep_quantized: bool | None = None) -> M3ForCausalLM:
    """`keep_quantized` defaults to True on CUDA (weights stay in their stored format and are dequantized per
    call, so a checkpoint fits as it does on disk) and False on CPU (dequantized once at load)."""
    device = torch.device(device)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: expected one of {QUANTIZATIONS}")
    cfg = model if isinstance(model, M3Config) else resolve_config(model)
    if keep_quantized is None:
        keep_quantized = device.type == "cuda"
    net = M3ForCausalLM(cfg, tp=tp, dtype=dtype)
    with torch.no_grad():
        if random_weights:
            loaded: set[str] = set()
            for i in range(cfg.num_hidden_layers):  # one layer at a time keeps peak memory near the model size
                tensors = random_tensors(cfg, seed, quantization, device, dtype, layers=range(i, i + 1),
                                         include_globals=(i == 0))
                loaded |= load_checkpoint(net, DictSource(tensors), keep_quantized=keep_quantized, dtype=dtype,
                                          device=device, check_complete=False)
                del tensors
            check_loaded(net, loaded)
        else:
            if not isinstance(model, str) or not os.path.isdir(model):
                raise ValueError(f"model {model!r}: a preset needs random_weights=True (no weights ship for it)")
            if quantization is not None:
                raise ValueError("quantization= applies to random weights; a checkpoint's format is read from it")
            load_checkpoint(net, SafetensorsSource(model), keep_quantized=keep_quantized, dtype=dtype, device=device)
    net.to(device)
    net.eval()
    return net
