"""The decode step as CUDA graphs: one graph per batch bucket, replayed from the step's staged upload.

A pure decode step (every scheduled request computes one token and samples the next) is padded to the
smallest bucket >= its batch size and runs as:

    host   pack [rows | change | token seq | positions | token ids, seq lens | changed table rows] into one
           pinned buffer (DeviceBlockTables.stage with pad_to=bucket)
    H2D    one copy                                   (stage views sit at fixed offsets for a bucket)
    device one graph replay: table rows -> slot table, token slots (expand_staged, captured), input ids (a staged id, or -1 = "the token this row's request sampled in the
           previous graph step", kept on the device) -> embed -> L x (norms, projections, kv.write,
           [msa.scores, msa.select], attn.paged, o_proj, MoE) -> head -> argmax -> remember it per row
    D2H    the bucket's token ids (8 bytes per row) into a pinned ring slot, then an event

Because a step's input can come from the previous step's output on the device, the host may launch step n+1
before it has read step n's tokens (the engine's overlap loop): it syncs on step n's event only after step
n+1 is queued, so its own work hides behind the GPU's.

Padded rows use the block tables' padding row (slot 0 everywhere, token slot -1) and sequence length 0, so
the kernels neither read nor write the cache for them. Graphs share one private memory pool; every kernel is
compiled by an eager warm-up run before its capture (Triton compiles on first call, which capture forbids).

Shape legend: S bucket size (sequences = query tokens), B max pages per sequence, V vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from m3serve.model.m3 import ForwardBatch
from m3serve.targets.attention import PagedStep, split_plan

log = logging.getLogger("m3serve")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `batch` sequences, or None when the batch is larger than every bucket."""
    for b in buckets:
        if b >= batch:
            return b
    return None


def buckets_up_to(max_num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The default buckets that a batch of at most max_num_seqs can use (the largest one covering it)."""
    out = [b for b in buckets if b < max_num_seqs]
    top = bucket_for(max_num_seqs, buckets)
    if top is not None:
        out.append(top)
    return tuple(out)


def stage_offsets(bucket: int) -> dict[str, slice]:
    """Where a decode bucket's inputs sit in the staged upload (DeviceBlockTables.prepare's layout with
    S = T = bucket and the payload [token ids S | seq lens S])."""
    s = bucket
    return {"positions": slice(3 * s, 4 * s), "token_ids": slice(4 * s, 5 * s), "seq_lens": slice(5 * s, 6 * s)}


def pack_decode(bucket: int, token_ids: list[int], positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host arrays for one padded decode step: (token seq index [S], positions [S], payload [2S] int32).
    Padded rows: position 0, token 0, sequence length 0."""
    n = len(token_ids)
    pos = np.zeros(bucket, dtype=np.int32)
    pos[:n] = positions
    extra = np.zeros(2 * bucket, dtype=np.int32)
    extra[:n] = token_ids
    extra[bucket:bucket + n] = pos[:n] + 1
    return np.arange(bucket, dtype=np.int32), pos, extra


@dataclass
class Launched:
    """A replayed step whose tokens may not have arrived on the host yet."""
    bucket: int
    n: int                      # real rows (the first n of the bucket)
    host: torch.Tensor          # pinned [bucket] int64 ring slot
    done: torch.cuda.Event      # recorded after the D2H copy


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph
    step: PagedStep
    tokens: torch.Tensor        # [S] int64 greedy tokens (graph output)
    logits: torch.Tensor        # [S, V] fp32 (graph output; read only when a row samples or wants logprobs)


