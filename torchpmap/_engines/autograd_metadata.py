"""A mapped value's autograd metadata, read in a vectorized run, as an instance sees it.

Under vmap a value batched at a map's level is a wrapper, which reports
``requires_grad=False``, ``is_leaf=True`` and ``grad_fn=None`` whatever the value behind
it carries. An instance run alone (a device thread's, or one at a time) holds its slice of
that value, which requires grad when the value does. So ``v * 2 if v.requires_grad else
v * 3`` took one branch on one device and the other on four: a silent difference between
placements.

While a run is watched (the first vectorized run of a function with grad mode on; see
:mod:`torchpmap._engines.instance_autograd`), a torch function mode, :class:`InstanceView`,
answers these reads for values batched at torchpmap's own levels as the instance would:
``requires_grad`` is that of the value behind the wrapper, ``is_leaf`` its negation (an
instance's slice of a value that requires grad is a view, not a leaf). A ``grad_fn`` read
of such a value raises :class:`GradFnUnderVmap`, whose message the engine choice reads as
"vmap cannot run this function" (there is no instance's node to hand out): the instances
run one at a time. A function whose watched run read any of them keeps the mode on every
later vectorized run with grad mode on (it costs a Python call per torch function; the
others pay nothing).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torchpmap._state import context as _context
from torchpmap._state import torch_private as private

#: The first words of the refusal: :data:`torchpmap._engines.dispatch._CANNOT_VECTORIZE` lists them.
MESSAGE_START = "torchpmap: vmap cannot give an instance's grad_fn"

# what a torch function mode receives for a read of each property: its descriptor's __get__
_REQUIRES_GRAD, _IS_LEAF, _GRAD_FN = (
    getattr(torch.Tensor, name).__get__ for name in ("requires_grad", "is_leaf", "grad_fn")
)
_READS = frozenset({_REQUIRES_GRAD, _IS_LEAF, _GRAD_FN})


class GradFnUnderVmap(RuntimeError):
    """A vectorized run read the ``grad_fn`` of a mapped value that requires grad."""


def _behind_own_levels(t: torch.Tensor) -> torch.Tensor | None:
    """The value behind ``t``'s batching at torchpmap's own vmap levels (the outermost of
    its wrappers first), or None when ``t`` is not batched at one of them."""
    own = _context.own_vmap_levels()
    found = None
    while private.is_functorch_wrapped(t):
        level = private.vmap_level_of(t)
        if level not in own:
            break
        t, _ = private.unwrap_batched(t, level)
        found = t
    return found


class InstanceView(TorchFunctionMode):
    """The mode of a watched run (module docstring); ``read`` says whether it answered a read."""

    def __init__(self) -> None:
        super().__init__()
        self.read = False

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in _READS and len(args) == 1 and isinstance(args[0], torch.Tensor):
            behind = _behind_own_levels(args[0])
            if behind is not None:
                self.read = True
                requires_grad = bool(behind.requires_grad)
                if func == _REQUIRES_GRAD:  # a new method-wrapper each time: equal, not the same
                    return requires_grad
                if func == _IS_LEAF:
                    return not requires_grad
                if requires_grad:
                    raise GradFnUnderVmap(
                        f"{MESSAGE_START}: the function read the grad_fn of a mapped value that requires grad, which "
                        "each instance holds as a node of its own; the instances run one at a time instead, as on "
                        "several devices."
                    )
                return None
        return func(*args, **(kwargs or {}))
