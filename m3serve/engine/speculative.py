"""One-model Eagle3 speculative decoding: `SpecDecoding`, the component an LLMEngine delegates its step to.

The engine stays the one host-side engine (m3serve.engine.engine: requests, scheduler, block manager, stop checks,
the overlap loop's flight) over its model runner (m3serve.runtime.model_runner: the cache, now with the shared
draft layer, and block tables sized for verify steps). SpecDecoding holds what speculation adds: the drafter, the
speculative passes (spec_runner.SpecRunner, or a tensor-parallel group's broadcasting one), the SpecSteps
programs on the target, each request's drafts and acceptance counts; it runs the step and reads and writes the
engine's host state through `self.engine`. `speculative_engine(...)` builds such an engine.

The pieces live beside it, one concept each: spec_config.py (speculative_config), spec_state.py (per-request
state, one request's share of a step), spec_verify.py (greedy / rejection-sampled acceptance with the proofs,
forced acceptance), spec_rng.py (the device RNG), spec_batch.py (step preparation through
DeviceBlockTables.prepare), spec_runner.py (the device work every tensor-parallel rank repeats).

Batch-size policy (speculative_config.disable_by_batch_size, vLLM's name and meaning; engine/spec_policy.py): with
more requests in the engine (running + waiting) than the threshold a step runs as a plain step
(LLMEngine._step_chunks: its decode graphs, prefill graphs and overlap loop on the target); the others speculate
as below. "auto" chooses per batch bucket the kind of step that measured
more tokens per second per sequence so far. Only one kind of step is ever in flight: the other kind reads it back first.

One `SpecDecoding.step(chunks)` (LLMEngine.step schedules, then hands the chunks over):
  1. every decode request that holds K' <= K drafts from the previous step gets pages for
     K' more tokens (blocks.append_slots; if that fails it verifies no drafts this step, which stays exact);
  2. target forward over [last token, d1..dK'] per decode request (plus any prefill chunks), packed by ONE
     DeviceBlockTables.prepare (spec_batch.pack_verify), capturing the drafter's layers (the residual stream
     entering layer i);
  3. verification -> a accepted drafts + one target token per request (spec_verify); acceptance only moves
     lengths: num_computed += 1 + a. Target KV written for rejected drafts sits beyond num_computed, is never
     read (reads stop at the sequence length) and is overwritten later (append-only);
  4. draft loop, its KV written and read through the cache's DraftKVView (the shared pool's draft layer), each
     pass packed by ONE prepare on the view's own device tables:
     pass 1 runs the draft layer over every row whose next token is now known, with input (token at p+1,
     fused target states at p) at RoPE position p. This rewrites the draft KV of the accepted positions with
     target features (overwriting what the previous draft loop wrote there from draft features). Its last row
     (position c-1, c = num_computed) proposes d1; passes j = 2..K run one token per request at position
     c+j-2 from (d_{j-1}, the previous pass's pre-norm output) and propose dj. A prompt finished here whose next
     step runs as the step program proposes nothing (pass 1 still writes its draft K/V): it joins that program as a
     fresh row (_target_step), whose draft passes propose on the device.
  Invariant between steps: target and draft KV are valid for positions < num_computed = num_tokens - 1.
  Notes: a decode request verifies 1 + K' tokens but the scheduler's token budget counts it as 1 (the block
  tables are sized for K more tokens per sequence). Prefix-cache pages carry the draft layer too; the draft
  entry of a page's last position was computed from the token after the page, which a request reusing the
  page may not share (drafts only get worse there: outputs stay exact).

Tensor parallelism (m3serve.distributed.spec_driver): rank 0's component holds a TPSpecRunner, which broadcasts
each target or draft pass before running it; followers repeat the pass (spec_runner.py: the drafter is replicated).

Shape legend: R requests that sample this step, K' <= K drafts of a request, V target vocab, Vd draft vocab,
  H hidden, T packed tokens.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine, _last_token
from m3serve.engine.request import Request
from m3serve.engine.sampler import processed_probs, top_logprobs
from m3serve.engine.spec_batch import pack_spans, pack_verify
from m3serve.engine.spec_config import SpecConfig
from m3serve.engine.spec_policy import PLAIN, SPEC, make_policy
from m3serve.engine.spec_rng import DeviceRNG, mix32, sample_categorical
from m3serve.engine.spec_runner import ARGMAX, LOGITS, NONE, HeadOut, SpecRunner
from m3serve.engine.spec_state import SpecState, StepItem
from m3serve.engine.spec_verify import forced_accepts, verify_greedy, verify_sampled
from m3serve.model.eagle3 import Eagle3Drafter, load_drafter, random_drafter
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.decode_graphs import sampling_row
from m3serve.runtime.model_runner import ModelRunner, all_certified
from m3serve.runtime.spec_graphs import MAX_ROWS, SpecSteps
from m3serve.runtime.step_inputs import buckets_up_to
from m3serve.targets.explain import spec_step_placements, uncertified_attention, uncertified_draft_attention
from m3serve.targets.routing import install_drafter, mode_of

log = logging.getLogger("m3serve")


class _SpecFlight(NamedTuple):
    """A SpecSteps step not read back yet, in the engine's `_inflight`. The plain decode graphs' flight may stand
    there instead, after a step the batch-size policy ran plainly: this type tells them apart."""
    launched: object
    reqs: list[Request]
    preemptions: dict[int, int]          # request id -> its preemption count at launch
    fresh: frozenset = frozenset()       # ids of the rows staged without drafts (see _target_step)


def build_drafter(spec: SpecConfig, model: M3ForCausalLM) -> Eagle3Drafter:
    """The drafter `spec` names (random weights shaped for the target when spec.model is None), on the
    target's device and dtype. Every tensor-parallel rank builds the same one (it is replicated)."""
    if spec.model is None:
        return random_drafter(model.cfg, seed=spec.draft_seed, dtype=model.dtype, device=model.device)
    return load_drafter(spec.model, model.cfg, dtype=model.dtype, device=model.device)


