"""The engine: requests in, one batched model step at a time, tokens out.

One `step()`: schedule (continuous batching, chunked prefill, preemption) -> pack the step's tokens into a
ForwardBatch over the paged KV cache -> model forward -> sample the rows that end a sequence's known tokens
-> append tokens, check stop conditions, commit full pages to the prefix cache, free finished requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from m3serve.engine import groups, prompt_logprobs, stopping, token_filters
from m3serve.engine.detokenize import output_text
from m3serve.engine.penalties import PenaltyState
from m3serve.engine.request import Request, RequestGroup, Status
from m3serve.engine.sampler import sample, sampling_key, top_logprobs
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import ScheduledChunk, Scheduler
from m3serve.engine.token_masks import TokenMaskRows
from m3serve.kernels._jit import COMPILE_WATCH
from m3serve.kernels.catalog import all_entries
from m3serve.kv.block_manager import BlockManager
from m3serve.kv.block_table import DeviceBlockTables
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.rotation import DEFAULT_ROTATION_SEED
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.m3 import ForwardBatch, M3ForCausalLM, SeqSpan
from m3serve.runtime.decode_graphs import DecodeGraphs, sampling_row
from m3serve.runtime.step_plan import buckets_up_to, sparse_tiles_per_block, split_plan
from m3serve.targets.attention import PAGED_KERNELS, PagedStep
from m3serve.targets.explain import uncertified_attention

log = logging.getLogger("m3serve")


@dataclass
class EngineConfig:
    max_model_len: int | None = None          # default: what the config and the cache allow
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_dtype: str = "auto"              # auto | bf16 | fp8 | nvfp4 (hybrid: NVFP4 sparse, FP8 dense)
    # Hybrid cache: sparse layers kept in FP8 (KVCacheSpec.fp8_layers). "auto" = what LLM resolves from the model's
    # kv_scales.json; an engine built without LLM has no model directory to read, so "auto" is none there.
    kv_fp8_layers: tuple[int, ...] | str = "auto"
    # Hybrid cache: seed of the randomized Hadamard rotation of the NVFP4 layers' K/V (KVCacheSpec.kv_rotation_seed),
    # None = unrotated. "auto" = LLM's choice from the model's kv_scales.json; without LLM, the default seed.
    kv_rotation: int | None | str = "auto"
    index_k_dtype: str = "auto"
    kv_cache_bytes: int | None = None         # CPU (or explicit) budget
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_queue: int | None = None
    # Admission batching (Scheduler.admission_wait_s): while requests decode, hold new ones back up to this many
    # seconds so that several share one prefill step. 0 = admit at once.
    admission_wait_s: float = 0.0
    seed: int = 0


class LLMEngine:
    def __init__(self, model: M3ForCausalLM, config: EngineConfig, tokenizer=None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        cfg = model.cfg
        dev = model.device
        spec = self._kv_spec(model, config)
        if config.kv_cache_bytes is not None or dev.type != "cuda":
            budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else 256 << 20
            self.kv = PagedKVCache.from_budget(spec, device=dev, budget_bytes=budget)
        else:
            self.kv = PagedKVCache.from_budget(spec, device=dev, gpu_memory_utilization=config.gpu_memory_utilization)
        page = self.kv.page_size
        capacity = self.kv.num_slots * page
        self.sparse_tiles = sparse_tiles_per_block(spec)   # split_plan's key tiles per MSA block (fixed per cache)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_blocks_per_seq = -(-self.max_model_len // page)
        self._make_tables(self.max_blocks_per_seq)
        self.capacity_tokens = capacity
        self.target_attention = False   # attention through the paged-cache kernels (enable_target)
        self._graphs_version = 0         # bumped whenever `graphs` is replaced (keys per-request caches)
        self.graphs = None               # m3serve.runtime.decode_graphs.DecodeGraphs (enable_target)
        self.overlap = True              # with graphs: launch step n+1 before reading step n's tokens
        self._inflight = None            # (launched graph step, its requests) not yet read back
        self._ids = itertools.count()
        self.requests: dict[int, Request] = {}
        self.eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        # Penalties / logit_bias / min_tokens state: one device row per running request that uses them.
        self.penalties = PenaltyState(config.max_num_seqs, cfg.vocab_size, dev, self.eos)
        # Structured output: allowed-token masks per penalty-state row (device), their grammars (host, made on
        # the first constrained request: m3serve.engine.structured).
        self.token_masks = TokenMaskRows(config.max_num_seqs, cfg.vocab_size, dev)
        self.grammars = None
        self._grammars_lock = threading.Lock()
        self._deferred: dict[int, RequestGroup] = {}          # leader id -> its candidates, queued after its prefill
        self._prompt_lp_pending: dict[int, Request] = {}      # requests still missing prompt logprobs
        log.info("KV cache: %s", self.kv.describe())

    @property
    def graphs(self):
        return self._graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self._graphs = graphs
        self._graphs_version += 1

    def _kv_spec(self, model: M3ForCausalLM, config: EngineConfig, **extra) -> KVCacheSpec:
        """The cache roles this engine needs (the speculative engine adds the shared draft layer)."""
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
        return KVCacheSpec.from_model_config(model.cfg, tp_size=model.tp.size, kv_cache_dtype=config.kv_cache_dtype,
                                             index_k_dtype=config.index_k_dtype, model_dtype=model.dtype,
                                             fp8_layers=fp8_layers, kv_rotation_seed=seed, **extra)

    def enable_target(self, graphs: bool = True, buckets: tuple[int, ...] | None = None, mode: str = "auto") -> bool:
        """The decode target: attention through the paged-cache kernels for every step, and pure decode steps
        replayed as CUDA graphs (one per batch bucket). Needs a bf16 model on CUDA at TP 1 and every attention
        layer's decode kernels in certified cells; otherwise `auto` keeps the stock path (returns False, logs
        why) and `require` raises naming each uncertified placement."""
        if self.model.device.type != "cuda" or self.model.dtype != torch.bfloat16 or self.model.tp.size != 1:
            raise ValueError(f"decode target: needs a bf16 model on CUDA at TP 1, found {self.model.dtype} on "
                             f"{self.model.device} at TP {self.model.tp.size}")
        if self.requests:
            raise RuntimeError("enable_target: call it before the first request (it may re-size the block tables)")
        buckets = buckets or buckets_up_to(self.config.max_num_seqs)
        width = self._certified_table_width()
        if width != self.tables.max_blocks:
            self._make_tables(width)
        missing = uncertified_attention(self.model, self.kv, self.tables.max_blocks, buckets)
        if not self._all_certified(missing, "attention", "decode target", mode):
            return False
        self.target_attention = True
        self.model.use_attention(PAGED_KERNELS)
        if graphs:
            own = self._own_sampling_step()
            self.graphs = DecodeGraphs(self.model, self.kv, self.tables, buckets,
                                       penalties=self.penalties if own else None,
                                       token_masks=self.token_masks if own else None)
            self.graphs.capture(mode)
        return True

    @staticmethod
    def _all_certified(missing: list, what: str, target: str, mode: str) -> bool:
        """True when no placement is missing; else `require` raises naming them and `auto` logs them."""
        if not missing:
            return True
        why = "; ".join(p.line() for p in missing[:8]) + (f"; ... {len(missing) - 8} more" if len(missing) > 8 else "")
        if mode == "require":
            raise ValueError(f"route='require': {what} outside the certified cells: {why}")
        log.warning("%s off (%s outside the certified cells): %s", target, what, why)
        return False

    def _certified_table_width(self) -> int:
        """msa.select compiles per block-table width (padded to a power of two) and is certified at the model's
        full context; use the smallest certified width that holds max_model_len (or keep ours)."""
        cfg, need = self.model.cfg, self.tables.max_blocks
        if not any(t == "sparse" for t in cfg.layer_types):
            return need
        hk, p = self.kv.spec.num_kv_heads, self.kv.page_size
        widths = sorted(c.shape[3] for c in all_entries()["msa.select"].cells
                        if c.shape[:3] == (hk, p, cfg.index_topk_blocks) and c.shape[3] >= need)
        return widths[0] if widths else need

    def _make_tables(self, width: int) -> None:
        """Allocator, scheduler and device block tables `width` pages wide. The tables hold slot ids (index_scale
        1); kernels that need sub-page tables build their own views with the cache's geometry."""
        cfg = self.config
        self.blocks = BlockManager(self.kv.num_slots, self.kv.page_size, max_seqs=cfg.max_num_seqs,
                                   max_blocks_per_seq=width, enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens, max_queue=cfg.max_queue,
                                   admission_wait_s=cfg.admission_wait_s)
        self.tables = DeviceBlockTables(self.blocks, self.model.device, index_scale=1, kv_offset=1,
                                        max_tokens=cfg.max_num_batched_tokens)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Request:
        """Validate and queue a request; returns it. With n / best_of > 1 it is the leader of a RequestGroup
        (req.group.members: one request per candidate, see m3serve.engine.groups). Raises ValueError naming the
        problem (OverflowError when the queue is full); nothing else is disturbed."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params: expected SamplingParams, found {type(params).__name__}")
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt: empty (at least one token is needed)")
        prompt_token_ids = self._truncated(prompt_token_ids, params)
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {len(bad)} ids outside [0, {vocab}), first {bad[0]!r}")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the context limit (max_model_len) is {self.max_model_len} "
                             "and at least one token must be generated")
        if n + 1 > self.capacity_tokens:
            raise ValueError(f"prompt has {n} tokens; the KV cache holds {self.capacity_tokens} tokens in all")
        self._check_sampling_support(params)
        grammars = self._grammars() if params.structured_outputs is not None else None
        if grammars is not None:
            grammars.compiler.compile(params.structured_outputs)     # a bad schema raises before anything is queued
        candidates = groups.candidate_params(params)
        limit = self.scheduler.max_queue
        if limit is not None and len(candidates) > 1 and len(self.scheduler.waiting) + len(candidates) > limit:
            raise OverflowError(f"the waiting queue is full ({limit} requests; this one has {len(candidates)} "
                                "candidates)")
        bad_words = token_filters.bad_word_sequences(params.bad_words, self.tokenizer)
        reqs = [Request(next(self._ids), list(prompt_token_ids), p, prompt=prompt) for p in candidates]
        for req in reqs:
            req.bad_word_ids = bad_words
            req.sample_key = sampling_key(req.params, self.config.seed * 1_000_003 + req.request_id)
            prompt_logprobs.start(req)
            if grammars is not None:
                grammars.start(req.request_id, req.params.structured_outputs)
        leader = reqs[0]
        self.scheduler.add(leader)
        if len(reqs) > 1:
            group = RequestGroup(params, reqs)
            for req in reqs:
                req.group = group
            if self.blocks.enable_prefix_caching:
                self._deferred[leader.request_id] = group
            else:                                   # nothing to share: all candidates prefill at once
                self.scheduler.waiting.extend(reqs[1:])
        for req in reqs:
            self.requests[req.request_id] = req
        if leader.prompt_logprobs is not None:
            self._prompt_lp_pending[leader.request_id] = leader
        return leader

    def _truncated(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """truncate_prompt_tokens: the prompt's last k tokens (-1: as many as leave room for one new token)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        if k == -1:
            k = self.max_model_len - 1
        return list(prompt_token_ids[-k:])

    def _check_sampling_support(self, params: SamplingParams) -> None:
        """What depends on the model or on this engine's sampling step (ValueError naming the field)."""
        vocab = self.model.cfg.vocab_size
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias: token id {bad[0]} outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids: token id {bad[0]} outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.allowed_token_ids or []) if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.allowed_token_ids: token id {bad[0]} outside the vocabulary "
                             f"[0, {vocab})")
        if self._own_sampling_step():
            return
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_tokens", 0), ("logit_bias", None), ("prompt_logprobs", None), ("min_p", 0.0),
                              ("allowed_token_ids", None), ("bad_words", None), ("structured_outputs", None)):
            value = getattr(params, name)
            if value != neutral and not (name in ("logit_bias", "bad_words") and not value):
                raise ValueError(f"SamplingParams.{name} = {value!r}: not available with {type(self).__name__} "
                                 "(penalties, logit_bias, min_tokens, min_p, allowed_token_ids, bad_words, "
                                 "prompt_logprobs and structured_outputs are applied by LLMEngine's own sampling "
                                 "step)")

    def _own_sampling_step(self) -> bool:
        """This engine samples through LLMEngine's own step, which applies penalties, logit_bias, bans, grammars
        (a subclass that replaces it refuses them, and its decode graphs need no processed variant)."""
        return all(getattr(type(self), m) is getattr(LLMEngine, m) for m in ("step", "_forward_sample", "_sample_rows"))

    def _grammars(self):
        """The structured-output grammars, made on first use (xgrammar takes seconds to import and to index the
        vocabulary; a server that never sees a constrained request never pays for it)."""
        with self._grammars_lock:
            if self.grammars is None:
                from m3serve.engine import structured     # heavy optional dependency: loaded on first use
                compiler = structured.GrammarCompiler(self.tokenizer, self.model.cfg.vocab_size, self.eos)
                self.grammars = structured.Grammars(compiler, self.token_masks)
        return self.grammars

    def compile_grammar(self, constraint) -> None:
        """Compile a StructuredOutputsParams into the engine's grammar cache; safe from any thread (the server
        calls it while parsing a request, so add_request finds it compiled and the engine thread never waits
        for a compile). Raises ValueError naming the constraint's field when it does not compile."""
        self._grammars().compiler.compile(constraint)

    def _constrained(self, req: Request) -> bool:
        return self.grammars is not None and self.grammars.has(req.request_id)

    def _release_grammar(self, req: Request) -> None:
        if self.grammars is not None:
            self.grammars.release(req.request_id)

    def abort(self, request_id: int) -> None:
        """Abort a request; a group leader's id aborts all its candidates."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._deferred.pop(request_id, None)
        members = req.group.members if req.group is not None and req is req.group.leader else [req]
        for m in members:
            self.requests.pop(m.request_id, None)
            if not m.is_finished:
                self.scheduler.finish(m, "abort")
            self.penalties.release(m)
            self._release_grammar(m)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def fault(self) -> str | None:
        """Why this engine can run no more steps (None while it can). A tensor-parallel driver reports its
        group's (a worker that exited, a failed step); a single-process engine never becomes unusable."""
        return None

    def drain(self) -> list[Request]:
        """Read back the graph step in flight, if any (its tokens are accepted as a step would; a request that
        finished meanwhile has its token discarded). Afterwards no launched step is outstanding: the graphs may
        be dropped and every page of a finished request is back in the pool."""
        return self._resolve_inflight()

    def disable_graphs(self) -> None:
        """Continue on the eager target (or stock path): drain the step in flight, then drop the graphs."""
        self.drain()
        self.graphs = None

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Run one model step; returns the requests that got a new token or finished in it."""
        if self._deferred:
            self._release_orphaned_candidates()
        if self._prompt_lp_pending:
            with prompt_logprobs.full_prefill_admission(self._prompt_lp_pending, self.blocks):
                chunks = self.scheduler.schedule()
        else:
            chunks = self.scheduler.schedule()
        if not chunks:
            return self._resolve_inflight() + self._unschedulable()
        return self._step_chunks(chunks)

    def _step_chunks(self, chunks: list[ScheduledChunk]) -> list[Request]:
        """Run the scheduled chunks as one plain step: a decode graph (overlapped when every row allows it) or an
        eager step. SpeculativeEngine runs its plain steps here too (speculative_config.disable_by_batch_size)."""
        graph_step = self.graphs is not None and all(c.num_tokens == 1 and c.reaches_end for c in chunks) \
            and self.graphs.bucket_for(len(chunks)) is not None
        if graph_step and self.overlap and all(self._overlappable(c.request) for c in chunks):
            return self._launch_overlapped([c.request for c in chunks])
        done = []
        if self._inflight is not None:
            # This step needs every token id on the host: read the step in flight first. A request it finished
            # (EOS, max_tokens) drops out of this step; its pages were freed in stream order, after its last write.
            done = self._resolve_inflight()
            chunks = [c for c in chunks if not c.request.is_finished]
            if not chunks:
                return done
        sampled = [c for c in chunks if c.reaches_end]
        reqs = [c.request for c in sampled]
        if graph_step:
            tokens, lp = self._graph_decode(reqs)
        else:
            batch = self._build_batch(chunks)
            plan = None
            if self._prompt_lp_pending:
                starts = np.cumsum([0] + [c.num_tokens for c in chunks[:-1]]).tolist()
                plan = prompt_logprobs.plan(chunks, starts, batch.input_ids.device)
            if plan is None:
                tokens, lp = self._forward_sample(batch, reqs)
            else:                  # the prompt rows' logits come from the same head call, after the sampled rows
                batch.logits_rows = torch.cat((batch.logits_rows, plan.rows))
                tokens, lp = self._forward_sample(batch, reqs, plan)
        for c in chunks:
            c.request.num_computed += c.num_tokens
        if not sampled:
            return done
        self._accept(reqs, tokens, lp)
        return done + reqs

    # ------------------------------------------------------------------ the overlap loop
    def _overlappable(self, req: Request) -> bool:
        """Its next token can stay on the device until the step after next: chosen inside the graph (argmax, or
        the graphs' sampling variant), no logprobs or logits processing that need the host between steps.
        Fixed for a request's life under one set of graphs (its params, bans and grammar are), so it is worked
        out once per request and graphs object, not per row per step."""
        cached = req.overlap_for
        if cached is not None and cached[0] == self._graphs_version:
            return cached[1]
        ok = self._graph_decides(req) and not self._constrained(req)
        req.overlap_for = (self._graphs_version, ok)
        return ok

    def _graph_decides(self, req: Request) -> bool:
        """A decode graph variant can choose its next token: no logprobs, sampling / penalties / grammar masks
        inside the graph. A constrained request is not overlappable (its next mask needs this token on the
        host) but still takes the processed graph."""
        g = self.graphs
        return (req.params.logprobs is None and (req.params.greedy or g.sampling)
                and (not req.logits_processing or g.penalties is not None) and not req.has_dynamic_bans)

    def _graph_choice(self, reqs: list[Request]) -> tuple[list | None, list[int] | None]:
        """(sampling, penalty_rows) for DecodeGraphs.run: the rows' sampling parameters (None when every row is
        greedy and none is processed) and their penalty-state rows (None when none is processed)."""
        rows = self.penalties.row_ids_for(reqs)
        if rows is None and all(r.params.greedy for r in reqs):
            return None, None
        if rows is not None:
            self.penalties.refresh()
        return [r.graph_sampling or self._graph_sampling_row(r) for r in reqs], rows

    @staticmethod
    def _graph_sampling_row(req: Request) -> tuple:
        p = req.params
        req.graph_sampling = sampling_row(p.temperature, p.top_k, p.top_p, req.sample_key)
        return req.graph_sampling

    def _launch_overlapped(self, reqs: list[Request]) -> list[Request]:
        """Step n+1 is queued before step n's tokens are read: a request whose last token is still pending takes
        it from the device (-1 in the staged ids). Then step n is read back and accepted, while the GPU runs n+1.
        Returns the requests of step n that got their token (as a synchronous step would have)."""
        last = [-1 if r.pending else _last_token(r) for r in reqs]
        launched = self.graphs.run([r.request_id for r in reqs], last, [r.num_computed for r in reqs],
                                   *self._graph_choice(reqs))
        for r in reqs:
            r.num_computed += 1
            r.pending += 1
        prev, self._inflight = self._inflight, (launched, reqs)
        return self._resolve(prev)

    def _resolve_inflight(self) -> list[Request]:
        prev, self._inflight = self._inflight, None
        return self._resolve(prev)

    def _resolve(self, inflight) -> list[Request]:
        if inflight is None:
            return []
        launched, reqs = inflight
        tokens = self.graphs.fetch_tokens(launched)
        live, toks = [], []
        for r, t in zip(reqs, tokens):
            r.pending -= 1
            if r.is_finished:          # stopped (or aborted) after this step was queued: its token is discarded
                r.pending = 0
                continue
            live.append(r)
            toks.append(t)
        self._accept(live, toks, None)
        return live

    def _accept(self, reqs: list[Request], tokens: list[int], lp) -> None:
        """Append each request's new token (and logprobs), check its stop conditions, cache its full pages."""
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.output_token_ids.append(tok)
            if self.grammars is not None and not self.grammars.advance(req.request_id, tok):
                log.error("request %d: token %d is outside its structured-output grammar (every token the grammar "
                          "allowed was forbidden by its other logits processing); aborted", req.request_id, tok)
                self._finish(req, "abort", None)
                continue
            if req.params.logprobs is not None:
                top = {tid: lv for tid, lv in zip(lp[1][i][:req.params.logprobs], lp[2][i][:req.params.logprobs])}
                top[tok] = lp[0][i]
                req.output_logprobs.append(top)
            self._check_stop(req, tok)
            # (a request preempted while its step was in flight is not allocated; the token list is built only on
            # the steps where a page became full: O(context) per request per step otherwise)
            if not req.is_finished and req.allocated and \
                    self.blocks.has_uncommitted_full_pages(req.request_id, req.num_computed):
                self.blocks.commit_full_pages(req.request_id, req.all_token_ids[:req.num_computed])

    def _forward_sample(self, batch: ForwardBatch, reqs: list[Request],
                        prompt_plan: prompt_logprobs.PromptLogprobPlan | None = None) -> tuple[list[int], tuple | None]:
        """Model forward, then one token per sampled row (batch.logits_rows order, one per request in `reqs`)
        and, when asked, (chosen logprobs, top ids, top logprobs) as lists. prompt_plan: prompt-logprob rows that
        follow the sampled ones in batch.logits_rows. The tensor-parallel driver (m3serve.distributed.driver)
        overrides this to broadcast the step and sample vocab-parallel (without prompt plans or penalties)."""
        with torch.inference_mode():
            logits = self.model(batch)
            if prompt_plan is not None:
                prompt_plan.record(logits[len(reqs):])
                logits = logits[:len(reqs)]
        if not reqs:
            return [], None
        return self._sample_rows(logits, reqs)

    def _graph_decode(self, reqs: list[Request]) -> tuple[list[int], tuple | None]:
        """A pure decode step as one graph replay; rows that the graph itself can decide (no logprobs, no logits
        processing) read back only token ids, otherwise the step's logits are sampled as an eager step would."""
        own = all(self._graph_decides(r) for r in reqs)     # the graph's argmax / sampling variant is the answer
        sampling, rows = self._graph_choice(reqs) if own else (None, None)
        if rows is not None and self.grammars is not None:
            self.grammars.fill([r.request_id for r in reqs], rows, in_graph=True)
        launched = self.graphs.run([r.request_id for r in reqs], [_last_token(r) for r in reqs],
                                   [r.num_computed for r in reqs], sampling, rows)
        if own:
            return self.graphs.fetch_tokens(launched), None
        return self._sample_rows(self.graphs.logits(launched), reqs)

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], tuple | None]:
        """logits [R, V] -> one token per row; penalties, logit_bias and min_tokens change the scores the token
        is chosen from (on the device, only when a request in the batch asks for them), logprobs stay raw."""
        rows = self.penalties.rows_for(reqs)
        if rows is not None:
            self.penalties.refresh()
        scores = logits if rows is None else self.penalties.apply(logits, rows)
        if rows is not None and self.grammars is not None and self.grammars.fill(
                [r.request_id for r in reqs], self.penalties.row_ids_for(reqs), in_graph=False):
            scores = self.token_masks.apply(scores, rows)
        tokens = sample(scores, [r.params for r in reqs], [r.sample_key for r in reqs], [r.num_tokens for r in reqs])
        if rows is not None:
            self.penalties.record(rows, tokens)
        want = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        lp = top_logprobs(logits, tokens, want) if want is not None else None
        return tokens.tolist(), (tuple(x.tolist() for x in lp) if lp is not None else None)

    def _build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
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
        extra = None
        if self.target_attention:  # the kernels' metadata rides in the same upload: [query_start | seq_lens]
            extra = np.concatenate(([0], np.cumsum(n), lengths)).astype(np.int32)
        slot_table, _, slot_mapping = self.tables.prepare([r.request_id for r in reqs], seq_of_token, positions,
                                                          extra=extra)
        step = None
        if self.target_attention:
            s = len(chunks)
            meta = self.tables.last_extra
            dense, sparse = split_plan(int(n.sum()), self.tables.max_blocks, self.kv.spec.num_kv_heads,
                                       self.model.cfg.index_topk_blocks, self.sparse_tiles)
            step = PagedStep(slot_table=slot_table, seq_lens=meta[s + 1:], query_start=meta[:s + 1],
                             max_query_len=int(n.max()), num_splits=dense, num_splits_sparse=sparse)
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

    def _check_stop(self, req: Request, tok: int) -> None:
        """After each appended token (both engines): queue a group's other candidates once the leader's prompt
        is in the cache, then finish the request if `tok` ends it (m3serve.engine.stopping)."""
        group = self._deferred.pop(req.request_id, None)
        if group is not None:
            self._release_candidates(group)
        hit = stopping.stop_hit(req, tok, self.eos, self.tokenizer, self.max_model_len)
        if hit is None and self.grammars is not None and self.grammars.complete(req.request_id):
            hit = ("stop", tok)                  # the grammar ended on a stop token (ignore_eos kept going)
        if hit is not None:
            self._finish(req, *hit)

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self.penalties.release(req)
        self._release_grammar(req)

    def _release_candidates(self, group: RequestGroup) -> None:
        """Queue the candidates after the leader, first in line: its full prompt pages are committed to the
        prefix cache now, so each of them computes only the prompt's last partial page."""
        leader = group.leader
        if leader.allocated:
            self.blocks.commit_full_pages(leader.request_id, leader.all_token_ids[:leader.num_computed])
        self.scheduler.waiting.extendleft(reversed([m for m in group.members[1:] if not m.is_finished]))

    def _release_orphaned_candidates(self) -> None:
        """A leader that ended without a token (e.g. unschedulable) must not strand its candidates."""
        for lid in [lid for lid, g in self._deferred.items() if g.leader.is_finished]:
            self._release_candidates(self._deferred.pop(lid))

    def _unschedulable(self) -> list[Request]:
        """Nothing could be scheduled: the head request does not fit even in an otherwise empty cache."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        req = self.scheduler.waiting[0]
        self.scheduler.finish(req, "length")  # its context outgrew the whole KV cache
        return [req]

    def detokenize(self, req: Request) -> str:
        return output_text(self.tokenizer, req)

    def release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._release_grammar(req)

    def stats(self) -> dict:
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_pages_free": self.blocks.num_free_slots(), "kv_pages_total": self.kv.num_slots,
                "preemptions": self.scheduler.num_preemptions,
                "kernel_compiles_after_warmup": COMPILE_WATCH.count,
                "structured_masked_steps": self.grammars.masked_steps if self.grammars is not None else 0,
                "structured_graph_masked_steps": self.grammars.graph_masked_steps if self.grammars is not None else 0}


def _last_token(req: Request) -> int:
    return req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]


def _token_slice(req: Request, start: int, count: int) -> list[int]:
    """req.all_token_ids[start:start + count] without concatenating the whole context (O(count))."""
    p = req.prompt_token_ids
    if start + count <= len(p):
        return p[start:start + count]
    if start >= len(p):
        return req.output_token_ids[start - len(p):start - len(p) + count]
    return p[start:] + req.output_token_ids[:start + count - len(p)]


__all__ = ["LLMEngine", "EngineConfig", "Status"]
