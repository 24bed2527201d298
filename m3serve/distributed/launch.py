"""Start a tensor-parallel group: spawn the worker processes ourselves, or join the group torchrun started.

  spawn     (no RANK/WORLD_SIZE in the environment) the calling process is rank 0: it opens a TCP store on a
            free port, starts ranks 1..N-1 as `python -m m3serve.distributed.worker` (fresh interpreters, so
            a user script without an `if __name__ == "__main__"` guard is not re-executed), waits for each to
            say hello, then every rank joins the process groups. Rank r uses cuda:(base + r) or the CPU.
  torchrun  (RANK and WORLD_SIZE set, or a default group already initialised) every process is a rank;
            rank r uses cuda:LOCAL_RANK. Rank 0 drives; the others follow inside LLM(...) and exit when rank
            0 shuts down.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from m3serve.distributed.context import CONTROL_TIMEOUT, TPContext, WorkerDiedError

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_GENERATION = itertools.count()   # torchrun mode: one store prefix per LLM, the same sequence on every rank


@dataclass
class TPLaunchSpec:
    """Everything a rank needs to build its model shard and KV cache (JSON-serialisable)."""
    model: str
    world_size: int
    device: str = "cpu"                 # "cpu" | "cuda" | "cuda:k" (spawn: rank r on cuda:k+r)
    dtype: str = "float32"
    seed: int = 0
    random_weights: bool = False
    quantization: str | None = None
    keep_quantized: bool | None = None
    kv_cache_dtype: str = "auto"
    index_k_dtype: str = "auto"
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    timeout_s: float = 600.0            # model-group collectives (NCCL / gloo)
    load_timeout_s: float = 3600.0      # loading a shard and start-up handshakes
    grace_s: float = 60.0               # rank 0 stuck in a step after a worker died: exit after this long
    speculative_config: dict | None = None   # Eagle3 speculation: every rank builds the same (replicated) drafter
    working_memory_bytes: int = 0       # the steps' working memory each rank keeps free of its KV cache

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            if self.dtype not in _DTYPE_NAMES:
                raise TypeError(f"dtype: expected one of {list(_DTYPE_NAMES)}, found {self.dtype}")
            self.dtype = _DTYPE_NAMES[self.dtype]
        if self.dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype: expected one of {list(_DTYPE_NAMES.values())}, found {self.dtype!r}")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 2:
            raise ValueError(f"tensor_parallel_size: a launched group needs >= 2 ranks, found {self.world_size!r}")
        dev = torch.device(self.device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device: tensor parallelism runs on 'cpu' (gloo) or 'cuda' (NCCL), found {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def rank_device(self, rank: int, local_rank: int | None = None) -> torch.device:
        dev = torch.device(self.device)
        if dev.type == "cpu":
            return dev
        index = local_rank if local_rank is not None else (dev.index or 0) + rank
        return torch.device("cuda", index)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TPLaunchSpec":
        return cls(**json.loads(text))


_SPAWNED: list[TPContext] = []   # live groups this process started (spawn mode): at most one


def under_torchrun() -> bool:
    """A launcher's environment, or a default group that someone other than m3serve's spawn set up."""
    live = [c for c in _SPAWNED if not c.closed]
    _SPAWNED[:] = live
    if live:
        raise RuntimeError("this process already runs a tensor-parallel LLM (rank 0 of its own group); call "
                           "shutdown() on it before starting another")
    return dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_groups(rank: int, world_size: int, device: torch.device, spec: TPLaunchSpec, store) -> object:
    """Join the model group (the default group) and create the gloo control group; returns the latter."""
    timeout = _dt.timedelta(seconds=spec.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def start(spec: TPLaunchSpec) -> TPContext:
    """This process's TPContext: rank 0 of a freshly spawned group, or its rank in torchrun's group."""
    return _join_torchrun(spec) if under_torchrun() else _spawn(spec)


def _check_devices(spec: TPLaunchSpec, first: torch.device, last: torch.device) -> None:
    if first.type == "cuda":
        n = torch.cuda.device_count()
        if last.index >= n:
            raise ValueError(f"tensor_parallel_size {spec.world_size}: needs GPUs {first.index}..{last.index}, "
                             f"found {n} visible")


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _spawn(spec: TPLaunchSpec) -> TPContext:
    device = spec.rank_device(0)
    _check_devices(spec, device, spec.rank_device(spec.world_size - 1))
    store = dist.TCPStore("127.0.0.1", 0, spec.world_size, True, timeout=_dt.timedelta(seconds=60),
                          wait_for_workers=False)
    procs: dict[int, subprocess.Popen] = {}
    ctx = TPContext(rank=0, world_size=spec.world_size, device=device, store=store, control=None,
                    launcher="spawn", procs=procs, grace_s=spec.grace_s)
    try:
        env = _worker_env()
        for r in range(1, spec.world_size):
            procs[r] = subprocess.Popen(
                [sys.executable, "-m", "m3serve.distributed.worker", "--rank", str(r), "--port", str(store.port),
                 "--parent", str(os.getpid()), "--spec", spec.to_json()], env=env, stdin=subprocess.DEVNULL)
        ctx.wait_followers("hello", timeout_s=min(spec.load_timeout_s, 300.0))
        ctx.control = init_groups(0, spec.world_size, device, spec, dist.PrefixStore("pg", store))
        ctx.start_watchdog()
        _SPAWNED.append(ctx)
        return ctx
    except BaseException:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        ctx.closed = True
        raise


def _join_torchrun(spec: TPLaunchSpec) -> TPContext:
    owns = not dist.is_initialized()
    if owns:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
    if world != spec.world_size:
        raise ValueError(f"tensor_parallel_size {spec.world_size} but the launcher started {world} ranks "
                         "(WORLD_SIZE); they must be equal")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = spec.rank_device(rank, local_rank=local)
    _check_devices(spec, device, device)
    timeout = _dt.timedelta(seconds=spec.timeout_s)
    if owns:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    store = dist.PrefixStore(f"m3serve/{next(_GENERATION)}", dist.distributed_c10d._get_default_store())
    return TPContext(rank=rank, world_size=world, device=device, store=store, control=control,
                     launcher="torchrun", owns_default_group=owns, grace_s=spec.grace_s)


__all__ = ["TPLaunchSpec", "start", "init_groups", "under_torchrun", "WorkerDiedError"]
