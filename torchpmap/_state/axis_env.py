"""The axis environment: which named axes are bound while a mapped function runs.

Every running ``pmap``/``vmap`` that has an ``axis_name`` pushes an :class:`AxisFrame`.
Collectives look their axis names up here; the innermost binding of a name wins, as in
JAX. The stack lives in :mod:`torchpmap._state.context` (a context variable): each engine thread
runs its own slice of the program with its own vmap levels, in a copy of its caller's
context.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from torchpmap._state import context as _context
from torchpmap._state.type_aliases import AxisName, AxisNames


class OrderedSums(Protocol):
    """Sums over the slices, agreed on beforehand, that start as their values arrive
    (always in order, in every slice) and are waited for where they are used."""

    def also_gather(self, ts: Sequence[torch.Tensor], what: str) -> None:
        """Before any part starts: this slice's ``ts`` (plain tensors) start on their way
        to every slice, with the agreement on the sums, and nothing waits for them."""
        ...

    def gathered(self) -> list[torch.Tensor]:
        """:meth:`also_gather`'s tensors of every slice, stacked along a new dim 0 (after
        the latest wait)."""
        ...

    def start(self, k: int, ts: Sequence[torch.Tensor]) -> None:
        """Part ``k``'s values (plain tensors) are ready; it starts once every part before it has."""
        ...

    def wait(self, k: int, divisor: int = 1, after: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Part ``k``'s sums, once complete (it must have started), divided by ``divisor``
        in their own buffer (a mean without a pass into a fresh one). ``after``: values
        that a compiled program computes before this wait (eager, they exist already)."""
        ...


class Exchange(Protocol):
    """How the slices of a split axis talk: one per slice (device thread or process).

    Implemented by the device threads' ``ThreadExchange``, the processes'
    ``ProcessExchange`` and the ``TracedExchange`` a compiled program records (the type
    checker checks each against this protocol, in its own module). The ``*_with_grad``
    methods are differentiable: autograd (and ``torch.func``) goes through them.
    """

    @property
    def reduces_locally(self) -> bool:
        """True when each slice sends its partial result of a reduction instead of every
        instance's value (across processes: traffic independent of the local size)."""
        ...

    #: True when sums can start and run while computation goes on (:meth:`sums_in_order`).
    starts_sums: bool

    def all_gather_with_grad(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        """For each ``ts[k]``: every slice's value stacked along a new dim 0, in axis order.
        The gradient of ``ts[k]`` is the sum of every slice's cotangent for this slice's entry."""
        ...

    def sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor] | None:
        """For each ``ts[k]`` (this slice's partial sum): the sum over the slices, the same
        bits in every slice; or None, and the caller gathers the partials instead (this
        exchange does not sum on its own, or not tensors this small). The gradient of a
        partial sum is the same sum of the cotangents."""
        ...

    def scatter_sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor] | None:
        """For each ``ts[k]`` (this slice's partial sums of every slice's share, one row per
        slice along dim 0): the sum over the slices of their rows for this slice, in slice
        order (a reduce-scatter); or None, and the caller gathers every instance's value
        instead. The gradient of ``ts[k]`` is every slice's cotangent, stacked."""
        ...

    def sums_in_order(self, groups: Sequence[Sequence[torch.Tensor]], what: str) -> OrderedSums | None:
        """Sums that start later, one per group of tensors (only shapes and dtypes are
        read), so that computation can go on while the values travel; the slices agree
        on them before the first starts. None when it cannot sum these. Only where
        :attr:`starts_sums` is True."""
        ...


@dataclasses.dataclass(frozen=True, eq=False)
class AxisFrame:
    """One bound named axis.

    Attributes:
        name: the user's axis name.
        size: the logical size of the axis (all instances, on all devices).
        token: ``arange(local_size)`` batched at exactly this axis' vmap level. A collective
            passes it into its autograd.Function so that the batching rule can tell which
            vmap level owns the axis. Read as a value it is the local instance index.
        local_size: how many of the instances run vectorized in this engine slice.
        offset: the axis index of this slice's first instance (non-zero when the axis is
            split over several devices or processes).
        exchange: how the slices of a split axis talk to each other, or None when the
            whole axis runs in one vectorized slice.
        vectorized: False when this slice is a single instance run without a vmap level
            (a mesh axis with one instance per device); collectives then apply directly.
        vma: the axis is a shard_map mesh axis under ``check_vma``: a value that is the
            same on every instance (unbatched at this axis' level) is *invariant*, and
            the collectives transpose by JAX's varying-manual-axes rules (the transpose
            of ``psum`` on an invariant cotangent is ``pvary``, not ``psum``).
    """

    name: AxisName
    size: int
    token: torch.Tensor
    local_size: int
    offset: int = 0
    exchange: Exchange | None = None
    vectorized: bool = True
    vma: bool = False


def _stack() -> tuple[AxisFrame, ...]:
    return _context.axis_frames.get()


class bound:  # lower case, used like a contextlib context manager: a class is cheaper per call
    """Binds ``frame`` for the duration of the block (``with bound(frame):``)."""

    __slots__ = ("frame", "_token")

    def __init__(self, frame: AxisFrame) -> None:
        self.frame = frame

    def __enter__(self) -> AxisFrame:
        self._token = _context.axis_frames.set(_context.axis_frames.get() + (self.frame,))
        return self.frame

    def __exit__(self, *exc: object) -> None:
        _context.axis_frames.reset(self._token)


def lookup(name: AxisName) -> AxisFrame:
    """The innermost frame bound to ``name``; ``NameError`` if there is none."""
    for frame in reversed(_stack()):
        if frame.name == name:
            return frame
    bound_names = [f.name for f in _stack()]
    where = f"bound axis names: {bound_names}" if bound_names else "no axis is bound here"
    raise NameError(
        f"unbound axis name: {name!r} ({where}). Collectives can only name an axis of an "
        f"enclosing pmap/vmap: pass axis_name={name!r} to the pmap or vmap that maps it."
    )


def normalize_names(axis_name: AxisNames, what: str, allow_empty: bool = False) -> tuple[AxisName, ...]:
    """``axis_name`` as a tuple of distinct names, not empty unless ``allow_empty``."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names and not allow_empty:
        raise ValueError(f"{what}: axis_name must name at least one axis, got {axis_name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: axis_name {axis_name!r} names an axis more than once")
    return names


def frames(names: tuple[AxisName, ...]) -> list[AxisFrame]:
    return [lookup(n) for n in names]


def current_frames() -> tuple[AxisFrame, ...]:
    return tuple(_stack())


@contextlib.contextmanager
def inherited(frames: tuple[AxisFrame, ...]) -> Iterator[None]:
    """Binds ``frames`` (a parent thread's, rebound to this thread) over what this thread has."""
    token = _context.axis_frames.set(_context.axis_frames.get() + frames)
    try:
        yield
    finally:
        _context.axis_frames.reset(token)
