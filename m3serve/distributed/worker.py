"""A follower rank: load this rank's model shard and KV cache, then run every step rank 0 broadcasts.

Started by rank 0 as `python -m m3serve.distributed.worker --rank R --port P --parent PID --spec JSON`
(spawn mode), or reached from LLM(...) on ranks > 0 under torchrun (`serve_follower`). Any exception is
written to the store under `error/<rank>` (rank 0 reports it verbatim) and the process exits non-zero.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from m3serve.distributed.context import TPContext, destroy_groups
from m3serve.distributed.kv_slots import local_kv_slots, rank_kv_spec
from m3serve.distributed.launch import TPLaunchSpec, init_groups
from m3serve.distributed.protocol import run_step
from m3serve.distributed.spec_protocol import run_spec_op
from m3serve.engine.spec_runner import DraftLayerIO, SpecRunner
from m3serve.engine.speculative import SpecConfig, build_drafter
from m3serve.kv.cache import PagedKVCache
from m3serve.model.loader import load_model
from m3serve.runtime.step_inputs import HEADER_LEN, OP_STEP, OP_STOP, SPEC_OPS, payload_len, unpack_step

FAULT_ENV = "M3SERVE_TP_FAULT"   # tests: "<rank>:load" or "<rank>:step<N>" makes that rank fail there


def _fault(rank: int, where: str) -> None:
    if os.environ.get(FAULT_ENV) == f"{rank}:{where}":
        raise RuntimeError(f"injected fault ({FAULT_ENV}={rank}:{where})")


def follow(ctx: TPContext, model, kv: PagedKVCache, runner=None) -> int:
    """Run broadcast steps until rank 0 sends STOP; returns the number of steps run. runner: the
    speculative passes' SpecRunner (m3serve.engine.spec_runner) when rank 0 speculates."""
    draft_io = DraftLayerIO(kv) if runner is not None else None
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    step = 0
    while True:
        dist.broadcast(header, 0, group=ctx.control)
        op = int(header[0])
        if op == OP_STOP:
            return step
        spec_op = op in SPEC_OPS and runner is not None
        if (op != OP_STEP and not spec_op) or int(header[7]) != step:
            raise RuntimeError(f"rank {ctx.rank}: step protocol out of sync: expected step {step}, received "
                               f"op {op} step {int(header[7])}")
        payload = torch.empty(payload_len(header), dtype=torch.int64)
        dist.broadcast(payload, 0, group=ctx.control)
        _fault(ctx.rank, f"step{step}")
        if spec_op:
            run_spec_op(runner, header, payload, ctx.device, kv, draft_io)
        else:
            run_step(model, unpack_step(header, payload, ctx.device, kv), int(header[5]), int(header[6]))
        step += 1


def serve_follower(ctx: TPContext, spec: TPLaunchSpec) -> int:
    """Load, agree on the KV size with rank 0, follow. Errors are published for rank 0, then re-raised."""
    try:
        torch.manual_seed(spec.seed)
        _fault(ctx.rank, "load")
        model = load_model(spec.model, device=ctx.device, dtype=spec.torch_dtype, tp=ctx.tp,
                           random_weights=spec.random_weights, quantization=spec.quantization, seed=spec.seed,
                           keep_quantized=spec.keep_quantized)
        runner = None
        if spec.speculative_config is not None:        # the drafter is replicated: the same one as rank 0's
            drafter = build_drafter(SpecConfig.from_dict(spec.speculative_config), model).attach_target(model).eval()
            runner = SpecRunner(model, drafter)
        kv_spec = rank_kv_spec(model, spec.kv_cache_dtype, spec.index_k_dtype,
                               None if runner is None else runner.drafter.cfg.num_key_value_heads)
        ctx.store.set(f"slots/{ctx.rank}",
                      str(local_kv_slots(kv_spec, ctx.device, spec.kv_cache_bytes, spec.gpu_memory_utilization,
                                              spec.working_memory_bytes)))
        kv = PagedKVCache(kv_spec, int(ctx.wait_driver("go")), ctx.device)
        return follow(ctx, model, kv, runner)
    except BaseException:
        try:
            ctx.store.set(f"error/{ctx.rank}", f"rank {ctx.rank} on {ctx.device}:\n{traceback.format_exc()}")
        except Exception:
            pass
        raise


def _exit_with_parent(parent: int) -> None:
    """Spawn mode: die with rank 0 (a killed parent cannot tell us)."""
    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)
    threading.Thread(target=watch, name="m3serve-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m m3serve.distributed.worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    _exit_with_parent(args.parent)
    spec = TPLaunchSpec.from_json(args.spec)
    store = dist.TCPStore(args.host, args.port, spec.world_size, False, timeout=_dt.timedelta(seconds=60))
    device = spec.rank_device(args.rank)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)   # LLM's CPU policy: tiny decode ops lose more to OpenMP hand-off than they gain
    ctx = TPContext(rank=args.rank, world_size=spec.world_size, device=device, store=store, control=None,
                    launcher="spawn")
    try:
        store.set(f"hello/{args.rank}", str(os.getpid()))
        ctx.control = init_groups(args.rank, spec.world_size, device, spec, dist.PrefixStore("pg", store))
        serve_follower(ctx, spec)
    except BaseException:
        if os.getppid() != args.parent:
            os._exit(3)                      # rank 0 is gone: its own error (if any) is the one to read
        try:
            if not store.check([f"error/{args.rank}"]):
                store.set(f"error/{args.rank}", f"rank {args.rank}:\n{traceback.format_exc()}")
        except Exception:
            pass
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)                          # skip communicator teardown: a peer may be gone or desynchronised
    ctx.closed = True
    destroy_groups(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
