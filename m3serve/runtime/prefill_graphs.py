"""Eager steps as CUDA graphs: the forward of a step with prefill chunks (alone, or beside decoding rows) replayed
from static buffers, one graph per (token bucket, sequence bucket).

Why: an eager step launches every layer's kernels from Python, one by one, with each routed call's checks on the
host. At small models and short prompts that host work is the step: the embedded model (6 layers) takes ~10 ms for
one 128-token prompt on the H200 (bench/results/spec_serving_steps/), ~30x its decode graph step, and every running
stream waits for it on each arrival. A graph replays the same kernels from the device's own queue.

A step of T tokens in S sequences (T <= the largest token bucket) is padded to the smallest captured (Tb >= T,
Sb >= S) and runs as:

    host   the eager batch as ModelRunner.build_batch packs it (one staged upload, its PagedStep)
    device copies into the bucket's static views: token ids, positions, slot mapping, slot table rows, sequence
           lengths, query starts; the padding made inert (below)
           -> one graph replay: the model's layers at Tb rows -> hidden states [Tb, H] (and, for a speculative
           engine, the residual streams its drafter fuses, `capture_layers`)
    host   the head on the step's logits rows and the sampling, eagerly (a few launches), or the speculative eager
           step's fuse / verify / draft passes (engine/spec_runner.py)

Padding is inert, by the decode graphs' convention: the padded tokens (slot -1: kv.write skips them) are the query
rows of one padded sequence of length 0, whose rows every attention kernel sets to zeros without reading the cache;
the other padded sequences own no rows. Every other op is row-wise (norms, projections, MoE routing and experts
per token), so a padded row changes no real row. The graph's host ints are fixed per bucket: the attention
grids use max_query_len = Tb (programs past a sequence's own rows return at once) and split_plan(Tb, ...), and the
routed modules run their cells for Tb rows, which differ from the eager step's (T rows) by summation order only.

Shape legend: T / Tb tokens of the step / its bucket, S / Sb sequences / bucket, B max pages per sequence, V vocab.
"""

from __future__ import annotations

import logging

import torch

from m3serve.kernels.gemm._tiled import keep_outgrown_scratch
from m3serve.model.m3 import ForwardBatch
from m3serve.runtime import capture_check
from m3serve.runtime.step_inputs import PagedPlan, PagedStep, split_plan

log = logging.getLogger("m3serve")

MIN_GRAPH_TOKENS = 16
# Steps of more tokens always run eagerly: there the GEMMs outweigh the host's launches many times over, and from
# 4096 rows the MoE's decode-once band would put its 2.4 GB scratch (M3 dims) into the graphs.
MAX_GRAPH_TOKENS = 2048


