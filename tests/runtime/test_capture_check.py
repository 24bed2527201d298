"""Graph-capture blockers (runtime/capture_check.py) on CPU: the probe names the module and the op that would
sync the host, `auto` logs and leaves the bucket eager, `require` raises. On CPU the device's sync checker is
not armed, so the tests make the blocking op raise the way it does under torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import contextlib
import logging
import types

import pytest
import torch

from m3serve.model.loader import load_model
from m3serve.runtime import capture_check
from m3serve.runtime.decode_graphs import DecodeGraphs

SYNC_ERROR = "called a synchronizing CUDA operation"


@pytest.fixture
def tolist_syncs(monkeypatch):
    """Tensor.tolist raises as it does on CUDA with the sync checker set to "error"."""
    def boom(self):
        raise RuntimeError(SYNC_ERROR)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)


def test_probe_names_the_stock_moe_of_a_128_expert_style_model(tolist_syncs):
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True)
    x = torch.randn(3, model.cfg.hidden_size)
    moe = model.layers[1].mlp                               # the stock loop: torch.unique(ids).tolist()
    blocker = capture_check.probe(lambda: moe(x), model, "decode (greedy)", 4)
    assert blocker is not None
    assert blocker.module == "layers.1.mlp (MoE)", blocker
    assert blocker.where.startswith("model/moe.py:"), blocker
    assert SYNC_ERROR in blocker.reason and blocker.bucket == 4
    line = blocker.line()
    assert "decode (greedy) bucket 4" in line and "layers.1.mlp (MoE)" in line


def test_probe_passes_a_clean_run_and_restores_module_hooks():
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True)
    x = torch.randn(2, model.cfg.hidden_size)
    before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    assert capture_check.probe(lambda: model.layers[0].mlp(x), model, "decode", 2) is None
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == before
    assert len(torch.nn.modules.module._global_forward_hooks) == 0


def test_policy_auto_logs_require_raises(caplog):
    b = capture_check.CaptureBlocker("decode (greedy)", 64, "layers.3.mlp (MoE)", "model/moe.py:72 (forward)",
                                     SYNC_ERROR)
    with caplog.at_level(logging.WARNING, logger="m3serve"):
        capture_check.handle(b, "auto")
    assert "layers.3.mlp (MoE)" in caplog.text and "runs eagerly" in caplog.text
    with pytest.raises(capture_check.GraphCaptureError, match=r"require.*bucket 64.*layers\.3\.mlp \(MoE\)"):
        capture_check.handle(b, "require")


def test_a_blocked_bucket_is_served_by_the_next_captured_one_or_eagerly():
    g = DecodeGraphs.__new__(DecodeGraphs)                  # capture itself needs a GPU: set its outcome
    g.buckets = (1, 2, 4, 8, 16)
    g.captured = (1, 2, 4, 16)                              # bucket 8 was blocked
    assert g.bucket_for(1) == 1 and g.bucket_for(3) == 4
    assert g.bucket_for(5) == 16                            # padded into the next captured bucket
    assert g.bucket_for(17) is None                         # past every graph: an eager step


class _FakeCuda:
    """torch.cuda's graph capture as capture_check.capture uses it, on CPU: records what was captured; a capture
    raises when `fail` is set (as a sync inside real capture would)."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.captured, self.fail = [], fail
        fake = self

        class Graph:
            pass

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            fake.captured.append(g)
            if fake.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            yield
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_capture_returns_the_graph_and_what_the_captured_call_returned(monkeypatch):
    """capture: the probe first (a blocked warm-up is never captured), then the capture; a failed capture becomes
    a blocker naming the bucket, like a blocked probe."""
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True)
    stream = types.SimpleNamespace(device=torch.device("cpu"))
    x = torch.randn(2, model.cfg.hidden_size)
    cuda = _FakeCuda(monkeypatch)
    graph, out, blocker = capture_check.capture(lambda: model.layers[0].mlp(x), model, "prefill", 16, None, stream)
    assert blocker is None and cuda.captured == [graph] and out.shape == x.shape
    cuda.fail = True
    graph, out, blocker = capture_check.capture(lambda: model.layers[0].mlp(x), model, "prefill", 16, None, stream)
    assert graph is None and out is None and blocker.bucket == 16 and "capturing" in blocker.reason
    cuda.captured.clear()
    moe = model.layers[1].mlp
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (_ for _ in ()).throw(RuntimeError(SYNC_ERROR)))
    graph, out, blocker = capture_check.capture(lambda: moe(x), model, "prefill", 32, None, stream)
    assert graph is None and blocker.module == "layers.1.mlp (MoE)" and cuda.captured == []


def test_graphs_refuse_to_replay_after_the_model_is_bound_again():
    """routing.bind counts kernel bindings; graphs remember the one they captured, and check_binding raises, naming
    both, once the model (or its drafter) was bound again: the old graphs would replay the old binding's kernels on
    re-laid-out weights and write into workspaces the new binding may have freed."""
    import pytest
    import torch

    from m3serve.model.loader import load_model
    from m3serve.runtime.capture_check import binding_of, check_binding
    from m3serve.targets import routing
    model = load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=0)
    before = binding_of(model)
    routing.install(model, "auto")
    under = binding_of(model)
    assert under == (before[0] + 1,)
    check_binding(under, (model,), "decode")                  # unchanged: no error
    check_binding(binding_of(model, None), (model, None), "speculative")   # an absent drafter counts for nothing
    routing.install(model, "auto")
    with pytest.raises(RuntimeError, match=r"decode graphs: captured under kernel binding \(\d+,\), .*now bound"):
        check_binding(under, (model,), "decode")
