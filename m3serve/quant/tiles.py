"""The weight layouts of the quantized formats: "rows" (as checkpoints store them) or "mma_tile" (the permutation
inside blocks of 16 rows x 128 columns that the decode target's kernels read; nvfp4.tile_nvfp4 and
mxfp8.tile_mxfp8 say how). One entry point per question, for any format:

    tileable(fmt, w, s)                whether the tile layout covers this weight (N % 16 == 0, K % 128 == 0)
    to_layout(fmt, w, s, src, dst)     (w, s) from one layout to the other (the same tensors when src == dst)

fmt is a QWeight format name; w / s are its per-row tensors (nvfp4: packed, scale; mxfp8: q, scale).
"""

from __future__ import annotations

from torch import Tensor

from m3serve.quant.mxfp8 import check_tileable_mxfp8, tile_mxfp8, untile_mxfp8
from m3serve.quant.nvfp4 import check_tileable, tile_nvfp4, untile_nvfp4

LAYOUTS = ("rows", "mma_tile")
TILED_FORMATS = ("nvfp4", "mxfp8")
ROW_KEYS = {"nvfp4": ("packed", "scale"), "mxfp8": ("q", "scale")}  # the per-row tensors a layout permutes

_OPS = {"nvfp4": (check_tileable, tile_nvfp4, untile_nvfp4), "mxfp8": (check_tileable_mxfp8, tile_mxfp8, untile_mxfp8)}


def tileable(fmt: str, w: Tensor, s: Tensor) -> bool:
    if fmt not in _OPS:
        return False
    try:
        _OPS[fmt][0](w, s)
    except ValueError:
        return False
    return True


def to_layout(fmt: str, w: Tensor, s: Tensor, src: str, dst: str) -> tuple[Tensor, Tensor]:
    for name, lay in (("src", src), ("dst", dst)):
        if lay not in LAYOUTS:
            raise ValueError(f"{name}: expected a weight layout of {LAYOUTS}, found {lay!r}")
    if src == dst:
        return w, s
    if fmt not in _OPS:
        raise ValueError(f"fmt: the MMA tile layout is defined for {TILED_FORMATS}, found {fmt!r}")
    _, tile, untile = _OPS[fmt]
    return tile(w, s) if dst == "mma_tile" else untile(w, s)
