"""The decode step as CUDA graphs: one graph per batch bucket, replayed from the step's staged upload.

A pure decode step (every scheduled request computes one token and samples the next) is padded to the
smallest bucket >= its batch size and runs as:

    host   pack [rows | change | token seq | positions | token ids, seq lens | changed table rows] into one
           pinned buffer (DeviceBlockTables.stage with pad_to=bucket)
    H2D    one copy                                   (stage views sit at fixed offsets for a bucket)
    device one graph replay: table rows -> slot table, token slots (expand_staged, captured), input ids (a staged id, or -1 = "the token this row's request sampled in the
           previous graph step", kept on the device) -> embed -> L x (norms, projections, kv.write,
           [msa.scores, msa.select], attn.paged, o_proj, MoE) -> head -> argmax (the greedy variant takes the
           model's greedy head when bound: head GEMV + argmax of the bf16 logits, no logits written) (or, in the sampling
           variant, temperature and the keyed exponential race: the `sample.race` kernel where a processed variant
           exists to take the steps whose rows ask for top-k / top-p, else the torch sampler with those passes; in
           the processed variant, penalties / logit_bias / min_tokens and the structured-output token masks from
           the staged state rows first, then the torch sampler, the tokens counted after)
           -> remember it per row
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

from m3serve.engine.sampler import sample_rows
from m3serve.kernels import _jit
from m3serve.kernels.sample import race
from m3serve.model.m3 import ForwardBatch
from m3serve.runtime import capture_check
from m3serve.runtime.step_inputs import PagedStep, bucket_for, sparse_tiles_per_block, split_plan
from m3serve.targets.dispatch import lookup

log = logging.getLogger("m3serve")

# The payload of a decode step, S int32 values each, in this order (after the positions of the stage).
PAYLOAD = ("token_ids", "seq_lens", "temperature", "top_k", "top_p", "key_lo", "key_hi", "penalty_row")


def stage_offsets(bucket: int) -> dict[str, slice]:
    """Where a decode bucket's inputs sit in the staged upload (DeviceBlockTables.prepare's layout with
    S = T = bucket: [rows S | change S | token seq S | positions S | payload 8S | changed rows])."""
    s = bucket
    out = {"positions": slice(3 * s, 4 * s)}
    for i, name in enumerate(PAYLOAD):
        out[name] = slice((4 + i) * s, (5 + i) * s)
    return out


SamplingRow = tuple[int, int, int, int, int]   # one row's staged (temperature, top_k, top_p, key_lo, key_hi)
_ONE_BITS = int(np.float32(1.0).view(np.int32))


def _i32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


def sampling_row(temperature: float, top_k: int, top_p: float, key: int) -> SamplingRow:
    """A request's sampling parameters as the int32 values the decode step stages (computed once per request):
    temperature and top_p as fp32 bit patterns, top_k raw (0 / -1: off), the 63-bit key as two halves."""
    bits = np.array([temperature, top_p], dtype=np.float32).view(np.int32)
    return int(bits[0]), int(top_k), int(bits[1]), _i32(key & 0xFFFFFFFF), _i32((key >> 32) & 0xFFFFFFFF)


def pack_decode(bucket: int, token_ids: list[int], positions: list[int], sampling=None,
                penalty_rows: list[int] | None = None, neutral_row: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host arrays for one padded decode step: (token seq index [S], positions [S], payload [8S] int32).
    The payload carries each row's token id, sequence length, sampling_row values (a list of them, or their int32
    array [n, 5]) and penalty-state row
    (m3serve.engine.penalties). Padded rows (and every row when `sampling` is None): position 0, token 0,
    sequence length 0, greedy (temperature 0), top_p 1, the neutral penalty row."""
    n, s = len(token_ids), bucket
    pos = np.zeros(s, dtype=np.int32)
    pos[:n] = positions
    extra = np.zeros(len(PAYLOAD) * s, dtype=np.int32)
    extra[:n] = token_ids
    np.add(pos[:n], 1, out=extra[s:s + n])
    if sampling is not None:
        extra[2 * s:7 * s].reshape(5, s)[:, :n] = np.asarray(sampling, dtype=np.int32).T
    extra[4 * s + (n if sampling is not None else 0):5 * s] = _ONE_BITS
    extra[7 * s:8 * s] = neutral_row
    if penalty_rows is not None:
        extra[7 * s:7 * s + n] = penalty_rows
    return np.arange(s, dtype=np.int32), pos, extra