def token_buckets(limit: int) -> tuple[int, ...]:
    """Powers of two from 16, with 1.5x steps between them from 128 (where the padded rows' GEMMs start to
    count: padding stays below 1.5x there), up to min(limit, MAX_GRAPH_TOKENS) (and that bound itself). Steps of
    more tokens run eagerly. () below 16."""
    limit = min(limit, MAX_GRAPH_TOKENS)
    out, p = [], MIN_GRAPH_TOKENS
    while p <= limit:
        out.append(p)
        if p >= 128 and p * 3 // 2 <= limit:
            out.append(p * 3 // 2)
        p *= 2
    if out and out[-1] != limit:
        out.append(limit)
    return tuple(sorted(set(out)))


def seq_buckets(max_seqs: int) -> tuple[int, ...]:
    """4, 16, 64, ... up to max_seqs (and max_seqs itself): a padded sequence costs a few programs that return at
    once, so the sequence buckets are coarse (a lone prompt shorter than its token bucket needs 2: its own and
    the padding sequence)."""
    out, s = [], 4
    while s < max_seqs:
        out.append(s)
        s *= 4
    return tuple(out) + (max_seqs,)


class _Graph:
    def __init__(self, graph, out: tuple[torch.Tensor, dict]):
        self.graph, self.out = graph, out

    def replay(self) -> None:
        self.graph.replay()


class _Eager:
    """The same padded static-buffer forward, run eagerly (graphs=False: CPU tests under the Triton interpreter)."""

    def __init__(self, forward):
        self.forward, self.out = forward, None

    def replay(self) -> None:
        self.out = self.forward()


class PrefillGraphs:
    """graphs=False keeps the padded static-buffer program but runs it eagerly (the CPU tests' form)."""

    def __init__(self, model, kv, tables, plan: PagedPlan, tokens: tuple[int, ...], seqs: tuple[int, ...],
                 graphs: bool = True, capture_layers: tuple[int, ...] = ()):
        if graphs and model.device.type != "cuda":
            raise ValueError(f"PrefillGraphs: CUDA graphs need a CUDA model, found {model.device}")
        if not tokens or not seqs:
            raise ValueError(f"PrefillGraphs: expected token and sequence buckets, found {tokens} / {seqs}")
        if tokens[-1] > tables.max_tokens or seqs[-1] > tables.manager.max_seqs:
            raise ValueError(f"PrefillGraphs: buckets up to {tokens[-1]} tokens / {seqs[-1]} sequences exceed the "
                             f"block tables' {tables.max_tokens} tokens / {tables.manager.max_seqs} sequences")
        self.model, self.kv, self.tables, self.plan = model, kv, tables, plan
        self.binding = capture_check.binding_of(model)   # the kernel binding the programs capture (capture sets it)
        self.use_graphs = graphs
        self.capture_layers = tuple(capture_layers)   # residual streams kept (an Eagle3 drafter's: ForwardBatch)
        self.tokens, self.seqs = tuple(sorted(tokens)), tuple(sorted(seqs))
        dev = model.device
        tmax, smax, b = self.tokens[-1], self.seqs[-1], tables.max_blocks
        self.input_ids = torch.zeros(tmax, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(tmax, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((tmax,), -1, dtype=torch.int64, device=dev)
        self.slot_table = torch.zeros(smax, b, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(smax, dtype=torch.int32, device=dev)
        self.query_start = torch.zeros(smax + 1, dtype=torch.int32, device=dev)
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.programs: dict[tuple[int, int], _Graph | _Eager] = {}
        self.blocked: dict[tuple[int, int], capture_check.CaptureBlocker] = {}
        self._workspaces: dict[int, dict] = {}     # Tb -> kernel scratch shared by that token bucket's steps
        self.replays = 0
        self.enabled = True                        # False: every step runs eagerly (the warm-up's first pass)
        self.memory_bytes = 0                      # device memory the capture reserved (its pool, workspaces)

    # ------------------------------------------------------------------ the program
    def _step(self, tb: int, sb: int) -> PagedStep:
        p = self.plan
        dense, sparse = split_plan(tb, self.tables.max_blocks, p.kv_heads, p.topk, p.sparse_tiles)
        # one scratch per token bucket: the buckets' replays never overlap (one stream)
        return PagedStep(slot_table=self.slot_table[:sb], seq_lens=self.seq_lens[:sb],
                         query_start=self.query_start[:sb + 1], max_query_len=tb, num_splits=dense,
                         num_splits_sparse=sparse, workspaces=self._workspaces.setdefault(tb, {}))

    def _forward(self, tb: int, step: PagedStep) -> tuple[torch.Tensor, dict]:
        batch = ForwardBatch(input_ids=self.input_ids[:tb], positions=self.positions[:tb], seqs=[],
                             slot_mapping=self.slot_mapping[:tb], kv=self.kv, step=step,
                             capture_layers=self.capture_layers)
        return self.model.hidden(batch), batch.captured

    def _inert(self, tb: int) -> None:
        """Inputs of a step with no real token (the warm-up before capture): every row a padding row of sequence 0,
        of length 0; nothing read or written in the cache."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.query_start.fill_(tb)
        self.query_start[0] = 0

    def capture(self, mode: str = "auto") -> None:
        """Build every bucket's program, largest first (smaller graphs reuse the shared pool's blocks). A bucket whose
        warm-up syncs the host or whose capture fails is left out: `auto` logs the module and reason and its steps
        run eagerly; `require` raises GraphCaptureError naming it."""
        if not self.use_graphs:
            for tb in self.tokens:
                for sb in self.seqs:
                    step = self._step(tb, sb)
                    self.programs[(tb, sb)] = _Eager(lambda tb=tb, step=step: self._forward(tb, step))
            return
        dev = self.model.device
        self.binding = capture_check.binding_of(self.model)
        reserved = torch.cuda.memory_reserved(dev)
        keep_outgrown_scratch()     # steps from 512 rows decode quantized weights into the process-wide scratch
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for tb in sorted(self.tokens, reverse=True):
                for sb in sorted(self.seqs, reverse=True):
                    step = self._step(tb, sb)
                    self._inert(tb)
                    graph, out, blocker = capture_check.capture(lambda: self._forward(tb, step), self.model,
                                                                f"prefill ({sb} sequences)", tb, self.pool, stream)
                    if blocker is None:
                        self.programs[(tb, sb)] = _Graph(graph, out)
                    else:
                        self.blocked[(tb, sb)] = blocker
                        capture_check.handle(blocker, mode)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - reserved
        log.info("prefill graphs captured: %d of %d buckets (tokens %s x sequences %s), %.0f MiB more reserved%s",
                 len(self.programs), len(self.tokens) * len(self.seqs), self.tokens, self.seqs,
                 self.memory_bytes / 2**20, f"; eager: {sorted(self.blocked)}" if self.blocked else "")

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (token bucket, sequence bucket) pairs replayed as CUDA graphs."""
        return sorted(key for key, prog in self.programs.items() if isinstance(prog, _Graph))

    # ------------------------------------------------------------------ replay
    def bucket_for(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The smallest built (Tb, Sb) holding the step, with room for the padding sequence when Tb > tokens (None:
        run it eagerly). A blocked bucket gives way to the next larger built one of the same token bucket."""
        tb = next((t for t in self.tokens if t >= tokens), None)
        if tb is None:
            return None
        need = seqs + (tb > tokens)
        return next(((tb, s) for s in self.seqs if s >= need and (tb, s) in self.programs), None)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The logits [R, V] of an eager step's batch (build_batch's: its PagedStep, R logits rows), from its
        bucket's program and the head on those rows; None when no bucket holds it (the caller runs it eagerly)."""
        h = self.hidden(batch)
        if h is None:
            return None
        return self.model.logits(h if batch.logits_rows is None else h[batch.logits_rows])

    def hidden(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The final hidden states [T, H] of an eager step's batch (its PagedStep given) from its bucket's program,
        and in batch.captured the residual streams of batch.capture_layers (which must be this program's), as
        views valid until the next replay; None when no bucket holds the step."""
        st = batch.step
        if not self.enabled or st is None or tuple(batch.capture_layers) not in ((), self.capture_layers):
            return None
        t, s = batch.input_ids.numel(), st.seq_lens.numel()
        key = self.bucket_for(t, s)
        if key is None or t == 0:
            return None
        tb, sb = key
        if st.slot_table.shape[1] != self.slot_table.shape[1]:
            raise ValueError(f"batch.step.slot_table: expected width {self.slot_table.shape[1]} (the tables' "
                             f"max_blocks at capture), found {tuple(st.slot_table.shape)}")
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slot_mapping[:t].copy_(batch.slot_mapping)
        self.slot_mapping[t:tb].fill_(-1)
        self.slot_table[:s].copy_(st.slot_table)
        self.seq_lens[:s].copy_(st.seq_lens)
        self.seq_lens[s:sb].zero_()
        self.query_start[:s + 1].copy_(st.query_start)
        self.query_start[s + 1:sb + 1].fill_(tb)      # padded sequence s owns rows t..tb-1, the others none
        prog = self.programs[key]
        if isinstance(prog, _Graph):
            capture_check.check_binding(self.binding, (self.model,), "prefill")
        prog.replay()
        self.replays += 1
        h, captured = prog.out
        for i in batch.capture_layers:
            batch.captured[i] = captured[i][:t]
        return h[:t]


__all__ = ["PrefillGraphs", "token_buckets", "seq_buckets", "MAX_GRAPH_TOKENS"]
