"""Private torch APIs that carry a caller's thread-local state into device threads.

Each entry says what it is for, the public API that would replace it, and the torch
versions it was checked on. (To be merged into :mod:`torchpmap._torch_private`.)
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch


def forward_grad_enabled() -> bool:
    """Whether forward-mode AD is on in this thread (``torch.func.jvp`` turns it on).

    Public replacement: none (``torch.autograd.forward_ad`` only has the private
    ``_set_fwd_grad_enabled``). Checked: torch 2.13.0, 2.14.1.
    """
    return torch._C._is_fwd_grad_enabled()


def forward_grad_set(enabled: bool) -> contextlib.AbstractContextManager:
    """Sets forward-mode AD on or off in this thread for a block. Public replacement:
    none. Checked: torch 2.13.0, 2.14.1."""
    return torch.autograd.forward_ad._set_fwd_grad_enabled(enabled)


def function_mode_stack() -> list[Any]:
    """The torch function modes in force in this thread, outermost first.

    Public replacement: none (``torch.overrides`` exposes only the private
    ``_get_current_function_mode_stack``). Checked: torch 2.13.0, 2.14.1.
    """
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


@contextlib.contextmanager
def function_mode_pushed(mode: Any) -> Iterator[None]:
    """Pushes an already-entered torch function mode of another thread onto this thread's
    stack (entering it again would re-run its ``__enter__``). Public replacement: none.
    Checked: torch 2.13.0, 2.14.1."""
    from torch.overrides import _pop_mode, _push_mode

    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()


def functorch_layers() -> list[Any]:
    """The torch.func interpreter stack of this thread, innermost first, left in place.

    Public replacement: none; ``torch._functorch.pyfunctorch`` has the same loop in its
    private ``temporarily_clear_interpreter_stack``. Checked: torch 2.13.0, 2.14.1.
    """
    from torch._C._functorch import peek_interpreter_stack, pop_dynamic_layer_stack, push_dynamic_layer_stack

    layers = []
    while peek_interpreter_stack() is not None:
        layers.append(pop_dynamic_layer_stack())
    for layer in reversed(layers):
        push_dynamic_layer_stack(layer)
    return layers


@contextlib.contextmanager
def functorch_layers_restored(layers: Sequence[Any]) -> Iterator[None]:
    """Pushes ``layers`` (from :func:`functorch_layers` of another thread) onto this
    thread's interpreter stack for a block: the caller's transforms enclose the block.
    Public replacement: none. Checked: torch 2.13.0, 2.14.1."""
    from torch._C._functorch import pop_dynamic_layer_stack, push_dynamic_layer_stack

    pushed = 0
    try:
        for layer in reversed(layers):
            push_dynamic_layer_stack(layer)
            pushed += 1
        yield
    finally:
        for _ in range(pushed):
            pop_dynamic_layer_stack()


def jvp_nesting() -> int:
    """How many ``torch.func.jvp`` calls are open in this process (a module global of
    torch.func, which opens the forward-AD level only at nesting 1). Public replacement:
    none. Checked: torch 2.13.0, 2.14.1."""
    from torch._functorch import eager_transforms

    return eager_transforms.JVP_NESTING


@contextlib.contextmanager
def jvp_nesting_raised() -> Iterator[None]:
    """Counts one more open jvp for a block, so that a jvp inside it neither opens nor
    closes the process' forward-AD level (the caller holds it open). Public replacement:
    none. Checked: torch 2.13.0, 2.14.1."""
    from torch._functorch import eager_transforms

    eager_transforms.JVP_NESTING += 1
    try:
        yield
    finally:
        eager_transforms.JVP_NESTING -= 1


@contextlib.contextmanager
def functorch_layers_cleared() -> Iterator[None]:
    """No torch.func transform in force for a block (put back after). Public replacement:
    none (torch has the private ``temporarily_clear_interpreter_stack``). Checked: torch
    2.13.0, 2.14.1."""
    from torch._C._functorch import peek_interpreter_stack, pop_dynamic_layer_stack, push_dynamic_layer_stack

    layers = []
    while peek_interpreter_stack() is not None:
        layers.append(pop_dynamic_layer_stack())
    try:
        yield
    finally:
        for layer in reversed(layers):
            push_dynamic_layer_stack(layer)


def release_compiled(fn: Any) -> None:
    """Drops what torch.compile keeps for ``fn`` (a bound method of a traced graph
    module) once torchpmap evicts the program: Dynamo's cache entries on its code object
    hold, through a clean-up hook, the graph module itself, so an evicted program was
    never freed (about 0.1 MiB per recompilation). ``torch._dynamo.reset_code`` is
    exported by torch._dynamo but undocumented. Public replacement: none
    (``torch.compiler.reset()`` drops every program of the process). Checked: torch
    2.13.0, 2.14.1."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None:
        torch._dynamo.reset_code(code)
