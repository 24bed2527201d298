"""`m3serve eval`: compare two configurations on a task, with McNemar's exact test.

    python -m m3serve.eval [--model DIR] [--task synthetic|FILE.jsonl] [--limit N]
                           [--config-a reference:fp32] [--config-b reference:bf16] [--json OUT]

A configuration is "kind[:options]". Built in: `reference[:fp32|bf16]`, the stock model's
cache-free greedy generation (m3serve.eval.reference). Engines add their kinds with
`register_config(kind, builder)`, builder(model_dir, options, device) -> generate_fn.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from m3serve.eval.harness import Comparison, GenerateFn, compare, format_report
from m3serve.eval.tasks import load_task

Builder = Callable[[str, str, str], GenerateFn]
BUILDERS: dict[str, Builder] = {}


def default_model_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "m3-tiny-verse"


def register_config(kind: str, builder: Builder) -> None:
    if not kind or ":" in kind:
        raise ValueError(f"kind: expected a non-empty name without ':', found {kind!r}")
    BUILDERS[kind] = builder


def build_config(spec: str, model_dir: str, device: str) -> GenerateFn:
    kind, _, options = spec.partition(":")
    if kind not in BUILDERS:
        raise ValueError(f"configuration {spec!r}: expected a kind in {sorted(BUILDERS)}, found {kind!r}")
    return BUILDERS[kind](model_dir, options, device)


def _reference_builder(model_dir: str, options: str, device: str) -> GenerateFn:
    import torch

    from m3serve.eval.reference import make_reference_generate_fn
    from m3serve.model.loader import load_model
    from m3serve.train.tokenizer import load_tokenizer

    dtypes = {"": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}
    if options not in dtypes:
        raise ValueError(f"reference options: expected one of {sorted(k for k in dtypes if k)}, found {options!r}")
    model = load_model(model_dir, device=device, dtype=dtypes[options])
    return make_reference_generate_fn(model, load_tokenizer(model_dir))


register_config("reference", _reference_builder)


def _engine_builder(model_dir: str, options: str, device: str) -> GenerateFn:
    """`engine[:key=value,...]` with keys dtype (fp32|bf16|auto), kv (auto|bf16|fp8|nvfp4), max_tokens,
    route (off|auto|require: the stock path or the decode target), eager (1: no CUDA graphs), max_seqs, kv_gib
    (the KV cache's GiB on a GPU, default 2), rot (the hybrid cache's K/V rotation: a seed, `off`, or `auto` =
    the model's kv_scales.json), fp8 (sparse layers the hybrid cache keeps in FP8, `+`-separated, e.g. fp8=2;
    `none`; default the kv_scales.json's list), kv_scales (a kv_scales.json path, or `none`)."""
    from m3serve.engine.sampling_params import SamplingParams
    from m3serve.llm import LLM

    opts = dict(kv.split("=", 1) for kv in options.split(",") if kv) if options else {}
    keys = ("dtype", "kv", "max_tokens", "route", "eager", "max_seqs", "kv_gib", "rot", "fp8", "kv_scales")
    unknown = set(opts) - set(keys)
    if unknown:
        raise ValueError(f"engine options: unknown keys {sorted(unknown)}; expected one of {', '.join(keys)}")
    extra = {"route": opts["route"]} if "route" in opts else {}
    if "max_seqs" in opts:
        extra["max_num_seqs"] = int(opts["max_seqs"])
    if device.startswith("cuda"):
        # an eval builds two engines in one process: each gets a fixed KV budget (kv_gib, default 2) rather than
        # "90 % of the GPU", which the first would take from the second
        extra["kv_cache_bytes"] = int(float(opts.get("kv_gib", 2)) * (1 << 30))
    rot = opts.get("rot", "auto")
    extra["kv_rotation"] = None if rot == "off" else rot if rot == "auto" else int(rot)
    fp8 = opts.get("fp8", "auto")
    extra["kv_fp8_layers"] = "auto" if fp8 == "auto" else () if fp8 == "none" else tuple(
        int(i) for i in fp8.split("+"))
    if "kv_scales" in opts:
        extra["kv_scales"] = None if opts["kv_scales"] == "none" else opts["kv_scales"]
    llm = LLM(model_dir, device=device, dtype=opts.get("dtype", "auto"), kv_cache_dtype=opts.get("kv", "auto"),
              enforce_eager=opts.get("eager", "0") == "1", **extra)
    params = SamplingParams(max_tokens=int(opts.get("max_tokens", 64)), temperature=0.0)

    def generate(prompts: list[str]) -> list[str]:
        ids = [{"prompt_token_ids": llm.tokenizer.encode(p, add_special_tokens=False)} for p in prompts]
        return [o.outputs[0].text for o in llm.generate(ids, params, use_tqdm=False)]

    return generate


register_config("engine", _engine_builder)


def _recorded_builder(model_dir: str, options: str, device: str) -> GenerateFn:
    """`recorded:FILE.json#CONFIG`: the outputs configuration CONFIG produced in an earlier `--json` run (for
    instance on another machine), looked up by prompt. Every prompt asked for must have been recorded."""
    from m3serve.train.tokenizer import chat_prompt

    path, sep, name = options.partition("#")
    if not sep or not path or not name:
        raise ValueError(f"recorded options: expected FILE.json#CONFIG, found {options!r}")
    doc = json.loads(Path(path).read_text())
    if name not in doc.get("configs", {}):
        raise ValueError(f"recorded {path}: no configuration {name!r}; it has {sorted(doc.get('configs', {}))}")
    by_prompt = {chat_prompt(it["question"]): it[f"{name}.output"] for it in doc.get("items", [])}

    def generate(prompts: list[str]) -> list[str]:
        missing = [p for p in prompts if p not in by_prompt]
        if missing:
            raise ValueError(f"recorded {path}: {len(missing)} prompts were not recorded, e.g. {missing[0][:80]!r}")
        return [by_prompt[p] for p in prompts]

    return generate


register_config("recorded", _recorded_builder)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=str(default_model_dir()), help="checkpoint directory")
    ap.add_argument("--task", default="synthetic", help="'synthetic' or a jsonl of {question, answer}")
    ap.add_argument("--limit", type=int, default=None, help="first N items only")
    ap.add_argument("--config-a", default="engine:kv=bf16", help="kind[:options]: engine[:dtype=,kv=,max_tokens=,route=,eager=,max_seqs=], "
                                                                 "reference[:fp32|bf16] or recorded:FILE.json#CONFIG")
    ap.add_argument("--config-b", default="engine:kv=nvfp4")
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per generate_fn call (default: all)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--json", default=None, help="write the full result (with per-item outputs) here")


