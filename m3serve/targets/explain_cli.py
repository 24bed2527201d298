"""`m3serve explain`: per module and decode batch bucket, the catalog entry and certified cell that runs on the
decode target, or why the module runs stock.

    m3serve explain                                   # the embedded model, buckets 1 and 8
    m3serve explain --model minimax-m3:4 --random-weights --quantization nvfp4 --kv-cache-dtype nvfp4 \\
        --device cuda --batch 1,4,16
    m3serve explain --device cuda --graph-memory     # the graphs' buckets and what their capture reserved
"""

from __future__ import annotations

import sys

import torch

from m3serve.cli import _add_model_args, build_llm
from m3serve.targets.explain import explain
from m3serve.targets.routing import weight_layouts


def routing_note(device_type: str) -> str | None:
    """Off CUDA nothing is routed: say so before the placements, which describe a GPU run."""
    if device_type == "cuda":
        return None
    return (f"device {device_type}: routing is off here (every module runs the stock torch path); the placements "
            "below are what a CUDA run with route=auto would use")


def weight_layout_line(model) -> str:
    """How a CUDA target run holds the model's NVFP4 / MXFP8 weights (routing.weight_layouts)."""
    placed = weight_layouts(model, "mma_tile")
    if not placed:
        return "weights: no NVFP4 / MXFP8 linears (nothing to lay out)"
    counts: dict[tuple[str, str], int] = {}
    for lin, lay in placed:
        counts[(lin.fmt, lay)] = counts.get((lin.fmt, lay), 0) + 1
    parts = [f"{n} {fmt} {'in MMA tiles' if lay == 'mma_tile' else 'row-major (not tileable)'}"
             for (fmt, lay), n in sorted(counts.items())]
    return "weights on a CUDA target run: " + ", ".join(parts)


def graph_memory_lines(engine) -> list[str]:
    """One line per captured set of CUDA graphs: its buckets and the device memory its capture reserved."""
    sets = engine.graph_sets()
    lines = [f"{name} graphs: {g.memory_bytes / 2**20:.0f} MiB reserved at capture; buckets {list(g.captured)}"
             for name, g in sets.items()]
    total = sum(g.memory_bytes for g in sets.values())
    lines.append(f"CUDA graphs in all: {total / 2**20:.0f} MiB" if sets else "no CUDA graphs captured")
    runner = engine.runner
    if getattr(runner, "working_memory", None) is not None:
        lines.append(f"memory plan (reserved before the KV cache): {runner.working_memory.describe()}")
        measured = runner.measured_working_bytes()
        lines.append(f"taken since the KV cache was allocated: {measured / 2**30:.2f} GiB "
                     f"({'within' if measured <= runner.working_memory.total else 'ABOVE'} the plan)")
    return lines


def cmd_graph_memory(args) -> int:
    """--graph-memory: build the engine as `m3serve serve` would (route auto, graphs captured) and report what the
    graphs cost; a CUDA run only (capture needs the device)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cuda":
        print(f"explain --graph-memory: the graphs are captured and measured on CUDA only (--device cuda), found "
              f"device {device}", file=sys.stderr)
        return 2
    llm = build_llm(args)
    for line in graph_memory_lines(llm.engine):
        print(line)
    return 0


def cmd_explain(args) -> int:
    if args.graph_memory:
        return cmd_graph_memory(args)
    buckets = tuple(int(b) for b in args.batch.split(","))
    args.route = "off"                       # placements are computed, nothing is compiled or captured
    llm = build_llm(args, max_num_seqs=max(buckets))
    eng = llm.engine
    width = eng.runner.certified_table_width()
    rows = explain(llm.model, eng.kv, width, buckets)
    print(f"model {args.model or 'm3-tiny-verse'}: KV {eng.kv.spec.split_summary()}; block tables {width} pages wide")
    note = routing_note(llm.device.type)
    if note:
        print(note)
    print(weight_layout_line(llm.model))
    for p in rows:
        print(p.line())
    stock = sum(p.entry is None for p in rows)
    print(f"{len(rows) - stock} placements on certified entries or capturable torch, {stock} stock")
    return 0


def register(sub) -> None:
    p = sub.add_parser("explain", help="which catalog entry and cell each module runs on the decode target")
    _add_model_args(p)
    p.add_argument("--batch", default="1,8", help="decode batch buckets to explain (comma list)")
    p.add_argument("--graph-memory", action="store_true",
                   help="build the engine with its CUDA graphs (as serve does) and report each set's buckets and the "
                        "device memory its capture reserved (--device cuda)")
    p.set_defaults(fn=cmd_explain)
