"""CUDA's autograd device thread, simulated on the CPU.

On CUDA, autograd runs a backward in a thread of its own per device: a custom
``autograd.Function``'s backward and a tensor's gradient hook run there, where none of
the forward thread's ``contextvars`` are set (torchpmap's bound axes, default devices,
instance thread). On the CPU they run in the thread that called ``backward()``, so a
backward that reads those variables works on a CPU machine and fails on a GPU (the
sharded step's gathered layers did: ``make gpu-check``, 2026-11-30).

:func:`empty_backward_context` makes the CPU behave as CUDA does here: every custom
function's backward and every hook registered through ``Tensor.register_hook`` runs in
an empty context. The ``autograd_device_thread`` fixture (conftest) applies it to one
test; ``TORCHPMAP_TEST_BACKWARD_CONTEXT=empty`` to a whole pytest run (not to the
processes the tests start). On 2026-11-30 the whole API, shard_map, training,
instance-autograd, multi-device, device-equivalence, output- and written-copy, gradient
mean, binding, compiled multi-device and distributed test files passed so, once the
gathered layer's backward ran in its forward's context."""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import function as _function


@contextlib.contextmanager
def empty_backward_context() -> Iterator[None]:
    apply, register_hook = _function.BackwardCFunction.apply, torch.Tensor.register_hook

    def apply_in_empty_context(self: Any, *args: Any) -> Any:
        return contextvars.Context().run(apply, self, *args)

    def register_hook_in_empty_context(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
        return register_hook(self, lambda *a: contextvars.Context().run(hook, *a))

    _function.BackwardCFunction.apply = apply_in_empty_context  # type: ignore[method-assign]
    torch.Tensor.register_hook = register_hook_in_empty_context  # type: ignore[method-assign]
    try:
        yield
    finally:
        _function.BackwardCFunction.apply = apply  # type: ignore[method-assign]
        torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
