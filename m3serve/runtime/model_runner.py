"""The model runner: the device side of an engine step (nano-vllm's ModelRunner, vLLM v1's GPUModelRunner).

It owns the model, the paged KV cache, the device block tables (and, with a draft layer, the draft view's), the
decode target switch (attention through the paged-cache kernels, the decode graphs, and optionally eager steps as
prefill graphs: runtime/prefill_graphs.py) and the device side of sampling. The engine (m3serve.engine.engine)
stays on the host: it schedules, asks the runner for the step (`build_batch` + `run`, or `launch_graph` +
`fetch_tokens` in the overlap loop) and post-processes (append, stop checks, page commits).

Requests and scheduled chunks reach the runner duck-typed, because the runtime layer sits below the engine's
types: a request's `request_id`, `num_computed`, `params`, `sample_key`, `num_tokens`, `prompt_token_ids`,
`output_token_ids`; a chunk's `request`, `num_tokens`, `reaches_end`. The penalty / logit-bias state and the
grammar masks stay with the engine (m3serve.engine.penalties, token_masks: their rows are assigned per request,
host bookkeeping); an eager step receives the rows the engine picked (step_inputs.LogitsProcessing), the decode
graphs the two state objects at capture.

A tensor-parallel group's rank 0 plugs in m3serve.distributed.driver.TPDriverRunner, which broadcasts each step
to the followers before running it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from m3serve.engine.sampler import sample, top_logprobs
from m3serve.kernels.catalog import all_entries
from m3serve.kv.block_table import DeviceBlockTables
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.rotation import DEFAULT_ROTATION_SEED
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.runtime.decode_graphs import DecodeGraphs, Launched
from m3serve.runtime.memory_plan import WorkingMemory, experts_quantized, kv_budget_bytes, plan_working_memory
from m3serve.runtime.prefill_graphs import PrefillGraphs, seq_buckets, token_buckets
from m3serve.runtime.step_inputs import (LogitsProcessing, PagedPlan, paged_meta, paged_step,
                                         sparse_tiles_per_block)
from m3serve.targets.attention import PAGED_KERNELS
from m3serve.targets.explain import uncertified_attention

log = logging.getLogger("m3serve")


def cache_spec(model, config, draft_kv_heads: int | None = None) -> KVCacheSpec:
    """The cache roles a runner of `config` (an EngineConfig) needs. draft_kv_heads: with speculation, the
    Eagle3 drafter's KV heads; the drafter is replicated under tensor parallelism, so every rank holds all
    of them (the spec divides heads by the TP size, hence the product)."""
    fp8_layers = config.kv_fp8_layers
    if isinstance(fp8_layers, str):
        if fp8_layers != "auto":
            raise ValueError(f"EngineConfig.kv_fp8_layers: expected 'auto' or a tuple of sparse layer ids, "
                             f"found {fp8_layers!r}")
        fp8_layers = ()
    seed = config.kv_rotation
    if isinstance(seed, str):
        if seed != "auto":
            raise ValueError(f"EngineConfig.kv_rotation: expected 'auto', None or a non-negative int seed, "
                             f"found {seed!r}")
        seed = DEFAULT_ROTATION_SEED if config.kv_cache_dtype == "nvfp4" else None
    draft = {} if draft_kv_heads is None else {"num_draft_layers": 1,
                                               "draft_num_kv_heads": draft_kv_heads * model.tp.size}
    return KVCacheSpec.from_model_config(model.cfg, tp_size=model.tp.size, kv_cache_dtype=config.kv_cache_dtype,
                                         index_k_dtype=config.index_k_dtype, model_dtype=model.dtype,
                                         fp8_layers=fp8_layers, kv_rotation_seed=seed, **draft)


def all_certified(missing: list, what: str, target: str, mode: str) -> bool:
    """True when no placement is missing; else `require` raises naming them and `auto` logs them."""
    if not missing:
        return True
    why = "; ".join(p.line() for p in missing[:8]) + (f"; ... {len(missing) - 8} more" if len(missing) > 8 else "")
    if mode == "require":
        raise ValueError(f"route='require': {what} outside the certified cells: {why}")
    log.warning("%s off (%s outside the certified cells): %s", target, what, why)
    return False


class ModelRunner:
    # Its sampling step applies penalties, logit_bias, min_tokens, bans, grammar masks and prompt logprobs (a
    # runner that cannot says False here, and the engine refuses such requests).
    processes_logits = True

    def __init__(self, model, config, *, draft_kv_heads: int | None = None, max_step_tokens: int | None = None,
                 spec_k: int = 0):
        """config: the engine's EngineConfig (cache dtype and budget, max_num_batched_tokens). draft_kv_heads:
        adds the shared Eagle3 draft layer to the cache. max_step_tokens: tokens one step may pack (a verify step
        holds K drafts per sequence more than the scheduler's budget). spec_k: the speculative tokens per step
        (the memory plan reserves the speculative graphs' rows)."""
        self.model, self.config = model, config
        n = config.prefill_graph_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"prefill_graph_tokens: expected an int >= 0 (0: off), found {n!r}")
        dev = model.device
        spec = cache_spec(model, config, draft_kv_heads)
        self.max_step_tokens = max_step_tokens if max_step_tokens is not None else config.max_num_batched_tokens
        self.working_memory: WorkingMemory | None = None   # the plan the cache was sized by (GPU budget only)
        self._used_after_cache: int | None = None          # device bytes in use once the cache was allocated
        if config.kv_cache_bytes is not None or dev.type != "cuda":
            budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else 256 << 20
            self.kv = PagedKVCache.from_budget(spec, device=dev, budget_bytes=budget)
        else:
            self.kv = self._cache_from_memory_plan(spec, spec_k)
        self.sparse_tiles = sparse_tiles_per_block(spec)   # split_plan's key tiles per MSA block (fixed per cache)
        self.tables: DeviceBlockTables | None = None   # bind_tables
        self.view = None                 # the draft layer's DraftKVView (bind_tables, with a draft layer)
        self.target_attention = False    # attention through the paged-cache kernels (enable_target)
        self.graphs_version = 0          # bumped whenever `graphs` is replaced (keys the engine's per-request caches)
        self.graphs = None               # DecodeGraphs (enable_target)
        self.prefill_graphs = None       # PrefillGraphs (enable_target, config.prefill_graph_tokens > 0)
        self.prefill_capture_layers = ()  # residual streams its programs keep (a speculative engine's drafter's)
        log.info("KV cache: %s", self.kv.describe())

    def _cache_from_memory_plan(self, spec: KVCacheSpec, spec_k: int) -> PagedKVCache:
        """The cache takes the utilization's share of the card less what is in use and less the planned working
        memory of the steps, graphs and engine state (runtime/memory_plan.py)."""
        model, config, dev = self.model, self.config, self.model.device
        cfg = model.cfg
        graphs = not config.enforce_eager and self.target_possible()
        self.working_memory = plan_working_memory(
            cfg, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_step_tokens=self.max_step_tokens,
            max_model_len=cfg.context_limit(config.max_model_len),
            graphs=graphs, prefill_graph_tokens=config.prefill_graph_tokens if graphs else 0, spec_k=spec_k,
            quantized_experts=experts_quantized(model))
        torch.cuda.empty_cache()      # blocks the loader left cached would count as in use and shrink the cache
        free, total = torch.cuda.mem_get_info(dev)
        budget = kv_budget_bytes(free, total, config.gpu_memory_utilization, self.working_memory)
        kv = PagedKVCache.from_budget(spec, device=dev, budget_bytes=budget)
        free, _ = torch.cuda.mem_get_info(dev)
        self._used_after_cache = total - free
        log.info("memory plan: working memory %s reserved before the KV cache", self.working_memory.describe())
        return kv

    def measured_working_bytes(self) -> int | None:
        """Device bytes taken since the cache was allocated (graph pools, engine state, the steps' cached
        activations, cuBLAS workspaces): after start-up, what the plan stood for; None without a plan."""
        if self._used_after_cache is None:
            return None
        free, total = torch.cuda.mem_get_info(self.model.device)
        return total - free - self._used_after_cache

    def check_memory_plan(self) -> dict | None:
        """After start-up (graphs captured, warm-up run): the plan against what was taken, logged (a warning when
        the plan fell short); {"planned_working_bytes", "measured_working_bytes"} or None without a plan."""
        measured = self.measured_working_bytes()
        if measured is None:
            return None
        planned = self.working_memory.total
        (log.warning if measured > planned else log.info)(
            "memory plan: working memory planned %.2f GiB, taken after start-up %.2f GiB%s", planned / 2**30,
            measured / 2**30, " (above the plan: lower gpu_memory_utilization if steps run out of memory)"
            if measured > planned else "")
        return {"planned_working_bytes": planned, "measured_working_bytes": measured}

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self._graphs = graphs
        self.graphs_version += 1

    def fault(self) -> str | None:
        """Why this runner can run no more steps (None while it can); a single-process runner never fails so."""
        return None

    # ------------------------------------------------------------------ block tables
    def bind_tables(self, blocks) -> None:
        """Device block tables over the engine's allocator (slot ids, index_scale 1: kernels that need sub-page
        tables build their own views with the cache's geometry), and the draft view's own tables when the cache
        has a draft layer (sub-page geometry)."""
        dev = self.model.device
        self.tables = DeviceBlockTables(blocks, dev, index_scale=1, kv_offset=1, max_tokens=self.max_step_tokens)
        if self.kv.spec.num_draft_layers:
            self.view = self.kv.draft_view(blocks)
            self.view.tables = DeviceBlockTables(blocks, dev, self.view.index_scale, self.view.kv_offset,
                                                 max_tokens=self.max_step_tokens)

    def certified_table_width(self) -> int:
        """msa.select compiles per block-table width (padded to a power of two) and is certified at the model's
        full context; the smallest certified width that holds the tables' width (or theirs)."""
        cfg, need = self.model.cfg, self.tables.max_blocks
        if not any(t == "sparse" for t in cfg.layer_types):
            return need
        hk, p = self.kv.spec.num_kv_heads, self.kv.page_size
        widths = sorted(c.shape[3] for c in all_entries()["msa.select"].cells
                        if c.shape[:3] == (hk, p, cfg.index_topk_blocks) and c.shape[3] >= need)
        return widths[0] if widths else need

    # ------------------------------------------------------------------ the decode target
    def target_possible(self) -> bool:
        """The decode target (and so its CUDA graphs) needs a bf16 model on CUDA at TP 1."""
        m = self.model
        return m.device.type == "cuda" and m.dtype == torch.bfloat16 and m.tp.size == 1

    def check_target(self) -> None:
        """The decode target needs a bf16 model on CUDA at TP 1 (ValueError naming what differs)."""
        m = self.model
        if not self.target_possible():
            raise ValueError(f"decode target: needs a bf16 model on CUDA at TP 1, found {m.dtype} on {m.device} "
                             f"at TP {m.tp.size}")

    def enable_target(self, graphs: bool, buckets: tuple[int, ...], mode: str, penalties=None,
                      token_masks=None) -> bool:
        """Attention through the paged-cache kernels for every step and, with graphs, one decode graph per bucket
        (with the engine's PenaltyState and TokenMaskRows also the processed variant). The tables must have their
        final width (the engine re-sizes them first). auto: False (logged) when an attention placement is
        uncertified; require: raises naming them."""
        missing = uncertified_attention(self.model, self.kv, self.tables.max_blocks, buckets)
        if not all_certified(missing, "attention", "decode target", mode):
            return False
        self.use_paged_kernels()
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.kv, self.tables, buckets, penalties=penalties,
                                       token_masks=token_masks)
            self.graphs.capture(mode)
            self.enable_prefill_graphs(mode)
        return True

    def use_paged_kernels(self) -> None:
        """Attention through the paged-cache kernels for every step: eager steps carry a PagedStep (paged_plan)."""
        self.target_attention = True
        self.model.use_attention(PAGED_KERNELS)

    def enable_prefill_graphs(self, mode: str, graphs: bool = True) -> None:
        """Eager steps of up to config.prefill_graph_tokens tokens as CUDA graphs (runtime/prefill_graphs.py);
        graphs=False builds the same padded programs to run eagerly (CPU tests). Needs the target's attention."""
        limit = min(self.config.prefill_graph_tokens, self.config.max_num_batched_tokens, self.tables.max_tokens)
        tokens = token_buckets(limit)
        if not self.target_attention or not tokens or self.prefill_graphs is not None:
            return
        self.prefill_graphs = PrefillGraphs(self.model, self.kv, self.tables, self.paged_plan(), tokens,
                                            seq_buckets(min(self.config.max_num_seqs, self.tables.manager.max_seqs)),
                                            graphs=graphs, capture_layers=self.prefill_capture_layers)
        self.prefill_graphs.capture(mode)

    # ------------------------------------------------------------------ eager steps
    def paged_plan(self, draft: bool = False) -> PagedPlan | None:
        """What an eager step's PagedStep needs for the target's layers (draft: the Eagle3 draft layer's), or None
        while attention runs the stock loop (before enable_target)."""
        if not self.target_attention:
            return None
        if draft:
            return PagedPlan(self.kv.spec.kv_heads(self.view.layer), 0)
        return PagedPlan(self.kv.spec.num_kv_heads, self.model.cfg.index_topk_blocks, self.sparse_tiles)

    def build_batch(self, chunks) -> ForwardBatch:
        """Pack the step. Block tables and the token slot mapping come from ONE staged upload and ONE device
        op for the whole batch (DeviceBlockTables.prepare); only changed block-table rows are re-staged."""
        page = self.kv.page_size
        dev = self.model.device
        reqs = [c.request for c in chunks]
        n = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        done = np.fromiter((r.num_computed for r in reqs), dtype=np.int64, count=len(chunks))
        starts = np.concatenate(([0], np.cumsum(n)[:-1]))
        seq_of_token = np.repeat(np.arange(len(chunks)), n)
        positions = np.repeat(done - starts, n) + np.arange(int(n.sum()))
        lengths = done + n
        plan = self.paged_plan()
        # the kernels' metadata rides in the same upload
        extra = None if plan is None else paged_meta(n, lengths).astype(np.int32)
        slot_table, _, slot_mapping = self.tables.prepare([r.request_id for r in reqs], seq_of_token, positions,
                                                          extra=extra)
        step = None if plan is None else paged_step(slot_table, self.tables.last_extra, n, self.tables.max_blocks,
                                                    plan, lengths)
        spans = [] if step is not None else [
            SeqSpan(int(starts[i]), int(n[i]), int(lengths[i]), slot_table[i, :-(-int(lengths[i]) // page)].long())
            for i in range(len(chunks))]
        ids = [t for r, d, k in zip(reqs, done.tolist(), n.tolist()) for t in _token_slice(r, d, k)]
        rows = [int(starts[i] + n[i] - 1) for i, c in enumerate(chunks) if c.reaches_end]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            seqs=spans,
            slot_mapping=slot_mapping,
            kv=self.kv,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            step=step,
        )

    def run(self, batch: ForwardBatch, reqs: list, prompt_plan=None, processing: LogitsProcessing | None = None
            ) -> tuple[list[int], tuple | None]:
        """Model forward, then one token per sampled row (batch.logits_rows order, one per request in `reqs`)
        and, when asked, (chosen logprobs, top ids, top logprobs) as lists. prompt_plan: prompt-logprob rows that
        follow the sampled ones in batch.logits_rows (m3serve.engine.prompt_logprobs). processing: see `sample`."""
        with torch.inference_mode():
            logits = None
            if self.prefill_graphs is not None and prompt_plan is None:
                logits = self.prefill_graphs.run(batch)     # None: no bucket holds the step
            if logits is None:
                logits = self.model(batch)
            if prompt_plan is not None:
                prompt_plan.record(logits[len(reqs):])
                logits = logits[:len(reqs)]
        if not reqs:
            return [], None
        return self.sample(logits, reqs, processing)

    def sample(self, logits: torch.Tensor, reqs: list, processing: LogitsProcessing | None = None
               ) -> tuple[list[int], tuple | None]:
        """logits [R, V] -> one token per row. processing (None: no request in the batch asks for it): penalties,
        logit_bias and min_tokens change the scores the token is chosen from, then the grammar masks; the drawn
        tokens are counted in the state rows. Logprobs stay those of the raw logits."""
        scores = logits if processing is None else processing.penalties.apply(logits, processing.rows)
        if processing is not None and processing.masks is not None:
            scores = processing.masks.apply(scores, processing.rows)
        tokens = sample(scores, [r.params for r in reqs], [r.sample_key for r in reqs], [r.num_tokens for r in reqs])
        if processing is not None:
            processing.penalties.record(processing.rows, tokens)
        want = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        lp = top_logprobs(logits, tokens, want) if want is not None else None
        return tokens.tolist(), (tuple(x.tolist() for x in lp) if lp is not None else None)

    # ------------------------------------------------------------------ graph steps
    def launch_graph(self, seq_ids: list[int], token_ids: list[int], positions: list[int], sampling=None,
                     penalty_rows: list[int] | None = None, want_logits: bool = False) -> Launched:
        """One decode graph replay (DecodeGraphs.run); its tokens are read later by `fetch_tokens`, its logits
        (want_logits) by `graph_logits`."""
        return self.graphs.run(seq_ids, token_ids, positions, sampling, penalty_rows, want_logits)

    def fetch_tokens(self, launched: Launched) -> list[int]:
        """A launched graph step's tokens (waits for that step only)."""
        return self.graphs.fetch_tokens(launched)

    def graph_logits(self, launched: Launched) -> torch.Tensor:
        """[n, V] logits of a step launched with want_logits, for rows the engine samples eagerly."""
        return self.graphs.logits(launched)


def _token_slice(req, start: int, count: int) -> list[int]:
    """req.all_token_ids[start:start + count] without concatenating the whole context (O(count))."""
    p = req.prompt_token_ids
    if start + count <= len(p):
        return p[start:start + count]
    if start >= len(p):
        return req.output_token_ids[start - len(p):start - len(p) + count]
    return p[start:] + req.output_token_ids[:start + count - len(p)]


__all__ = ["ModelRunner", "cache_spec", "all_certified"]
