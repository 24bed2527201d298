"""Step preparation of the speculative engine (spec_batch.py) equals the per-request packing it replaced.

Every verify pass and every draft pass of real runs (staggered arrivals, chunked prefill, prefix hits, long
accepted runs and rejections from the cheating drafter, greedy and sampled requests, and a run under page
pressure with preemptions and failed draft-page allocations) is checked against a plain per-request
reference written the old way: token ids, positions, flat slots (slot * page + offset), per-sequence spans and
their slot ids, logits rows, the rows the draft passes take their hidden states from, and the proposing rows;
plus the draft view's sub-page table against build_block_tables_reference. The persistent output buffers of
both device tables are poisoned (-777) before every prepare, so a stale value cannot pass. Integer outputs:
compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3serve.engine.engine import EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.kv.block_table import build_block_tables_reference
from m3serve.kv.layout import SlotLayout
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.loader import load_model
from tests.spec.specutil import CheatDecoding, engine_with, plain_outputs, prompts, run_staggered, spec_cfg

POISON = -777


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", random_weights=True, dtype=torch.float32)


def _poisoned(tables):
    prepare = tables.prepare

    def wrapped(*a, **k):
        tables.slot_table.fill_(POISON)
        tables.subpage_table.fill_(POISON)
        tables.slot_mapping_out.fill_(POISON)
        return prepare(*a, **k)
    return wrapped


def _flat_slots(slots: list[int], positions, page: int) -> list[int]:
    return [slots[p // page] * page + p % page for p in positions]


def _assert_spans(batch, expect: list[tuple[int, int, int, list[int]]], page: int) -> None:
    assert len(batch.seqs) == len(expect)
    for sp, (start, n, length, slots) in zip(batch.seqs, expect):
        assert (sp.start, sp.num_query, sp.seq_len) == (start, n, length)
        assert sp.slots.dtype == torch.int64
        assert sp.slots.tolist() == slots[:-(-length // page)]


class CheckedDecoding(CheatDecoding):
    """Checks every packed pass against the per-request reference, then runs it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checked = {"target": 0, "draft_first": 0, "draft_next": 0}
        self._items = []
        passes = self.spec_runner
        run_target, run_draft = passes.target, passes.draft

        def target(batch, mode):
            self._check_target(batch)
            return run_target(batch, mode)

        def draft(batch, src, gather, mode):
            self._check_draft(batch, src, gather)
            return run_draft(batch, src, gather, mode)

        passes.target, passes.draft = target, draft

    def attach(self, engine):
        super().attach(engine)
        engine.runner.tables.prepare = _poisoned(engine.runner.tables)
        engine.runner.view.tables.prepare = _poisoned(engine.runner.view.tables)
        return self

    def _plan(self, chunks):
        self._items = super()._plan(chunks)
        return self._items

    # ---------------------------------------------------------------- the verify pass
    def _check_target(self, batch):
        page = self.engine.kv.page_size
        ids, pos, smap, spans, rows = [], [], [], [], []
        for it in self._items:                       # the old per-request packing
            n = len(it.tokens)
            p = list(range(it.pos0, it.pos0 + n))
            slots = self.engine.blocks.slot_ids(it.req.request_id)
            ids += it.tokens
            pos += p
            smap += _flat_slots(slots, p, page)
            spans.append((it.row0, n, it.pos0 + n, slots))
            if it.sample:
                assert it.logit_row0 == len(rows)
                first = it.row0 + n - 1 - len(it.drafts)
                rows += range(first, it.row0 + n)
        assert batch.input_ids.tolist() == ids
        assert batch.positions.tolist() == pos
        assert batch.slot_mapping.tolist() == smap
        assert batch.logits_rows.tolist() == rows
        _assert_spans(batch, spans, page)
        self.checked["target"] += 1

    # ---------------------------------------------------------------- the draft passes
    def _check_draft(self, batch, src, gather):
        page = self.engine.kv.page_size
        if gather is not None:
            live = [it for it in self._items if not it.req.is_finished and it.req.allocated]
            ids, pos, smap, spans, src_ref, start = [], [], [], [], [], 0
            self._last_rows = {}
            for it in live:
                r, c = it.req, it.req.num_computed
                n = c - it.pos0
                p = list(range(it.pos0, c))
                slots = self.engine.blocks.slot_ids(r.request_id)
                ids += r.all_token_ids[it.pos0 + 1:c + 1]
                pos += p
                smap += _flat_slots(slots, p, page)
                spans.append((start, n, c, slots))
                src_ref += range(it.row0, it.row0 + n)
                self._last_rows[r.request_id] = start + n - 1
                start += n
            assert batch.input_ids.tolist() == ids
            assert src.tolist() == src_ref
            self._gather = gather.tolist()
            key = "draft_first"
        else:
            reqs = [self.engine.requests[sid] for sid in self._next_ids(batch)]
            j = self._pass
            pos = [r.num_computed + j - 2 for r in reqs]
            blocks = self.engine.blocks
            smap = [_flat_slots(blocks.slot_ids(r.request_id), [p], page)[0] for r, p in zip(reqs, pos)]
            spans = [(i, 1, p + 1, blocks.slot_ids(r.request_id)) for i, (r, p) in enumerate(zip(reqs, pos))]
            assert src.tolist() == [self._proposers.index(r.request_id) for r in reqs]
            key = "draft_next"
        assert batch.positions.tolist() == pos
        assert batch.slot_mapping.tolist() == smap
        _assert_spans(batch, spans, page)
        view, blocks = self.engine.runner.view, self.engine.blocks
        rows = blocks.rows_of([r.request_id for r in self._span_reqs(batch, gather)])
        _, sub_ref = build_block_tables_reference(blocks.host_table, rows, view.index_scale, view.kv_offset)
        assert torch.equal(view.tables.subpage_table[:len(rows)].cpu(), sub_ref)
        self.checked[key] += 1

    def _span_reqs(self, batch, gather):
        if gather is not None:
            return [it.req for it in self._items if not it.req.is_finished and it.req.allocated]
        return [self.engine.requests[sid] for sid in self._next_ids(batch)]

    def _next_ids(self, batch):
        """Later passes hold the proposers drafting at least `_pass` tokens, in proposer order."""
        return [sid for sid, k in zip(self._proposers, self._ks) if k >= self._pass]

    def _propose(self, head, reqs, greedy, keys):
        if self._j == 0:                                  # after the first pass: who proposes, how many
            self._proposers = [r.request_id for r in reqs]
            self._ks = [min(self.spec.num_speculative_tokens, self.engine.max_model_len - 1 - r.num_computed)
                        for r in reqs]
            assert self._gather == [self._last_rows[sid] for sid in self._proposers]
        self._pass = self._j + 2
        return super()._propose(head, reqs, greedy, keys)