def staged_sampling(stage: torch.Tensor, bucket: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """The device view of pack_decode's sampling payload -> sample_rows' arguments (temperature, top_k, top_p,
    greedy, keys, counters) for a bucket; pure tensor ops on the staged int32 buffer (graph-safe)."""
    off = stage_offsets(bucket)
    counters = stage[off["positions"]].long() + 1          # the index of the token being drawn
    return sampling_tensors(*(stage[off[name]] for name in SAMPLING_FIELDS), vocab) + (counters,)


GREEDY_ROW = sampling_row(0.0, 0, 1.0, 0)     # temperature 0: the row's argmax in every sampling variant


def race_config(bucket: int, vocab: int) -> race.RaceConfig | None:
    """sample.race's config for a bucket's sampling variant (its dispatch table row), None where no cell serves."""
    entry = lookup("sample.race", bucket, (vocab,), "auto")
    return None if entry is None else entry.cell_for(bucket, (vocab,)).config["race"]


def filtered(sampling: np.ndarray, vocab: int) -> bool:
    """Whether any row of the int32 sampling rows [n, 5] asks for top-k (0 < k < V) or top-p (< 1): passes the
    sample.race kernel does not run."""
    k = sampling[:, 1]
    return bool(((k > 0) & (k < vocab)).any() or (sampling[:, 2] != _ONE_BITS).any())

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "key_lo", "key_hi")   # a sampling_row, in order


def sampling_tensors(temp_bits: torch.Tensor, top_k: torch.Tensor, top_p_bits: torch.Tensor, key_lo: torch.Tensor,
                     key_hi: torch.Tensor, vocab: int) -> tuple[torch.Tensor, ...]:
    """Staged sampling_row fields (int32 [S] device views) -> (temperature, top_k, top_p, greedy, keys) as
    processed_rows / sample_rows take them; graph-safe tensor ops (the decode and speculative graphs)."""
    temp_raw = temp_bits.view(torch.float32)
    greedy = temp_raw == 0
    k_raw = top_k.long()
    return (torch.where(greedy, 1.0, temp_raw), torch.where((k_raw > 0) & (k_raw < vocab), k_raw, vocab),
            top_p_bits.view(torch.float32), greedy, (key_hi.long() << 32) | (key_lo.long() & 0xFFFFFFFF))


@dataclass
class Launched:
    """A replayed step whose tokens may not have arrived on the host yet."""
    bucket: int
    n: int                      # real rows (the first n of the bucket)
    host: torch.Tensor          # pinned [bucket] int64 ring slot
    done: torch.cuda.Event      # recorded after the D2H copy
    logits: torch.Tensor | None = None   # [bucket, V] the replayed variant's logits (None: it wrote none)


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph
    step: PagedStep
    tokens: torch.Tensor        # [S] int64 greedy tokens (graph output)
    logits: torch.Tensor | None  # [S, V] fp32 (graph output; read only when a row samples or wants logprobs);
                                 # None in a greedy variant that runs the model's greedy head


# Buckets of at least this many rows are captured with programmatic dependent launch (kernels/_jit.py), the
# smaller ones without, whatever kernels._jit.PDL_ENABLED (the eager launches' switch) says; a value past the
# largest bucket captures none with it. From 8 rows: on the H100 PDL measured
# 1.1-1.3 % faster at batch 8 with the same tokens and level to 3 % slower at batch 1 (bench/results/decode/
# decode-target-h100-m3_{5,12}-pdl8.json, route target-pdl8 beside target; -round11.json, route target-pdl for
# every bucket); on the H200, with every bucket, minimax-m3:24 9.73 against 9.81 ms at batch 8 and 4.14 against
# 4.22 at 1, but minimax-m3:5 1-3 % slower at 1 (decode-target-h200-m3_24-rings.json, decode-target-h200-pdl-*.json).
# The smaller buckets stay without, as the shallow models measured them.
PDL_FROM_BUCKET: int = 8


