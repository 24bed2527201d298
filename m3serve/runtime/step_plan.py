"""A step's shape plan on the decode target: the graph bucket ladder every padded decode step runs in, and the
split-KV factors attn.paged uses for a step of that many rows (the same for an eager step and the graph of its
bucket, so both sum in the same order)."""

from __future__ import annotations

from m3serve.kernels.attention.paged import choose_num_splits, tile_config

# Buckets of sequences per decode step; a configuration uses those up to max_num_seqs (buckets_up_to), so the
# default max_num_seqs = 64 ends at 64 and a larger one extends through 96, 128, ... (and max_num_seqs itself past
# the last). Each bucket costs its graph's retained outputs (logits [S, V] fp32 per variant) in the shared pool.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `batch` sequences, or None when the batch is larger than every bucket."""
    for b in buckets:
        if b >= batch:
            return b
    return None


def buckets_up_to(max_num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a batch of at most max_num_seqs can use: the defaults below it, then max_num_seqs itself as
    the last (so every batch size the scheduler can form has a graph and no bucket pads past the limit)."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: expected a positive int, found {max_num_seqs!r}")
    return tuple(b for b in buckets if b < max_num_seqs) + (max_num_seqs,)


def sparse_tiles_per_block(spec) -> int:
    """Key tiles attn.paged walks per selected block on the MSA layers of a cache spec (tile_config: NVFP4
    pages go in half-page tiles); the most over the sparse layers' formats."""
    fmts = {spec.kv_format(i) for i in spec.sparse_layers}
    return max((spec.page_size // tile_config(1, spec.page_size, 1, True, f == "nvfp4").BN for f in fmts), default=1)


def split_plan(query_rows: int, max_blocks: int, kv_heads: int, topk: int,
               sparse_tiles: int = 1) -> tuple[int, int]:
    """(dense, sparse) split-KV factors for a step of `query_rows` rows. Decode rows are rounded up to their
    graph bucket first, so an eager step and the graph of the same bucket split (and so sum) identically.
    MSA layers split over key tiles (topk blocks x sparse_tiles each): one tile per split is allowed, the
    fastest on the H200 at batch 1 (bench/results/kernel_variants/kernel-variants-h200.json)."""
    rows = bucket_for(query_rows, DEFAULT_BUCKETS) or query_rows
    dense = choose_num_splits(rows, max_blocks, kv_heads=kv_heads)
    sparse = choose_num_splits(rows, max(topk, 1) * sparse_tiles, kv_heads=kv_heads, min_blocks_per_split=1)
    return dense, sparse
