"""Eagle3 speculative decode steps on the decode target: verify, greedy acceptance and the K draft passes as ONE
fixed-shape device program per batch bucket, replayed as a CUDA graph (or run eagerly: CPU, enforce_eager).

One step of a bucket of S sequences, each holding n tokens of KV (num_computed), its last token x (position n)
and K drafts d_1..d_K (positions n+1..n+K), T = S(K+1) packed rows, row (i, j) at position n_i + j:

    host   pack [rows | change | token seq T | positions T | token ids T, seq lens S, forced S, n S | changed
           rows] into one pinned buffer (DeviceBlockTables.stage, padded to the bucket); ONE H2D copy. A row
           staged with n = -1 takes n, x and its drafts from the device instead: what the previous step of the
           same table row left there (so the host may launch step m+1 before it has read step m: the engine's
           overlap loop)
    device spec.inputs: [n, x, d] per row (staged or from the device) -> positions, sequence lengths (into the
           stage) and verify ids; table rows -> slot table, token slots (expand_staged); all captured
           verify: the target over [x, d_1..d_K] per sequence (attention through the paged-cache kernels,
                   causal within the K+1 rows), capturing the drafter's residual streams; t = argmax per row
           spec.accept: a = the longest prefix with d_j = t_{j-1} (or the staged forced count, benchmarks);
                   emitted e_j = d_{j+1} for j < a, e_a = t_a (spec_verify.py's proof); n' = n + a + 1 kept
                   per table row; each later draft pass's position, token slot and key count
           draft pass 1: the draft layer over all T rows, row (i, j) fed (e_j, fused target state of row j)
                   at position n+j; row a of each sequence proposes d'_1 from its state h
           draft passes 2..K: one row per sequence at position c+j-2 (c = n+a+1) fed (d'_{j-1}, h) -> d'_j
           spec.commit: the device keeps per table row [e_a, d'_1..d'_K] (the next step's inputs)
    D2H    [e_0..e_K | a+1 | d'_1..d'_K] per row (int64), then an event

Why pass 1 may run all K+1 rows: rows j > a saw a rejected token, so their draft K/V (positions n+a+1..n+K) is
garbage, but every such position is rewritten before anything reads it: passes 2..K rewrite n+a+1..n+a+K-1 in
order (pass j reads only positions <= its own), and the next step's pass 1 rewrites everything from its n' =
n+a+1 on. The same holds for the target K/V of rejected rows (the next verify rewrites them), so accepted K/V
stays where verify wrote it and no token is ever moved. Positions written this step lie below n + 2K: the host
allocates pages for n + 2K tokens before staging.

Sampled rows (the second variant of each bucket, SpecSteps(sampling=True)): the staged payload also carries each
row's temperature, top-k, top-p and key; verify turns the target's logits into p (processed_rows, greedy rows
one-hot) and accepts by rejection sampling against the drafts' distributions q kept per table row (next_q), with
draws keyed by (request key, token index, purpose) instead of a stateful RNG (spec_verify.accept_keyed, its
proof in spec_verify's docstring); the draft passes sample d'_j from their processed distributions and keep
them in next_q for the next step. Greedy rows inside a sampled step reduce to the greedy rule exactly.

Shape legend: S bucket (sequences), K drafts per sequence, T = S(K+1) verify rows, V target vocab, H hidden.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from m3serve.engine.sampler import processed_rows
from m3serve.engine.spec_rng import TAG_DRAFT, keyed_categorical
from m3serve.engine.spec_verify import accept_keyed
from m3serve.kernels.spec.step import spec_accept, spec_commit, spec_inputs
from m3serve.model.m3 import ForwardBatch
from m3serve.runtime import capture_check
from m3serve.runtime.decode_graphs import _ONE_BITS, sampling_tensors
from m3serve.runtime.step_inputs import PagedStep, bucket_for, sparse_tiles_per_block, split_plan
from m3serve.targets.explain import spec_step_placements

log = logging.getLogger("m3serve")

# Verify rows per step (S(K+1)) the fixed-shape programs take: the tables' token budget bounds them too. Modules
# outside their entries' cells at these rows run stock code inside the graph; a bucket whose stock code cannot
# be captured runs its program eagerly (capture_check).
MAX_ROWS = 4096


@dataclass
class SpecLaunched:
    """A spec step whose results may not have arrived on the host yet."""
    n: int                           # real rows (the first n of the bucket)
    host: torch.Tensor               # [bucket, 2K+2] int64: emitted K+1 | number emitted | next drafts K
    done: object                     # event recorded after the D2H copy (None: eager CPU, already there)


@dataclass
class StepBuffers:
    """A bucket's persistent device outputs (stable addresses for the graph; S sequences, K drafts)."""
    ids: torch.Tensor                # [T] int64 verify inputs x, d_1..d_K per sequence
    positions: torch.Tensor          # [T] int64
    pos0: torch.Tensor               # [S] int64 n
    emitted: torch.Tensor            # [S, K+1] int64 e_0..e_K (draft pass 1's inputs)
    last: torch.Tensor               # [S] int64 verify row a of each sequence
    draft_pos: torch.Tensor          # [K-1, S] int64 position of draft pass j+2
    draft_map: torch.Tensor          # [K-1, S] int64 its token slot (-1: padding)
    draft_lens: torch.Tensor         # [K-1, S] int32 its key count (0: padding)
    drafted: torch.Tensor            # [K, S] int64 d'_1..d'_K
    result: torch.Tensor             # [S, 2K+2] int64 e_0..e_K | a+1 | d'_1..d'_K
    accepted: torch.Tensor           # [S] int32 a (sampled variant)
    q: torch.Tensor | None           # [S, K, V] fp32 the drafts' distributions (sampled variant)

    @classmethod
    def make(cls, s: int, k: int, device, vocab: int | None) -> StepBuffers:
        def i64(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=device)
        return cls(ids=i64(s * (k + 1)), positions=i64(s * (k + 1)), pos0=i64(s), emitted=i64(s, k + 1), last=i64(s),
                   draft_pos=i64(k - 1, s), draft_map=i64(k - 1, s),
                   draft_lens=torch.zeros(k - 1, s, dtype=torch.int32, device=device), drafted=i64(k, s),
                   result=i64(s, 2 * k + 2), accepted=torch.zeros(s, dtype=torch.int32, device=device),
                   q=None if vocab is None else torch.zeros(s, k, vocab, dtype=torch.float32, device=device))