def step_token_capacity(config: EngineConfig, k: int) -> int:
    """Tokens a verify step may hold: the scheduler's budget plus K drafts per sequence."""
    return config.max_num_batched_tokens + k * config.max_num_seqs


def spec_runner_config(config: EngineConfig, spec: SpecConfig, drafter: Eagle3Drafter) -> dict:
    """The ModelRunner arguments speculation needs: the shared Eagle3 draft layer in the cache (K/V sub-pages in
    every slot, all the replicated drafter's heads on every rank) and block tables sized for verify steps (K more
    tokens per sequence)."""
    return {"draft_kv_heads": drafter.cfg.num_key_value_heads,
            "max_step_tokens": step_token_capacity(config, spec.num_speculative_tokens),
            "spec_k": spec.num_speculative_tokens}


def prepare_drafter(spec: SpecConfig, model: M3ForCausalLM, drafter: Eagle3Drafter | None = None) -> Eagle3Drafter:
    """The drafter given (else the one `spec` names) on the target's device and dtype, attached to it, in eval mode."""
    if drafter is None:
        drafter = build_drafter(spec, model)
    return drafter.to(device=model.device, dtype=model.dtype).attach_target(model).eval()


def speculative_engine(model: M3ForCausalLM, config: EngineConfig, tokenizer=None, *,
                       speculative_config: dict | SpecConfig, drafter: Eagle3Drafter | None = None) -> LLMEngine:
    """An LLMEngine that decodes speculatively (vLLM's speculative_config: {"method": "eagle3", "model": dir | None,
    "num_speculative_tokens": K, ...}): its runner's cache holds the shared draft layer, its tables hold verify
    steps, and its step is SpecDecoding's. drafter: one already built (default: spec.model's, or random weights)."""
    spec = SpecConfig.from_dict(speculative_config)
    drafter = prepare_drafter(spec, model, drafter)
    runner = ModelRunner(model, config, **spec_runner_config(config, spec, drafter))
    return LLMEngine(model, config, tokenizer, runner=runner, speculation=SpecDecoding(spec, drafter))


