"""Compile before serving: run throw-away requests through the engine so every kernel variant a prefill or a
decode step can reach is compiled before the first real request (and before the server reports healthy).

Triton compiles a kernel per specialization of its integer arguments (== 1, divisible by 16, other), so a
chunk of 1 token, of 16, and of an odd length are three compilations; the first request of each kind paid
them in front of a user (TTFT p90 of 2 s at concurrency 1 while p50 was 26 ms). The routed modules' row cells
are compiled by targets.routing.warmup and the decode buckets by their graph capture; what is left is the
attention side of prefill (kv.write / msa / attn.prefill at chunk shapes), mixed prefill + decode steps,
chunked prefill (a prompt longer than max_num_batched_tokens), and the sampler variants. The requests below
cover those classes; their pages are freed and the prefix cache cleared afterwards, so serving starts from an
empty cache. With prefill graphs the waves run twice: eagerly first (a graph pads every step to its bucket, a
multiple of 16, so through the graphs the eager steps' other classes would be built in front of a user: seen on
the H200 as a paged-attention variant built while serving), then the first two waves through the graphs (the
head and sampling on their logits rows).
"""

from __future__ import annotations

import logging
import time

from m3serve.engine.sampling_params import SamplingParams
from m3serve.kernels._jit import COMPILE_WATCH
from m3serve.kernels.attention._paged_call import tile_config
from m3serve.kernels.attention.msa_index import scores_variant
from m3serve.runtime.step_inputs import split_plan

log = logging.getLogger("m3serve")


def shape_class(n: int) -> str:
    """The class Triton specializes an integer kernel argument by: == 1, divisible by 16, or other."""
    return "1" if n == 1 else "x16" if n % 16 == 0 else "other"


