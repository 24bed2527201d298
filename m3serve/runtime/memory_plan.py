"""The memory plan: what a GPU engine needs besides its weights and its KV cache, reserved BEFORE the cache is
sized.

The cache takes what `gpu_memory_utilization` leaves once everything else is counted. Everything else is the
weights (already allocated when the runner starts: measured) and the working memory of the steps to come (not
allocated yet: planned here). Without the plan the cache took all of `util x total - used`, the CUDA graphs' pools
then found no room (the largest speculative graphs failed to capture and ran eagerly), and the engine thread's
first cuBLAS call could not create its handle (seen on the 80 GB H100: minimax-m3:5 NVFP4 + Eagle3 at 128
sequences, every request failed).

vLLM measures one forward pass of the largest step before it sizes the cache. Here the steps' working memory is
estimated from the shapes (every term below names the tensors it stands for), and start-up measures what was
really taken once the graphs are captured and the warm-up has run every step class (`measured_working_bytes`):
the log, `m3serve explain --graph-memory` and the engine's stats show both, and a plan below the measurement is
logged as a warning (a GPU test holds the plan above it at the configurations we serve).

Terms, for V = vocab, H = hidden, T = tokens of the largest eager step, R = rows a graph samples:
    eager step     T x step_bytes_per_token (activations of one layer at a time, the MoE's per-slot buffers,
                   the indexer's block scores) + the decode-once expert scratch (quantized experts from 4096 rows)
                   + the sampled rows' logits and sampler temporaries
    graph pools    per family (decode, speculative, prefill): its largest bucket's working set, plus the static
                   logits every bucket keeps (the sampled and processed variants' [R, V] fp32 outputs)
    engine state   penalties / logit-bias rows ([S, V] fp32 x2 + bool x2), token masks, the draft rows' q [S, K, V]
    driver         cuBLAS / cuBLASLt handles and workspaces of each thread that launches, allocator fragmentation
"""

from __future__ import annotations

from dataclasses import dataclass

from m3serve.kernels.moe.grouped import DECODE_ONCE_ROWS, GroupedConfig
from m3serve.runtime.step_inputs import buckets_up_to

# bytes per [row, vocab] element while a sampled row is processed: the fp32 logits, the temperature-scaled copy,
# the top-k sort (fp32 values + int64 indices), softmax, the top-p sort (values + int64 order) and its cumsum,
# masks and the noise race: engine.sampler.sample_rows peaked at 56 B per logit on the H200 (64 rows of minimax-m3's
# vocabulary, top-k and top-p on; tests/runtime/test_no_cliffs_gpu.py holds it below this)
SAMPLER_BYTES_PER_LOGIT = 64
# the decode-once band's expert scratch (EXPERT_GROUP experts' gate|up in bf16) is used from DECODE_ONCE_ROWS rows
# of one step, for quantized experts only (kernels/moe/grouped.py)
DECODE_ONCE_EXPERTS = GroupedConfig.EXPERT_GROUP
# cuBLAS / cuBLASLt handles and workspaces per launching thread (the engine thread, the loader's), the CUDA
# graphs' own bookkeeping and the caching allocator's fragmentation
DRIVER_RESERVE_BYTES = 1 << 30


