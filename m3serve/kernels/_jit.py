"""One Triton source, two executors: compiled for CUDA tensors, interpreted for CPU tensors.

Why not plain `@triton.jit`: Triton decides compiled-vs-interpreted once, when the decorator
runs, from the TRITON_INTERPRET environment variable. In a shared test process another module
may import these kernels before any test sets that variable, and a compiled kernel cannot run
on CPU tensors. Here the choice is made per launch from the tensors' device, so the same
kernel source is exercised on the CPU (interpreter) and on the GPU (compiled), and no entry
reads an environment variable.

    kernel(fn)  -> DualKernel: kernel[grid](*args, num_warps=..., num_stages=..., **constexprs)
    helper(fn)  -> a device function callable from both executors

`aot_compile` builds a kernel for a named GPU target without a GPU (Triton ships ptxas), so
the catalog can prove that every certified cell compiles for sm_90 on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import triton
import triton.runtime.interpreter as _interp_mod
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


_ORIG_PATCH_LANG_TENSOR = _interp_mod._patch_lang_tensor
_INTERP_CACHE: dict[Callable, InterpretedFunction] = {}


def _interpreted_call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    f = _INTERP_CACHE.get(self.fn)
    if f is None:
        f = _INTERP_CACHE[self.fn] = InterpretedFunction(self.fn)
    return f(*args, **kwargs)


def _patched_namespaces() -> tuple:
    """What Triton's interpreter patches while it runs: triton.language and its core, math and standard
    modules, and the tensor class."""
    import triton.language as tl
    import triton.language.core as core
    import triton.language.math as tl_math
    import triton.language.standard as standard
    return (tl, core, tl_math, standard, core.tensor)


@contextlib.contextmanager
def _interpreting() -> Iterator[None]:
    """While a CPU launch runs, nested @jit functions (ours and triton.language's own, e.g.
    tl.zeros / tl.sum, which Triton built as compiled functions because TRITON_INTERPRET was
    unset at import) are executed by the interpreter instead of refusing to be called.

    Afterwards every attribute of triton.language's namespaces that existed before is put back as it
    was (names the interpreter adds for itself stay): Triton 3.6's
    interpreter leaves some builtins patched after a launch whose nested device functions it ran,
    and a kernel compiled later in the same process (aot_compile, or a GPU launch) would then build
    with the interpreter's builtins and fail."""
    saved_call = JITFunction.__call__
    saved_patch = _interp_mod._patch_lang_tensor
    spaces = _patched_namespaces()
    saved = [dict(vars(ns)) for ns in spaces]
    JITFunction.__call__ = _interpreted_call  # type: ignore[method-assign]
    _interp_mod._patch_lang_tensor = _patch_lang_tensor_np2
    try:
        yield
    finally:
        JITFunction.__call__ = saved_call  # type: ignore[method-assign]
        _interp_mod._patch_lang_tensor = saved_patch
        for ns, before in zip(spaces, saved):
            now = vars(ns)
            for name, value in before.items():
                if now.get(name) is not value:
                    setattr(ns, name, value)


