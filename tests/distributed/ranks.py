"""Run a function on N gloo ranks (CPU processes) and collect what each returns.

`run_ranks(fn, n, *args)` spawns n processes; each joins a gloo group through a file store, calls
fn(rank, n, *args) and pickles the result for the parent. A rank that raises fails the call with its
traceback (torch.multiprocessing kills the other ranks), so a broken collective cannot hang a test.
"""

from __future__ import annotations

import os
import pickle
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, n: int, store: str, out: str, args: tuple) -> None:
    torch.set_num_threads(1)   # n ranks share 2 CI cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    try:
        result = fn(rank, n, *args)
        with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, n: int, *args) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(fn, n, store, tmp, args), nprocs=n, join=True, start_method="spawn")
        out = []
        for r in range(n):
            with open(os.path.join(tmp, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out
