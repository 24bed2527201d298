"""`m3serve explain`: per module and decode batch bucket, the catalog entry and certified cell that runs on the
decode target, or why the module runs stock.

    m3serve explain                                   # the embedded model, buckets 1 and 8
    m3serve explain --model minimax-m3:4 --random-weights --quantization nvfp4 --kv-cache-dtype nvfp4 \\
        --device cuda --batch 1,4,16
"""

from __future__ import annotations

from m3serve.cli import _add_model_args, build_llm
from m3serve.targets.explain import explain


def routing_note(device_type: str) -> str | None:
    """Off CUDA nothing is routed: say so before the placements, which describe a GPU run."""
    if device_type == "cuda":
        return None
    return (f"device {device_type}: routing is off here (every module runs the stock torch path); the placements "
            "below are what a CUDA run with route=auto would use")


def cmd_explain(args) -> int:
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
    for p in rows:
        print(p.line())
    stock = sum(p.entry is None for p in rows)
    print(f"{len(rows) - stock} placements on certified entries or capturable torch, {stock} stock")
    return 0


def register(sub) -> None:
    p = sub.add_parser("explain", help="which catalog entry and cell each module runs on the decode target")
    _add_model_args(p)
    p.add_argument("--batch", default="1,8", help="decode batch buckets to explain (comma list)")
    p.set_defaults(fn=cmd_explain)
