"""Batching rules torch.func gets wrong under mixed precision, corrected while a map runs.

Under ``torch.autocast``, a convolution hands batch norm a bfloat16 (or float16) input
while its weight and running statistics stay float32. PyTorch's batch norm kernel takes
that mix (it computes in float32 and returns the input's dtype), but torch.func's
batching rule for it does not: with running statistics it fails ("expected scalar type
BFloat16 but found Float"), without them it returns float32. While a map runs under
autocast, a torch function mode computes such a batch norm as the kernel does: on the
input upcast to float32 (exact), rounded back to the input's dtype at the end. The mode
is only pushed under autocast, so other calls pay nothing for it.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchpmap._state import context as _context

_REDUCED = (torch.bfloat16, torch.float16)
_BATCH_NORMS = (F.batch_norm, torch.batch_norm)


class _MixedPrecisionBatchNorm(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _BATCH_NORMS and args:
            x = args[0]
            others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
            if isinstance(x, torch.Tensor) and x.dtype in _REDUCED and any(o.dtype == torch.float32 for o in others):
                return func(x.float(), *args[1:], **kwargs).to(x.dtype)
        return func(*args, **kwargs)


def needed() -> bool:
    """Whether a map starting now needs the corrections (autocast is on): cheap, per call."""
    return any(torch.is_autocast_enabled(t) for t in _context.DEVICE_AUTOCAST_TYPES)


def fixed() -> contextlib.AbstractContextManager[Any]:
    """The corrections above, in force for a block (enter it only when :func:`needed`)."""
    return _MixedPrecisionBatchNorm()