def _agreement_tokenizer(model_dir: str):
    """The model's own tokenizer for the greedy-agreement count; a directory without one (a registered
    configuration that is not a checkpoint) counts characters instead, and the result says so."""
    if not (Path(model_dir) / "tokenizer.json").exists():
        return list
    from m3serve.train.tokenizer import load_tokenizer
    tok = load_tokenizer(model_dir)
    return lambda text: tok.encode(text, add_special_tokens=False)


def run(args: argparse.Namespace) -> Comparison:
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.config_a == args.config_b:
        raise ValueError(f"config_b: expected a configuration different from config_a, found {args.config_b!r} twice")
    items = load_task(args.task, args.model, args.limit)
    configs = {s: build_config(s, args.model, args.device) for s in (args.config_a, args.config_b)}
    cmp = compare(items, configs, batch_size=args.batch_size, tokenize=_agreement_tokenizer(args.model))
    print(format_report(cmp))
    if args.json:
        from m3serve.benchmeta import run_metadata
        doc = {**run_metadata(), **cmp.to_dict(include_items=True),
               "agreement_unit": "tokens" if (Path(args.model) / "tokenizer.json").exists() else "characters"}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return cmp


def register(subparsers) -> None:
    """The `m3serve eval` subcommand."""
    p = subparsers.add_parser("eval", help="accuracy of two configurations on a task, with McNemar's test",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=lambda args: (run(args), 0)[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="m3serve eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    run(ap.parse_args(argv))
    return 0
