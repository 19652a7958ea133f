"""Module backward hooks in a vectorized run: its instances run one at a time instead.

A module's backward hooks (``register_full_backward_hook``, its pre-hook, the old
``register_backward_hook`` and their global forms) are attached by ``Module.__call__`` only
to tensors that require grad. Under vmap the instances' tensors are batched wrappers, which
do not, so torch attaches no hook: a pmap whose function calls a hooked module, followed by
``.backward()`` through its result, called the hook once per instance on four devices (each
device thread runs its instance directly) and never on one device. A silent difference
between placements.

So a vectorized run that may record a graph (grad mode on) refuses a module with a backward
hook, raising :class:`BackwardHookUnderVmap`, whose message the engine choice
(:mod:`torchpmap._engines.dispatch`) reads as "vmap cannot run this function": the
instances then run one at a time, each calling its hooks, as on several devices. How the
hooked module is found:

- The first such run of a mapped function is *watched*: a global forward pre-hook sees the
  module calls made in torchpmap's own vmap levels (other threads' calls pass through), and
  keeps them in the function's :class:`ModulesCalled`.
- Each later run checks those modules' hooks (and the global ones) before it starts: a
  watched run makes every module call take the slow path of ``Module.__call__`` (about
  10 us a call on the 2-core CPU machine), the check a few hundred nanoseconds in all.

A module that a later call reaches and the watched one did not (a branch on a Python value,
a closure rebound to another module) is not checked. A call with grad mode off adds nothing.
(JAX has no module objects, so there is no JAX counterpart to follow.)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import weakref
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from torchpmap._state import context as _context
from torchpmap._state import torch_private as private

#: The first words of the refusal: :data:`torchpmap._engines.dispatch._CANNOT_VECTORIZE` lists them.
MESSAGE_START = "torchpmap: vmap cannot run module backward hooks"


class BackwardHookUnderVmap(RuntimeError):
    """A module with a backward hook was called in a vectorized run that records a graph."""


@dataclasses.dataclass(eq=False)
class ModulesCalled:
    """The modules a mapped function called in its watched run (module docstring); None
    until a watched run succeeded."""

    modules: list[weakref.ref[torch.nn.Module]] | None = None


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(module._backward_hooks or module._backward_pre_hooks)


def _refuse(module: torch.nn.Module) -> BackwardHookUnderVmap:
    return BackwardHookUnderVmap(
        f"{MESSAGE_START}: a {type(module).__name__} module with a backward hook was called while the instances "
        "run as one vectorized program, where torch would never call the hook; the instances run one at a time "
        "instead, each calling it, as on several devices. To stay vectorized, remove the hook (its handle's "
        ".remove()) or call the module under torch.no_grad()."
    )


class _Watch(threading.local):
    open: list[dict[int, torch.nn.Module]]  # per watched run of this thread, innermost last

    def __init__(self) -> None:
        self.open = []


_watch = _Watch()
_lock = threading.Lock()
_handle: list[Any] = []  # the global hook's handle while any watched run is open
_runs = 0


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    if not _watch.open or not _context.own_vmap_levels() or not torch.is_grad_enabled():
        return  # a module call of another thread, or one that records no graph
    if _has_hooks(module) or private.global_backward_hooks():
        raise _refuse(module)
    for seen in _watch.open:
        seen[id(module)] = module


def enter(record: ModulesCalled | None) -> dict[int, torch.nn.Module] | None:
    """Before a vectorized run of a function whose modules ``record`` keeps: raises
    :class:`BackwardHookUnderVmap` when one of them has a backward hook now; returns the
    watch to pass to :func:`leave` when this run is watched, else None."""
    if not torch.is_grad_enabled() or _checked.get():
        return None
    if record is not None and record.modules is not None:  # checked, not watched
        global_hooks = private.global_backward_hooks()
        for ref in record.modules:
            module = ref()
            if module is not None and (global_hooks or _has_hooks(module)):
                raise _refuse(module)
        return None
    global _runs
    with _lock:
        _runs += 1
        if _runs == 1:
            _handle.append(register_module_forward_pre_hook(_pre_hook))
    seen: dict[int, torch.nn.Module] = {}
    _watch.open.append(seen)
    return seen


def leave(seen: dict[int, torch.nn.Module], record: ModulesCalled | None, succeeded: bool) -> None:
    """After a watched run: its modules go into ``record`` when it succeeded."""
    global _runs
    assert _watch.open and _watch.open[-1] is seen  # a thread's watched runs nest
    _watch.open.pop()
    with _lock:
        _runs -= 1
        if _runs == 0:
            _handle.pop().remove()
        if succeeded and record is not None:  # the device threads of one call watch in turns: a union
            known = {id(r()) for r in record.modules or ()}
            record.modules = [*(record.modules or ()), *(weakref.ref(m) for k, m in seen.items() if k not in known)]


def checked_by_caller() -> contextlib.AbstractContextManager[None]:
    """For a caller that refused backward hooks on the modules it runs (the data-parallel
    step): its vectorized runs are neither watched nor checked."""
    return _context.setting(_checked, True)


_checked: contextvars.ContextVar[bool] = contextvars.ContextVar("torchpmap_backward_hooks_checked", default=False)