def _patch_lang_tensor_np2(tensor: Any, scope: Any) -> None:
    """Triton 3.6's interpreter converts scalars with int(1-element array), which numpy >= 2.4
    rejects (e.g. `for k in range(0, K, BK)` with a runtime K); take the element explicitly."""
    _ORIG_PATCH_LANG_TENSOR(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


def helper(fn: Callable) -> JITFunction:
    """A device function, inlined by compiled kernels and called by the interpreter."""
    return JITFunction(fn)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("kernel launch: expected at least one torch.Tensor argument, found none")


_CAPTURE: list[list] = []

# The one switch for programmatic dependent launch (kernels that declare a PDL constexpr, see _pdl.py): False
# launches them plainly, with PDL=False. Read at every launch; a CUDA graph keeps what it captured. Off: on the
# H200 the minimax-m3:5 decode step measured 1-3 % slower with it (bench/decode.py --routes target,target-pdl;
# bench/results/decode-target-h200-pdl-*.json), 3-15 % with the dependents released at kernel start.
PDL_ENABLED = False


@contextlib.contextmanager
def pdl_launches(enabled: bool) -> Iterator[None]:
    """PDL_ENABLED set to `enabled` inside the block (a CUDA graph captured there keeps what it launched with),
    restored after it."""
    global PDL_ENABLED
    before = PDL_ENABLED
    PDL_ENABLED = enabled
    try:
        yield
    finally:
        PDL_ENABLED = before


@contextlib.contextmanager
def capture_launches() -> Iterator[list]:
    """Record (kernel, grid, args, kwargs) instead of launching: raw calls run on 'meta' tensors
    with real shapes yield the exact compiled variants a GPU would build (see aot_check)."""
    rec: list = []
    _CAPTURE.append(rec)
    try:
        yield rec
    finally:
        _CAPTURE.pop()


class DualKernel:
    def __init__(self, fn: Callable, do_not_specialize: tuple[str, ...] = (), unaligned: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.gpu = JITFunction(fn, do_not_specialize=list(do_not_specialize) or None,
                               do_not_specialize_on_alignment=list(unaligned) or None)
        self.cpu = InterpretedFunction(fn)
        self.__name__ = fn.__name__
        # kernels with a PDL constexpr follow _pdl's contract and are launched with programmatic dependence
        self.pdl = "PDL" in inspect.signature(fn).parameters

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            if _CAPTURE:
                if self.pdl and "PDL" not in kwargs:
                    kwargs["PDL"] = PDL_ENABLED  # 'meta' tensors stand for CUDA ones
                _CAPTURE[-1].append((self, grid, args, dict(kwargs)))
                return None
            cuda = _first_tensor(args, kwargs).device.type == "cuda"
            if self.pdl and "PDL" not in kwargs:
                kwargs["PDL"] = cuda and PDL_ENABLED
            if kwargs.get("PDL"):
                kwargs["launch_pdl"] = True
            if cuda:
                return self.gpu[grid](*args, **kwargs)
            # The interpreter has no notion of warps, pipelining or launch attributes; drop the launch options.
            for opt in _LAUNCH_OPTS:
                kwargs.pop(opt, None)
            with _interpreting():
                return self.cpu[grid](*args, **kwargs)

        return launch


# --- kernels compiled while serving ---------------------------------------------------------------

def describe_variant(name: str, compile: dict) -> str:
    """A variant as Triton's compile hook hands it over: its launch options, its constexpr values (an integer
    specialised to 1 is one of them) and the integer arguments specialised as divisible by 16."""
    sig = compile.get("signature") or {}
    names = list(sig)

    def arg(path) -> str:
        i = path[0] if isinstance(path, tuple) and path else path
        return names[i] if isinstance(i, int) and i < len(names) else str(path)

    consts = ", ".join(f"{arg(p)}={v}" for p, v in (compile.get("constants") or {}).items())
    attrs = (compile.get("configs") or [{}])[0] or {}
    x16 = [arg(p) for p in attrs if not str(sig.get(arg(p), "")).startswith("*")]
    aligned = [arg(p) for p in attrs if str(sig.get(arg(p), "")).startswith("*")]
    opts = f"num_warps={compile.get('num_warps')}, num_stages={compile.get('num_stages')}"
    return (f"{name}[{opts}]({consts}" + (f"; divisible by 16: {', '.join(x16)}" if x16 else "")
            + (f"; 16-byte aligned: {', '.join(aligned)}" if aligned else "") + ")")


class CompileWatch:
    """Counts the Triton kernel variants first built in this process after `arm()` (compiled, or loaded from
    Triton's disk cache: both are a stall in front of whoever launched it), and logs each with its specialization.

    Why: Triton builds one variant per specialization of a kernel's integer arguments (== 1, divisible by 16,
    other), so a serving step of a shape class the start-up warm-up never ran (16 prompts prefilled together, say)
    compiles in front of its requests: a TTFT spike that no unit test sees. Armed at the end of the warm-up, the
    count should stay 0; `m3serve_kernel_compiles_after_warmup` exports it and the log names the kernel."""

    def __init__(self) -> None:
        self.armed = False
        self.compiled: list[str] = []
        self._startups = 0          # start-ups in progress (another LLM built in the same process, say)

    @contextlib.contextmanager
    def startup(self) -> Iterator[None]:
        """Variants built inside are a start-up's own (compiling before serving is its job): not counted."""
        self._startups += 1
        try:
            yield
        finally:
            self._startups -= 1

    def arm(self) -> None:
        if not self.armed:
            triton.knobs.runtime.jit_post_compile_hook = self._on_compile
            self.armed = True

    def _on_compile(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled) -> None:
        if self._startups:
            return
        what = describe_variant(getattr(fn, "name", "?"), compile)
        self.compiled.append(what)
        logging.getLogger("m3serve").warning("a Triton kernel variant was built after the warm-up (a stall in front "
                                             "of this step; engine/warmup.py should reach it): %s", what)

    @property
    def count(self) -> int:
        return len(self.compiled)


COMPILE_WATCH = CompileWatch()   # one per process: Triton's hook is process-wide


def kernel(fn: Callable) -> DualKernel:
    return DualKernel(fn)


def kernel_unspecialized(*names: str, unaligned: tuple[str, ...] = ()) -> Callable[[Callable], DualKernel]:
    """@kernel whose integer arguments `names` are not specialised (== 1, divisible by 16): one compiled variant
    serves every value, so a kernel launched at thousands of row counts compiles once per config (warm-up can
    then reach every variant with one call per cell). `unaligned`: pointer arguments not specialised on 16-byte
    alignment, for the step metadata (sequence lengths, query starts) that are views at offsets of one staged
    upload: their alignment follows the step's sequence and token counts, so each alignment would be a variant."""
    return lambda fn: DualKernel(fn, names, unaligned)



def is_compiled(t: torch.Tensor) -> bool:
    """True when launches on `t` run compiled code rather than the interpreter ('meta' tensors
    stand for GPU tensors in capture_launches)."""
    return t.device.type in ("cuda", "meta")


# --- ahead-of-time compile check (no GPU needed) ---------------------------------------------

_LAUNCH_OPTS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


@dataclass
class AotResult:
    name: str
    regs: int
    stack: int
    shared: int
    local: int
    sass: str | None


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def aot_build(k: DualKernel, args: tuple, kwargs: dict, arch: int = 90):
    """Compile `k` for sm_`arch` with the argument types/alignments of `args` (CPU or 'meta' tensors are fine:
    only dtype and 16-byte alignment are read); returns Triton's CompiledKernel (asm stages, metadata)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    jf = k.gpu
    names = [p.name for p in jf.params]
    opts = {o: kwargs[o] for o in _LAUNCH_OPTS if o in kwargs}
    bound = dict(zip(names, args))
    bound.update({n: v for n, v in kwargs.items() if n not in _LAUNCH_OPTS})
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, p in enumerate(jf.params):
        if p.name not in bound:
            if p.default is not inspect.Parameter.empty:
                bound[p.name] = p.default
            else:
                raise TypeError(f"aot_compile({k.__name__}): missing argument {p.name}")
        v = bound[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
            continue
        ty, attr = native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize, True)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[p.name] = attr
        elif isinstance(attr, str) and "D" in attr:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=jf, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def aot_compile(k: DualKernel, args: tuple, kwargs: dict, arch: int = 90, sass: bool = False) -> AotResult:
    """aot_build, then registers/stack/shared read back from the cubin with Triton's bundled cuobjdump."""
    compiled = aot_build(k, args, kwargs, arch)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([_bin("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
        text = None
        if sass:
            text = subprocess.run([_bin("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout

    def field(key: str) -> int:
        for tok in res.replace(",", " ").split():
            if tok.startswith(key + ":"):
                return int(tok.split(":")[1])
        return -1

    return AotResult(k.__name__, field("REG"), field("STACK"), field("SHARED"), field("LOCAL"), text)
