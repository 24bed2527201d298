"""Compile every certified cell's kernels for sm_90 without a GPU and report resource use.

    python -m m3serve.kernels.aot_check [--entry NAME] [--sass-dir DIR]

Each entry's raw call runs on 'meta' tensors of the real shapes inside capture_launches, so
the exact compiled variants (constexprs, 16-byte divisibility, ==1 specialisation) are
collected without allocating memory; each distinct variant is then built with Triton's own
ptxas and read back with cuobjdump. A register spill (stack > 0) is reported; a build error
fails. This is a CPU-side guard: it proves compilation and shows the code size, not speed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from m3serve.kernels._jit import AotResult, aot_compile, capture_launches
from m3serve.kernels.catalog import Entry, all_entries

META = torch.device("meta")


def _variant_key(kern, args, kwargs) -> tuple:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    spec = []
    for a in args:
        ty, attr = native_specialize_impl(BaseBackend, a, False, True, True)
        spec.append((ty, attr if isinstance(attr, (str, int, float, bool, type(None))) else str(attr)))
    return (kern.__name__, tuple(spec), tuple(sorted((k, str(v)) for k, v in kwargs.items())))


def collect(entries: list[Entry]) -> dict[tuple, tuple]:
    """Distinct (kernel, specialisation) -> (entry name, cell why, kernel, args, kwargs)."""
    variants: dict[tuple, tuple] = {}
    for e in entries:
        for cell in e.cells:
            for rows in sorted({cell.rows[0], cell.rows[1]}):
                case = e.make_case(cell, rows, META, None)
                with capture_launches() as rec:
                    e.raw_call(*case.args, **case.kwargs)
                for kern, _grid, args, kwargs in rec:
                    variants.setdefault(_variant_key(kern, args, kwargs), (e.name, cell.why, kern, args, kwargs))
    return variants


def run(entries: list[Entry], arch: int = 90, sass_dir: str | None = None) -> list[tuple[str, str, AotResult]]:
    out = []
    for key, (ename, why, kern, args, kwargs) in collect(entries).items():
        res = aot_compile(kern, args, kwargs, arch=arch, sass=sass_dir is not None)
        if sass_dir is not None and res.sass:
            os.makedirs(sass_dir, exist_ok=True)
            with open(os.path.join(sass_dir, f"{ename}.{kern.__name__}.{abs(hash(key)) % 10**8}.sass"), "w") as f:
                f.write(f"# {why}\n# {kwargs}\n{res.sass}")
        out.append((ename, why, res))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entry", action="append", help="entry name (repeatable); default: all")
    ap.add_argument("--sass-dir", default=None)
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args(argv)
    ents = all_entries()
    chosen = [ents[n] for n in a.entry] if a.entry else list(ents.values())
    spills = 0
    for ename, why, r in run(chosen, a.arch, a.sass_dir):
        flag = "  SPILL" if r.stack > 0 or r.local > 0 else ""
        spills += bool(flag)
        print(f"{ename:14s} {r.name:20s} regs {r.regs:3d} stack {r.stack:4d} smem {r.shared:6d}{flag}  [{why}]")
    print(f"done; {spills} variant(s) with spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
