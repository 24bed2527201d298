"""Bad arguments raise TypeError/ValueError naming the argument, the expected and the found value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3serve.kernels.gemm import fp8 as linear_fp8, mxfp8 as linear_mxfp8, nvfp4 as linear_nvfp4, qkv_fused
from m3serve.kernels.head import bf16 as head_bf16, head12
from m3serve.kernels.moe import nvfp4 as moe_nvfp4
from m3serve.kernels.norm import add_rms as add_rmsnorm
from m3serve.kernels.gemm._gemm_tiles import GemmConfig, make_workspace

CPU = torch.device("cpu")


def _case(mod, i=0, rows=None):
    e = mod.ENTRY if hasattr(mod, "ENTRY") else mod.ENTRIES[0]
    c = e.interp_cells[i]
    return e, e.make_case(c, rows or c.rows[0], CPU, torch.Generator().manual_seed(0))


def _swap(args, k, v):
    a = list(args)
    a[k] = v
    return a


def test_linear_nvfp4_arguments() -> None:
    e, case = _case(linear_nvfp4)
    a = case.args
    with pytest.raises(TypeError, match=r"x: expected dtype torch.bfloat16, found torch.float32"):
        e.raw_call(*_swap(a, 0, a[0].float()))
    with pytest.raises(ValueError, match=r"block_scale: expected shape"):
        e.raw_call(*_swap(a, 2, a[2][:, :-1]))
    with pytest.raises(TypeError, match=r"packed: expected dtype torch.uint8"):
        e.raw_call(*_swap(a, 1, a[1].view(torch.int8)))
    big = torch.zeros(17, a[0].shape[1], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x: this config \(BM=16\) serves 1..16 rows, found M=17"):
        e.raw_call(*_swap(_swap(a, 0, big), 4, torch.zeros(17, a[4].shape[1], dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"out: expected shape"):
        e.raw_call(*_swap(a, 4, a[4][:, :-1]))
    with pytest.raises(ValueError, match=r"global_scale: expected a 0-dim/1-element"):
        e.raw_call(*_swap(a, 3, torch.ones(3)))
    bad_cfg = GemmConfig(BM=16, BN=64, BK=128, SPLIT=4)
    with pytest.raises(ValueError, match=r"K % 512 == 0"):
        e.raw_call(*_swap(_swap(a, 6, bad_cfg), 5, make_workspace(bad_cfg, a[4].shape[1], CPU)))


def test_split_workspace_is_checked() -> None:
    e, case = _case(linear_nvfp4, i=1, rows=2)  # the split-K interpreter cell
    a = case.args
    ws = dataclasses.replace(a[5], part=a[5].part[:10])
    with pytest.raises(ValueError, match=r"workspace.part: expected >= "):
        e.raw_call(*_swap(a, 5, ws))


def test_mxfp8_and_fp8_arguments() -> None:
    e, case = _case(linear_mxfp8)
    a = case.args
    with pytest.raises(TypeError, match=r"scale: expected dtype torch.uint8, found torch.float32"):
        e.raw_call(*_swap(a, 2, a[2].float()))
    with pytest.raises(TypeError, match=r"q: expected dtype torch.float8_e4m3fn"):
        e.raw_call(*_swap(a, 1, a[1].view(torch.uint8)))
    e, case = _case(linear_fp8)
    a = case.args
    with pytest.raises(ValueError, match=r"scale: expected a 0-dim/1-element or \[128\] tensor, found \(2,\)"):
        e.raw_call(*_swap(a, 2, torch.ones(2)))


def test_fused_projection_format() -> None:
    with pytest.raises(ValueError, match=r"fmt: expected one of 'nvfp4', 'mxfp8', 'fp8', found 'int4'"):
        qkv_fused.fuse_projection_weights("int4", [(torch.zeros(1),)])
    with pytest.raises(ValueError, match=r"splits: expected rows summing to 10"):
        qkv_fused.split_projection(torch.zeros(2, 10), (4, 4))


def test_norm_arguments() -> None:
    e, case = _case(add_rmsnorm)
    a = case.args
    with pytest.raises(ValueError, match=r"eps: expected a positive float, found -1.0"):
        e.raw_call(*_swap(a, 3, -1.0))
    with pytest.raises(TypeError, match=r"weight: expected torch.bfloat16 or torch.float32, found torch.int32"):
        e.raw_call(*_swap(a, 2, a[2].int()))
    with pytest.raises(ValueError, match=r"residual: expected shape"):
        e.raw_call(*_swap(a, 1, a[1][:, :-1]))


def test_head_arguments() -> None:
    e, case = _case(head_bf16)
    a = case.args
    with pytest.raises(TypeError, match=r"ids: expected dtype torch.int64, found torch.int32"):
        e.raw_call(*_swap(a, 2, a[2].int()))
    with pytest.raises(TypeError, match=r"w: expected dtype torch.bfloat16"):
        e.raw_call(*_swap(a, 1, a[1].float()))
    e, case = _case(head12)
    a = case.args
    with pytest.raises(ValueError, match=r"codes: expected shape"):
        e.raw_call(*_swap(a, 2, a[2][:, :-1]))
    with pytest.raises(ValueError, match=r"x: head.head12 serves 1..8 rows"):
        e.raw_call(*_swap(a, 0, torch.zeros(9, a[0].shape[1], dtype=torch.bfloat16)))
    with pytest.raises(TypeError, match=r"config: expected a Head12MmaConfig"):
        e.raw_call(*_swap(a, 12, head_bf16.HeadConfig(BM=16)))


def test_moe_arguments() -> None:
    e, case = _case(moe_nvfp4)
    a = case.args
    with pytest.raises(ValueError, match=r"g13: expected shape \(16, 2\), found \(16, 3\)"):
        e.raw_call(*_swap(a, 5, torch.ones(16, 3)))
    with pytest.raises(TypeError, match=r"router_w: expected torch.float32 or torch.bfloat16, found torch.float16"):
        e.raw_call(*_swap(a, 1, a[1].half()))
    ws = dataclasses.replace(a[-2], act=a[-2].act[:1])
    with pytest.raises(ValueError, match=r"workspace.act"):
        e.raw_call(*_swap(a, len(a) - 2, ws))
    with pytest.raises(ValueError, match=r"sh_s13/sh_g13/sh_s2/sh_g2: expected None for a BF16 shared expert"):
        bf13 = torch.zeros(a[9].shape[1], a[9].shape[2] * 2, dtype=torch.bfloat16)
        bf2 = torch.zeros(a[12].shape[1], a[12].shape[2] * 2, dtype=torch.bfloat16)
        e.raw_call(*_swap(_swap(a, 9, bf13), 12, bf2))
