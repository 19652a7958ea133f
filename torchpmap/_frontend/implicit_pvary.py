"""shard_map's implicit ``pvary``: JAX's rule for a gradient taken inside the map.

Under ``check_vma``, every value inside a shard_map knows the mesh axes along which it
varies. When one op mixes a value that is the same on every position of an axis
(invariant: a replicated weight, an ``all_gather``'s result) with one that varies along
it (this position's block of the batch), JAX first makes the invariant operand varying
with ``pvary``. That changes no value, but it gives the gradient its meaning: the
transpose of ``pvary`` is ``psum``, so the gradient of a replicated weight taken inside
the map is the sum of every position's contribution, the same on every position, as the
weight is. Without it each position would hold only its own part (what ``pmap`` gives,
where nothing is invariant).

torch.func has no such step, so this module inserts it, where it matters: while the
body of a shard_map under ``check_vma`` runs a torch.func transform of its own (a
``grad``, ``vjp`` or ``jvp`` inside the map), each torch op whose floating-point tensor
arguments vary along different mesh axes gets its differentiated arguments ``pvary``'d
along the axes they lack. Which axes a tensor varies along is which of the mesh axes'
vmap levels it is batched at; whether it is differentiated, whether a transform level
inside the body wraps it. A value used only with values of its own kind gets no
``pvary``, so the invariant uses of a weight add their (invariant) gradient once, and
the varying uses add the ``psum`` of theirs: JAX's gradient.

Outside such transforms the mode returns at once (a level comparison per op); the
collectives' own ops are left alone. Ops that write into their first argument (``add_``,
``__setitem__``) never have that argument replaced: the write must reach the tensor the
program holds.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torchpmap._collectives.public import pvary
from torchpmap._state import axis_env as _axis_env
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.torch_private import pytree


class _ImplicitPvary(TorchFunctionMode):
    """The mode: ``axes`` maps each mesh axis' vmap level to its name; ``above`` is the
    innermost level of the body (a level past it is a transform inside the body)."""

    def __init__(self, axes: Mapping[int, Hashable], above: int):
        super().__init__()
        self.axes, self.above = axes, above

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        level = private.current_vmap_level()
        if level is None or level <= self.above or _context.in_collective.get() or func in _NOT_OPS:
            return func(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        varies: dict[int, frozenset[Hashable]] = {}
        tracked: set[int] = set()
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                batched, wrapped = private.functorch_levels(leaf)
                varies[k] = frozenset(self.axes[b] for b in batched if b in self.axes)
                if any(w > self.above for w in wrapped):
                    tracked.add(k)
        if len(varies) < 2 or not tracked:
            return func(*args, **kwargs)
        union = frozenset().union(*varies.values())
        written = _written_first(func, args)
        changed = False
        for k in tracked:
            missing = union - varies[k]
            if missing and not (written and leaves[k] is args[0]):
                leaves[k] = pvary(leaves[k], tuple(a for a in self.axes.values() if a in missing))
                changed = True
        if not changed:
            return func(*args, **kwargs)
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return func(*args, **kwargs)


#: Torch functions that take tensors but compute nothing of them (torch.func's own
#: ``autograd.grad`` on the differentiated inputs must see the tensors it was given).
_NOT_OPS: frozenset[Callable[..., Any]] = frozenset(
    {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward}
)


def _written_first(func: Callable[..., Any], args: tuple) -> bool:
    """Whether ``func`` writes into its first argument (an in-place method, ``__setitem__``)."""
    name = getattr(func, "__name__", "")
    return bool(args) and (name == "__setitem__" or (name.endswith("_") and not name.endswith("__")))


@contextlib.contextmanager
def implicit_pvary(axis_names: tuple[Hashable, ...]) -> Iterator[None]:
    """Inside a shard_map body (under ``check_vma``): JAX's implicit ``pvary`` for the
    transforms the body runs, over the mesh axes ``axis_names`` bound by the enclosing maps."""
    axes: dict[int, Hashable] = {}
    for frame in _axis_env.frames(axis_names):
        if frame.vectorized:
            axes[private.vmap_level_of(frame.token)] = frame.name
    here = private.current_vmap_level()
    if not axes or here is None:
        yield
        return
    with _ImplicitPvary(axes, here):
        yield
