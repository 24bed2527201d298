"""GPU smoke test of the shipped preset: bf16 autocast, real sizes (1024-token windows with
sparse selection active), a few steps, checkpoint written, reloaded and evaluated.
The same code runs on CPU at toy size in test_loop.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from m3serve.train.loop import TrainConfig, train

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_preset_few_steps_on_gpu(tmp_path: Path) -> None:
    data = tmp_path / "text"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    words = ("thou art more lovely and more temperate rough winds do shake the darling buds of may "
             "and summer's lease hath all too short a date sometime too hot the eye of heaven shines").split()
    for i in range(8):
        idx = torch.randint(0, len(words), (6000,), generator=g).tolist()
        (data / f"w{i}.txt").write_text(" ".join(words[j] for j in idx) + "\n")
    tc = TrainConfig(preset="m3-tiny-verse", device=DEVICE, steps=20, batch_size=8, log_every=5,
                     overrides=dict(n_syn_train=2000, n_syn_heldout=64, eval_items=8, heldout_windows=2,
                                    sample_tokens=8, max_new_tokens=16))
    report = train(tc, data, tmp_path / "ckpt")
    curve = report["train"]["curve"]
    assert all(torch.isfinite(torch.tensor(r["ce"])) for r in curve)
    assert curve[-1]["ce"] < curve[0]["ce"] - 0.5
    assert report["recipe"]["autocast_bf16"]
    assert report["indexer"]["per_layer"] and report["indexer"]["per_layer"][0]["active_queries"] > 0
    assert report["checkpoint"]["within_limit"]
