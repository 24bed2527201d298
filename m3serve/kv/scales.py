"""The per-layer K/V scales a model's cache starts from: reading `kv_scales.json` (written by `m3serve calibrate-kv`,
m3serve.kv.calibrate) or a checkpoint's k_scale / v_scale tensors, and applying them to a cache's NVFP4 layers.
`LLM` applies, in this order of preference, kv_scales.json, then the checkpoint's scales, and takes
kv_scales.json's `fp8_layers` as its default `kv_fp8_layers`. The file's fields: m3serve.kv.calibrate.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Sequence

from m3serve.kv import rotation
from m3serve.model.weights import SafetensorsSource, read_kv_cache_scales
from m3serve.quant.fp8 import FP8_MAX
from m3serve.quant.nvfp4 import E2M1_MAX

log = logging.getLogger("m3serve")

KV_SCALES_FILE = "kv_scales.json"
FILE_FORMAT = "m3serve.kv_scales"
FILE_VERSION = 1


ROTATION_KIND = "randomized-hadamard"


def rotation_record(head_dim: int, seed: int) -> dict:
    """The `rotation` field of kv_scales.json: enough to rebuild (and check) the cache's rotation."""
    return {"kind": ROTATION_KIND, "seed": seed, "head_dim": head_dim,
            "hadamard_block": rotation.hadamard_block(head_dim),
            "applies_to": "K and V of every NVFP4 layer (m3serve.kv.rotation)",
            "signs": [int(x) for x in rotation.rotation_signs(head_dim, seed).tolist()]}