class DecodeGraphs:
    """sampling=True also captures, per bucket, a variant that samples on the device (temperature, top-k, top-p,
    per-request keys: m3serve.engine.sampler.sample_rows) from the staged parameters; greedy steps replay the
    plain argmax variant, so they pay nothing for it. With the sampling variant and a bound greedy head
    (model.greedy_head), the greedy variant writes no logits; a step that needs them (run(want_logits=True))
    replays the sampling variant with every row greedy."""

    def __init__(self, model, kv, tables, buckets: tuple[int, ...], sampling: bool = True, penalties=None,
                 token_masks=None, race_sampler: bool | None = None, pdl_from: int | None = None):
        if model.device.type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a CUDA model, found {model.device}")
        self.model, self.kv, self.tables = model, kv, tables
        self.buckets = tuple(sorted(buckets))
        # pdl_from: buckets of at least this many rows captured with PDL, the rest without (None: PDL_FROM_BUCKET)
        self.pdl_from = PDL_FROM_BUCKET if pdl_from is None else pdl_from
        if self.pdl_from < 1:
            raise ValueError(f"pdl_from: expected a bucket size >= 1 (or None for PDL_FROM_BUCKET), "
                             f"found {self.pdl_from}")
        if not self.buckets or self.buckets[-1] > tables.manager.max_seqs:
            raise ValueError(f"buckets: expected sizes in [1, max_num_seqs = {tables.manager.max_seqs}], "
                             f"found {buckets}")
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Bucket] = {}            # greedy variant per bucket
        self.sampling = sampling
        self.sampled_graphs: dict[int, _Bucket] = {}    # sampling variant per bucket (when sampling)
        # With a PenaltyState (and sampling): a third variant per bucket applies penalties / logit_bias /
        # min_tokens from the state rows staged per batch row, samples, and counts the tokens in place.
        self.penalties = penalties if sampling else None
        # With TokenMaskRows (and penalties): the processed variant also applies each row's allowed-token mask
        # (structured output) after the penalties; rows without a grammar point at all-allowed mask rows.
        self.token_masks = token_masks if self.penalties is not None else None
        self.processed_graphs: dict[int, _Bucket] = {}
        # The sampling variant's draw per bucket: the sample.race kernel's config, or None (the torch sampler).
        # The kernel reads temperature alone, so it is bound only where the processed variant exists to take the
        # steps whose rows ask for top-k / top-p (run() routes them there with neutral state rows: the identity).
        # race_sampler: None = the entry's switch (race.ENABLED), False = the torch sampler (the bench's baseline).
        on = self.penalties is not None and (race.ENABLED if race_sampler is None else race_sampler)
        self.race = {b: race_config(b, model.cfg.vocab_size) if on else None for b in self.buckets}
        self.filtered_replays = 0   # sampling steps sent to the processed variant for their top-k / top-p rows
        self.replays = 0
        self.sampled_replays = 0                         # of them, on the sampling variant
        # The token each block-table row's request sampled in the last graph step (the padding row included).
        self.tok_by_row = torch.zeros(tables.manager.max_seqs + 1, dtype=torch.int64, device=model.device)
        # Two pinned slots: step n's tokens stay readable while step n+1's copy is queued.
        top = self.buckets[-1]
        self._ring = [(torch.empty(top, dtype=torch.int64, pin_memory=True), torch.cuda.Event()) for _ in range(2)]
        self._next = 0
        self._offsets: dict[int, tuple[int, ...]] = {}   # bucket -> staged layout its graph expands
        self.blocked: dict[int, capture_check.CaptureBlocker] = {}   # buckets left eager, and why
        self.captured: tuple[int, ...] = ()                          # buckets with graphs (after capture)
        # the greedy variant's head: the fused greedy head (no logits) when the sampling variant can supply logits
        self.fused_greedy = sampling and getattr(model, "greedy_head", None) is not None
        self.memory_bytes = 0       # device memory the capture reserved (its pool, static outputs), measured
        self.binding = capture_check.binding_of(model)   # the kernel binding the graphs capture (capture sets it)

    # ------------------------------------------------------------------ capture
    def _forward(self, bucket: int, step: PagedStep, variant: str = "greedy") -> tuple[torch.Tensor, torch.Tensor]:
        off = stage_offsets(bucket)
        self.tables.expand_staged(bucket, bucket, self._offsets[bucket])   # staged rows -> tables, token slots
        stage = self.tables._dev_stage
        rows = stage[:bucket].long()
        staged = stage[off["token_ids"]].long()
        ids = torch.where(staged >= 0, staged, self.tok_by_row[rows])
        batch = ForwardBatch(input_ids=ids, positions=stage[off["positions"]].long(),
                             seqs=[], slot_mapping=self.tables.slot_mapping_out[:bucket], kv=self.kv, step=step)
        if variant == "greedy" and self.fused_greedy:
            return self._remember(rows, self.model.greedy_tokens(self.model.hidden(batch))), None
        logits = self.model(batch)
        if variant == "greedy":
            tokens = logits.argmax(-1)
        else:
            scores = logits
            if variant == "processed":
                prow = stage[off["penalty_row"]].long()
                scores = self.penalties.apply(logits, prow)
                if self.token_masks is not None:
                    scores = self.token_masks.apply(scores, prow)
            if variant == "sampled" and self.race[bucket] is not None:
                tokens = self._race(stage, bucket, logits)
            else:
                tokens = sample_rows(scores, *staged_sampling(stage, bucket, logits.shape[1]))
            if variant == "processed":
                self.penalties.record(prow, tokens)
        return self._remember(rows, tokens), logits

    def _race(self, stage: torch.Tensor, bucket: int, logits: torch.Tensor) -> torch.Tensor:
        """sample.race over the staged temperature (fp32 bits; 0 = greedy), key halves and positions."""
        off = stage_offsets(bucket)
        tokens = torch.empty(bucket, dtype=torch.int64, device=logits.device)
        return race.sample_race(logits, stage[off["temperature"]].view(torch.float32), stage[off["key_lo"]],
                                stage[off["key_hi"]], stage[off["positions"]], tokens, self.race[bucket])

    def _remember(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        self.tok_by_row.index_copy_(0, rows, tokens)   # padded rows all land on the padding row
        return tokens

    def _variants(self) -> list[tuple[str, dict]]:
        out = [("greedy", self.graphs)]
        if self.sampling:
            out.append(("sampled", self.sampled_graphs))
        if self.penalties is not None:
            self.penalties.ensure_allocated()
            out.append(("processed", self.processed_graphs))
        return out

    def _stage(self, bucket: int, seq_ids: list[int], token_ids: list[int], positions: list[int],
               sampling: list[SamplingRow] | None = None, penalty_rows: list[int] | None = None) -> None:
        neutral = self.penalties.neutral if self.penalties is not None else 0
        tsi, pos, extra = pack_decode(bucket, token_ids, positions, sampling, penalty_rows, neutral)
        s, t, offsets = self.tables.stage(seq_ids, tsi, pos, extra=extra, pad_to=bucket)
        if self._offsets.setdefault(bucket, offsets) != offsets or (s, t) != (bucket, bucket):
            raise AssertionError(f"bucket {bucket}: staged layout {(s, t, offsets)} differs from the captured one")

    def _safe_inputs(self, bucket: int) -> None:
        """Stage a step of padding rows only: the warm-up run before capture reads and writes nothing in the
        cache (every row is the padding row: slot 0, token slot -1, sequence length 0)."""
        self._stage(bucket, [], [], [])

    def capture(self, mode: str = "auto") -> None:
        """Capture every bucket, largest first (later, smaller graphs reuse the shared pool's blocks). A bucket
        whose warm-up syncs the host (a module on a path that capture forbids, runtime/capture_check.py) or
        whose capture fails is left out: `auto` logs the module and reason and that bucket's batches run
        eagerly; `require` raises GraphCaptureError naming it."""
        dev = self.model.device
        self.binding = capture_check.binding_of(self.model)
        reserved = torch.cuda.memory_reserved(dev)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(stream):
            sparse_tiles = sparse_tiles_per_block(self.kv.spec)
            for bucket in sorted(self.buckets, reverse=True):
                off = stage_offsets(bucket)
                dense, sparse = split_plan(bucket, self.tables.max_blocks, self.kv.spec.num_kv_heads,
                                           self.model.cfg.index_topk_blocks, sparse_tiles)
                step = PagedStep(slot_table=self.tables.slot_table[:bucket],
                                 seq_lens=self.tables._dev_stage[off["seq_lens"]],
                                 query_start=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
                                 max_query_len=1, num_splits=dense, num_splits_sparse=sparse)
                blocker = None
                for variant, store in self._variants():
                    self._safe_inputs(bucket)
                    with _jit.pdl_launches(bucket >= self.pdl_from):
                        graph, out, blocker = capture_check.capture(lambda: self._forward(bucket, step, variant),
                                                                    self.model, f"decode ({variant})", bucket,
                                                                    self.pool, stream)
                    if blocker is not None:
                        break
                    store[bucket] = _Bucket(graph, step, *out)
                if blocker is not None:
                    for _, store in self._variants():
                        store.pop(bucket, None)
                    self.blocked[bucket] = blocker
                    capture_check.handle(blocker, mode)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        self.captured = tuple(b for b in self.buckets if b in self.graphs)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - reserved
        log.info("decode graphs captured for buckets %s, %.0f MiB more reserved%s", self.captured,
                 self.memory_bytes / 2**20, f" (eager: {sorted(self.blocked)})" if self.blocked else "")

    # ------------------------------------------------------------------ replay
    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured bucket holding `batch` sequences (None: run the step eagerly)."""
        return bucket_for(batch, self.captured)

    def run(self, seq_ids: list[int], token_ids: list[int], positions: list[int],
            sampling: list[SamplingRow] | None = None, penalty_rows: list[int] | None = None,
            want_logits: bool = False) -> Launched:
        """Stage, prepare and replay one padded decode step, then queue the copy of its tokens to the host.
        token_ids[i] = -1: row i's input is the token its request sampled in the previous graph step.
        sampling: each row's sampling_row(...) to sample on the device (temperature 0: that row's argmax);
        None: every row greedy. penalty_rows: each row's PenaltyState row (the neutral one for
        rows without processing), with `sampling` given; None: no penalties this step. want_logits: the step's
        logits must be readable (`logits`); a greedy step then replays a variant that writes them."""
        bucket = self.bucket_for(len(seq_ids))
        if bucket is None:
            raise ValueError(f"seq_ids: {len(seq_ids)} sequences; no captured graph bucket holds them "
                             f"(captured: {self.captured})")
        if sampling is not None and not self.sampling:
            raise ValueError("sampling: these graphs were captured without the sampling variant")
        if penalty_rows is not None and (self.penalties is None or sampling is None):
            raise ValueError("penalty_rows: needs graphs captured with a PenaltyState, and the rows' sampling")
        if want_logits and sampling is None and self.fused_greedy:
            sampling = [GREEDY_ROW] * len(seq_ids)     # the sampling variant's logits; temperature 0 is argmax
        capture_check.check_binding(self.binding, (self.model,), "decode")
        if sampling is not None:   # one conversion a step: the routing test below and the staged payload read it
            sampling = np.asarray(sampling, dtype=np.int32).reshape(-1, 5)
        if (penalty_rows is None and sampling is not None and self.race[bucket] is not None
                and filtered(sampling, self.model.cfg.vocab_size)):
            penalty_rows = [self.penalties.neutral] * len(seq_ids)   # the processed variant's torch sampler
            self.filtered_replays += 1
        self._stage(bucket, seq_ids, token_ids, positions, sampling, penalty_rows)   # the graph expands it
        store = (self.processed_graphs if penalty_rows is not None
                 else self.sampled_graphs if sampling is not None else self.graphs)
        g = store[bucket]
        self.sampled_replays += sampling is not None
        g.graph.replay()
        self.replays += 1
        host, done = self._ring[self._next]
        self._next ^= 1
        host[:bucket].copy_(g.tokens, non_blocking=True)
        done.record()
        return Launched(bucket, len(seq_ids), host, done, g.logits)

    def logits(self, launched: Launched) -> torch.Tensor:
        """[n, V] fp32 logits of a launched step (valid until the same bucket's variant replays again)."""
        if launched.logits is None:
            raise ValueError("logits: this step replayed the greedy variant, which writes none (launch it with "
                             "want_logits=True)")
        return launched.logits[:launched.n]

    @staticmethod
    def fetch_tokens(launched: Launched) -> list[int]:
        """The step's greedy tokens: waits for its event only (later queued work keeps running)."""
        launched.done.synchronize()
        return launched.host[:launched.n].tolist()
