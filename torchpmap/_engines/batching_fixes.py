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
calls pay nothing for it: by the dispatcher when a map starts under autocast
(:func:`needed`, :func:`fixed`), and, for autocast entered *inside* a mapped function, by
``torch.autocast`` itself: :func:`install` makes its ``__enter__`` push the mode (and its
``__exit__`` pop it) when a vmap level of torchpmap's is open in the thread, and only
then (outside maps, and in a user's own ``torch.func.vmap``, autocast is torch's). The
check costs one thread-local read per ``torch.autocast`` entered.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchpmap._engines import autocast_policy, batching_rules
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
    for device_type in _context.DEVICE_AUTOCAST_TYPES:  # a loop, not any(generator): this runs on every call
        if torch.is_autocast_enabled(device_type):
            return True
    return False


def fixed() -> contextlib.AbstractContextManager[Any]:
    """The corrections above, in force for a block (enter it only when :func:`needed`)."""
    return _MixedPrecision()


_installed = False


def install() -> None:
    """Makes ``torch.autocast`` entered inside one of torchpmap's maps push the
    corrections' mode for its block (see the module docstring). Idempotent."""
    global _installed
    if _installed:
        return
    autocast = torch.amp.autocast_mode.autocast
    autocast.__enter__ = _entering(autocast.__enter__)  # type: ignore[method-assign]
    autocast.__exit__ = _exiting(autocast.__exit__)  # type: ignore[method-assign]
    _installed = True


def _entering(enter: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(enter)
    def __enter__(self: Any) -> Any:
        result = enter(self)
        mode = _MixedPrecision() if getattr(self, "_enabled", False) and batching_rules.torchpmap_levels() else None
        if mode is not None:
            mode.__enter__()
        self.__dict__.setdefault("_torchpmap_modes", []).append(mode)  # None too: __exit__ pops one per __enter__
        return result

    return __enter__


def _exiting(exit_: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(exit_)
    def __exit__(self: Any, *exc: Any) -> Any:
        modes = self.__dict__.get("_torchpmap_modes")
        mode = modes.pop() if modes else None
        if mode is not None:
            mode.__exit__(*exc)
        return exit_(self, *exc)

    return __exit__