def step_bytes_per_token(cfg, max_model_len: int) -> int:
    """Activations one token of an eager step holds at the peak of a layer (bf16 unless named): the residual
    stream and its norms (16 H), the q|k|v|index projections and attention output (3x), the MoE's per-slot
    gate|up, activation and expert output (2x for the grouped kernels' padded copies), the shared expert and the
    dense MLP, and the indexer's fp32 block scores per index head over the longest context."""
    h = cfg.hidden_size
    attn = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    index = (cfg.index_n_heads + 1) * cfg.index_head_dim if "sparse" in cfg.layer_types else 0
    moe = cfg.num_experts_per_tok * (3 * cfg.intermediate_size + h) if "moe" in cfg.mlp_layer_types else 0
    shared = 3 * cfg.shared_intermediate_size if "moe" in cfg.mlp_layer_types else 0
    dense = 3 * cfg.dense_intermediate_size if "dense" in cfg.mlp_layer_types else 0
    bf16 = 2 * (16 * h + 3 * (attn + index) + 2 * moe + shared + dense)
    blocks = -(-max_model_len // cfg.index_block_size)
    scores = 4 * cfg.index_n_heads * blocks if "sparse" in cfg.layer_types else 0
    return bf16 + scores


def sampled_rows_bytes(rows: int, vocab: int) -> int:
    return rows * vocab * SAMPLER_BYTES_PER_LOGIT


@dataclass(frozen=True)
class WorkingMemory:
    """Planned bytes per use (see the module docstring); `total` is what the KV cache leaves free."""
    eager_step: int
    decode_graphs: int
    spec_graphs: int
    prefill_graphs: int
    engine_state: int
    driver: int

    @property
    def total(self) -> int:
        return (self.eager_step + self.decode_graphs + self.spec_graphs + self.prefill_graphs + self.engine_state
                + self.driver)

    def describe(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.2f}" for k, v in self.__dict__.items() if v)
        return f"{self.total / 2**30:.2f} GiB ({parts})"


def plan_working_memory(cfg, *, max_num_seqs: int, max_num_batched_tokens: int, max_step_tokens: int,
                        max_model_len: int, graphs: bool, prefill_graph_tokens: int = 0, spec_k: int = 0,
                        quantized_experts: bool = False) -> WorkingMemory:
    """The working memory of an engine with these limits. graphs: the decode target's CUDA graphs will be
    captured (decode buckets up to max_num_seqs; with spec_k > 0 also the speculative ones, R = S (K + 1) verify
    rows; prefill graphs up to prefill_graph_tokens). quantized_experts: the MoE experts are NVFP4 / MXFP8 / FP8
    (the prefill band decodes them once per step into a bf16 scratch)."""
    for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("max_step_tokens", max_step_tokens), ("max_model_len", max_model_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_working_memory: {name} must be a positive int, found {v!r}")
    vocab, s = cfg.vocab_size, max_num_seqs
    per_token = step_bytes_per_token(cfg, max_model_len)
    t = max(max_num_batched_tokens, max_step_tokens)
    eager = t * per_token + sampled_rows_bytes(min(t, s), vocab)
    if quantized_experts and t >= DECODE_ONCE_ROWS and "moe" in cfg.mlp_layer_types:
        eager += DECODE_ONCE_EXPERTS * 2 * cfg.intermediate_size * cfg.hidden_size * 2
    decode = spec = prefill = 0
    if graphs:
        buckets = buckets_up_to(s)
        # the sampled and processed variants keep their [R, V] fp32 logits per bucket; the pool's working set is
        # the largest bucket's
        decode = 2 * sum(buckets) * vocab * 4 + s * per_token + sampled_rows_bytes(s, vocab)
        if spec_k:
            rows = s * (spec_k + 1)
            spec = (sum(buckets) * (spec_k + 1) * vocab * 4 + rows * per_token + sampled_rows_bytes(rows, vocab)
                    + s * spec_k * vocab * 4)   # the step's draft distributions q [S, K, V]
        tokens = min(prefill_graph_tokens, max_num_batched_tokens)
        if tokens:
            prefill = tokens * per_token + sampled_rows_bytes(min(tokens, s), vocab)
    state = s * vocab * (4 + 4 + 1 + 1) + s * vocab // 8
    if spec_k:
        state += (s + 1) * spec_k * vocab * 4        # next_q: each row's drafts' distributions between steps
    return WorkingMemory(eager_step=eager, decode_graphs=decode, spec_graphs=spec, prefill_graphs=prefill,
                         engine_state=state, driver=DRIVER_RESERVE_BYTES)


def experts_quantized(model) -> bool:
    """True when some MoE expert weight is held quantized (NVFP4 / MXFP8 / FP8): the prefill band's scratch."""
    return any(getattr(m, "num_experts", None) and getattr(m, "fmt", "dense") not in ("dense", "unset")
               for m in model.modules())


def kv_budget_bytes(free: int, total: int, gpu_memory_utilization: float, working: WorkingMemory | int) -> int:
    """What the KV cache may take: the utilization's share of the card, less what is in use now (weights, other
    processes), less the planned working memory (a WorkingMemory, or its bytes). Raises ValueError naming the
    figures when nothing is left."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: expected a fraction in (0, 1], found {gpu_memory_utilization}")
    reserve = working.total if isinstance(working, WorkingMemory) else int(working)
    what = working.describe() if isinstance(working, WorkingMemory) else f"{reserve / 2**30:.2f} GiB"
    allowed = int(gpu_memory_utilization * total)
    used = total - free
    budget = allowed - used - reserve
    if budget <= 0:
        raise ValueError(
            f"KV cache: no memory left: gpu_memory_utilization {gpu_memory_utilization} allows "
            f"{allowed / 2**30:.2f} GiB of {total / 2**30:.2f} GiB, {used / 2**30:.2f} GiB are in use (weights, "
            f"other processes) and the steps' working memory needs {what}; raise gpu_memory_utilization, or "
            f"lower max_num_seqs / max_num_batched_tokens / the speculative tokens")
    return budget


__all__ = ["WorkingMemory", "plan_working_memory", "experts_quantized", "kv_budget_bytes", "step_bytes_per_token",
           "sampled_rows_bytes", "SAMPLER_BYTES_PER_LOGIT", "DRIVER_RESERVE_BYTES"]
