"""Recurrent modules on CUDA with weights that are not plain tensors: cuDNN kept out.

On CUDA, ``nn.GRU``/``nn.LSTM``/``nn.RNN`` run cuDNN's fused kernel on weights copied
into one chunk of memory (``flatten_parameters``), which needs each weight's storage.
Under a map, the weights an RNN module sees are often not plain tensors:

* **torch.func wrappers**: per-instance weights (``functional_call`` with stacked
  weights, an ensemble) are vmap's batched wrappers; parameters differentiated by
  ``torch.func.grad`` (``data_parallel_step`` across devices and processes, a user's
  ``pmap(grad(...))``) are grad wrappers. Neither has storage: ``flatten_parameters``
  raises ("Cannot access data pointer of Tensor that doesn't have storage"), and cuDNN's
  kernel raises ("Cannot access storage of TensorWrapper"), in plain ``torch.func`` too.
* **a trace** (``pmap(jit=True)``, inside :func:`traced`): cuDNN's weight buffer is a
  storage the trace cannot record, and its fake tensors have no data pointer.

For such weights the module runs with cuDNN off (``torch.backends.cudnn.enabled``, for
its forward only): torch then computes the network cell by cell, ops that torch.func batches
and differentiates and that a trace records. Per-instance weights still go through the
op's batching rule (:func:`torchpmap._engines.batching_rules._recurrent`), one call per
instance; shared plain weights keep cuDNN. With cuDNN off, ``flatten_parameters`` leaves
the weights as they are (torch's own early return).

The change is to the modules' ``forward`` itself, made
once, when torchpmap's batching rules are installed; it holds for every torch.func
transform in the process from then on (turning an error into the cell-by-cell path), and
for traces only inside torchpmap's own (a user's ``torch.compile`` of an RNN is left as
torch makes it).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from torchpmap._state import torch_private as private

_installed = False
_tracing = threading.local()


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """While torchpmap traces a program in this thread: RNN modules on CUDA run their cells."""
    previous = getattr(_tracing, "on", False)
    _tracing.on = True
    try:
        yield
    finally:
        _tracing.on = previous


def wrapped(weights: Iterable[object]) -> bool:
    """Whether any of ``weights`` is a torch.func wrapper (no storage for cuDNN)."""
    return any(isinstance(w, torch.Tensor) and private.is_functorch_wrapped(w) for w in weights)


def weights_in_use(module: nn.RNNBase) -> list[torch.Tensor]:
    """The weights ``module``'s next forward reads: ``functional_call`` puts them in place
    without updating ``_flat_weights``, which the forward refreshes from their names."""
    named = (getattr(module, name, None) for name in getattr(module, "_flat_weights_names", ()))
    return [w for w in named if isinstance(w, torch.Tensor)]


def _needs_cells(module: nn.RNNBase) -> bool:
    """Whether ``module`` must run without cuDNN (see the module docstring)."""
    weights = weights_in_use(module)
    if not weights or not torch.backends.cudnn.enabled or not any(w.device.type == "cuda" for w in weights):
        return False
    return wrapped(weights) or getattr(_tracing, "on", False)


def install() -> None:
    """Makes RNN modules on CUDA run their cells without cuDNN where their weights are
    torch.func wrappers or traced (see the module docstring). Idempotent."""
    global _installed
    if _installed:
        return
    for cls in (nn.RNN, nn.LSTM, nn.GRU):
        cls.forward = _forward_in_cells_when_needed(cls.forward)  # type: ignore[method-assign, assignment]
    _installed = True


def _forward_in_cells_when_needed(forward: Callable[..., object]) -> Callable[..., object]:
    @functools.wraps(forward)
    def wrapper(self: nn.RNNBase, *args: object, **kwargs: object) -> object:
        if not _needs_cells(self):
            return forward(self, *args, **kwargs)
        cudnn: Any = torch.backends.cudnn  # a module whose flags are properties (typed as descriptors)
        cudnn.enabled = False  # only this flag (torch.backends.cudnn.flags would reset the others too)
        try:
            return forward(self, *args, **kwargs)
        finally:
            cudnn.enabled = True

    return wrapper