class SpecDecoding:
    def __init__(self, spec: SpecConfig, drafter: Eagle3Drafter, spec_runner: SpecRunner | None = None):
        """drafter: attached to its target (prepare_drafter). spec_runner: the speculative passes (default: a
        SpecRunner; a tensor-parallel group plugs in its broadcasting one, m3serve.distributed.spec_driver)."""
        self.spec, self.drafter = spec, drafter
        self.spec_runner = spec_runner if spec_runner is not None else SpecRunner(drafter.target, drafter)
        self.engine = None               # the LLMEngine this serves (attach)
        self.rng = None                  # DeviceRNG keyed by the engine's seed (attach)
        self.spec_steps = None           # m3serve.runtime.spec_graphs.SpecSteps (enable_target)
        self._flight_sampled = False     # the SpecSteps step in flight ran the sampled variant
        self.graph_steps = 0             # steps that ran as SpecSteps
        self.overlapped_steps = 0        # of them, launched before the previous one was read back
        self.split_steps = 0             # of them, beside prefill chunks that ran eagerly in the same step
        self.fresh_rows = 0              # rows they took without drafts (stand-ins verified: _target_step)
        # steps with decoding requests that speculative_config.disable_by_batch_size ran plainly / speculatively
        self.policy = make_policy(spec.disable_by_batch_size)
        self.policy_plain_steps = 0
        self.policy_spec_steps = 0
        self._state: dict[int, SpecState] = {}
        self._totals = SpecState.empty(spec.num_speculative_tokens)
        self._forced_step: dict[int, int] = {}

    def attach(self, engine: LLMEngine) -> SpecDecoding:
        """Serve `engine` (LLMEngine.__init__ calls it); its runner's cache must hold the draft layer."""
        if engine.runner.view is None:
            raise ValueError("speculative decoding: the engine's runner has no draft layer (build it with "
                             "spec_runner_config)")
        self.engine = engine
        self.rng = DeviceRNG(engine.config.seed, engine.model.device)
        if self.spec_runner.paged_batches:    # its eager steps' target forward may replay the runner's prefill graphs
            engine.runner.prefill_capture_layers = self.spec_runner.capture
        return self

    def enable_target(self, graphs: bool = True, buckets: tuple[int, ...] | None = None, mode: str = "auto",
                      sampling: bool = True) -> bool:
        """Speculative steps on the decode target: a step in which every request decodes (no logprobs, no logits
        processing) from K drafts runs as one fixed-shape device program per batch bucket
        (m3serve.runtime.spec_graphs: verify, acceptance and the K draft passes, attention through the
        paged-cache kernels), replayed as a CUDA graph unless graphs=False: greedy steps by the greedy rule, a
        step with a sampled request (temperature, top-k, top-p) by rejection sampling (sampling=True: a second
        graph per bucket and the drafts' distributions kept on the device, max_num_seqs x K x V fp32). Every
        other step (prefill, logprobs, penalties, the last tokens before max_model_len) takes the eager path
        below, which is exact too. With speculative_config.disable_by_batch_size set, the plain decode target is
        enabled too (ModelRunner.enable_target: its decode graphs for every bucket), for the steps the policy runs
        plainly.
        auto: returns False (and logs why) when an attention placement of the verify or draft passes lies
        outside the certified cells; require: raises naming them."""
        eng = self.engine
        runner, m = eng.runner, eng.model
        if m.device.type != "cuda" and graphs:
            raise ValueError(f"decode target: CUDA graphs need a CUDA model, found {m.device}")
        if m.dtype != torch.bfloat16 or m.tp.size != 1:
            raise ValueError(f"speculative decode target: needs a bf16 model at TP 1, found {m.dtype} at TP "
                             f"{m.tp.size}")
        if eng.requests:
            raise RuntimeError("enable_target: call it before the first request (it may re-size the block tables)")
        k = self.spec.num_speculative_tokens
        buckets = buckets or buckets_up_to(eng.config.max_num_seqs)
        plain_buckets = self._policy_buckets(buckets)
        self.policy = make_policy(self.spec.disable_by_batch_size, buckets)   # its buckets: the graphs'
        # bucket 1 always stays: K <= 16 and the tables hold max_num_batched_tokens + K per sequence
        buckets = tuple(b for b in buckets if b * (k + 1) <= min(runner.tables.max_tokens, MAX_ROWS))
        eng._fit_certified_width()
        width = runner.tables.max_blocks
        # buckets past the bookkeeping launches' certified sequences are dropped (their batches take the eager
        # speculative step); require raises for them below
        certified = tuple(b for b in buckets if all(p.entry is not None for p in spec_step_placements((b,), k)))
        if mode != "require" and certified and certified != buckets:
            log.warning("speculative graphs: buckets %s dropped (spec.* launches certified up to %d sequences)",
                        [b for b in buckets if b not in certified], certified[-1])
            buckets = certified
        missing = (uncertified_attention(m, runner.kv, width, buckets, query_len=k + 1)
                   + uncertified_draft_attention(self.drafter, runner.kv, buckets, k)
                   + [p for p in spec_step_placements(buckets, k) if p.entry is None])
        if not all_certified(missing, "speculative attention", "speculative decode target", mode):
            return False
        install_drafter(self.drafter, "auto" if mode_of(m) == "off" else mode_of(m))
        # the drafter runs its target's backend; the eager steps' batches carry the kernels' metadata (paged_plan),
        # with or without a batch-size policy (without this they ran the stock loop over sequences)
        runner.use_paged_kernels()
        self.spec_steps = SpecSteps(m, self.drafter, runner.view, runner.tables, k, buckets, graphs=graphs,
                                    sampling=sampling)
        self.spec_steps.capture(mode)
        if plain_buckets and m.device.type == "cuda":
            # the steps the policy runs plainly take the plain engine's target: its decode graphs (overlap loop)
            # for the batches above the threshold, the paged-cache kernels in its eager steps. The tables were
            # sized above, so this keeps them (SpecSteps captured their buffers).
            runner.enable_target(graphs, plain_buckets, mode)
        if graphs:
            # eager steps (arrivals' prefill chunks) replay prefill graphs that also keep the drafter's layers
            runner.enable_prefill_graphs(mode)
            self.spec_runner.prefill_graphs = runner.prefill_graphs
        return True

    def _policy_buckets(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """The graph buckets a plain step of the batch-size policy can land in: none when it is off, else all of
        them (the fixed threshold counts the requests in the engine, so a plain step may decode any number of rows:
        three requests in the engine, one of them still prefilling, make a plain step of two decoding rows)."""
        return () if self.spec.disable_by_batch_size is None else buckets

    # ------------------------------------------------------------------ bookkeeping
    def _st(self, req: Request) -> SpecState:
        st = self._state.get(req.request_id)
        if st is None:
            st = self._state[req.request_id] = SpecState.empty(self.spec.num_speculative_tokens,
                                                               req.num_preemptions)
            req.spec_metrics = st.metrics()
        return st

    def _key(self, req: Request) -> int:
        s = req.params.seed
        return s if s is not None else (self.engine.config.seed * 1_000_003 + req.request_id) % (2 ** 63)

    def _keys(self, reqs: list[Request]) -> torch.Tensor:
        return torch.tensor([self._key(r) for r in reqs], dtype=torch.int64, device=self.engine.model.device)

    def forget(self, request_id: int) -> None:
        """The request was aborted or released: drop its drafts and counters."""
        self._state.pop(request_id, None)
        self._forced_step.pop(request_id, None)

    def stats(self) -> dict:
        """The engine's stats()["spec_decode"]: acceptance totals, the configuration, the policy's step counts."""
        t = self._totals
        m = t.metrics()
        m["num_speculative_tokens"] = self.spec.num_speculative_tokens
        m["forced_acceptance"] = self.spec.forced_acceptance
        m["disable_by_batch_size"] = self.spec.disable_by_batch_size
        m["policy_plain_steps"] = self.policy_plain_steps
        m["policy_spec_steps"] = self.policy_spec_steps
        # how the speculative steps ran: as the step program (of them, beside eager prefill chunks), and the rows
        # the program took without drafts
        m["program_steps"], m["split_steps"], m["fresh_rows"] = self.graph_steps, self.split_steps, self.fresh_rows
        m.update(self.policy.describe())
        m["acceptance_rate_per_position"] = [a / p if p else None
                                             for a, p in zip(t.accepted_per_pos, t.proposed_per_pos)]
        return m

    def reset_stats(self) -> None:
        self._totals = SpecState.empty(self.spec.num_speculative_tokens)

    # ------------------------------------------------------------------ the step
    def step(self, chunks) -> list[Request]:
        """The step of the scheduled `chunks` (LLMEngine.step calls it with a non-empty schedule)."""
        if self.spec.disable_by_batch_size is not None:
            decoding = sum(c.num_tokens == 1 and c.reaches_end for c in chunks)
            pure = decoding == len(chunks)
            sched = self.engine.scheduler
            if not self.policy.speculate(decoding, len(sched.running) + len(sched.waiting)):
                self.policy.observe_step(PLAIN, decoding, pure)
                self.policy_plain_steps += int(decoding > 0)
                return self._plain_step(chunks)
            self.policy.observe_step(SPEC, decoding, pure)
            self.policy_spec_steps += int(decoding > 0)
        done: list[Request] = []
        if self.engine._inflight is not None and not isinstance(self.engine._inflight, _SpecFlight):
            # a plain decode graph step in flight: its rows' last tokens are still on the device, where the
            # speculative step does not look for them. Plain steps move num_computed at launch, so the chunks
            # stay as scheduled once it is read back.
            done = self.engine._resolve_inflight()
            chunks = [c for c in chunks if not c.request.is_finished]
            if not chunks:
                return done
        reqs = self._target_step_requests(chunks)
        if reqs is not None:
            return done + self._target_step(reqs)
        # classified before any launch: reading back the step in flight moves a decoding row's num_computed, after
        # which its chunk no longer reaches_end and would pass for a prefill
        decodes = [c for c in chunks if c.num_tokens == 1 and c.reaches_end]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.reaches_end)]
        if decodes and prefills:
            # prefill chunks beside decoding rows: the decoding rows keep the step program (one launch), the
            # prefills run eagerly after it (an eager step of every row costs the verify and K draft passes of
            # all of them in host launches, on every step that admits a request)
            reqs = self._target_step_requests(decodes)
            if reqs is not None:
                self.split_steps += 1
                done += self._target_step(reqs)
                chunks = prefills
        return done + self._eager_step(chunks)

    def _plain_step(self, chunks) -> list[Request]:
        """The step as the plain engine runs it (no drafts, verify rows or draft passes): LLMEngine's decode graph
        (overlapped) or eager step. A SpecSteps step in flight is read back first: the plain step stages its rows'
        tokens and positions from the host. Its requests keep no drafts: the state they were made for is gone, so
        the next speculative step of each is the eager one (verify its last token, draft anew)."""
        done = []
        if isinstance(self.engine._inflight, _SpecFlight):
            done = self.engine._resolve_inflight()
            chunks = [c for c in chunks if not c.request.is_finished]
            # that flight moved its rows on by up to K + 1 tokens after they were scheduled; the pages it took
            # (below n + 2K) hold the new decode position unless K = 1
            if not all(self.engine.blocks.append_slots(c.request.request_id, c.request.num_computed + c.num_tokens)
                       for c in chunks):
                return done          # no room: the next schedule() preempts
            if not chunks:
                return done
        for c in chunks:
            st = self._state.get(c.request.request_id)
            if st is not None:
                st.drop_drafts()
        return done + self.engine._step_chunks(chunks)

    def _paged(self, draft: bool):
        """The eager step's batches carry the paged-cache kernels' metadata (the runner's PagedPlan) when the spec
        runner runs them locally (a tensor-parallel group's followers rebuild each batch from its wire form's
        spans, which the stock loop reads)."""
        return self.engine.runner.paged_plan(draft) if self.spec_runner.paged_batches else None

    def _eager_step(self, chunks) -> list[Request]:
        """Verify + draft passes of `chunks` on the host-driven path (prefill chunks, logprobs, penalties, ...)."""
        done = self.engine._resolve_inflight()       # the eager step needs every token on the host
        if done:
            chunks = [c for c in chunks if not c.request.is_finished]
        if not chunks:
            return done
        with torch.inference_mode():
            items = self._plan(chunks)
            sampled = [it for it in items if it.sample]
            batch = pack_verify(items, self.engine.runner.tables, self.engine.runner.kv, self._paged(draft=False))
            head = self.spec_runner.target(batch, self._target_mode(sampled))
            emitted = self._verify(sampled, head) if sampled else []
            out = self._commit(items, sampled, emitted, head)
            self._draft(items)
        return done + out

    # ------------------------------------------------------------------ the decode target's step
    def _in_flight(self) -> dict[int, int]:
        """request id -> its preemption count at launch, for the requests of the SpecSteps step in flight."""
        return self.engine._inflight.preemptions if isinstance(self.engine._inflight, _SpecFlight) else {}

    def _target_step_requests(self, chunks) -> list[Request] | None:
        """The requests of `chunks` when the step can run as SpecSteps: every chunk a decode (greedy, or sampled
        when the graphs have the sampled variant; no logprobs, no logits processing) holding K drafts for its
        current state, or in the step in flight (whose outputs the device keeps for this one), or holding none (a
        fresh row, see _target_step: after its prefill, or after plain steps of the batch-size policy), in a
        bucket, with room for the step's writes (pages allocated here). None: take the eager path (which first
        reads back the step in flight)."""
        ss = self.spec_steps
        if ss is None or ss.bucket_for(len(chunks)) is None:
            return None
        sampled = any(not c.request.params.greedy for c in chunks)
        if sampled and (not ss.sampling or (self.engine._inflight is not None and not self._flight_sampled)):
            return None          # no sampled variant; or the flight's rows kept no draft distributions
        k = self.spec.num_speculative_tokens
        eng = self.engine
        max_len = eng.max_model_len
        flight = self._in_flight()
        reqs, reach = [], []
        for c in chunks:
            r = c.request
            moving = flight.get(r.request_id) == r.num_preemptions
            # writes stay below n + 2K, n = num_computed after the step in flight (at most K + 1 more)
            end = r.num_computed + (k + 1 if moving else 0) + 2 * k
            if c.num_tokens != 1 or not c.reaches_end or not self._program_takes(r) or end > max_len:
                return None
            reqs.append(r)
            reach.append(end)
        if eng.overlap and any(r.request_id not in flight for r in reqs) and flight:
            return None          # a new row's staged state and the flight's device state: read the flight first
        if not all(eng.blocks.append_slots(r.request_id, e) for r, e in zip(reqs, reach)):
            return None
        return reqs

    def _target_step(self, reqs: list[Request]) -> list[Request]:
        """One SpecSteps step. With overlap (the default) it is launched before the step in flight is read back:
        a request in that step takes its state from the device, and the requests that step finishes are
        returned now, while the GPU runs this one. Without overlap it is launched and read back at once."""
        k = self.spec.num_speculative_tokens
        flight = self._in_flight()
        moving = [flight.get(r.request_id) == r.num_preemptions for r in reqs]
        # A fresh row holds no drafts for its state (it was just prefilled, its last steps ran plainly, or its
        # drafts were dropped): it is staged with K copies of its last token s as stand-in drafts. Greedy
        # verification keeps exactly the prefix that equals the target's own tokens, so it emits what plain greedy
        # steps would. A sampled row's stand-ins come with q = one-hot(s) (q=None below): rejection sampling then
        # accepts s with probability min(1, p(s)/1) = p(s) and otherwise draws from max(p - q, 0) normalised, which
        # is p without s, renormalised; so s comes out with probability p(s) and any y != s with
        # (1 - p(s)) * p(y) / (1 - p(s)) = p(y): the target's distribution, as for any proposal q whose draft was
        # drawn from q. The row leaves with K drafts from the program's draft passes; its acceptance is not the
        # drafter's, so resolve() counts none of it. Without fresh rows, such a row sent the whole batch down the
        # eager path, dozens of times a step program's cost, on every arrival and every switch of the policy.
        fresh = frozenset(r.request_id for r, m in zip(reqs, moving) if not m and not self._holds_drafts(r))
        forced = None
        if self.spec.forced_acceptance is not None:   # benchmarks: a fresh row's stand-ins are never forced in
            forced = []
            for r in reqs:
                if r.request_id in fresh:
                    forced.append(0)
                    continue
                step = self._forced_step.get(r.request_id, 0)
                self._forced_step[r.request_id] = step + 1
                forced.append(min(forced_accepts(step, self.spec.forced_acceptance - 1.0), k))
        sampling = q = None
        if any(not r.params.greedy for r in reqs):
            p = [r.params for r in reqs]
            sampling = [sampling_row(x.temperature, x.top_k, x.top_p, self._key(r)) for x, r in zip(p, reqs)]
            q = [None if m or r.request_id in fresh else self._state[r.request_id].q for r, m in zip(reqs, moving)]
        launched = self.spec_steps.run(
            [r.request_id for r in reqs], [0 if m else _last_token(r) for r, m in zip(reqs, moving)],
            [[] if m else [_last_token(r)] * k if r.request_id in fresh else self._state[r.request_id].drafts
             for r, m in zip(reqs, moving)],
            [-1 if m else r.num_computed for r, m in zip(reqs, moving)], forced, sampling, q)
        self._flight_sampled = sampling is not None
        self.graph_steps += 1
        self.overlapped_steps += any(moving)
        eng = self.engine
        self.fresh_rows += len(fresh)
        flight_now = _SpecFlight(launched, reqs, {r.request_id: r.num_preemptions for r in reqs}, fresh)
        prev, eng._inflight = eng._inflight, flight_now
        if not eng.overlap:
            return eng._resolve(prev) + eng._resolve_inflight()
        return eng._resolve(prev)

    @staticmethod
    def owns(inflight) -> bool:
        """The engine's flight is a SpecSteps step (else a plain decode graph step, which the engine reads)."""
        return isinstance(inflight, _SpecFlight)

    def resolve(self, inflight: _SpecFlight) -> list[Request]:
        """Read back a SpecSteps step (LLMEngine._resolve hands it over): each request that is still running as
        it was launched (not finished, aborted or preempted since) appends what it emitted; the others' results
        are dropped."""
        launched, reqs, preemptions, fresh = inflight
        res = self.spec_steps.fetch(launched)
        k = self.spec.num_speculative_tokens
        eng, blocks = self.engine, self.engine.blocks
        out, emitted = [], 0
        for r, toks, drafts in zip(reqs, res.emitted, res.drafts):
            if r.is_finished or not r.allocated or r.num_preemptions != preemptions[r.request_id]:
                continue
            st = self._st(r)
            st.preemptions = r.num_preemptions      # as launched (checked above): a fresh row's state starts here
            a = len(toks) - 1
            r.num_computed += 1 + a
            if r.request_id not in fresh:       # a fresh row verified stand-ins, not the drafter's drafts
                self._record(st, k, a)
                emitted += 1 + a
            out.append(r)
            for tok in toks:
                r.output_token_ids.append(tok)
                eng._check_stop(r, tok)
                if r.is_finished:
                    break
            if r.is_finished:
                st.drop_drafts()
            else:
                if blocks.has_uncommitted_full_pages(r.request_id, r.num_computed):
                    blocks.commit_full_pages(r.request_id, r.all_token_ids[:r.num_computed])
                # a sampled request's draft distributions stay on the device (a view of its table row: the eager
                # path reads it only after resolving every step in flight, so it is this step's)
                st.drafts, st.anchor = drafts, r.num_tokens
                st.q = None if r.params.greedy else self.spec_steps.q_of(r.request_id)
            r.spec_metrics = st.metrics()
        self.policy.observe_acceptance(emitted, sum(r.request_id not in fresh for r in out))
        return out

    def _holds_drafts(self, r: Request) -> bool:
        st = self._state.get(r.request_id)
        return (st is not None and len(st.drafts) == self.spec.num_speculative_tokens and st.anchor == r.num_tokens
                and st.preemptions == r.num_preemptions)

    @staticmethod
    def _target_mode(sampled: list[StepItem]) -> int:
        """ARGMAX when every verifying request is greedy without logprobs (no full rows needed), else LOGITS."""
        if not sampled:
            return NONE
        if all(it.req.params.greedy and it.req.params.logprobs is None for it in sampled):
            return ARGMAX
        return LOGITS

    def _plan(self, chunks) -> list[StepItem]:
        """Attach last step's drafts to decode chunks (allocating their pages) and lay out the packed rows."""
        items, row = [], 0
        for c in chunks:
            r = c.request
            st = self._st(r)
            if st.preemptions != r.num_preemptions:          # KV was dropped: its drafts' context is gone
                st.drop_drafts()
                st.preemptions = r.num_preemptions
            drafts: list[int] = []
            if c.reaches_end and c.num_tokens == 1 and st.drafts and st.anchor == r.num_tokens:
                n = r.num_computed
                k = min(len(st.drafts), self.engine.max_model_len - 1 - n)   # verify writes positions n..n+k
                if k > 0 and not self.engine.blocks.append_slots(r.request_id, n + 1 + k):
                    k = 0
                drafts = st.drafts[:k]
            elif st.drafts:                                    # not a decode of the state they were made for
                st.drop_drafts()
            toks = r.all_token_ids[r.num_computed:r.num_computed + c.num_tokens] + drafts
            items.append(StepItem(r, r.num_computed, toks, row, c.reaches_end, drafts))
            row += len(toks)
        return items

    # ------------------------------------------------------------------ verification
    def _verify(self, sampled: list[StepItem], head: HeadOut) -> list[list[int]]:
        """Tokens each sampling request emits this step (before stop checks)."""
        if head.tokens is not None and not any(it.drafts for it in sampled):
            # greedy rows without drafts (prompts the step finished): one logits row each, its argmax the token
            # (forced acceptance accepts nothing without drafts either); no verify launches or uploads
            return [[t] for t in head.tokens.tolist()]
        dev = self.engine.model.device
        r = len(sampled)
        nd = np.fromiter((len(it.drafts) for it in sampled), dtype=np.int64, count=r)
        k = int(nd.max())
        row0 = np.fromiter((it.logit_row0 for it in sampled), dtype=np.int64, count=r)
        # Row (request i, j) of the padded [R, K+1] view -> its logits row; padding repeats the last real row.
        idx = torch.from_numpy(row0[:, None] + np.minimum(np.arange(k + 1), nd[:, None])).to(dev)
        pad = np.zeros((r, k), dtype=np.int64)
        for i, it in enumerate(sampled):
            pad[i, :len(it.drafts)] = it.drafts
        drafts = torch.from_numpy(pad).to(dev)
        num_drafts = torch.from_numpy(nd).to(dev)
        greedy = all(it.req.params.greedy for it in sampled)
        keys = None if greedy else self._keys([it.req for it in sampled])
        if self.spec.forced_acceptance is not None:
            return self._forced(sampled, head, idx, greedy, keys)
        if greedy:
            t = head.tokens if head.tokens is not None else head.logits.argmax(-1)
            tokens, n_emit = verify_greedy(t[idx], drafts, num_drafts)
        else:
            p = processed_probs(head.logits, self._row_params(sampled, head.logits.shape[0]))[idx]  # [R, K+1, V]
            q = self._draft_q(sampled, drafts, k, p.shape[-1])
            tokens, n_emit = verify_sampled(p, q, drafts, num_drafts, self.rng, keys)
        tokens, n_emit = tokens.tolist(), n_emit.tolist()
        return [tokens[i][:n_emit[i]] for i in range(r)]

    @staticmethod
    def _row_params(sampled: list[StepItem], n_rows: int) -> list:
        params = [None] * n_rows
        for it in sampled:
            for j in range(len(it.drafts) + 1):
                params[it.logit_row0 + j] = it.req.params
        return params

    def _draft_q(self, sampled: list[StepItem], drafts: torch.Tensor, k: int, v: int) -> torch.Tensor:
        """[R, K, V] draft distributions: stored ones for sampled drafts, one-hot for greedy drafts."""
        q = torch.zeros(len(sampled), k, v, dtype=torch.float32, device=drafts.device)
        if k == 0:
            return q
        q.scatter_(2, drafts.unsqueeze(-1), 1.0)
        for i, it in enumerate(sampled):
            st = self._state[it.req.request_id]
            if it.drafts and st.q is not None:
                q[i, :len(it.drafts)] = st.q[:len(it.drafts)]
        return q

    def _forced(self, sampled: list[StepItem], head: HeadOut, idx: torch.Tensor, greedy: bool,
                keys: torch.Tensor | None) -> list[list[int]]:
        """Benchmark mode: accept the forced count, then the target's own token at that row."""
        r, k1 = idx.shape
        if greedy:
            t = (head.tokens if head.tokens is not None else head.logits.argmax(-1))[idx]
        else:
            p = processed_probs(head.logits, self._row_params(sampled, head.logits.shape[0]))[idx]
            row_keys = keys.repeat_interleave(k1)
            t = sample_categorical(p.view(r * k1, -1), self.rng, row_keys).view(r, k1)
        t = t.tolist()
        out = []
        for i, it in enumerate(sampled):
            a = 0
            if it.drafts:
                rid = it.req.request_id
                step = self._forced_step.get(rid, 0)
                self._forced_step[rid] = step + 1
                a = min(forced_accepts(step, self.spec.forced_acceptance - 1.0), len(it.drafts))
            out.append(it.drafts[:a] + [t[i][a]])
        return out

    # ------------------------------------------------------------------ commit
    def _commit(self, items: list[StepItem], sampled: list[StepItem], emitted: list[list[int]], head: HeadOut
                ) -> list[Request]:
        """Move lengths, append tokens with stop checks, record acceptance, commit full pages."""
        lp_by_item: dict[tuple[int, int], tuple] = {}
        want = max((it.req.params.logprobs for it in sampled if it.req.params.logprobs is not None), default=None)
        if want is not None:
            logits = head.logits
            sel = [(i, j) for i, it in enumerate(sampled) if it.req.params.logprobs is not None
                   for j in range(len(emitted[i]))]
            rows = torch.tensor([sampled[i].logit_row0 + j for i, j in sel], dtype=torch.int64, device=logits.device)
            toks = torch.tensor([emitted[i][j] for i, j in sel], dtype=torch.int64, device=logits.device)
            lp = tuple(x.tolist() for x in top_logprobs(logits[rows], toks, want))
            for n, (i, j) in enumerate(sel):
                lp_by_item[(i, j)] = (lp[0][n], lp[1][n], lp[2][n])
        em = {id(it): (i, e) for i, (it, e) in enumerate(zip(sampled, emitted))}
        out, verified, emitted_by_drafted = [], 0, 0
        for it in items:
            req = it.req
            if not it.sample:
                req.num_computed += len(it.tokens)
                continue
            i, toks = em[id(it)]
            a = len(toks) - 1
            req.num_computed += len(it.tokens) - len(it.drafts) + a
            if it.drafts:
                self._record(self._st(req), len(it.drafts), a)
                verified += 1
                emitted_by_drafted += 1 + a
            for j, tok in enumerate(toks):
                req.output_token_ids.append(tok)
                if req.params.logprobs is not None:
                    chosen, ids, vals = lp_by_item[(i, j)]
                    top = {tid: lv for tid, lv in zip(ids[:req.params.logprobs], vals[:req.params.logprobs])}
                    top[tok] = chosen
                    req.output_logprobs.append(top)
                self.engine._check_stop(req, tok)
                if req.is_finished:
                    break
            if not req.is_finished:
                self.engine.blocks.commit_full_pages(req.request_id, req.all_token_ids[:req.num_computed])
            else:
                self._st(req).drop_drafts()
            req.spec_metrics = self._st(req).metrics()
            out.append(req)
        self.policy.observe_acceptance(emitted_by_drafted, verified)   # requests without drafts verify nothing
        return out

    def _record(self, st: SpecState, k: int, a: int) -> None:
        st.record(k, a)
        self._totals.record(k, a)

    # ------------------------------------------------------------------ the draft loop
    def _draft(self, items: list[StepItem]) -> None:
        kmax = self.spec.num_speculative_tokens
        live = [it for it in items if not it.req.is_finished and it.req.allocated]
        if not live:
            return
        # Pass 1: every row whose next token is known now: positions pos0 .. num_computed-1 of each request.
        reqs_live = [it.req for it in live]
        c = np.fromiter((r.num_computed for r in reqs_live), dtype=np.int64, count=len(live))
        pos0 = np.fromiter((it.pos0 for it in live), dtype=np.int64, count=len(live))
        row0 = np.fromiter((it.row0 for it in live), dtype=np.int64, count=len(live))
        counts = c - pos0
        starts = np.cumsum(counts) - counts
        src = np.repeat(row0 - starts, counts) + np.arange(int(counts.sum()))   # verify rows feeding each row
        ids = np.fromiter((t for r, p, n in zip(reqs_live, pos0.tolist(), c.tolist())
                           for t in r.all_token_ids[p + 1:n + 1]), dtype=np.int64, count=int(counts.sum()))
        proposers, ks = [], []               # live indices that draft, and how many tokens each drafts
        for i, it in enumerate(live):
            if not it.sample:
                continue
            req = it.req
            k = min(kmax, self.engine.max_model_len - 1 - req.num_computed)   # next verify: positions c..c+k
            # A prompt finished here whose next step the program takes proposes nothing: pass 1 below still writes
            # its draft KV and its first decode step joins the program as a fresh row, which drafts on the device.
            # Passes 2..K here would cost every running stream K - 1 host-driven passes and a device->host read.
            # Elsewhere (no program: CPU, tensor parallel; logprobs or logits processing) it drafts as ever.
            prefill = len(it.tokens) > len(it.drafts) + 1
            if (not (prefill and self._program_takes(req)) and k > 0
                    and self.engine.blocks.append_slots(req.request_id, req.num_computed + 1 + k)):
                proposers.append(i)
                ks.append(k)
            else:
                self._st(req).drop_drafts()
        prop = np.asarray(proposers, dtype=np.int64)
        gather = starts[prop] + counts[prop] - 1                        # each proposer's last row
        reqs = [reqs_live[i] for i in proposers]
        greedy = all(r.params.greedy for r in reqs)
        mode = NONE if not reqs else (ARGMAX if greedy else LOGITS)
        t = len(src)
        view = self.engine.runner.view
        paged = self._paged(draft=True)
        batch, tail = pack_spans(view.tables, view, [r.request_id for r in reqs_live], pos0, counts, ids,
                                 np.concatenate((src, gather)), paged)
        head = self.spec_runner.draft(batch, tail[:t], tail[t:], mode)
        if not reqs:
            return
        keys = None if greedy else self._keys(reqs)
        tok, q = self._propose(head, reqs, greedy, keys)
        props, qs = [tok], [q]
        ks_np = np.asarray(ks, dtype=np.int64)
        c_prop = c[prop]
        for j in range(2, kmax + 1):
            act = np.nonzero(ks_np >= j)[0]
            if not len(act):
                break
            batch, sel = pack_spans(view.tables, view, [reqs[i].request_id for i in act.tolist()],
                                    c_prop[act] + j - 2, np.ones(len(act), dtype=np.int64), None, act, paged)
            batch.input_ids = props[-1][sel]
            head_j = self.spec_runner.draft(batch, sel, None, mode)
            tok_j, q_j = self._propose(head_j, [reqs[i] for i in act.tolist()], greedy,
                                       None if keys is None else keys[sel])
            # scatter back into full-width tensors so later passes index by request
            full_tok = props[-1].clone()
            full_tok[sel] = tok_j
            props.append(full_tok)
            if q_j is not None:
                full_q = torch.zeros_like(qs[-1])
                full_q[sel] = q_j
                qs.append(full_q)
            else:
                qs.append(None)
        drafts = torch.stack(props, dim=1).tolist()                      # [P, passes]
        for i, (r, k) in enumerate(zip(reqs, ks)):
            st = self._st(r)
            st.drafts = drafts[i][:k]
            st.q = None if qs[0] is None else torch.stack([qq[i] for qq in qs[:k]])
            st.anchor = r.num_tokens

    def _program_takes(self, r: Request) -> bool:
        """The step program can run this request's decode steps: there is one, the request asks for no logprobs or
        logits processing (those need the host between steps), and a sampled one has the sampled variant."""
        ss = self.spec_steps
        return (ss is not None and r.params.logprobs is None and not r.logits_processing
                and (r.params.greedy or ss.sampling))

    def _propose(self, head: HeadOut, reqs: list[Request], greedy: bool, keys: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens (target ids) [n] and, unless all greedy, their distributions over the target vocab
        [n, V] (one-hot for greedy requests). Tests override this to force particular proposals."""
        if greedy:
            return head.tokens, None
        q = processed_probs(head.logits, [r.params for r in reqs])
        d = sample_categorical(q, self.rng, keys)
        return self.drafter.to_target_ids(d), self.drafter.to_target_probs(q)


__all__ = ["SpecDecoding", "speculative_engine", "prepare_drafter", "SpecConfig", "DeviceRNG", "mix32",
           "sample_categorical", "verify_greedy", "verify_sampled", "forced_accepts", "build_drafter",
           "step_token_capacity", "spec_runner_config"]
