"""The engine: requests in, one batched model step at a time, tokens out. Host-side only.

One `step()` (nano-vllm's schedule -> model_runner.run -> postprocess): schedule (continuous batching, chunked
prefill, preemption) -> the runner (m3serve.runtime.model_runner) packs the step's tokens into a ForwardBatch over
the paged KV cache, runs the model and samples the rows that end a sequence's known tokens -> append tokens, check
stop conditions, commit full pages to the prefix cache, free finished requests.
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
from m3serve.engine.sampler import sampling_key
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import ScheduledChunk, Scheduler
from m3serve.engine.token_masks import TokenMaskRows
from m3serve.kernels._jit import COMPILE_WATCH
from m3serve.kv.block_manager import BlockManager
from m3serve.kv.cache import PagedKVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.decode_graphs import sampling_row
from m3serve.runtime.model_runner import ModelRunner
from m3serve.runtime.step_inputs import LogitsProcessing, buckets_up_to

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
    # Eager steps (prefill chunks, alone or beside decoding rows) of up to this many tokens replayed as CUDA graphs
    # on the decode target (m3serve/runtime/prefill_graphs.py); 0 = off. 1024 by default: on the H200 it cut the
    # served TTFT at one user from 10.6 to 3.7 ms (embedded model) and from 16.3 to 12.8 ms (minimax-m3:5 NVFP4)
    # (bench/results/serve/serve-pareto-*prefill-graphs-h200.json); eager steps and CPU runs ignore it.
    prefill_graph_tokens: int = 1024
    # No CUDA graphs will be captured (LLM's enforce_eager, or route "off"): the memory plan reserves none
    # (runtime/memory_plan.py), so the KV cache gets that memory.
    enforce_eager: bool = False
    seed: int = 0


class LLMEngine:
    """The host side of serving: requests, the scheduler, the block manager, stop checks, page commits and the
    overlap loop's bookkeeping. Every device operation goes through `self.runner` (m3serve.runtime.model_runner:
    the model, the KV cache, the device block tables, the decode graphs, the sampling step); a tensor-parallel
    group plugs in its broadcasting runner (m3serve.distributed.driver.TPDriverRunner). With `speculation` (an
    m3serve.engine.speculative.SpecDecoding, whose runner holds the draft layer: speculative_engine builds both)
    each step is the speculative one."""

    def __init__(self, model: M3ForCausalLM, config: EngineConfig, tokenizer=None, runner: ModelRunner | None = None,
                 speculation=None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        cfg = model.cfg
        dev = model.device
        # the runner first: a GPU cache takes what is left of the memory budget, as before any engine state
        self.runner = runner if runner is not None else ModelRunner(model, config)
        page = self.runner.kv.page_size
        self.eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        # Penalties / logit_bias / min_tokens state: one device row per running request that uses them (rows are
        # assigned here, per request; the runner applies a step's rows: _logits_processing).
        self.penalties = PenaltyState(config.max_num_seqs, cfg.vocab_size, dev, self.eos)
        # Structured output: allowed-token masks per penalty-state row (device), their grammars (host, made on
        # the first constrained request: m3serve.engine.structured).
        self.token_masks = TokenMaskRows(config.max_num_seqs, cfg.vocab_size, dev)
        self.max_model_len = cfg.context_limit(config.max_model_len)
        self.max_blocks_per_seq = -(-self.max_model_len // page)
        self._make_tables(self.max_blocks_per_seq)
        self.capacity_tokens = self.runner.kv.num_slots * page
        self.overlap = True              # with graphs: launch step n+1 before reading step n's tokens
        self._inflight = None            # a launched graph step not read back: (launched, its requests), or speculation's
        self._ids = itertools.count()
        self.requests: dict[int, Request] = {}
        self.grammars = None
        self._grammars_lock = threading.Lock()
        self._deferred: dict[int, RequestGroup] = {}          # leader id -> its candidates, queued after its prefill
        self._prompt_lp_pending: dict[int, Request] = {}      # requests still missing prompt logprobs
        # the speculative step's component (it reaches back into this engine's host state), None = plain steps
        self.speculation = speculation.attach(self) if speculation is not None else None

    @property
    def kv(self) -> PagedKVCache:
        """The runner's KV cache (read by calibration, memory reports and tests)."""
        return self.runner.kv

    def enable_target(self, graphs: bool = True, buckets: tuple[int, ...] | None = None, mode: str = "auto") -> bool:
        """The decode target: attention through the paged-cache kernels for every step, and pure decode steps
        replayed as CUDA graphs (one per batch bucket). Needs a bf16 model on CUDA at TP 1 and every attention
        layer's decode kernels in certified cells; otherwise `auto` keeps the stock path (returns False, logs
        why) and `require` raises naming each uncertified placement. With speculation: SpecDecoding.enable_target."""
        if self.speculation is not None:
            return self.speculation.enable_target(graphs, buckets, mode)
        self.runner.check_target()
        if self.requests:
            raise RuntimeError("enable_target: call it before the first request (it may re-size the block tables)")
        self._fit_certified_width()
        own = self.runner.processes_logits   # the graphs' processed variant applies the engine's state rows
        return self.runner.enable_target(graphs, buckets or buckets_up_to(self.config.max_num_seqs), mode,
                                         self.penalties if own else None, self.token_masks if own else None)

    def _fit_certified_width(self) -> None:
        """Re-size the allocator and tables to the smallest certified msa.select width that holds them."""
        width = self.runner.certified_table_width()
        if width != self.runner.tables.max_blocks:
            self._make_tables(width)

    def _make_tables(self, width: int) -> None:
        """Allocator and scheduler `width` pages wide, and the runner's device block tables over them."""
        cfg = self.config
        self.blocks = BlockManager(self.runner.kv.num_slots, self.runner.kv.page_size, max_seqs=cfg.max_num_seqs,
                                   max_blocks_per_seq=width, enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens, max_queue=cfg.max_queue,
                                   admission_wait_s=cfg.admission_wait_s)
        self.runner.bind_tables(self.blocks)

    # ------------------------------------------------------------------ requests
    def restart_request_ids(self) -> None:
        """Number requests from 0 again; only between requests (the warm-up calls it when its own are done). A request
        without a seed draws from a key made of the engine's seed and its id, so the same requests then draw the same
        tokens however many warm-up requests ran before them (graphs on or off, prefill graphs or not)."""
        if self.has_work():
            raise RuntimeError("restart_request_ids: the engine has requests; ids must stay unique among them")
        self._ids = itertools.count()

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
        if self.runner.processes_logits and self.speculation is None:
            return
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_tokens", 0), ("logit_bias", None), ("prompt_logprobs", None), ("min_p", 0.0),
                              ("allowed_token_ids", None), ("bad_words", None), ("structured_outputs", None)):
            value = getattr(params, name)
            if value != neutral and not (name in ("logit_bias", "bad_words") and not value):
                step = "speculative decoding" if self.speculation is not None else type(self.runner).__name__
                raise ValueError(f"SamplingParams.{name} = {value!r}: not available with {step} "
                                 "(penalties, logit_bias, min_tokens, min_p, allowed_token_ids, bad_words, "
                                 "prompt_logprobs and structured_outputs are applied by ModelRunner's own sampling "
                                 "step)")

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
            if self.speculation is not None:
                self.speculation.forget(m.request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def fault(self) -> str | None:
        """Why this engine can run no more steps (None while it can): its runner's (a tensor-parallel group's
        runner reports a worker that exited or a failed step; a single-process runner never becomes unusable)."""
        return self.runner.fault()

    def drain(self) -> list[Request]:
        """Read back the graph step in flight, if any (its tokens are accepted as a step would; a request that
        finished meanwhile has its token discarded). Afterwards no launched step is outstanding: the graphs may
        be dropped and every page of a finished request is back in the pool."""
        return self._resolve_inflight()

    def disable_graphs(self) -> None:
        """Continue on the eager target (or stock path): drain the step in flight, then drop the graphs."""
        self.drain()
        self.runner.graphs = None

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
        if self.speculation is not None:
            return self.speculation.step(chunks)
        return self._step_chunks(chunks)

    def _step_chunks(self, chunks: list[ScheduledChunk]) -> list[Request]:
        """Run the scheduled chunks as one plain step: a decode graph (overlapped when every row allows it) or an
        eager step. SpecDecoding runs its plain steps here too (speculative_config.disable_by_batch_size)."""
        graphs = self.runner.graphs
        graph_step = graphs is not None and all(c.num_tokens == 1 and c.reaches_end for c in chunks) \
            and graphs.bucket_for(len(chunks)) is not None
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
            batch = self.runner.build_batch(chunks)
            plan = None
            if self._prompt_lp_pending:
                starts = np.cumsum([0] + [c.num_tokens for c in chunks[:-1]]).tolist()
                plan = prompt_logprobs.plan(chunks, starts, batch.input_ids.device)
            if plan is not None:   # the prompt rows' logits come from the same head call, after the sampled rows
                batch.logits_rows = torch.cat((batch.logits_rows, plan.rows))
            tokens, lp = self.runner.run(batch, reqs, plan, self._logits_processing(reqs))
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
        if cached is not None and cached[0] == self.runner.graphs_version:
            return cached[1]
        ok = self._graph_decides(req) and not self._constrained(req)
        req.overlap_for = (self.runner.graphs_version, ok)
        return ok

    def _graph_decides(self, req: Request) -> bool:
        """A decode graph variant can choose its next token: no logprobs, sampling / penalties / grammar masks
        inside the graph. A constrained request is not overlappable (its next mask needs this token on the
        host) but still takes the processed graph."""
        g = self.runner.graphs
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
        launched = self.runner.launch_graph([r.request_id for r in reqs], last, [r.num_computed for r in reqs],
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
        if self.speculation is not None and self.speculation.owns(inflight):
            return self.speculation.resolve(inflight)
        launched, reqs = inflight
        tokens = self.runner.fetch_tokens(launched)
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

    def _graph_decode(self, reqs: list[Request]) -> tuple[list[int], tuple | None]:
        """A pure decode step as one graph replay; rows that the graph itself can decide (no logprobs, no logits
        processing) read back only token ids, otherwise the step's logits are sampled as an eager step would."""
        own = all(self._graph_decides(r) for r in reqs)     # the graph's argmax / sampling variant is the answer
        sampling, rows = self._graph_choice(reqs) if own else (None, None)
        if rows is not None and self.grammars is not None:
            self.grammars.fill([r.request_id for r in reqs], rows, in_graph=True)
        launched = self.runner.launch_graph([r.request_id for r in reqs], [_last_token(r) for r in reqs],
                                            [r.num_computed for r in reqs], sampling, rows, want_logits=not own)
        if own:
            return self.runner.fetch_tokens(launched), None
        return self.runner.sample(self.runner.graph_logits(launched), reqs, self._logits_processing(reqs))

    def _logits_processing(self, reqs: list[Request]) -> LogitsProcessing | None:
        """The host side of an eager sampling step's logits processing, for runner.run / runner.sample: the rows'
        penalty-state rows (their host-written parts refreshed) and, when grammar masks were written for them,
        the masks. None when no request in the batch uses penalties, logit_bias, min_tokens, bans or a grammar."""
        rows = self.penalties.rows_for(reqs)
        if rows is None:
            return None
        self.penalties.refresh()
        masked = self.grammars is not None and self.grammars.fill(
            [r.request_id for r in reqs], self.penalties.row_ids_for(reqs), in_graph=False)
        return LogitsProcessing(self.penalties, rows, self.token_masks if masked else None)

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
        if self.speculation is not None:
            self.speculation.forget(req.request_id)

    def stats(self) -> dict:
        out = {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_pages_free": self.blocks.num_free_slots(), "kv_pages_total": self.runner.kv.num_slots,
                "preemptions": self.scheduler.num_preemptions,
                "kernel_compiles_after_warmup": COMPILE_WATCH.count,
                "prefill_graph_replays": getattr(getattr(self.runner, "prefill_graphs", None), "replays", 0),
                "structured_masked_steps": self.grammars.masked_steps if self.grammars is not None else 0,
                "structured_graph_masked_steps": self.grammars.graph_masked_steps if self.grammars is not None else 0}
        # device memory each set's capture reserved (its private pool and static outputs), measured around it
        out["graph_memory_bytes"] = {name: g.memory_bytes for name, g in self.graph_sets().items()}
        if self.speculation is not None:
            out["spec_decode"] = self.speculation.stats()
        return out

    def graph_sets(self) -> dict:
        """The sets of CUDA graph programs this engine holds, by name (decode, prefill, speculative): each with its
        `captured` buckets and the `memory_bytes` its capture reserved; empty without graphs."""
        sets = {"decode": getattr(self.runner, "graphs", None), "prefill": getattr(self.runner, "prefill_graphs", None),
                "speculative": getattr(self.speculation, "spec_steps", None)}
        return {name: g for name, g in sets.items() if g is not None and hasattr(g, "memory_bytes")}


def _last_token(req: Request) -> int:
    return req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]


__all__ = ["LLMEngine", "EngineConfig", "Status"]
