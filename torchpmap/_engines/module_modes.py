"""The train/eval mode of the modules a compiled program called: part of what it bakes in.

A ``jit=True`` program is traced once per signature. A module's forward reads
``self.training`` in Python while it is traced (dropout on or off, batch norm's batch or
running statistics, a branch of the user's own), so the compiled program keeps the mode
the modules had then. Dynamo would guard on the flag; torchpmap's cache keys on the
arguments, so :func:`recorded` notes every module called during the trace, and a
program is reused only while each of them is in the mode it was traced in
(:func:`current`); ``model.eval()`` after training traces the program anew.

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

#: Each module a trace called (weakly: a module that is gone no longer matters) and its mode then.
ModuleModes = tuple[tuple["weakref.ref[torch.nn.Module]", bool], ...]

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


def modes_of(modules: Sequence[torch.nn.Module]) -> ModuleModes:
    """Each distinct module of ``modules`` with its ``training`` flag now."""
    seen: dict[int, torch.nn.Module] = {}
    for m in modules:
        m = _originals.get(m, m)
        seen.setdefault(id(m), m)
    return tuple((weakref.ref(m), bool(m.training)) for m in seen.values())


def current(modes: ModuleModes) -> bool:
    """Whether every module of ``modes`` that still exists is in the mode recorded."""
    for ref, training in modes:
        module = ref()
        if module is not None and module.training != training:
            return False
    return True
