"""The math of each collective over one named axis, on all instances at once.

Each class turns ``X`` (shape ``(n, *lead, *instance_shape)``, see :mod:`torchpmap._collectives.binding`) into
the result every instance receives, and names its transpose. Tuple axis names and the
user-facing argument checks live in :mod:`torchpmap._collectives.public`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from torchpmap._collectives.binding import InputKind, Primitive, partial_sum_dtype
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private

#: ``axis_index_groups``: the members of each group, or None for one group of all.
Groups = tuple[tuple[int, ...], ...] | None


def _group_ids(groups: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """The group number of each member."""
    gid = torch.empty(sum(len(g) for g in groups), dtype=torch.long)
    for k, g in enumerate(groups):
        gid[list(g)] = k
    return gid.to(device)


def _group_reduce(X: torch.Tensor, groups: tuple[tuple[int, ...], ...], op: str) -> torch.Tensor:
    """Each member's group reduction, member dim kept at 0."""
    n, gid = X.shape[0], _group_ids(groups, X.device)
    index = gid.view(n, *([1] * (X.dim() - 1))).expand_as(X)
    init = torch.zeros((len(groups), *X.shape[1:]), dtype=X.dtype, device=X.device)
    if op == "sum":
        out = init.scatter_add(0, index, _in_row_order(X))
    else:
        out = init.scatter_reduce(0, index, X, reduce=op, include_self=False)
    return out.index_select(0, gid)


def _sum_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.int64 if x.dtype == torch.bool else x.dtype