class DecodeGraphs:
    def __init__(self, model, kv, tables, buckets: tuple[int, ...]):
        if model.device.type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a CUDA model, found {model.device}")
        self.model, self.kv, self.tables = model, kv, tables
        self.buckets = tuple(sorted(buckets))
        if not self.buckets or self.buckets[-1] > tables.manager.max_seqs:
            raise ValueError(f"buckets: expected sizes in [1, max_num_seqs = {tables.manager.max_seqs}], "
                             f"found {buckets}")
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Bucket] = {}
        self.replays = 0
        # The token each block-table row's request sampled in the last graph step (the padding row included).
        self.tok_by_row = torch.zeros(tables.manager.max_seqs + 1, dtype=torch.int64, device=model.device)
        # Two pinned slots: step n's tokens stay readable while step n+1's copy is queued.
        top = self.buckets[-1]
        self._ring = [(torch.empty(top, dtype=torch.int64, pin_memory=True), torch.cuda.Event()) for _ in range(2)]
        self._next = 0
        self._offsets: dict[int, tuple[int, ...]] = {}   # bucket -> staged layout its graph expands

    # ------------------------------------------------------------------ capture
    def _forward(self, bucket: int, step: PagedStep) -> tuple[torch.Tensor, torch.Tensor]:
        off = stage_offsets(bucket)
        self.tables.expand_staged(bucket, bucket, self._offsets[bucket])   # staged rows -> tables, token slots
        stage = self.tables._dev_stage
        rows = stage[:bucket].long()
        staged = stage[off["token_ids"]].long()
        ids = torch.where(staged >= 0, staged, self.tok_by_row[rows])
        batch = ForwardBatch(input_ids=ids, positions=stage[off["positions"]].long(),
                             seqs=[], slot_mapping=self.tables.slot_mapping_out[:bucket], kv=self.kv, step=step)
        logits = self.model(batch)
        tokens = logits.argmax(-1)
        self.tok_by_row.index_copy_(0, rows, tokens)   # padded rows all land on the padding row
        return tokens, logits

    def _stage(self, bucket: int, seq_ids: list[int], token_ids: list[int], positions: list[int]) -> None:
        tsi, pos, extra = pack_decode(bucket, token_ids, positions)
        s, t, offsets = self.tables.stage(seq_ids, tsi, pos, extra=extra, pad_to=bucket)
        if self._offsets.setdefault(bucket, offsets) != offsets or (s, t) != (bucket, bucket):
            raise AssertionError(f"bucket {bucket}: staged layout {(s, t, offsets)} differs from the captured one")

    def _safe_inputs(self, bucket: int) -> None:
        """Stage a step of padding rows only: the warm-up run before capture reads and writes nothing in the
        cache (every row is the padding row: slot 0, token slot -1, sequence length 0)."""
        self._stage(bucket, [], [], [])

    def capture(self) -> None:
        """Capture every bucket, largest first (later, smaller graphs reuse the shared pool's blocks)."""
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for bucket in sorted(self.buckets, reverse=True):
                off = stage_offsets(bucket)
                dense, sparse = split_plan(bucket, self.tables.max_blocks, self.kv.spec.num_kv_heads,
                                           self.model.cfg.index_topk_blocks)
                step = PagedStep(slot_table=self.tables.slot_table[:bucket],
                                 seq_lens=self.tables._dev_stage[off["seq_lens"]],
                                 query_start=torch.arange(bucket + 1, dtype=torch.int32, device=self.model.device),
                                 max_query_len=1, num_splits=dense, num_splits_sparse=sparse)
                self._safe_inputs(bucket)
                self._forward(bucket, step)                 # compile + allocate the step's scratch
                torch.cuda.synchronize(self.model.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    tokens, logits = self._forward(bucket, step)
                self.graphs[bucket] = _Bucket(graph, step, tokens, logits)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        torch.cuda.synchronize(self.model.device)
        log.info("decode graphs captured for buckets %s", self.buckets)

    # ------------------------------------------------------------------ replay
    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(batch, self.buckets)

    def run(self, seq_ids: list[int], token_ids: list[int], positions: list[int]) -> Launched:
        """Stage, prepare and replay one padded decode step, then queue the copy of its greedy tokens to the host.
        token_ids[i] = -1: row i's input is the token its request sampled in the previous graph step."""
        bucket = self.bucket_for(len(seq_ids))
        if bucket is None:
            raise ValueError(f"seq_ids: {len(seq_ids)} sequences; the largest graph bucket is {self.buckets[-1]}")
        self._stage(bucket, seq_ids, token_ids, positions)      # the graph's first op expands it on the device
        g = self.graphs[bucket]
        g.graph.replay()
        self.replays += 1
        host, done = self._ring[self._next]
        self._next ^= 1
        host[:bucket].copy_(g.tokens, non_blocking=True)
        done.record()
        return Launched(bucket, len(seq_ids), host, done)

    def logits(self, launched: Launched) -> torch.Tensor:
        """[n, V] fp32 logits of a launched step (valid until the same bucket replays again)."""
        return self.graphs[launched.bucket].logits[:launched.n]

    @staticmethod
    def fetch_tokens(launched: Launched) -> list[int]:
        """The step's greedy tokens: waits for its event only (later queued work keeps running)."""
        launched.done.synchronize()
        return launched.host[:launched.n].tolist()