def _engine(model, ps, params, ref, **cfg):
    reference = {tuple(p): out for p, out in zip(ps, ref)}
    return engine_with(model, EngineConfig(**{"kv_cache_bytes": 8 << 20, **cfg}), spec_cfg(3),
                       lambda s, d: CheckedDecoding(s, d, reference=reference, corrupt_every=4))


def test_packing_equals_per_request_reference(model):
    ps = prompts(8, seed=30)
    ps[4] = list(ps[1])                                          # full-page prefix hits
    greedy = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in np.random.default_rng(0).integers(4, 30, 8)]
    params = [g if i % 3 else SamplingParams(max_tokens=g.max_tokens, temperature=0.8, seed=i, ignore_eos=True)
              for i, g in enumerate(greedy)]
    ref = plain_outputs(model, ps, greedy)
    eng = _engine(model, ps, params, ref, max_num_batched_tokens=40)
    reqs = run_staggered(eng, ps, params, [0, 0, 1, 3, 4, 6, 9, 12])
    for i, r in enumerate(reqs):
        if params[i].greedy:
            assert list(r.output_token_ids) == ref[i]
    assert min(eng.speculation.checked.values()) > 10, eng.speculation.checked
    hist = set(eng.speculation.accept_hist)                      # short and full accepted runs were packed
    assert {0, 3} <= hist and len(hist) >= 3, hist