@dataclass
class SpecResult:
    emitted: list[list[int]]         # per real row: the tokens this step emits (a accepted drafts + 1)
    drafts: list[list[int]]          # per real row: K drafts for the next step


class SpecSteps:
    """The fixed-shape speculative step of each bucket; `graphs=True` captures one CUDA graph per bucket.

    model: the target (bf16, TP 1, routed); drafter: its Eagle3Drafter; view: the cache's DraftKVView (its
    layer is the draft layer of the same slots the target tables address); tables: the engine's
    DeviceBlockTables of slot ids, sized for the buckets' T rows."""

    def __init__(self, model, drafter, view, tables, k: int, buckets: tuple[int, ...], graphs: bool = True,
                 sampling: bool = False):
        if k < 1:
            raise ValueError(f"k: expected >= 1 speculative tokens, found {k}")
        self.model, self.drafter, self.view, self.tables, self.k = model, drafter, view, tables, k
        self.binding = capture_check.binding_of(model, drafter)   # the kernel bindings the graphs capture
        self.kv = view.cache
        self.buckets = tuple(sorted(buckets))
        if not self.buckets or self.buckets[-1] > tables.manager.max_seqs:
            raise ValueError(f"buckets: expected sizes in [1, max_num_seqs = {tables.manager.max_seqs}], "
                             f"found {buckets}")
        if self.buckets[-1] * (k + 1) > tables.max_tokens:
            raise ValueError(f"buckets: {self.buckets[-1]} x {k + 1} verify rows exceed the tables' "
                             f"max_tokens = {tables.max_tokens}")
        off = [p.line() for p in spec_step_placements(self.buckets, k) if p.entry is None]
        if off:
            raise ValueError(f"SpecSteps: the step's bookkeeping launches are not certified: {off[:3]}")
        self.graphs = graphs
        if graphs and model.device.type != "cuda":
            raise ValueError(f"SpecSteps: CUDA graphs need a CUDA model, found {model.device}")
        self.capture_ids = tuple(drafter.cfg.capture_layers)
        dev = model.device
        self._offsets: dict[int, tuple[int, ...]] = {}
        self._steps: dict[int, tuple[PagedStep, list[PagedStep]]] = {}
        self._bufs: dict[int, StepBuffers] = {}
        self._graph: dict[int, torch.cuda.CUDAGraph] = {}
        self._result: dict[int, torch.Tensor] = {}
        self.blocked: dict[tuple[int, bool], capture_check.CaptureBlocker] = {}   # (bucket, sampled) left eager
        self.memory_bytes = 0       # device memory the capture reserved (its pool, static outputs), measured
        top = self.buckets[-1]
        pin = dev.type == "cuda"
        self._ring = [torch.empty(top, 2 * k + 2, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self._next = 0
        self.replays = 0
        self._query_start = {b: torch.arange(0, b * (k + 1) + 1, k + 1, dtype=torch.int32, device=dev)
                             for b in self.buckets}
        self._one_each = {b: torch.arange(b + 1, dtype=torch.int32, device=dev) for b in self.buckets}
        # What each block-table row's last step left for its next one (the padding row included).
        rows = tables.manager.max_seqs + 1
        self.next_pos = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.next_ids = torch.zeros(rows, k + 1, dtype=torch.int64, device=dev)
        # sampling: a second variant per bucket verifies by rejection sampling; the drafts' distributions q of
        # each table row stay here between steps ([R, K, V] fp32, V the target vocabulary)
        self.sampling = sampling
        self.next_q = torch.zeros(rows, k, model.cfg.vocab_size, dtype=torch.float32, device=dev) if sampling else None
        self.sampled_replays = 0

    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(batch, self.buckets)

    # ------------------------------------------------------------------ host: stage one step
    def stage(self, bucket: int, seq_ids: list[int], last_tokens: list[int], drafts: list[list[int]],
              positions: list[int], forced: list[int] | None = None, sampling: list | None = None) -> None:
        """Pack one padded step: row i verifies [last_tokens[i], *drafts[i]] (K drafts) from positions[i] (its
        num_computed); positions[i] = -1: all three come from the device (what the row's previous step left;
        last_tokens[i] and drafts[i] are then ignored). forced[i] >= 0: accept that many drafts (forced-
        acceptance benchmarks), else verify. sampling: one decode_graphs.sampling_row per row (the sampled
        variant's temperature, top-k, top-p and key); None stages greedy rows.
        Payload after the positions: [ids T | seq lens S | forced S | n S | temperature, top_k, top_p, key_lo,
        key_hi: S each]."""
        k, s, n = self.k, bucket, len(seq_ids)
        if len(drafts) != n or len(last_tokens) != n or len(positions) != n or any(
                len(d) != k for d, p in zip(drafts, positions) if p >= 0):
            raise ValueError(f"drafts: expected {n} rows of exactly K = {k} drafts with one last token and position "
                             f"each, found {[len(d) for d in drafts][:8]}")
        if sampling is not None and len(sampling) != n:
            raise ValueError(f"sampling: expected one row per sequence ({n}), found {len(sampling)}")
        t = s * (k + 1)
        pos0 = np.zeros(s, dtype=np.int64)
        pos0[:n] = positions
        staged = pos0 >= 0
        # placeholder positions for device rows: the program writes the real ones before expanding the tables
        positions_t = (np.where(staged, pos0, 0)[:, None] + np.arange(k + 1)).reshape(-1)
        tsi = np.repeat(np.arange(s), k + 1)
        extra = np.zeros(t + 8 * s, dtype=np.int32)
        ids = extra[:t].reshape(s, k + 1)
        for i in np.flatnonzero(staged[:n]):
            ids[i, 0] = last_tokens[i]
            ids[i, 1:] = drafts[i]
        extra[t:t + n] = np.where(staged[:n], pos0[:n] + k + 1, 0)
        extra[t + s:t + 2 * s] = -1
        if forced is not None:
            extra[t + s:t + s + n] = forced
        extra[t + 2 * s:t + 3 * s] = pos0
        params = extra[t + 3 * s:].reshape(5, s)          # temperature 0 = greedy, top_p 1.0 for every other row
        params[2] = _ONE_BITS
        if sampling is not None:
            params[:, :n] = np.array(sampling, dtype=np.int32).reshape(n, 5).T
        got_s, got_t, offsets = self.tables.stage(seq_ids, tsi, positions_t, extra=extra, pad_to=s)
        if self._offsets.setdefault(bucket, offsets) != offsets or (got_s, got_t) != (s, t):
            raise AssertionError(f"bucket {bucket}: staged layout {(got_s, got_t, offsets)} differs from the "
                                 f"captured one {self._offsets[bucket]}")

    def _sampling_params(self, bucket: int, vocab: int) -> tuple[torch.Tensor, ...]:
        """The staged sampling payload of a bucket -> (temperature, top_k, top_p, greedy, keys) [S] on the device."""
        s, t = bucket, bucket * (self.k + 1)
        base = self._offsets[bucket][3] + t + t + 3 * s
        stage = self.tables._dev_stage
        return sampling_tensors(*(stage[base + i * s:base + (i + 1) * s] for i in range(5)), vocab)

    # ------------------------------------------------------------------ device: the step program
    def _plans(self, bucket: int) -> tuple[PagedStep, list[PagedStep]]:
        """(verify step, one step per draft pass 2..K) metadata of a bucket; the draft passes' key counts are
        rows of spec.accept's output, so no pass copies anything before it runs."""
        if bucket not in self._steps:
            k, s, t = self.k, bucket, bucket * (self.k + 1)
            off = self._offsets[bucket]
            stage = self.tables._dev_stage
            extra = off[3] + t
            spec, cfg = self.kv.spec, self.model.cfg
            tiles = sparse_tiles_per_block(spec)
            b = self.tables.max_blocks
            dense, sparse = split_plan(t, b, spec.num_kv_heads, cfg.index_topk_blocks, tiles)
            verify = PagedStep(slot_table=self.tables.slot_table[:s], seq_lens=stage[extra + t:extra + t + s],
                               query_start=self._query_start[s], max_query_len=k + 1, num_splits=dense,
                               num_splits_sparse=sparse)
            ddense, _ = split_plan(s, b, spec.kv_heads(self.view.layer), 0)
            shared: dict = {}                     # the passes run one after the other: one attention workspace
            lens = self._buffers(bucket).draft_lens
            passes = [PagedStep(slot_table=self.tables.slot_table[:s], seq_lens=lens[j], query_start=self._one_each[s],
                                max_query_len=1, num_splits=ddense, num_splits_sparse=ddense, workspaces=shared)
                      for j in range(k - 1)]
            self._steps[bucket] = (verify, passes)
        return self._steps[bucket]

    def _buffers(self, bucket: int) -> StepBuffers:
        if bucket not in self._bufs:
            self._bufs[bucket] = StepBuffers.make(bucket, self.k, self.model.device,
                                                  self.model.cfg.vocab_size if self.sampling else None)
        return self._bufs[bucket]

    def _program(self, bucket: int, sampled: bool = False) -> torch.Tensor:
        """The whole step on the device from the staged buffer -> [S, 2K+2] int64 (see the module docstring).
        sampled: the rejection-sampling variant (module docstring: "Sampled rows")."""
        k, s = self.k, bucket
        t = s * (k + 1)
        off = self._offsets[bucket]
        stage = self.tables._dev_stage
        extra = off[3] + t
        rows, seq_lens = stage[:s], stage[extra + t:extra + t + s]
        forced, staged_pos = stage[extra + t + s:extra + t + 2 * s], stage[extra + t + 2 * s:extra + t + 3 * s]
        buf = self._buffers(bucket)
        spec_inputs(rows, stage[extra:extra + t], seq_lens, staged_pos, self.next_pos, self.next_ids, buf.ids,
                    buf.positions, stage[off[3]:off[3] + t], seq_lens, buf.pos0)
        _, _, slot_mapping = self.tables.expand_staged(s, t, off)
        verify, passes = self._plans(bucket)
        m, d = self.model, self.drafter

        batch = ForwardBatch(input_ids=buf.ids, positions=buf.positions, seqs=[], slot_mapping=slot_mapping,
                             kv=self.kv, step=verify, capture_layers=self.capture_ids)
        h = m.hidden(batch)
        fused = d.fuse([batch.captured[i] for i in d.cfg.capture_layers])
        if sampled:
            logits = m.logits(h)                                             # [T, V] fp32
            v = logits.shape[1]
            temp, top_k, top_p, greedy, keys = params = self._sampling_params(bucket, v)
            per_row = [x.repeat_interleave(k + 1) for x in (temp, top_k, top_p, greedy)]
            p = processed_rows(logits, *per_row).view(s, k + 1, v)
            a, y = accept_keyed(p, self.next_q[rows.long()], buf.ids.view(s, k + 1)[:, 1:], forced, keys,
                                buf.pos0 + 1)
            buf.accepted.copy_(a)                          # spec.accept takes a as the "forced" count, y as t_a
            accepted, target = buf.accepted, y[:, None].expand(s, k + 1).contiguous()
        else:
            # t_j: argmax of the bf16 logits, through the model's greedy head where bound (no logits written)
            accepted, target = forced, m.greedy_tokens(h).view(s, k + 1)
        spec_accept(buf.ids.view(s, k + 1), target, accepted, buf.pos0, seq_lens, rows,
                    self.tables.slot_table[:s], self.kv.page_size, self.next_pos, buf.emitted, buf.last,
                    buf.draft_pos, buf.draft_map, buf.draft_lens, buf.result)

        # draft pass 1: every verify row, fed the token that follows it; row a of each sequence proposes d'_1
        dbatch = ForwardBatch(input_ids=buf.emitted.view(-1), positions=buf.positions, seqs=[],
                              slot_mapping=slot_mapping, kv=self.view, step=verify)
        normed, r2 = d(dbatch, fused)
        h_d = r2[buf.last]
        # sampled: d'_j sits at sequence index c + j (c = n + a + 1, the index of e_a): its draw's counter
        index = buf.pos0 + buf.accepted + 2 if sampled else None
        self._propose(normed[buf.last], 0, buf, params if sampled else None, index)
        for j, step in enumerate(passes):      # passes 2..K: one row per sequence at c + j (spec.accept)
            pbatch = ForwardBatch(input_ids=buf.drafted[j], positions=buf.draft_pos[j], seqs=[],
                                  slot_mapping=buf.draft_map[j], kv=self.view, step=step)
            normed, h_d = d(pbatch, h_d)
            self._propose(normed, j + 1, buf, params if sampled else None, None if index is None else index + j + 1)
        spec_commit(buf.result, buf.drafted, rows, self.next_ids)
        if sampled:
            self.next_q.index_copy_(0, rows.long(), buf.q)                    # padded rows: the padding row
        return buf.result

    def _propose(self, normed: torch.Tensor, j: int, buf: StepBuffers, params, index: torch.Tensor | None) -> None:
        """Draft d'_{j+1} (target vocabulary) of final-normed draft states [S, H] into buf.drafted[j]: greedy (the
        argmax reads the head's bf16 logits as they are: the fp32 copy Eagle3Drafter.logits makes holds the same
        values), or sampled from the rows' processed draft distribution q, kept in buf.q[:, j] for the next
        step's verification (keyed draw: stream TAG_DRAFT at sequence index `index`)."""
        d, out = self.drafter, buf.drafted[j]
        if params is None:
            if d.lm_head is not None:
                logits = d.lm_head(normed)
                if d.d2t is None:
                    torch.argmax(logits, dim=-1, out=out)
                    return
                ids = logits.argmax(-1)
            else:                     # the target's head: its greedy head where bound (no logits written)
                ids = self.model.greedy_tokens(normed.to(self.model.dtype))
                if d.d2t is None:
                    out.copy_(ids)
                    return
            torch.add(ids, d.d2t[ids], out=out)
            return
        temp, top_k, top_p, greedy, keys = params
        logits = d.logits(normed)                                            # [S, Vd] fp32
        vd = logits.shape[1]
        q = d.to_target_probs(processed_rows(logits, temp, top_k.clamp(max=vd), top_p, greedy))
        buf.q[:, j].copy_(q)
        out.copy_(keyed_categorical(q, keys, index, TAG_DRAFT))

    # ------------------------------------------------------------------ capture / replay
    def _variants(self) -> tuple[bool, ...]:
        return (False, True) if self.sampling else (False,)

    def capture(self, mode: str = "auto") -> None:
        """Capture every bucket (and variant), largest first, each after an eager warm-up (Triton compiles on first
        call, which capture forbids). Warm-up and capture run padding rows only: nothing is read or written in
        the cache. A bucket whose warm-up syncs the host (runtime/capture_check.py) or whose capture fails keeps
        no graph: `auto` logs the module and reason and runs that bucket's fixed-shape program eagerly;
        `require` raises GraphCaptureError naming it."""
        if not self.graphs:
            return
        dev = self.model.device
        self.binding = capture_check.binding_of(self.model, self.drafter)
        reserved = torch.cuda.memory_reserved(dev)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for bucket in sorted(self.buckets, reverse=True):
                for sampled in self._variants():
                    what = f"speculative ({'sampled' if sampled else 'greedy'}, K = {self.k})"
                    self.stage(bucket, [], [], [], [])
                    graph, out, blocker = capture_check.capture(lambda: self._program(bucket, sampled), self.model,
                                                                what, bucket, pool, stream)
                    if blocker is None:
                        self._result[bucket, sampled], self._graph[bucket, sampled] = out, graph
                    else:
                        self.blocked[bucket, sampled] = blocker
                        capture_check.handle(blocker, mode)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - reserved
        log.info("speculative graphs (K = %d) captured for buckets %s%s, %.0f MiB more reserved%s", self.k,
                 self.captured, " (greedy and sampled)" if self.sampling else "", self.memory_bytes / 2**20,
                 f"; eager programs for {sorted(self.blocked)}" if self.blocked else "")

    @property
    def captured(self) -> list[int]:
        """The buckets with a CUDA graph (of either variant)."""
        return sorted({b for b, _ in self._graph})

    def run(self, seq_ids: list[int], last_tokens: list[int], drafts: list[list[int]], positions: list[int],
            forced: list[int] | None = None, sampling: list | None = None,
            q: list[torch.Tensor | None] | None = None) -> SpecLaunched:
        """Stage, then replay (or run eagerly) one step, and queue the copy of its results to the host.
        sampling (one decode_graphs.sampling_row per row): the rejection-sampling variant; then q gives, per row
        staged from the host, its drafts' distributions [K, V] (None: greedy drafts, one-hot)."""
        bucket = self.bucket_for(len(seq_ids))
        if bucket is None:
            raise ValueError(f"seq_ids: {len(seq_ids)} sequences; the largest bucket is {self.buckets[-1]}")
        sampled = sampling is not None
        if sampled and not self.sampling:
            raise ValueError("sampling: these speculative graphs were built without the sampled variant")
        self.stage(bucket, seq_ids, last_tokens, drafts, positions, forced, sampling)
        if sampled:
            self._stage_q(seq_ids, drafts, positions, q)
        if (bucket, sampled) in self._graph:
            capture_check.check_binding(self.binding, (self.model, self.drafter), "speculative")
            self._graph[bucket, sampled].replay()
            result = self._result[bucket, sampled]
        else:
            with torch.inference_mode():
                result = self._program(bucket, sampled)
        self.replays += 1
        self.sampled_replays += sampled
        host, done = self._ring[self._next], self._events[self._next]
        self._next ^= 1
        host[:bucket].copy_(result, non_blocking=done is not None)
        if done is not None:
            done.record()
        return SpecLaunched(len(seq_ids), host, done)

    def _stage_q(self, seq_ids: list[int], drafts: list[list[int]], positions: list[int],
                 q: list[torch.Tensor | None] | None) -> None:
        """The drafts' distributions of the rows staged from the host into their table rows of next_q (rows taken
        from the device keep what their previous sampled step left there)."""
        rows = self.tables.manager.rows_of(seq_ids)
        with torch.inference_mode():
            for i, (row, pos) in enumerate(zip(rows.tolist(), positions)):
                if pos < 0:
                    continue
                dst = self.next_q[row]
                qi = None if q is None else q[i]
                if qi is None:
                    dst.zero_()
                    dst.scatter_(1, torch.tensor(drafts[i], device=dst.device).view(-1, 1), 1.0)
                else:
                    dst.copy_(qi)

    def q_of(self, seq_id: int) -> torch.Tensor:
        """[K, V] the distributions of the drafts a sequence's last sampled step left (a view: valid until that
        table row's next sampled step)."""
        return self.next_q[int(self.tables.manager.rows_of([seq_id])[0])]

    def fetch(self, launched: SpecLaunched) -> SpecResult:
        if launched.done is not None:
            launched.done.synchronize()
        k = self.k
        rows = launched.host[:launched.n].tolist()
        return SpecResult(emitted=[r[:r[k + 1]] for r in rows], drafts=[r[k + 2:] for r in rows])


__all__ = ["SpecSteps", "SpecLaunched", "SpecResult", "MAX_ROWS"]
