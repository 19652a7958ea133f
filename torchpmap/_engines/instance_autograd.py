"""What an instance's autograd sees that vmap hides: module backward hooks, and a mapped
value's autograd metadata.

A module's backward hooks (``register_full_backward_hook``, its pre-hook, the old
``register_backward_hook`` and their global forms) are attached by ``Module.__call__`` only
to tensors that require grad. Under vmap the instances' tensors are batched wrappers, which
do not, so torch attaches no hook: a pmap whose function calls a hooked module, followed by
``.backward()`` through its result, called the hook once per instance on four devices (each
device thread runs its instance directly) and never on one device. A silent difference
between placements; the same wrappers answer ``requires_grad``, ``is_leaf`` and ``grad_fn``
reads unlike an instance's slice (:mod:`torchpmap._engines.autograd_metadata`).

So a vectorized run that may record a graph (grad mode on) refuses a module with a backward
hook, raising :class:`BackwardHookUnderVmap`, whose message the engine choice
(:mod:`torchpmap._engines.dispatch`) reads as "vmap cannot run this function": the
instances then run one at a time, each calling its hooks, as on several devices. How:

- The first such run of a mapped function is *watched*: a global forward pre-hook sees the
  module calls made in torchpmap's own vmap levels (other threads' calls pass through), and
  keeps them in the function's :class:`AutogradRecord`; the metadata mode
  (:class:`~torchpmap._engines.autograd_metadata.InstanceView`) answers reads as the
  instance would.
- Each later run checks those modules' hooks (and the global ones) before it starts, and
  keeps the metadata mode on if the watched run read any metadata. Watching makes every
  module call take the slow path of ``Module.__call__`` (about 10 us a call on the 2-core
  CPU machine), and the mode a Python call per torch function (a 10-layer MLP under pmap:
  608 us a call with it, 481 us without, on the same machine); the check costs a few
  hundred nanoseconds in all.

A module that a later call reaches and the watched one did not (a branch on a Python value,
a closure rebound to another module) is not checked. A call with grad mode off adds nothing.
(JAX has no module objects or autograd metadata, so there is no JAX counterpart to follow.)
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

from torchpmap._engines.autograd_metadata import InstanceView
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private

#: The first words of the refusal: :data:`torchpmap._engines.dispatch._CANNOT_VECTORIZE` lists them.
HOOKS_MESSAGE_START = "torchpmap: vmap cannot run module backward hooks"


class BackwardHookUnderVmap(RuntimeError):
    """A module with a backward hook was called in a vectorized run that records a graph."""


@dataclasses.dataclass(eq=False)
class AutogradRecord:
    """What a mapped function's watched run (module docstring) found.

    Attributes:
        watched: whether a watched run succeeded (later runs are checked, not watched).
        modules: the modules it called (none when its caller checked them).
        reads_metadata: whether it read a mapped value's autograd metadata.
    """

    watched: bool = False
    modules: list[weakref.ref[torch.nn.Module]] = dataclasses.field(default_factory=list)
    reads_metadata: bool = False


@dataclasses.dataclass(eq=False)
class Watch:
    """One run's watch: the modules it saw (None: a checked run, not watched) and its
    metadata mode (None: off)."""

    seen: dict[int, torch.nn.Module] | None
    view: InstanceView | None


def has_backward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself (not its submodules) has a backward hook or pre-hook."""
    return bool(module._backward_hooks or module._backward_pre_hooks)


def _refuse(module: torch.nn.Module) -> BackwardHookUnderVmap:
    return BackwardHookUnderVmap(
        f"{HOOKS_MESSAGE_START}: a {type(module).__name__} module with a backward hook was called while the instances "
        "run as one vectorized program, where torch would never call the hook; the instances run one at a time "
        "instead, each calling it, as on several devices. To stay vectorized, remove the hook (its handle's "
        ".remove()) or call the module under torch.no_grad()."
    )


class _OpenWatches(threading.local):
    seen: list[dict[int, torch.nn.Module]]  # per watched run of this thread, innermost last

    def __init__(self) -> None:
        self.seen = []


_open = _OpenWatches()
_lock = threading.Lock()
_handle: list[Any] = []  # the global hook's handle while any watched run is open
_runs = 0


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    if not _open.seen or not _context.own_vmap_levels() or not torch.is_grad_enabled():
        return  # a module call of another thread, or one that records no graph
    if has_backward_hooks(module) or private.global_backward_hooks():
        raise _refuse(module)
    for seen in _open.seen:
        seen[id(module)] = module


def enter(record: AutogradRecord | None) -> Watch | None:
    """Before a vectorized run of a function whose watched run ``record`` keeps: raises
    :class:`BackwardHookUnderVmap` when one of its modules has a backward hook now; returns
    the watch to pass to :func:`leave`, or None when the run is neither watched nor needs
    the metadata mode. Under :func:`checked_by_caller` module calls are not watched."""
    if not torch.is_grad_enabled():
        return None
    if record is not None and record.watched:  # checked, not watched
        if record.modules:
            global_hooks = private.global_backward_hooks()
            for ref in record.modules:
                module = ref()
                if module is not None and (global_hooks or has_backward_hooks(module)):
                    raise _refuse(module)
        return Watch(None, _entered(InstanceView())) if record.reads_metadata else None
    if _checked.get():
        return Watch(None, _entered(InstanceView()))
    global _runs
    with _lock:
        _runs += 1
        if _runs == 1:
            _handle.append(register_module_forward_pre_hook(_pre_hook))
    seen: dict[int, torch.nn.Module] = {}
    _open.seen.append(seen)
    return Watch(seen, _entered(InstanceView()))


def _entered(view: InstanceView) -> InstanceView:
    view.__enter__()
    return view


def leave(watch: Watch, record: AutogradRecord | None, succeeded: bool) -> None:
    """After a run that :func:`enter` watched or gave the metadata mode: what a watched
    run found goes into ``record`` when it succeeded."""
    if watch.view is not None:
        watch.view.__exit__(None, None, None)
        if succeeded and record is not None:
            record.reads_metadata = record.reads_metadata or watch.view.read
    seen = watch.seen
    if seen is not None:
        global _runs
        assert _open.seen and _open.seen[-1] is seen  # a thread's watched runs nest
        _open.seen.pop()
        with _lock:
            _runs -= 1
            if _runs == 0:
                _handle.pop().remove()
            if succeeded and record is not None:  # the device threads of one call watch in turns: a union
                known = {id(r()) for r in record.modules}
                record.modules = [*record.modules, *(weakref.ref(m) for k, m in seen.items() if k not in known)]
    if succeeded and record is not None:
        record.watched = True


def checked_by_caller() -> contextlib.AbstractContextManager[None]:
    """For a caller that refused backward hooks on the modules it runs (the data-parallel
    step): its vectorized runs' module calls are neither watched nor checked (the metadata
    mode still answers on its first run)."""
    return _context.setting(_checked, True)


_checked: contextvars.ContextVar[bool] = contextvars.ContextVar("torchpmap_instance_autograd_checked", default=False)