def test_packing_under_page_pressure(model):
    spec = KVCacheSpec.from_model_config(model.cfg, kv_cache_dtype="auto", model_dtype=torch.float32,
                                         num_draft_layers=1, draft_num_kv_heads=model.cfg.num_key_value_heads)
    lay = SlotLayout(spec)
    ps = prompts(4, 30, 40, seed=31)
    params = [SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)] * 4
    ref = plain_outputs(model, ps, params)
    eng = _engine(model, ps, params, ref, kv_cache_bytes=14 * (lay.slot_bytes + lay.scale_slot_bytes),
                  max_num_seqs=4)
    reqs = run_staggered(eng, ps, params, [0, 0, 0, 0])
    assert eng.scheduler.num_preemptions > 0
    assert [list(r.output_token_ids) for r in reqs] == ref
    assert min(eng.speculation.checked.values()) > 5, eng.speculation.checked


def test_verify_step_may_exceed_the_scheduler_budget(model):
    # 6 decoding requests x (1 + K = 4) rows = 24 tokens under a 16-token budget: the tables hold them.
    ps = prompts(6, 3, 8, seed=32)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 6
    ref = plain_outputs(model, ps, params)
    eng = _engine(model, ps, params, ref, max_num_batched_tokens=16)
    assert eng.runner.tables.max_tokens == 16 + 3 * eng.config.max_num_seqs
    reqs = run_staggered(eng, ps, params, [0] * 6)
    assert [list(r.output_token_ids) for r in reqs] == ref


def test_paged_plan_packs_the_kernels_metadata_beside_the_same_slots():
    """spec_batch.pack_spans with a PagedPlan (the decode target's eager step): the batch carries a PagedStep whose
    query starts, sequence lengths and slot-table rows are those of the spans the stock loop would read, with
    split_plan's factors for the step's rows; token ids, positions, flat slots and the tail are unchanged."""
    from m3serve.engine.spec_batch import pack_spans
    from m3serve.kv import BlockManager, DeviceBlockTables
    from m3serve.runtime.step_inputs import PagedPlan, split_plan
    page = 16
    m = BlockManager(64, page, 8, 9, enable_prefix_caching=False)
    lens = {3: 40, 5: 7, 8: 70}
    for sid, n in lens.items():
        m.allocate(sid, list(range(n)))
    seq_ids = [8, 3, 5]
    counts = np.array([30, 1, 4])                               # a prefill chunk, a decode, a verify
    pos0 = np.array([lens[s] for s in seq_ids]) - counts
    ids = np.arange(int(counts.sum())) + 100
    tail = np.array([4, 29, 30, 31])
    stock, stock_tail = pack_spans(DeviceBlockTables(m, "cpu", 2), "kv", seq_ids, pos0, counts, ids, tail)
    plan = PagedPlan(kv_heads=2, topk=4, sparse_tiles=2)
    tables = DeviceBlockTables(m, "cpu", 2)
    tables.slot_table.fill_(POISON)
    paged, paged_tail = pack_spans(tables, "kv", seq_ids, pos0, counts, ids, tail, plan)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert torch.equal(getattr(paged, name), getattr(stock, name)), name
    assert torch.equal(paged_tail, stock_tail) and paged_tail.tolist() == tail.tolist()
    st = paged.step
    assert stock.step is None and paged.seqs == []
    assert st.query_start.tolist() == [0, 30, 31, 35]
    assert st.seq_lens.tolist() == [70, 40, 7] and st.max_query_len == 30
    for i, sp in enumerate(stock.seqs):
        assert st.slot_table[i, :sp.slots.numel()].tolist() == sp.slots.tolist()
    assert (st.num_splits, st.num_splits_sparse) == split_plan(35, tables.max_blocks, 2, 4, 2)