def variant_lengths(engine, limit: int) -> list[int]:
    """The shortest prompt length of each attention-kernel variant a prompt prefilled alone selects by its length:
    msa.scores' tiling and tile (decode: BQ, QCHUNKS, one more dot per 16 query rows up to 48; past 48 rows the
    one query-stationary prefill tile), whether attn.paged splits the
    keys (its split count is a runtime value; one split writes the output directly) and the dense rows' query
    stacking (QB). A serving step of another length reuses one of them: the kernels specialise on no count
    (kernel_unspecialized)."""
    cfg, hk = engine.model.cfg, engine.kv.spec.num_kv_heads
    g = max(1, cfg.num_attention_heads // max(1, cfg.num_key_value_heads))
    seen, out = set(), []
    for n in range(1, limit + 1):
        key = (scores_variant(n, cfg.index_n_heads),
               tuple(splits > 1 for splits in split_plan(n, engine.runner.tables.max_blocks, hk, cfg.index_topk_blocks,
                                                         engine.runner.sparse_tiles)),
               tile_config(g, engine.kv.page_size, n, False).QB)
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def scored_tails(engine) -> list[int]:
    """Chunk lengths n, one per msa.scores variant (tiling and tile), to run at a position past the indexer's top-k
    blocks: only such sequences are scored, so a short prompt of the same length never builds the variant (seen on
    the H200: a 65-96-row chunk beside a long sequence compiled while serving). `scored_prefix` says where."""
    cfg = engine.model.cfg
    if "sparse" not in cfg.layer_types:
        return []
    seen, out = set(), []
    for n in range(1, min(128, engine.config.max_num_batched_tokens) + 1):
        key = scores_variant(n, cfg.index_n_heads)
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def scored_prefix(engine) -> tuple[int, bool]:
    """(tokens before each scored tail, shared): with prefix caching, one whole-page prompt past the top-k blocks
    that every tail request extends (its pages come from the cache, so the tail is the step's only chunk);
    without it, whole chunks of the step budget that each tail request prefills first."""
    cfg = engine.model.cfg
    need = cfg.index_topk_blocks * cfg.index_block_size + 1
    if engine.config.enable_prefix_caching:
        page = engine.kv.page_size
        return -(-need // page) * page, True
    budget = engine.config.max_num_batched_tokens
    return -(-need // budget) * budget, False


def warmup_prompt_lengths(max_model_len: int, max_num_batched_tokens: int, capacity_tokens: int,
                          extra: tuple[int, ...] = ()) -> list[int]:
    """Prompt lengths covering the integer specializations of a prefill chunk: 1 token, odd lengths, multiples
    of 16, a page-crossing length, a full chunk and (when it fits) a chunked prompt, plus `extra` (variant_lengths);
    each leaves room for two generated tokens and all of them fit the cache at once."""
    limit = min(max_model_len - 2, capacity_tokens // 4)
    wanted = [1, 5, 16, 33, 128, 131, max_num_batched_tokens, max_num_batched_tokens + 37, *extra]
    out = sorted({n for n in wanted if 1 <= n <= limit})
    total, kept = 0, []
    for n in out:                       # all at once must fit the cache (no preemption during warm-up)
        if total + n + 2 <= capacity_tokens // 2:
            kept.append(n)
            total += n + 2
    return kept


def warm_up(engine, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Run the warm-up requests to completion (greedy, then sampled, then a wave arriving while others decode).
    Returns {"requests", "tokens", "seconds"}. Raises RuntimeError if the engine is busy or the warm-up stalls."""
    if engine.has_work():
        raise RuntimeError("warm_up: the engine already has requests; warm up before serving")
    t0 = time.perf_counter()
    vocab = engine.model.cfg.vocab_size
    budget = engine.config.max_num_batched_tokens
    lengths = warmup_prompt_lengths(engine.max_model_len, budget, engine.capacity_tokens,
                                    tuple(variant_lengths(engine, min(256, budget))))
    n_req = n_tok = 0

    def prompt(n: int, salt: int) -> list[int]:
        # distinct, deterministic ids away from the special tokens at the start of the vocabulary
        span = max(vocab - 16, 1)
        return [16 + (seed * 7919 + salt * 104729 + i * 31) % span for i in range(n)]

    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    waves = [
        [(n, greedy) for n in lengths],
        [(n, SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=20, seed=seed, ignore_eos=True))
         for n in lengths[:3]],
    ]
    # a prompt alone in its step (one sequence is its own specialization of the kernels' sequence count)
    waves += [[(n, greedy)] for n in lengths if n <= engine.config.max_num_batched_tokens]
    prefix, shared = scored_prefix(engine)
    tails = [n for n in scored_tails(engine) if prefix + n + 2 <= min(engine.max_model_len, engine.capacity_tokens // 2)]
    if tails:
        base = prompt(prefix, 9001)
        if shared:
            waves.append([(base, greedy)])             # its full pages stay in the prefix cache for the tails
        waves += [[(base + prompt(n, 9002 + n), greedy)] for n in tails]
    # a sequence count divisible by 16 is a specialization too (16 prompts prefilled together: measured on the H200
    # as a TTFT p90 of ~0.7 s at 16 users while p50 was 60 ms), with a token count divisible by 16 and with an
    # odd one; and several prompts whose tokens add up to a multiple of 16
    n = 16 if 16 * 16 <= engine.config.max_num_batched_tokens else 1     # 16 prompts in one step's token budget
    if engine.config.max_num_seqs >= 16 and 16 * (n + 3) <= engine.capacity_tokens // 2:
        waves += [[(n, greedy)] * 16, [(n, greedy)] * 15 + [(n + 1, greedy)], [(16, greedy)] * 3]
    graphs = getattr(engine.runner, "prefill_graphs", None)
    passes = [(waves, False)] + ([(waves[:2], True)] if graphs is not None else [])
    try:
        for wave_list, through_graphs in passes:
            if graphs is not None:
                graphs.enabled = through_graphs
            engine.blocks.clear_prefix_cache()     # the same prompts again: prefilled whole, not from the cache
            reqs, toks = _run_waves(engine, wave_list, prompt, lengths[min(2, len(lengths) - 1)], t0, timeout_s)
            n_req, n_tok = n_req + reqs, n_tok + toks
    finally:
        if graphs is not None:
            graphs.enabled = True
    engine.blocks.clear_prefix_cache()
    if engine.has_work():
        raise RuntimeError("warm_up: requests left behind")
    engine.restart_request_ids()          # unseeded requests' keys do not depend on how many warm-up requests ran
    if engine.model.device.type == "cuda":
        COMPILE_WATCH.arm()               # from here on a kernel variant built is a stall a user waits for: counted
    secs = time.perf_counter() - t0
    log.info("warm-up: %d requests (prompt lengths %s), %d tokens in %.2f s", n_req, lengths, n_tok, secs)
    return {"requests": n_req, "tokens": n_tok, "seconds": secs}


def _run_waves(engine, waves, prompt, late_len: int, t0: float, timeout_s: float) -> tuple[int, int]:
    """Each wave's requests to completion, a late arrival of late_len tokens joining while they decode; returns
    (requests, generated tokens)."""
    n_req = n_tok = 0
    for w, wave in enumerate(waves):
        reqs = [engine.add_request(n if isinstance(n, list) else prompt(n, w * 100 + i), params)
                for i, (n, params) in enumerate(wave)]
        # a late arrival joins while the others decode: a mixed prefill + decode step
        late = None
        steps = 0
        while any(not r.is_finished for r in reqs) or (late is not None and not late.is_finished):
            engine.step()
            steps += 1
            if steps == 2 and late is None:
                late = engine.add_request(prompt(late_len, w * 100 + 99),
                                          SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
                reqs.append(late)
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"warm_up: not finished after {timeout_s:.0f} s ({steps} steps)")
        engine.drain()
        for r in reqs:
            n_req += 1
            n_tok += len(r.output_token_ids)
            engine.release(r)
    return n_req, n_tok


__all__ = ["scored_prefix", "scored_tails", "shape_class", "variant_lengths", "warm_up", "warmup_prompt_lengths"]