def _summed_as(X: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """``X`` in the dtype its sum adds in, and the dtype of the sum. Half floats add in
    float32 and round once, as torch's own sum of them does, written out: inductor's
    scatter_add rounds every addition (inf for 6e4 + 6e4 - 6e4 - 6e4 in float16), and two
    fused float16 sums fail its C++ compile (``at_Half_tmp_acc0_vec``; torch 2.13)."""
    dtype = _sum_dtype(X)
    return X.to(partial_sum_dtype(dtype)), dtype


def _in_row_order(X: torch.Tensor) -> torch.Tensor:
    """The instances' values ``X`` laid out instance after instance (contiguous), as the
    placements that gather them hold them, so that a float sum over the instances adds
    in the same order on every placement. torch's CPU sum picks its order by the
    layout: one device's ``X`` is the batched value as the function left it (``in_axes=-1``
    puts the instances in the last, densest dim), and its sum was 2.4e-7 off what 2 and
    4 devices and debug mode gave. Integers add exactly in any order (no copy)."""
    if X.is_contiguous() or not (X.is_floating_point() or X.is_complex()):
        return X
    return X.contiguous()


#: Unsigned integers that torch's CPU reductions (sum, amax, scatter_add) have no kernel
#: for; a compiled program reduces them. They are reduced as int64 (see :func:`_as_int64`).
_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
#: The dtypes summed as int64 and cast back (wrapping as their own sum wraps): the unsigned
#: ones above, and the bytes, whose sum of a 1-D tensor of 8 or more inductor gets wrong
#: (``torch.compile(lambda t: t.sum(0, dtype=torch.uint8))`` of ``arange(16) * 30``: 64,
#: not 16; torch 2.13), where ``psum`` of one byte per instance compiles such a sum.
_SUMMED_AS_INT64 = (*_UNSIGNED, torch.int8, torch.uint8)
_SIGN_BIT = -(2**63)


def _as_int64(
    compute: Callable[[torch.Tensor], tuple[torch.Tensor, int | None]], X: torch.Tensor, ordered: bool
) -> tuple[torch.Tensor, int | None]:
    """``compute`` of an unsigned-integer (or byte) ``X`` through int64, with the result
    back in ``X``'s dtype: the values of 8, 16 and 32 bits exactly (a sum wraps when cast
    back, as their own sum wraps: JAX's numbers); 64 bits by their bits, a sum wrapping as theirs
    and, for a comparison (``ordered``), the sign bit flipped so that int64 orders them as
    unsigned."""
    dtype = X.dtype
    if dtype != torch.uint64:
        out, dim = compute(X.to(torch.int64))
        return out.to(dtype), dim
    Y = X.view(torch.int64)
    out, dim = compute(Y ^ _SIGN_BIT if ordered else Y)
    return (out ^ _SIGN_BIT if ordered else out).view(dtype), dim


_SIGNED = {torch.uint16: torch.int32, torch.uint32: torch.int64, torch.uint64: torch.int64}


def moved_as_signed(move: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``move(x)`` for a function that only moves elements (``index_select``,
    ``index_copy``, ``where`` with zeros): an unsigned ``x`` of 16 to 64 bits goes through
    a signed integer dtype, since torch's CPU kernels of those ops have no unsigned ones
    but ``uint8``: one that holds every value (uint64: int64, whose conversion keeps the
    bits both ways), converted rather than viewed (``view(dtype)`` has no batching rule in
    torch 2.11, and these ops run inside vmap)."""
    signed = _SIGNED.get(x.dtype)
    if signed is None:
        return move(x)
    return move(x.to(signed)).to(x.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Psum(Primitive):
    groups: Groups = None
    kind: InputKind = dataclasses.field(default_factory=InputKind)
    name = "psum"

    @property
    def reduces(self) -> bool:
        return self.groups is None

    @property
    def sums(self) -> bool:
        return self.groups is None

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        if X.dtype in _SUMMED_AS_INT64:
            return _as_int64(self.compute, X, ordered=False)
        X, dtype = _summed_as(X)
        if self.groups is not None:
            return _group_reduce(X, self.groups, "sum").to(dtype), 0
        return _in_row_order(X).sum(0, dtype=X.dtype).to(dtype), None

    def compute_unbatched(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """An integer sum of equal values is a product; a float one is the sum of the
        copies, as every placement that gathers them adds it (the product rounded
        differently: 2.4e-7 off for ``psum(pmean(v))`` on one device)."""
        if self.groups is not None or x.dtype in _UNSIGNED or x.is_floating_point() or x.is_complex():
            return super().compute_unbatched(x)
        return x.to(_sum_dtype(x)) * self.frame.local_size, None

    def partial(self, X: torch.Tensor) -> torch.Tensor:
        X = X.to(partial_sum_dtype(X.dtype))
        if X.shape[0] == 1 and X.dtype == _sum_dtype(X):  # the sum of one instance is its value: no copy
            return X
        return super().partial(X)

    def transpose(self) -> Primitive:
        if self.frame.vma and self.groups is None:  # shard_map's check_vma: JAX's rule
            # of an invariant input, JAX's psum is psum(pvary(x)): pvary's transpose adds a psum
            scale = self.frame.size if self.kind.invariant else 1
            return PsumOfCotangent(self.frame, self.lead, scale=scale)
        return Psum(self.frame, self.lead, self.groups)


@dataclasses.dataclass(frozen=True, eq=False)
class PsumOfCotangent(Psum):
    """``psum``'s transpose under shard_map's ``check_vma`` (JAX's varying-manual-axes
    rule): a cotangent that varies along the axis is summed, as ``psum`` does, but one
    that is the same on every instance (invariant: the gradient of an invariant result,
    such as a loss after ``pmean``) passes through unchanged, as ``pvary`` would: it is
    counted once, not once per instance. ``scale``: the axis size when the psum's input
    was itself invariant (JAX varies it first, and pvary's transpose is a psum).
    Without ``check_vma`` (and in ``pmap``), ``psum``'s transpose is ``psum``, which
    multiplies an invariant cotangent by the axis size, as JAX does there too."""

    scale: int = 1
    keeps_invariant = True

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        total, dim = super().compute(X)
        return (total * self.scale if self.scale != 1 else total), dim

    def compute_unbatched(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        x = x.to(_sum_dtype(x))
        return (x * self.scale if self.scale != 1 else x), None

    @property
    def reduces(self) -> bool:  # a scaled sum: the slices' partial sums would be scaled twice
        return self.scale == 1

    def transpose(self) -> Primitive:
        return Psum(self.frame, self.lead)


@dataclasses.dataclass(frozen=True, eq=False)
class Pvary(Primitive):
    """``pvary``: the value unchanged, each instance holding its own copy. Its transpose
    is ``psum`` for an input that was the same on every instance (the instances'
    cotangents add up into it), and nothing at all for one that already varied."""

    kind: InputKind = dataclasses.field(default_factory=InputKind)
    name = "pvary"
    views_input = True
    local = True

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        return X, 0

    def compute_unbatched(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        return x.unsqueeze(0).expand(self.frame.local_size, *x.shape), 0

    def transpose(self) -> Primitive:
        if self.kind.invariant is None:
            raise NotImplementedError(
                f"the gradient of pvary over axis {self.frame.name!r} taken inside the map: it is the psum of the "
                "instances' cotangents for an input that is the same on every instance, and each instance's own for "
                "one that already varies, and this instance ran without a vmap level (one instance per device or per "
                "process, or debug mode), which cannot tell the two apart. Take the gradient outside the map, or set "
                "torchpmap.config.bitwise_placement = True (each instance then runs in a vmap of its own, as on one "
                "device)."
            )
        if self.kind.invariant:
            return Psum(self.frame, self.lead)
        return Pvary(self.frame, self.lead)


class _NotDifferentiable(torch.autograd.Function):
    """Passes a value through and refuses to be differentiated, naming the collective."""

    generate_vmap_rule = True

    @staticmethod
    def forward(name: str, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.name = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise _not_differentiable(ctx.name)

    @staticmethod
    def jvp(ctx: Any, _name_t: Any, x_t: torch.Tensor) -> Any:
        raise _not_differentiable(ctx.name)


def _may_be_differentiated(x: torch.Tensor) -> bool:
    """Whether a derivative may be asked of a value computed from ``x``: with grad mode on
    (reverse mode), inside a torch.func transform (``x`` wrapped by it), or where ``x``
    carries a forward-mode tangent, which ``no_grad`` does not stop."""
    return torch.is_grad_enabled() or private.is_functorch_wrapped(x) or _context.carries_tangent(x)


def _not_differentiable(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"{name} is not differentiable (JAX defines no derivative for it either). Use "
        f"{name} on values that do not need gradients, e.g. on x.detach(), or pick a "
        "differentiable reduction such as psum or pmean."
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Pextremum(Primitive):
    """pmax (op='amax') and pmin (op='amin')."""

    op: str = "amax"
    groups: Groups = None
    linear = False

    @property
    def reduces(self) -> bool:
        return self.groups is None

    @property
    def name(self) -> str:  # type: ignore[override]  # a property over the base's attribute
        return "pmax" if self.op == "amax" else "pmin"

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        if X.dtype in _UNSIGNED:
            return _as_int64(self.compute, X, ordered=True)
        if self.groups is not None:
            out, dim = _group_reduce(X, self.groups, self.op), 0
        else:
            out, dim = getattr(torch, self.op)(X, 0), None
        if out.is_floating_point() and _may_be_differentiated(X):
            out = _NotDifferentiable.apply(self.name, out)
        return out, dim

    def compute_unbatched(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        if self.groups is not None:
            return super().compute_unbatched(x)
        if x.is_floating_point() and _may_be_differentiated(x):  # refused on every placement, as compute's
            return _NotDifferentiable.apply(self.name, x), None  # (a copy of x)
        return x.clone(), None  # a value of its own, as a reduction's: a write into it must not reach x

    def transpose(self) -> Primitive:
        raise _not_differentiable(self.name)


@dataclasses.dataclass(frozen=True, eq=False)
class AllGather(Primitive):
    axis: int = 0
    tiled: bool = False
    groups: Groups = None
    name = "all_gather"
    views_input = True

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        at = self.lead + self.axis
        if self.groups is None:
            out = X.movedim(0, at)  # every instance gets the same stack
            return (out.flatten(at, at + 1) if self.tiled else out), None
        gid = _group_ids(self.groups, X.device)
        table = torch.tensor(self.groups, dtype=torch.long, device=X.device)  # equal sizes
        stacked = X.index_select(0, table.flatten()).unflatten(0, table.shape)  # (G, size, ...)
        out = stacked.index_select(0, gid).movedim(1, 1 + at)  # (n, ..., size at axis, ...)
        return (out.flatten(1 + at, 2 + at) if self.tiled else out), 0

    def transpose(self) -> Primitive:
        if self.frame.vma and self.groups is None:  # shard_map's check_vma: JAX's rule
            return ScatterOfCotangent(self.frame, self.lead, dimension=self.axis, tiled=self.tiled)
        return PsumScatter(self.frame, self.lead, dimension=self.axis, tiled=self.tiled, groups=self.groups)


@dataclasses.dataclass(frozen=True, eq=False)
class PsumScatter(Primitive):
    dimension: int = 0
    tiled: bool = False
    groups: Groups = None
    name = "psum_scatter"

    @property
    def scatters(self) -> bool:
        return self.groups is None

    def shares(self, X: torch.Tensor) -> torch.Tensor:
        if X.dtype in _SUMMED_AS_INT64:
            return _as_int64(lambda Y: (self.shares(Y), None), X, ordered=False)[0]
        size, local = self.frame.size, self.frame.local_size
        X = X.to(partial_sum_dtype(X.dtype))
        return self._by_position(X, size).unflatten(0, (size // local, local))

    def _by_position(self, X: torch.Tensor, size: int) -> torch.Tensor:
        """The sum of the instances ``X`` (without groups), its scattered dim cut into the
        axis' ``size`` positions and moved first: ``(size, ...)``."""
        at = self.lead + self.dimension  # position in the summed value (member dim gone)
        X, dtype = _summed_as(X)
        summed = _in_row_order(X).sum(0, dtype=X.dtype).to(dtype)  # torch.sum would widen int32 to int64
        if self.tiled:
            summed = summed.unflatten(at, (size, summed.shape[at] // size))
        return summed.movedim(at, 0)

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        if X.dtype in _SUMMED_AS_INT64:
            return _as_int64(self.compute, X, ordered=False)
        if self.groups is None:
            return self._by_position(X, X.shape[0]), 0
        at = self.lead + self.dimension + 1  # position in the groups' sums (a member dim first)
        X, dtype = _summed_as(X)
        summed = _group_reduce(X, self.groups, "sum").to(dtype)  # (n, ...)
        position = torch.empty(X.shape[0], dtype=torch.long)
        for g in self.groups:
            position[list(g)] = torch.arange(len(g))
        position = position.to(X.device)
        size = len(self.groups[0])
        if self.tiled:
            summed = summed.unflatten(at, (size, summed.shape[at] // size))
        # member m keeps slice position[m] of its own group's sum
        chosen = summed.movedim(at, 1)  # (n, size, ...)
        index = position.view(-1, *([1] * (chosen.dim() - 1))).expand(-1, 1, *chosen.shape[2:])
        return chosen.gather(1, index).squeeze(1), 0

    def transpose(self) -> Primitive:
        return AllGather(self.frame, self.lead, axis=self.dimension, tiled=self.tiled, groups=self.groups)


@dataclasses.dataclass(frozen=True, eq=False)
class ScatterOfCotangent(PsumScatter):
    """``all_gather``'s transpose under shard_map's ``check_vma``: a cotangent that
    varies along the axis is summed and scattered (``psum_scatter``), one that is the
    same on every instance (the gradient of an invariant use of the gathered value) gives
    each instance its own slice, unsummed: counted once, not once per instance."""

    keeps_invariant = True

    def compute_unbatched(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        frame = self.frame
        at = self.lead + self.dimension
        if self.tiled:
            x = x.unflatten(at, (frame.size, x.shape[at] // frame.size))
        own = x.narrow(at, frame.offset, frame.local_size)
        return own.movedim(at, 0), 0

    def transpose(self) -> Primitive:
        return AllGather(self.frame, self.lead, axis=self.dimension, tiled=self.tiled)


@dataclasses.dataclass(frozen=True, eq=False)
class Ppermute(Primitive):
    """out[dst] = x[src] for each (src, dst) pair; instances that receive nothing get zeros."""

    perm: tuple[tuple[int, int], ...] = ()
    name = "ppermute"

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        return moved_as_signed(self._moved, X), 0

    def _moved(self, X: torch.Tensor) -> torch.Tensor:
        n = X.shape[0]
        source = [-1] * n
        for src, dst in self.perm:
            source[dst] = src
        received = [d for d in range(n) if source[d] >= 0]
        out = torch.zeros_like(X)
        if received:
            to = torch.tensor(received, device=X.device)
            came_from = torch.tensor([source[d] for d in received], device=X.device)
            out = out.index_copy(0, to, X.index_select(0, came_from))
        return out

    def transpose(self) -> Primitive:
        return dataclasses.replace(self, perm=tuple((dst, src) for src, dst in self.perm))


@dataclasses.dataclass(frozen=True, eq=False)
class AllToAll(Primitive):
    """Instance ``d`` receives piece ``d`` of every instance's value. With ``groups``
    (of equal size ``s``) the exchange stays within each group: the member at position
    ``p`` of its group receives piece ``p`` of each member's value, in group order."""

    split_axis: int = 0
    concat_axis: int = 0
    tiled: bool = False
    groups: Groups = None
    name = "all_to_all"
    views_input = True

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        if self.groups is not None:
            return moved_as_signed(self._within_groups, X), 0
        n, split = X.shape[0], self.dim(self.split_axis)
        if self.tiled:  # split the split dim into (destination, chunk)
            X = X.unflatten(split, (n, X.shape[split] // n))
        Y = X.movedim(split, 0)  # (destination, source, *lead, *chunked instance)
        return self._sources_at_concat(Y), 0

    def _within_groups(self, X: torch.Tensor) -> torch.Tensor:
        groups = self.groups
        assert groups is not None
        table = torch.tensor(groups, dtype=torch.long, device=X.device)  # (G, s): equal sizes
        count, size = table.shape
        split = 1 + self.dim(self.split_axis)  # in (group, source, *lead, *instance)
        by_group = X.index_select(0, table.flatten()).unflatten(0, (count, size))
        if self.tiled:
            by_group = by_group.unflatten(split, (size, by_group.shape[split] // size))
        # (group, destination position, source, ...): row g * s + p goes to member table[g][p]
        Y = by_group.movedim(split, 1).flatten(0, 1)
        row_of = [0] * (count * size)
        for row, member in enumerate(m for g in groups for m in g):
            row_of[member] = row
        return self._sources_at_concat(Y.index_select(0, torch.tensor(row_of, device=X.device)))

    def _sources_at_concat(self, Y: torch.Tensor) -> torch.Tensor:
        """``Y`` (destination, source, *lead, *instance) with the sources placed along
        the concat axis (a new dim, or merged into it when tiled)."""
        out = Y.movedim(1, self.dim(self.concat_axis))
        if self.tiled:  # merge (source, concat dim) into one concatenated dim
            at = self.dim(self.concat_axis)
            out = out.flatten(at, at + 1)
        return out

    def transpose(self) -> Primitive:
        return dataclasses.replace(self, split_axis=self.concat_axis, concat_axis=self.split_axis)