def _read_rotation(path: str, doc: dict) -> int | None:
    """The rotation seed of a kv_scales.json (None: calibrated unrotated); its recorded signs must be what the
    seed draws here (amaxes chosen under one rotation are wrong for another)."""
    rec = doc.get("rotation")
    if rec is None:
        return None
    if not isinstance(rec, dict) or rec.get("kind") != ROTATION_KIND:
        raise ValueError(f"{path}: field 'rotation': expected an object of kind {ROTATION_KIND!r}, found {rec!r:.120}")
    seed, d = rec.get("seed"), rec.get("head_dim")
    for name, val in (("seed", seed), ("head_dim", d)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ValueError(f"{path}: rotation.{name}: expected a non-negative int, found {val!r}")
    want = [int(x) for x in rotation.rotation_signs(d, seed).tolist()]
    if rec.get("signs") != want:
        raise ValueError(f"{path}: rotation.signs: expected the {d} signs seed {seed} draws "
                         f"(m3serve.kv.rotation.rotation_signs), found other values; recalibrate (m3serve calibrate-kv)")
    return seed


@dataclass(frozen=True)
class KVScalesFile:
    amax: dict[int, tuple[float, float]]     # layer -> (k_amax, v_amax)
    fp8_layers: tuple[int, ...]              # () when the file lists none (or predates the field)
    rotation_seed: int | None = None         # the K/V rotation the amaxes were chosen under (None: unrotated)


def read_kv_scales(path: str, num_layers: int) -> KVScalesFile:
    """A kv_scales.json written for a model of `num_layers` layers: amaxes and the optional `fp8_layers`."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: expected a JSON kv_scales file, found invalid JSON ({e.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path}: field 'format': expected {FILE_FORMAT!r}, found {found!r}")
    if doc.get("version") != FILE_VERSION:
        raise ValueError(f"{path}: field 'version': expected {FILE_VERSION}, found {doc.get('version')!r}")
    if doc.get("num_layers") != num_layers:
        raise ValueError(f"{path}: field 'num_layers': expected {num_layers} (the model's layers), "
                         f"found {doc.get('num_layers')!r}")
    layers = doc.get("layers")
    if not isinstance(layers, dict):
        raise ValueError(f"{path}: field 'layers': expected an object, found {type(layers).__name__}")
    out: dict[int, tuple[float, float]] = {}
    for key, entry in layers.items():
        if not key.isdigit() or not 0 <= int(key) < num_layers:
            raise ValueError(f"{path}: layers key: expected a layer id in [0, {num_layers}), found {key!r}")
        pair = []
        for t in ("k", "v"):
            a = entry.get(t, {}).get("amax") if isinstance(entry, dict) and isinstance(entry.get(t), dict) else None
            if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a) or a <= 0:
                raise ValueError(f"{path}: layers[{key}].{t}.amax: expected a finite positive number, found {a!r}")
            pair.append(float(a))
        out[int(key)] = (pair[0], pair[1])
    fp8 = doc.get("fp8_layers", [])
    if not isinstance(fp8, list) or len(set(map(repr, fp8))) != len(fp8) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers for i in fp8):
        raise ValueError(f"{path}: field 'fp8_layers': expected a list of distinct layer ids in [0, {num_layers}), "
                         f"found {fp8!r}")
    return KVScalesFile(out, tuple(sorted(fp8)), _read_rotation(path, doc))


def load_kv_scales(path: str, num_layers: int) -> dict[int, tuple[float, float]]:
    """{layer: (k_amax, v_amax)} from a kv_scales.json written for a model of `num_layers` layers."""
    return read_kv_scales(path, num_layers).amax


# ----------------------------------------------------------------------------- checkpoint k_scale / v_scale
def _kv_cache_quant_algo(model_dir: str) -> str | None:
    """The KV-cache format the checkpoint's scales were exported for: 'FP8', 'NVFP4' or None (unstated)."""
    hf_quant = os.path.join(model_dir, "hf_quant_config.json")          # ModelOpt's own export file
    if os.path.exists(hf_quant):
        with open(hf_quant) as f:
            algo = (json.load(f).get("quantization") or {}).get("kv_cache_quant_algo")
        if algo:
            return str(algo).upper()
    with open(os.path.join(model_dir, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    if qc.get("kv_cache_quant_algo"):                                   # ModelOpt in config.json
        return str(qc["kv_cache_quant_algo"]).upper()
    scheme = qc.get("kv_cache_scheme")                                  # compressed-tensors
    if isinstance(scheme, dict):
        if scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            return "FP8"
        if scheme.get("num_bits") == 4:
            return "NVFP4"
        raise ValueError(f"{model_dir}/config.json: quantization_config.kv_cache_scheme: expected an 8-bit float "
                         f"or 4-bit scheme, found {scheme}")
    return None


# ModelOpt exports k_scale = amax / maxbound: 448 for FP8 (clamped to >= 1.0), 448 * 6 for NVFP4 (the
# "scale_2" of its two-level scaling). Unstated formats follow the FP8 convention, the common case.
_SCALE_TO_AMAX = {"FP8": FP8_MAX, "NVFP4": FP8_MAX * E2M1_MAX}


def checkpoint_kv_amax(model_dir: str, num_layers: int) -> dict[int, tuple[float, float]] | None:
    """{layer: (k_amax, v_amax)} from the checkpoint's k_scale / v_scale tensors, or None when it has none."""
    scales = read_kv_cache_scales(SafetensorsSource(model_dir))
    if not scales:
        return None
    algo = _kv_cache_quant_algo(model_dir) or "FP8"
    if algo not in _SCALE_TO_AMAX:
        raise ValueError(f"{model_dir}: kv_cache_quant_algo: expected one of {sorted(_SCALE_TO_AMAX)}, found {algo!r}")
    out = {}
    for layer, kv in scales.items():
        if layer >= num_layers:
            continue                      # a pruned model (minimax-m3:L) uses the first L layers
        if set(kv) != {"k", "v"}:
            raise ValueError(f"{model_dir}: layer {layer}: expected both k_scale and v_scale, found {sorted(kv)}")
        out[layer] = (kv["k"] * _SCALE_TO_AMAX[algo], kv["v"] * _SCALE_TO_AMAX[algo])
    return out


# ----------------------------------------------------------------------------- applying to a cache
def apply_kv_amax(cache, table: dict[int, tuple[float, float]], source: str = "table") -> list[int]:
    """Set every NVFP4 layer's global scales from `table`; returns those layers. A missing NVFP4 layer
    raises (a calibration that does not cover the model is the wrong file); other layers are ignored."""
    nvfp4 = [i for i in range(cache.spec.num_attention_layers) if cache.spec.kv_format(i) == "nvfp4"]
    missing = [i for i in nvfp4 if i not in table]
    if missing:
        raise ValueError(f"{source}: expected K/V amax for every NVFP4 layer {nvfp4}, found none for {missing}")
    for i in nvfp4:
        cache.set_nvfp4_amax(i, *table[i])
    return nvfp4


def kv_scales_file(model_dir: str, kv_scales: str | None = "auto") -> str | None:
    """The kv_scales.json `kv_scales` names: "auto" = <model_dir>/kv_scales.json if present (else None), a path =
    that file (must exist), None = none."""
    if kv_scales is None:
        return None
    if not isinstance(kv_scales, str):
        raise TypeError(f"kv_scales: expected 'auto', a path or None, found {type(kv_scales).__name__}")
    if kv_scales != "auto":
        if not os.path.isfile(kv_scales):
            raise ValueError(f"kv_scales: expected an existing kv_scales.json file, found {kv_scales!r}")
        return kv_scales
    path = os.path.join(model_dir, KV_SCALES_FILE)
    return path if os.path.isdir(model_dir) and os.path.isfile(path) else None


def resolve_kv_amax(model_dir: str, num_layers: int, kv_scales: str | None = "auto"
                    ) -> tuple[str, dict[int, tuple[float, float]]] | None:
    """(source, table) for a model: kv_scales "auto" = <model_dir>/kv_scales.json if present, else the
    checkpoint's k_scale/v_scale, else None; a path = that file (must exist); None = no calibration."""
    path = kv_scales_file(model_dir, kv_scales)
    if path is not None:
        return path, load_kv_scales(path, num_layers)
    if kv_scales is None or not os.path.isdir(model_dir):
        return None                       # uncalibrated on purpose, or a preset with random weights
    table = checkpoint_kv_amax(model_dir, num_layers)
    return (f"{model_dir} k_scale/v_scale", table) if table else None


def resolve_kv_fp8_layers(model_dir: str, layer_types: Sequence[str], kv_scales: str | None = "auto"
                          ) -> tuple[str | None, tuple[int, ...]]:
    """(source, layers): the `fp8_layers` of the kv_scales.json that `kv_scales` names (see kv_scales_file), or
    (None, ()) without one. Checkpoint k_scale/v_scale tensors carry no such list. Every listed layer must be a
    sparse layer of this model (`layer_types`: M3Config.layer_types)."""
    path = kv_scales_file(model_dir, kv_scales)
    if path is None:
        return None, ()
    layers = read_kv_scales(path, len(layer_types)).fp8_layers
    sparse = [i for i, kind in enumerate(layer_types) if kind == "sparse"]
    bad = [i for i in layers if i not in sparse]
    if bad:
        raise ValueError(f"{path}: field 'fp8_layers': expected sparse layers of this model {sparse}, found {bad}")
    return path, layers


def resolve_kv_rotation(model_dir: str, num_layers: int, kv_scales: str | None = "auto"
                        ) -> tuple[str | None, int | None]:
    """(source, seed) of the K/V rotation a hybrid cache should use with `kv_scales` (see kv_scales_file): the
    kv_scales.json's `rotation` (None when it was calibrated unrotated), else (None, DEFAULT_ROTATION_SEED)."""
    path = kv_scales_file(model_dir, kv_scales)
    if path is None:
        return None, rotation.DEFAULT_ROTATION_SEED
    return path, read_kv_scales(path, num_layers).rotation_seed


def apply_model_kv_scales(cache, model_dir: str, num_layers: int, kv_scales: str | None = "auto") -> str | None:
    """What LLM calls after building its cache: apply the resolved amaxes to its NVFP4 layers (if any).
    Returns the source applied, or None (no NVFP4 layer, or no calibration found)."""
    if not any(cache.spec.kv_format(i) == "nvfp4" for i in range(cache.spec.num_attention_layers)):
        return None
    found = resolve_kv_amax(model_dir, num_layers, kv_scales)
    if found is None:
        log.info("KV cache: NVFP4 layers use the uncalibrated default amax (no kv_scales.json, no k_scale/v_scale)")
        return None
    source, table = found
    path = kv_scales_file(model_dir, kv_scales)
    if path is not None:
        calibrated = read_kv_scales(path, num_layers).rotation_seed
        if calibrated != cache.spec.kv_rotation_seed:
            raise ValueError(f"{path}: field 'rotation': its amaxes were chosen for K/V rotation seed {calibrated}, "
                             f"the cache uses kv_rotation {cache.spec.kv_rotation_seed}; pass kv_rotation='auto' "
                             f"(the file's), kv_scales=None, or recalibrate (m3serve calibrate-kv)")
    layers = apply_kv_amax(cache, table, source)
    log.info("KV cache: NVFP4 K/V amax of layers %s from %s", layers, source)
    return source
