"""Shared pieces of the speculative-decoding tests: prompts, engines, a "cheating" drafter, staggered runs."""

from __future__ import annotations

import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.spec_config import SpecConfig
from m3serve.engine.speculative import SpecDecoding, prepare_drafter, spec_runner_config
from m3serve.runtime.model_runner import ModelRunner

VOCAB = 512   # the tiny preset


def prompts(n: int, lo: int = 3, hi: int = 90, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def spec_cfg(k: int = 3, **kw) -> dict:
    """These tests check the speculative step at every batch size: the batch-size policy is off unless asked."""
    return {"method": "eagle3", "model": None, "num_speculative_tokens": k, "disable_by_batch_size": None, **kw}


def plain_outputs(model, ps: list[list[int]], params: list[SamplingParams], **cfg) -> list[list[int]]:
    """Reference: plain greedy decoding, every request submitted at once (batching invariance of the base
    engine is covered by tests/engine)."""
    eng = LLMEngine(model, EngineConfig(**{"kv_cache_bytes": 8 << 20, **cfg}))
    reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    while eng.has_work():
        eng.step()
    return [list(r.output_token_ids) for r in reqs]


def run_staggered(engine, ps: list[list[int]], params: list[SamplingParams], arrivals: list[int],
                  abort: dict[int, int] | None = None) -> list:
    """Request i joins at step arrivals[i]; abort = {request index: step} aborts it then. Returns the requests."""
    abort = abort or {}
    reqs: dict[int, object] = {}
    step = 0
    while len(reqs) < len(ps) or engine.has_work():
        for i, a in enumerate(arrivals):
            if a == step:
                reqs[i] = engine.add_request(ps[i], params[i])
        for i, s in abort.items():
            if s == step and i in reqs:
                engine.abort(reqs[i].request_id)
        if engine.has_work():
            engine.step()
        step += 1
        assert step < 10_000
    return [reqs[i] for i in range(len(ps))]


class CheatDecoding(SpecDecoding):
    """Proposes the target's own greedy continuation (known from a reference run), corrupted at a deterministic
    pattern so that every acceptance length occurs. The real draft layer still runs (its KV is written and
    read through the draft view); only the proposed tokens are replaced."""

    def __init__(self, *args, reference: dict[tuple, list[int]], corrupt_every: int = 5, **kw):
        super().__init__(*args, **kw)
        self.reference = reference
        self.corrupt_every = corrupt_every
        self.accept_hist: list[int] = []
        self._j = 0

    def _draft(self, items):
        self._j = 0
        super()._draft(items)

    def _propose(self, head, reqs, greedy, keys):
        self._j += 1
        tok, q = super()._propose(head, reqs, greedy, keys)
        forced = []
        for r in reqs:
            ref = self.reference[tuple(r.prompt_token_ids)]
            m = len(r.output_token_ids) + self._j - 1          # output index this draft proposes
            t = ref[m] if m < len(ref) else 0
            if self.corrupt_every and (7 * m + 3 * self._j + r.request_id) % self.corrupt_every == 0:
                t = (t + 1) % VOCAB
            forced.append(t)
        tok = torch.tensor(forced, dtype=torch.int64, device=tok.device)
        if q is not None:
            q = torch.zeros_like(q).scatter_(1, tok.unsqueeze(1), 1.0)   # the distribution the draft came from
        return tok, q

    def _record(self, st, k, a):
        self.accept_hist.append(a)
        super()._record(st, k, a)


def engine_with(model, config: EngineConfig, speculative_config: dict, decoding) -> LLMEngine:
    """An LLMEngine whose speculation is decoding(spec, drafter), a SpecDecoding subclass: the parts
    speculative_engine puts together."""
    spec = SpecConfig.from_dict(speculative_config)
    drafter = prepare_drafter(spec, model)
    runner = ModelRunner(model, config, **spec_runner_config(config, spec, drafter))
    return LLMEngine(model, config, runner=runner, speculation=decoding(spec, drafter))


def cheat_engine(model, ps, params, ref_outputs, k: int = 3, corrupt_every: int = 5, spec: dict | None = None,
                 **cfg) -> LLMEngine:
    """spec: more speculative_config keys (e.g. disable_by_batch_size); cfg: EngineConfig fields."""
    reference = {tuple(p): out for p, out in zip(ps, ref_outputs)}
    return engine_with(model, EngineConfig(**{"kv_cache_bytes": 8 << 20, **cfg}), spec_cfg(k, **(spec or {})),
                       lambda s, d: CheatDecoding(s, d, reference=reference, corrupt_every=corrupt_every))
