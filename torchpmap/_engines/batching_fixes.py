"""What torch.func's batching gets wrong under mixed precision, corrected while a map runs.

1. **Autocast's casts** happen below vmap, on the ops vmap's rules call rather than the op
   the function called: :mod:`torchpmap._engines.autocast_policy` makes them at that op.
2. **Normalizations of a reduced-precision input.** Under ``torch.autocast``, a
   convolution hands batch norm a bfloat16 (or float16) input while its weight and running
   statistics stay float32. PyTorch's batch norm kernel takes that mix (it computes in
   float32 and returns the input's dtype), but torch.func's batching rule for it does not:
   with running statistics it fails ("expected scalar type BFloat16 but found Float"),
   without them it returns float32; group norm's rule returns float32 too. Such a
   normalization is computed as the kernel does: on the input upcast to float32 (exact),
   rounded back to the input's dtype at the end.

A torch function mode makes both corrections; it is only pushed under autocast, so other
calls pay nothing for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchpmap._engines import autocast_policy
from torchpmap._state import context as _context

_REDUCED = (torch.bfloat16, torch.float16)
#: Normalizations that keep a reduced-precision input's dtype (with float32 weights).
_NORMALIZATIONS = (F.batch_norm, torch.batch_norm, F.group_norm, F.instance_norm, torch.instance_norm)


class _MixedPrecision(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        call = autocast_policy.like_autocast(func, args, kwargs or {})
        if func in _NORMALIZATIONS and call.args:
            x, rest = call.args[0], call.args[1:]
            others = [a for a in (*rest, *call.kwargs.values()) if isinstance(a, torch.Tensor)]
            if isinstance(x, torch.Tensor) and x.dtype in _REDUCED and any(o.dtype == torch.float32 for o in others):
                return dataclasses.replace(call, args=(x.float(), *rest)).run(func).to(x.dtype)  # type: ignore[attr-defined]
        return call.run(func)


def needed() -> bool:
    """Whether a map starting now needs the corrections (autocast is on): cheap, per call."""
    return any(torch.is_autocast_enabled(t) for t in _context.DEVICE_AUTOCAST_TYPES)


def fixed() -> contextlib.AbstractContextManager[Any]:
    """The corrections above, in force for a block (enter it only when :func:`needed`)."""
    return _MixedPrecision()
