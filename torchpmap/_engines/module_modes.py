"""The state of the modules a compiled program called: part of what it bakes in.

A ``jit=True`` program is traced once per signature. A module's forward reads Python
state while it is traced: ``self.training`` (dropout on or off, batch norm's batch or
running statistics, a branch of the user's own), its plain attributes (a dropout's
``p``, a temperature the user sets between steps) and its hooks, so the compiled program
keeps what the modules held then. Dynamo would guard on them; torchpmap's cache keys on
the arguments, so :func:`recorded` notes every module called during the trace, and a
program is reused only while each of them holds what it was traced with
(:func:`current`): its ``training`` flag, its public attributes that are numbers,
strings, booleans or None (or tuples of them), and its forward hooks and pre-hooks.
``model.eval()``, ``model[1].p = 0.0`` or a hook added after the first call trace the
program anew (until 2026-11-29 only the flag was checked, and the others were silently
ignored). Attributes of other types (a tensor, a list, an object) are not compared.

    >>> import torch
    >>> layer = torch.nn.Dropout(0.5)
    >>> with recorded() as called:
    ...     _ = layer(torch.ones(2))
    >>> modes = modes_of(called)
    >>> current(modes), current(modes_of([layer.eval()]))
    (True, True)
    >>> current(modes)
    False
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

#: What a trace read of a module: its ``training`` flag, plain attributes and hooks.
State = tuple[Any, ...]
#: Each module a trace called (weakly: a module that is gone no longer matters) and its state then.
ModuleModes = tuple[tuple["weakref.ref[torch.nn.Module]", State], ...]

_PLAIN = (bool, int, float, str, type(None))

#: Stand-ins made for one call of a module (the sharded step's shadows, see
#: :class:`torchpmap._frontend.layer_gather.Shadow`) -> the module whose mode they copy.
_originals: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()
_recording = [0]  # how many traces record modules now (stands_for does nothing otherwise)


def stands_for(copy: torch.nn.Module, original: torch.nn.Module) -> None:
    """``copy`` is made anew at each call from ``original`` (its ``training`` flag copied
    then): a trace that calls ``copy`` records ``original``'s mode, which a later
    ``original.eval()`` changes; the copy is gone by then. Outside a trace (an eager
    step, which makes its copies at every call) nothing is kept."""
    if _recording[0]:
        _originals[copy] = original


@contextlib.contextmanager
def recorded() -> Iterator[list[torch.nn.Module]]:
    """The modules called while the block runs, in any thread (a global forward pre-hook:
    traces run one at a time)."""
    called: list[torch.nn.Module] = []

    def note(module: torch.nn.Module, args: Any) -> None:
        called.append(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
    _recording[0] += 1
    try:
        yield called
    finally:
        _recording[0] -= 1
        handle.remove()


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def state_of(module: torch.nn.Module) -> State:
    """What a trace reads of ``module`` besides tensors: its ``training`` flag, its public
    plain attributes, and the keys of its forward hooks and pre-hooks."""
    attributes = tuple((k, v) for k, v in vars(module).items() if not k.startswith("_") and _plain(v))
    return (bool(module.training), attributes, tuple(module._forward_hooks), tuple(module._forward_pre_hooks))


def modes_of(modules: Sequence[torch.nn.Module]) -> ModuleModes:
    """Each distinct module of ``modules`` with its state now."""
    seen: dict[int, torch.nn.Module] = {}
    for m in modules:
        m = _originals.get(m, m)
        seen.setdefault(id(m), m)
    return tuple((weakref.ref(m), state_of(m)) for m in seen.values())


def current(modes: ModuleModes) -> bool:
    """Whether every module of ``modes`` that still exists holds the state recorded."""
    for ref, state in modes:
        module = ref()
        if module is not None and state_of(module) != state:
            return False
    return True
