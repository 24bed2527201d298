"""Sharded M3 on CPU: every rank's loaded shard is the matching slice of the full tensor in every format, and
TP = 2 / 4 over gloo gives TP = 1's logits and greedy tokens in fp32; vocab-parallel argmax and logprobs equal
the full-row ones.

Checkpoints: the tiny preset (random dense weights), transformers' oracle "a" saved with save_pretrained
(transformers layout, stacked experts), and the original layout quantized with the published splits
(nvfp4 = NVFP4 experts + MXFP8 projections; mxfp8 everywhere). TP = 4 exercises KV-head replication (the tiny
shapes have 2 KV heads). A "wide" tiny (expert width 128) lets MXFP8 experts split over 4 ranks at their
32-column block.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from m3serve.config import preset
from m3serve.model.checkpoint import save_checkpoint
from m3serve.model.loader import load_model
from m3serve.model.parallel import TPGroup, check_tp_shapes
from m3serve.model.qweight import CheckpointError
from tests.distributed.rank_checks import all_checks
from tests.distributed.ranks import run_ranks
from tests.distributed.shards import compare_shard
from tests.oracle import make_oracle

# fp32 TP vs TP = 1: identical math, only the summation order of row-parallel partial sums (and the
# all-reduce) differs, ~1e-7 relative per op; logits are O(1) after 3-4 layers, so a few 1e-6 is typical.
# 2e-5 (the oracle tests' bound) still catches any wrong slice, which moves logits by > 1e-2.
LOGIT_ATOL = 2e-5
# Vocab-parallel logprobs: log-sum-exp assembled from per-rank partial sums, fp32 rounding only.
LOGPROB_ATOL = 1e-5


def _wide():
    return dataclasses.replace(preset("tiny"), intermediate_size=128, shared_intermediate_size=128)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_ckpts")
    out = {"tiny": "tiny"}
    make_oracle("a").save_pretrained(root / "oracle_a")
    out["oracle_a"] = str(root / "oracle_a")
    tiny = load_model("tiny", random_weights=True)
    for q in ("nvfp4", "mxfp8"):
        save_checkpoint(tiny, tiny.cfg, str(root / f"tiny_{q}"), layout="original", quantization=q,
                        dtype=torch.float32)
        out[f"tiny_{q}"] = str(root / f"tiny_{q}")
    wide = load_model(_wide(), random_weights=True)
    save_checkpoint(wide, wide.cfg, str(root / "wide_mxfp8"), layout="original", quantization="mxfp8",
                    dtype=torch.float32)
    out["wide_mxfp8"] = str(root / "wide_mxfp8")
    return out


CASES = {2: ["tiny", "oracle_a", "tiny_nvfp4", "tiny_mxfp8"], 4: ["tiny", "oracle_a", "tiny_nvfp4", "wide_mxfp8"]}
FORMATS = {"tiny": {"dense"}, "oracle_a": {"dense"}, "tiny_nvfp4": {"dense", "mxfp8", "nvfp4"},
           "tiny_mxfp8": {"dense", "mxfp8"}, "wide_mxfp8": {"dense", "mxfp8"}}


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_holds_its_slice(ckpts, n):
    for name in CASES[n]:
        path = ckpts[name]
        kw = dict(dtype=torch.float32, random_weights=path == "tiny", keep_quantized=True)
        full = load_model(path, **kw)
        for r in range(n):
            res = compare_shard(full, load_model(path, tp=TPGroup(r, n), **kw), r, n)
            assert not res["mismatch"], (name, r, res["mismatch"][:5])
            assert res["formats"] == FORMATS[name], (name, res["formats"])
            # every linear (6 per attention + MLP parts) and norm was compared, not a subset
            assert res["tensors"] > 10 * full.cfg.num_hidden_layers, (name, res["tensors"])


def test_misaligned_quantized_split_names_the_tensor(ckpts, tmp_path):
    # Oracle "a" has dense-MLP width 96 and expert width 48: rank 1's input columns start at 48 (MXFP8 down_proj,
    # block 32) and 24 (NVFP4 experts, block 16), both inside a scale block.
    src = load_model(ckpts["oracle_a"], dtype=torch.float32)
    save_checkpoint(src, src.cfg, str(tmp_path / "q"), layout="original", quantization="nvfp4", dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"layers\.\d+\.[\w.]+\.weight_scale(_inv)?: the tensor-parallel column "
                                              r"slice \[\d+, \d+\) does not align with its block of (16|32) columns"):
        load_model(str(tmp_path / "q"), dtype=torch.float32, tp=TPGroup(1, 2), keep_quantized=True)


def test_unshardable_sizes_raise_before_launch():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="num_attention_heads: size 4 does not split over tensor-parallel size 3"):
        check_tp_shapes(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected a positive int"):
        check_tp_shapes(cfg, 0)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple of num_key_value_heads 3"):
        check_tp_shapes(dataclasses.replace(cfg, num_attention_heads=12, num_key_value_heads=3, index_n_heads=3,
                                            vocab_size=516), 4)


@pytest.fixture(scope="module", params=[2, 4])
def rank_results(request, ckpts):
    n = request.param
    cases = [(name, ckpts[name], 45, 8) for name in CASES[n]]
    results = run_ranks(all_checks, n, cases)
    return n, results


def test_vocab_parallel_argmax_matches_full_argmax(rank_results):
    n, results = rank_results
    for r, res in enumerate(results):
        v = res["vocab"]
        assert v["argmax"] == v["argmax_ref"], (n, r)


def test_vocab_parallel_logprobs_match_full_log_softmax(rank_results):
    _, results = rank_results
    for res in results:
        v = res["vocab"]
        chosen, ids, vals = v["lp"]
        rc, rids, rvals = v["lp_ref"]
        assert ids == rids
        for a, b in zip(chosen + [x for row in vals for x in row], rc + [x for row in rvals for x in row]):
            assert math.isfinite(a) and abs(a - b) < LOGPROB_ATOL
        assert v["lp0_shapes"] == [(5, 0), (5, 0)]
        assert all(abs(a - b) < LOGPROB_ATOL for a, b in zip(v["lp0_chosen"], rc))


def test_tp_logits_and_greedy_tokens_equal_tp1(rank_results):
    n, results = rank_results
    for name in CASES[n]:
        for r, res in enumerate(results):
            m = res["model"][name]
            assert m["max_abs"] < LOGIT_ATOL, (n, name, r, m["max_abs"])
            assert m["ref_scale"] > 0.05, (name, "logits too small for the bound to mean anything")
            assert m["tokens_tp"] == m["tokens_ref"], (n, name, r)
            assert m["argmax_tp"] == m["argmax_ref"], (n, name, r)
        assert len(set(results[0]["model"][name]["tokens_ref"])) > 1, (name, "degenerate greedy output")
