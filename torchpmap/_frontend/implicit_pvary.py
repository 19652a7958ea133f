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
``grad``, ``vjp`` or ``jvp`` inside the map), each torch op whose tensor arguments vary
along different mesh axes gets its differentiated arguments ``pvary``'d along the axes
they lack. Integer and bool arguments count (an embedding's indices, a mask,
``axis_index``); only floating-point and complex ones can be differentiated. Which axes
a tensor varies along is which of the mesh axes' vmap levels it is batched at; whether
it is differentiated, whether a transform level inside the body wraps it. A value used
only with values of its own kind gets no ``pvary``, so the invariant uses of a weight
add their (invariant) gradient once, and the varying uses add the ``psum`` of theirs:
JAX's gradient.

The collectives that move values between positions (``ppermute``, ``psum_scatter``,
``all_to_all``, ``all_gather``) need their input varying along their axes, in JAX as
here: :meth:`_ImplicitPvary.vary_input` ``pvary``'s a differentiated input that is the
same along them, called by the collective itself
(:data:`torchpmap._state.context.implicit_pvary_input`).

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
        if not self._inside_a_transform() or _context.in_collective.get() or func in _NOT_OPS:
            return func(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        varies: dict[int, frozenset[Hashable]] = {}
        tracked: set[int] = set()
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):  # integer and bool values vary too (indices, masks, axis_index)
                varies[k], differentiated = self._axes(leaf)
                if differentiated:
                    tracked.add(k)
        if len(varies) < 2 or not tracked:
            return func(*args, **kwargs)
        union = frozenset().union(*varies.values())
        written = _written_first(func, args)
        changed = False
        for k in tracked:
            missing = union - varies[k]
            if missing and not (written and leaves[k] is args[0]):
                leaves[k] = pvary(leaves[k], self._in_mesh_order(missing))
                changed = True
        if not changed:
            return func(*args, **kwargs)
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return func(*args, **kwargs)

    def vary_input(self, x: Any, axis_names: tuple[Hashable, ...]) -> Any:
        """``x`` (a collective's input) with each differentiated leaf that is the same
        along some of ``axis_names`` ``pvary``'d along them (JAX's rule for the
        collectives that move values between positions)."""
        if not self._inside_a_transform():
            return x
        wanted = frozenset(axis_names) & frozenset(self.axes.values())  # axes of device threads have no level

        def varied(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            axes, differentiated = self._axes(leaf)
            missing = wanted - axes
            return pvary(leaf, self._in_mesh_order(missing)) if differentiated and missing else leaf

        return varied(x) if isinstance(x, torch.Tensor) else pytree.tree_map(varied, x)

    def _inside_a_transform(self) -> bool:
        level = private.current_vmap_level()
        return level is not None and level > self.above

    def _axes(self, tensor: torch.Tensor) -> tuple[frozenset[Hashable], bool]:
        """The mesh axes ``tensor`` varies along, and whether a transform inside the body
        differentiates it (only floating-point and complex values can be)."""
        batched, wrapped = private.functorch_levels(tensor)
        axes = frozenset(self.axes[b] for b in batched if b in self.axes)
        differentiable = tensor.is_floating_point() or tensor.is_complex()
        return axes, differentiable and any(w > self.above for w in wrapped)

    def _in_mesh_order(self, names: frozenset[Hashable]) -> tuple[Hashable, ...]:
        return tuple(a for a in self.axes.values() if a in names)


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
    mode = _ImplicitPvary(axes, here)
    with mode, _context.setting(_context.implicit_pvary_input, mode.vary_input):
        yield
