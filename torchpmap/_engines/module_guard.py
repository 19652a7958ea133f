"""A module shared by the device threads of one call, reparametrized across a collective.

Device threads take turns between collectives (see :func:`multi_device.run_threads`), so
``functional_call(model, params, x)`` on one module from every thread is safe when the
forward holds no collective: each thread swaps its tensors in and out within its turn.
A forward that holds a collective (a tensor-parallel layer) is another matter: thread A
waits in the collective with its tensors swapped into the module, and thread B's
``functional_call`` swaps its own in and, on leaving, "restores" A's. The results would
still be right but the module would be left holding another thread's tensors.

While a multi-device call runs, module hooks watch the outermost module forward of each of
its threads; a thread that enters the forward of a module whose tensors (its own and its
submodules') differ from what another thread of the call saw when it entered that same,
still open, forward raises instead. (JAX has no module objects, so there is no JAX
counterpart to follow.)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from torchpmap._state import context as _context

_lock = threading.Lock()
_installed: list[Any] = []  # the hook handles while any multi-device call runs
_calls = 0


class SharedModuleReparametrized(RuntimeError):
    """Raised when device threads reparametrize one module across a collective."""


def _tensors(module: torch.nn.Module) -> tuple:
    """The identity of every tensor the module and its submodules hold."""
    return tuple(id(t) for m in module.modules() for t in (*m._parameters.values(), *m._buffers.values()))


class Watch:
    """The outermost open forward of each of one call's device threads:
    module -> {thread: the tensors it held when that thread entered}."""

    def __init__(self) -> None:
        self.open: dict[int, dict[int, tuple]] = {}
        self.depth: dict[int, int] = {}  # thread -> how many forwards it has open

    def enter(self, module: torch.nn.Module) -> None:
        me = threading.get_ident()
        depth = self.depth[me] = self.depth.get(me, 0) + 1
        if depth > 1:  # inside an outer forward, whose check covers this module's tensors
            return
        seen = _tensors(module)
        others = self.open.setdefault(id(module), {})
        for other, theirs in others.items():
            if other != me and theirs != seen:
                raise SharedModuleReparametrized(
                    f"torchpmap: device threads reparametrize one {type(module).__name__} module (e.g. with "
                    "torch.func.functional_call) while another thread waits in a collective inside its forward, "
                    "so the module would be left holding another thread's tensors. Give each device its own copy "
                    "of the module (copy.deepcopy), compute the layer from parameters passed explicitly, or run "
                    "this pmap on one device (devices=torchpmap.devices()[:1])."
                )
        others[me] = seen

    def leave(self, module: torch.nn.Module) -> None:
        me = threading.get_ident()
        self.depth[me] -= 1
        if self.depth[me] > 0:
            return
        others = self.open.get(id(module))
        if others is not None:
            others.pop(me, None)
            if not others:
                del self.open[id(module)]


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    watch = _context.module_watch.get()
    if watch is not None:
        watch.enter(module)


def _post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    watch = _context.module_watch.get()
    if watch is not None:
        watch.leave(module)


def install() -> None:
    """Called when a multi-device call starts: hooks are on while any such call runs."""
    global _calls
    with _lock:
        _calls += 1
        if _calls == 1:
            _installed.extend(
                [
                    register_module_forward_pre_hook(_pre_hook),
                    register_module_forward_hook(_post_hook, always_call=True),
                ]
            )


def uninstall() -> None:
    global _calls
    with _lock:
        _calls -= 1
        if _calls == 0:
            for handle in _installed:
                handle.remove()
            _installed.clear()


def watching(watch: Watch) -> contextlib.AbstractContextManager[None]:
    """In a device thread: report this thread's module forwards to ``watch``."""
    return _context.setting(_context.module_watch, watch)
