"""Which buckets can be captured as CUDA graphs, found by running each bucket's eager warm-up with the device's
sync checker armed.

CUDA-graph capture forbids anything that makes the host wait for the device (`.item()`, `.tolist()`,
`torch.unique`, `nonzero`, a D2H copy into pageable memory): such an op inside capture invalidates the capture,
and the CUDA error it leaves behind can poison later work. The warm-up run that compiles a bucket's kernels
before its capture executes exactly the code the capture would record, so running it under
`torch.cuda.set_sync_debug_mode("error")` names any blocker before capture is attempted. During that run a
stack of the modules being executed is kept, so the report names the module (e.g. `model.layers.3.mlp (MoE)`)
and the op, not just a CUDA error.

    probe(fn, model) -> None             fn ran without a host sync
                     -> CaptureBlocker   where and why it synced
    capture(fn, ...) -> the probe, then fn captured into a graph (or the blocker of either)

Policy (the caller's, per routing mode): "auto" logs the blocker and runs that bucket eagerly; "require" raises
`GraphCaptureError` naming it. A failure of the capture itself (anything the probe cannot see) is handled the
same way, so `auto` never crashes on a model it cannot capture.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from dataclasses import dataclass

import torch

log = logging.getLogger("m3serve")


def binding_of(*models) -> tuple[int, ...]:
    """The kernel-binding generation of each model (targets.routing.bind counts them; 0: never bound). A graph
    captured under one generation replays that binding's kernels, layout flags and workspace addresses: once a
    model is bound again, its graphs are stale (and the old workspaces may be freed and reused)."""
    return tuple(getattr(m, "kernel_binding", 0) for m in models if m is not None)


def check_binding(captured_under: tuple[int, ...], models, what: str) -> None:
    """Raise when a model was bound again since the graphs were captured (replaying them would run the old binding's
    kernels on re-laid-out weights and write into freed workspaces)."""
    now = binding_of(*models)
    if now != captured_under:
        raise RuntimeError(f"{what} graphs: captured under kernel binding {captured_under}, the model is now bound as "
                           f"{now} (targets.routing.install ran after capture): capture them again")


class GraphCaptureError(RuntimeError):
    """route='require' and a bucket cannot be captured: names the bucket, the module and the reason."""


@dataclass(frozen=True)
class CaptureBlocker:
    what: str      # the graph family ("decode", "speculative")
    bucket: int
    module: str    # dotted name (class) of the innermost module running when it failed, or "-"
    where: str     # the innermost m3serve source line, or "-"
    reason: str    # the error's first line

    def line(self) -> str:
        return (f"{self.what} bucket {self.bucket}: {self.module} at {self.where} cannot be captured as a CUDA "
                f"graph ({self.reason})")


@contextlib.contextmanager
def _module_stack(model):
    """Keep the stack of modules of `model` that are running (global forward hooks, removed on exit)."""
    names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
    stack: list[str] = []

    def pre(mod, _args):
        stack.append(f"{names[id(mod)]} ({type(mod).__name__})" if id(mod) in names else type(mod).__name__)

    def post(mod, _args, _out):
        if stack:
            stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield stack
    finally:
        h1.remove()
        h2.remove()


def _innermost_source(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/m3serve/" in f.filename.replace("\\", "/")]
    if not frames:
        return "-"
    f = frames[-1]
    return f"{f.filename.replace(chr(92), '/').split('/m3serve/')[-1]}:{f.lineno} ({f.name})"


def blocker_from(exc: BaseException, what: str, bucket: int, module: str) -> CaptureBlocker:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return CaptureBlocker(what, bucket, module or "-", _innermost_source(exc), reason)


def probe(fn, model, what: str, bucket: int, sync_mode: bool = True) -> CaptureBlocker | None:
    """Run fn() (a bucket's eager warm-up) with host syncs made errors; None when it ran clean.
    sync_mode=False runs it plainly (the module stack still names where an error came from)."""
    armed = sync_mode and torch.cuda.is_available()
    prev = torch.cuda.get_sync_debug_mode() if armed else None
    with _module_stack(model) as stack:
        if armed:
            torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as exc:
            return blocker_from(exc, what, bucket, stack[-1] if stack else "-")
        finally:
            if armed:
                torch.cuda.set_sync_debug_mode(prev)
    return None


def capture(fn, model, what: str, bucket: int, pool, stream) -> tuple[object | None, object, CaptureBlocker | None]:
    """One bucket's CUDA graph: fn's eager warm-up under the probe (it compiles the Triton variants and allocates
    scratch outside the graph), then fn captured into `pool` on `stream`. Returns (graph, what fn returned inside
    the capture, None), or (None, None, the blocker) when the warm-up synced the host or the capture failed."""
    blocker = probe(fn, model, what, bucket)
    torch.cuda.synchronize(stream.device)
    if blocker is not None:
        return None, None, blocker
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn()
    except RuntimeError as exc:
        torch.cuda.synchronize(stream.device)
        return None, None, blocker_from(exc, what, bucket, "-")
    return graph, out, None


def handle(blocker: CaptureBlocker, mode: str) -> None:
    """require: raise naming it; auto (or off): log it — the caller runs that bucket eagerly."""
    if mode == "require":
        raise GraphCaptureError(f"route='require': {blocker.line()}")
    log.warning("%s; that bucket runs eagerly", blocker.line())


__all__ = ["CaptureBlocker", "GraphCaptureError", "probe", "capture", "handle", "blocker_from"]
