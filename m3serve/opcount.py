"""Count the aten ops dispatched inside a `with` block: the driver of host cost per step that the sampler bench
and the penalty tests watch (an op is a dispatch, whatever its size)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AtenOpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))
