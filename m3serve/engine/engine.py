"""The engine: requests in, one batched model step at a time, tokens out.

One `step()`: schedule (continuous batching, chunked prefill, preemption) -> pack the step's tokens into a
ForwardBatch over the paged KV cache -> model forward -> sample the rows that end a sequence's known tokens
-> append tokens, check stop conditions, commit full pages to the prefix cache, free finished requests.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from m3serve.engine.request import Request, Status
from m3serve.engine.sampler import sample, top_logprobs
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import ScheduledChunk, Scheduler
from m3serve.kv.block_manager import BlockManager
from m3serve.kv.block_table import DeviceBlockTables
from m3serve.kv.cache import PagedKVCache
from m3serve.kv.spec import KVCacheSpec
from m3serve.model.m3 import ForwardBatch, M3ForCausalLM, SeqSpan

log = logging.getLogger("m3serve")


@dataclass
class EngineConfig:
    max_model_len: int | None = None          # default: what the config and the cache allow
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_dtype: str = "auto"              # auto | bf16 | fp8 | nvfp4 (hybrid: NVFP4 sparse, FP8 dense)
    index_k_dtype: str = "auto"
    kv_cache_bytes: int | None = None         # CPU (or explicit) budget
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_queue: int | None = None
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
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_blocks_per_seq = -(-self.max_model_len // page)
        self.blocks = BlockManager(self.kv.num_slots, page, max_seqs=config.max_num_seqs,
                                   max_blocks_per_seq=self.max_blocks_per_seq,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, max_queue=config.max_queue)
        self.capacity_tokens = capacity
        # Slot tables for the stock path (index_scale 1: slot ids); kernels that need sub-page tables build their
        # own views with the cache's geometry.
        self.tables = DeviceBlockTables(self.blocks, dev, index_scale=1, kv_offset=1,
                                        max_tokens=config.max_num_batched_tokens)
        self._ids = itertools.count()
        self.requests: dict[int, Request] = {}
        self.eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        log.info("KV cache: %s", self.kv.describe())

    def _kv_spec(self, model: M3ForCausalLM, config: EngineConfig, **extra) -> KVCacheSpec:
        """The cache roles this engine needs (the speculative engine adds the shared draft layer)."""
        return KVCacheSpec.from_model_config(model.cfg, tp_size=model.tp.size, kv_cache_dtype=config.kv_cache_dtype,
                                             index_k_dtype=config.index_k_dtype, model_dtype=model.dtype, **extra)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Request:
        """Validate and queue a request. Raises ValueError naming the problem; nothing else is disturbed."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params: expected SamplingParams, found {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise ValueError(f"SamplingParams.n = {params.n}: submit n copies of the request instead (n > 1 is "
                             "served by the HTTP layer)")
        if not prompt_token_ids:
            raise ValueError("prompt: empty (at least one token is needed)")
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
        req = Request(next(self._ids), list(prompt_token_ids), params, prompt=prompt)
        if any(not p.greedy for p in [params]):
            req.generator = torch.Generator(device=self.model.device)
            req.generator.manual_seed(params.seed if params.seed is not None
                                      else (self.config.seed * 1_000_003 + req.request_id) % (2 ** 63))
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req

    def abort(self, request_id: int) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Run one model step; returns the requests that got a new token or finished in it."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return self._unschedulable()
        batch = self._build_batch(chunks)
        sampled = [c for c in chunks if c.reaches_end]
        reqs = [c.request for c in sampled]
        tokens, lp = self._forward_sample(batch, reqs)
        for c in chunks:
            c.request.num_computed += c.num_tokens
        if not sampled:
            return []
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.output_token_ids.append(tok)
            if req.params.logprobs is not None:
                top = {tid: lv for tid, lv in zip(lp[1][i][:req.params.logprobs], lp[2][i][:req.params.logprobs])}
                top[tok] = lp[0][i]
                req.output_logprobs.append(top)
            self._check_stop(req, tok)
            if not req.is_finished:
                self.blocks.commit_full_pages(req.request_id, req.all_token_ids[:req.num_computed])
        return reqs

    def _forward_sample(self, batch: ForwardBatch, reqs: list[Request]) -> tuple[list[int], tuple | None]:
        """Model forward, then one token per sampled row (batch.logits_rows order, one per request in `reqs`)
        and, when asked, (chosen logprobs, top ids, top logprobs) as lists. The tensor-parallel driver
        (m3serve.distributed.driver) overrides this to broadcast the step and sample vocab-parallel."""
        with torch.inference_mode():
            logits = self.model(batch)
        if not reqs:
            return [], None
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
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
        slot_table, _, slot_mapping = self.tables.prepare([r.request_id for r in reqs], seq_of_token, positions)
        lengths = done + n
        spans = [SeqSpan(int(starts[i]), int(n[i]), int(lengths[i]), slot_table[i, :-(-int(lengths[i]) // page)].long())
                 for i in range(len(chunks))]
        ids = [t for r, d, k in zip(reqs, done.tolist(), n.tolist()) for t in r.all_token_ids[d:d + k]]
        rows = [int(starts[i] + n[i] - 1) for i, c in enumerate(chunks) if c.reaches_end]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            seqs=spans,
            slot_mapping=slot_mapping,
            kv=self.kv,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
        )

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        if not p.ignore_eos and tok in self.eos:
            return self.scheduler.finish(req, "stop", tok)
        if tok in p.stop_token_ids:
            return self.scheduler.finish(req, "stop", tok)
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            for s in p.stop:
                at = text.find(s)
                if at >= 0:
                    req.text = text[:at]
                    return self.scheduler.finish(req, "stop", s)
        if p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens:
            return self.scheduler.finish(req, "length")
        if req.num_tokens >= self.max_model_len:
            return self.scheduler.finish(req, "length")

    def _unschedulable(self) -> list[Request]:
        """Nothing could be scheduled: the head request does not fit even in an otherwise empty cache."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        req = self.scheduler.waiting[0]
        self.scheduler.finish(req, "length")  # its context outgrew the whole KV cache
        return [req]

    def detokenize(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        if req.finish_reason == "stop" and isinstance(req.stop_reason, str):
            return req.text
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)

    def release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)

    def stats(self) -> dict:
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_pages_free": self.blocks.num_free_slots(), "kv_pages_total": self.kv.num_slots,
                "preemptions": self.scheduler.num_preemptions}


__all__ = ["LLMEngine", "EngineConfig", "Status"]
