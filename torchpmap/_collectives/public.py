"""Collectives: communication between the instances of a mapped axis, addressed by name.

Every function here takes a pytree ``x`` (tensors, numpy arrays or Python numbers at the
leaves) and an ``axis_name`` that is one name or a tuple of names. A tuple addresses the
product of those axes in row-major order: the first name is the most significant, so
``axis_index(("i", "j")) == i * axis_size("j") + j``.

The math of each collective is in :mod:`torchpmap._collectives.math`; this module checks the
arguments, splits tuple names into per-axis steps and maps over the pytree. The leaves of
a pytree are bound together (:func:`~torchpmap._collectives.binding.bind_many`): each keeps its own
math, but across devices or processes they travel in one exchange per axis.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from torchpmap._collectives.binding import bind_many, narrowed, partial_sum_dtype
from torchpmap._collectives.math import (
    AllGather,
    AllToAll,
    Groups,
    Pextremum,
    Ppermute,
    Psum,
    PsumScatter,
    Pvary,
    moved_as_signed,
)
from torchpmap._state import axis_env as _axis_env
from torchpmap._state import context as _context
from torchpmap._state.axis_env import AxisFrame
from torchpmap._state.compile_guard import refuse_under_compile
from torchpmap._state.torch_private import pytree
from torchpmap._state.type_aliases import AxisNames, PyTree

# --------------------------------------------------------------------------- plumbing


def _leaf_tensor(leaf: Any, what: str) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "__array__"):
        return torch.as_tensor(leaf)
    raise TypeError(f"{what} takes tensors, numpy arrays or Python numbers, got {type(leaf).__name__}: {leaf!r}")


Leaves = Sequence[torch.Tensor]


def _tree_apply(
    what: str, x: Any, fn: Callable[[list[torch.Tensor]], Leaves], varying: Sequence[AxisFrame] = ()
) -> Any:
    """``fn`` on all the leaves of ``x`` at once (as tensors), rebuilt into ``x``'s structure.

    ``varying``: the axes along which the collective moves values between positions
    (``ppermute``, ``all_to_all``, ``all_gather``, ``psum_scatter``). Inside a shard_map
    body under ``check_vma``, while a transform inside the body runs, a differentiated
    leaf that is the same along them is ``pvary``'d first, as JAX does: the gradient of a
    replicated weight sent around then sums every position's part (``pvary``'s transpose
    is ``psum``), instead of keeping each position's own."""
    refuse_under_compile(what)
    vary = _context.implicit_pvary_input.get() if varying and not _context.in_collective.get() else None
    if vary is not None:
        x = vary(x, tuple(frame.name for frame in varying))
    inside = _context.in_collective.set(True)  # shard_map's implicit pvary leaves the collective's own ops alone
    try:
        if isinstance(x, torch.Tensor):  # the common case, without pytree's flatten and unflatten
            return fn([x])[0]
        leaves, spec = pytree.tree_flatten(x)
        return pytree.tree_unflatten(fn([_leaf_tensor(leaf, what) for leaf in leaves]), spec)
    finally:
        _context.in_collective.reset(inside)


def _frames(axis_name: AxisNames, what: str, allow_empty: bool = False) -> list[AxisFrame]:
    """The frames of the named axes. ``allow_empty``: an empty tuple names no axis (a
    collective over no axis is the identity, as in JAX: ``psum(x, ())`` is ``x``)."""
    refuse_under_compile(what)  # first: dynamo must not trace into the axis lookup (a ContextVar)
    return _axis_env.frames(_axis_env.normalize_names(axis_name, what, allow_empty))


def _over_no_axis(
    x: PyTree, what: str, groups: Any = None, leaf: Callable[[torch.Tensor], torch.Tensor] = torch.clone
) -> PyTree:
    """A reduction or gather over an empty tuple of axis names: ``leaf`` of each leaf, by
    default a copy of it as it is, as JAX returns it (a sum over no instance but this one)."""
    if groups is not None:
        raise ValueError(f"{what}: axis_index_groups needs an axis name; axis_name=() names none")
    return _tree_apply(what, x, lambda ts: [leaf(t) for t in ts])


def _total_size(frames: list[AxisFrame]) -> int:
    return math.prod(f.size for f in frames)


def _axis_phrase(frames: list[AxisFrame]) -> str:
    if len(frames) == 1:
        return f"axis {frames[0].name!r} (size {frames[0].size})"
    names = tuple(f.name for f in frames)
    return f"axes {names} (sizes {tuple(f.size for f in frames)}, {_total_size(frames)} in all)"


def _normalize_dim(dim: int, rank: int, what: str, arg: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{what}: {arg} must be an int, got {dim!r}")
    if not -rank <= dim < rank:
        raise ValueError(f"{what}: {arg}={dim} is out of range for a value of rank {rank} (valid: {-rank}..{rank - 1})")
    return dim % rank


def _index(i: Any) -> int:
    """An axis index: an int, or a 0-d integer tensor/array; never a string or a float."""
    if isinstance(i, bool) or not hasattr(i, "__index__"):
        raise TypeError(i)
    return int(i.__index__())


def _scattered_size(frames: list[AxisFrame], groups: Groups) -> tuple[int, str]:
    """The number of pieces a value is cut into (the axes' size, or one group's) and how
    an error names it."""
    if groups is None:
        return _total_size(frames), f"the size of {_axis_phrase(frames)}"
    size = len(groups[0])
    return size, f"the size of each of axis_index_groups' groups ({size}, on {_axis_phrase(frames)})"


def _check_groups(groups: Any, frames: list[AxisFrame], what: str, equal_sizes: bool) -> Groups:
    """``axis_index_groups`` as a tuple of tuples, checked against the axis size."""
    if groups is None:
        return None
    if len(frames) != 1:
        raise NotImplementedError(
            f"{what}: axis_index_groups works with a single axis name, got {_axis_phrase(frames)}"
        )
    n = frames[0].size
    try:
        normalized = tuple(tuple(_index(i) for i in g) for g in groups)
    except (TypeError, ValueError):
        raise TypeError(
            f"{what}: axis_index_groups must be a list of lists of integer axis indices (0..{n - 1} for "
            f"{_axis_phrase(frames)}), e.g. [[0, 1], [2, 3]]; got {groups!r}"
        ) from None
    members = sorted(i for g in normalized for i in g)
    if members != list(range(n)):
        raise ValueError(
            f"{what}: axis_index_groups={groups!r} must contain every index of {_axis_phrase(frames)} "
            f"exactly once, i.e. partition 0..{n - 1}"
        )
    if equal_sizes and len({len(g) for g in normalized}) > 1:
        raise ValueError(f"{what}: all groups in axis_index_groups must have the same size, got {groups!r}")
    return normalized


# --------------------------------------------------------------------------- reductions


def psum(x: PyTree, axis_name: AxisNames, *, axis_index_groups: Sequence[Sequence[int]] | None = None) -> PyTree:
    """Sums ``x`` over the instances of the named axis; every instance gets the total.

    Integer dtypes are kept, booleans are counted (as int64). An ``x`` that is the same on
    every instance (a constant, say) is multiplied by the axis size. Differentiating
    gives ``psum`` of the cotangent, JAX pmap's convention: inside ``pmap``,
    ``grad(lambda x: psum(x, "i"))`` is the axis size on every instance.

    Args:
        x: a pytree of tensors, numpy arrays or numbers.
        axis_name: a name bound by an enclosing ``pmap``/``vmap``, or a tuple of names.
            The empty tuple names no axis: ``x`` comes back as it is, as in JAX (so do
            ``pmean``, ``pmax``, ``pmin``, ``all_gather`` and ``psum_scatter``, and
            ``axis_index(())`` is 0).
        axis_index_groups: optional partition of the axis indices into groups; each
            instance then receives the sum over its own group.

    Example:
        >>> import torch, torchpmap
        >>> torchpmap.pmap(lambda x: torchpmap.psum(x, "i"), axis_name="i")(torch.arange(4.))
        tensor([6., 6., 6., 6.])
        >>> f = lambda x: torchpmap.psum(x, "i", axis_index_groups=[[0, 1], [2, 3]])
        >>> torchpmap.pmap(f, axis_name="i")(torch.arange(4))
        tensor([1, 1, 5, 5])
    """
    frames = _frames(axis_name, "psum", allow_empty=True)
    if not frames:
        return _over_no_axis(x, "psum", axis_index_groups)
    groups = _check_groups(axis_index_groups, frames, "psum", equal_sizes=False)
    return _tree_apply("psum", x, lambda ts: _sum(ts, frames, groups))


def pmean(x: PyTree, axis_name: AxisNames, *, axis_index_groups: Sequence[Sequence[int]] | None = None) -> PyTree:
    """The mean of ``x`` over the named axis: ``psum(x) / size`` (integers become floats).

    With ``axis_index_groups`` each instance receives the mean over its own group.

    Example:
        >>> import torch, torchpmap
        >>> torchpmap.pmap(lambda x: torchpmap.pmean(x, "i"), axis_name="i")(torch.arange(4))
        tensor([1.5000, 1.5000, 1.5000, 1.5000])
    """
    frames = _frames(axis_name, "pmean", allow_empty=True)
    if not frames:  # the total over no axis, divided by 1: integers become floats
        return _over_no_axis(x, "pmean", axis_index_groups, leaf=lambda t: t / 1)
    groups = _check_groups(axis_index_groups, frames, "pmean", equal_sizes=False)

    def mean(ts: list[torch.Tensor]) -> Leaves:
        totals = _sum(ts, frames, groups)
        if groups is None:
            return [total / _total_size(frames) for total in totals]
        group_size = [0] * frames[0].size
        for g in groups:
            for i in g:
                group_size[i] = len(g)
        return [total / _per_instance(group_size, axis_name, total.device) for total in totals]

    return _tree_apply("pmean", x, mean)


def pmax(x: PyTree, axis_name: AxisNames, *, axis_index_groups: Sequence[Sequence[int]] | None = None) -> PyTree:
    """The elementwise maximum of ``x`` over the named axis. Not differentiable, as in JAX.

    Example:
        >>> import torch, torchpmap
        >>> torchpmap.pmap(lambda x: torchpmap.pmax(x, "i"), axis_name="i")(torch.tensor([3, 1, 4, 1]))
        tensor([4, 4, 4, 4])
    """
    return _extremum(x, axis_name, axis_index_groups, "amax", "pmax")


def pmin(x: PyTree, axis_name: AxisNames, *, axis_index_groups: Sequence[Sequence[int]] | None = None) -> PyTree:
    """The elementwise minimum of ``x`` over the named axis. Not differentiable, as in JAX.

    Example:
        >>> import torch, torchpmap
        >>> torchpmap.pmap(lambda x: torchpmap.pmin(x, "i"), axis_name="i")(torch.tensor([3, 1, 4, 1]))
        tensor([1, 1, 1, 1])
    """
    return _extremum(x, axis_name, axis_index_groups, "amin", "pmin")


def _extremum(
    x: PyTree, axis_name: AxisNames, axis_index_groups: Sequence[Sequence[int]] | None, op: str, what: str
) -> PyTree:
    frames = _frames(axis_name, what, allow_empty=True)
    if not frames:
        return _over_no_axis(x, what, axis_index_groups)
    groups = _check_groups(axis_index_groups, frames, what, equal_sizes=False)

    def ordered(ts: list[torch.Tensor]) -> Leaves:
        for t in ts:
            if t.is_complex():
                raise TypeError(
                    f"{what}: complex values have no order, so there is no "
                    f"{'maximum' if what == 'pmax' else 'minimum'} of {t.dtype} values; take the "
                    f"{what} of their .abs() or of .real and .imag separately"
                )
        return _reduce(ts, frames, lambda f: Pextremum(f, op=op, groups=groups))

    return _tree_apply(what, x, ordered)


def _per_instance(table: list[int], axis_name: AxisNames, device: torch.device) -> torch.Tensor:
    """``table[axis_index(axis_name)]`` as a tensor (index_select: a 0-d tensor index would
    make torch call .item(), which vmap cannot do)."""
    index = axis_index(axis_name).reshape(1)
    return torch.tensor(table, device=device).index_select(0, index).squeeze(0)


def _sum(ts: Leaves, frames: list[AxisFrame], groups: Groups) -> Leaves:
    """The sums of ``ts`` over ``frames``. A sum of ``float16``/``bfloat16`` values adds in
    ``float32`` and rounds the total once, over a tuple of axes too: summed one axis at a
    time, each axis' total was rounded, so ``psum`` over ``("x", "y")`` of
    ``[[6e4, -6e4], [6e4, -6e4]]`` overflowed to nan where ``("y", "x")`` gave 0."""
    if len(frames) == 1:
        return _reduce(ts, frames, lambda f: Psum(f, groups=groups))
    dtypes = [t.dtype for t in ts]
    wide = [t.to(partial_sum_dtype(t.dtype)) for t in ts]
    totals = _reduce(wide, frames, lambda f: Psum(f, groups=groups))
    return [narrowed(total, dtype) for total, dtype in zip(totals, dtypes)]


def _reduce(ts: Leaves, frames: list[AxisFrame], prim: Callable[[AxisFrame], Any]) -> Leaves:
    for frame in frames:  # a reduction over a product of axes is one reduction per axis
        # one primitive per leaf: each records whether its own input varies (see InputKind)
        ts = bind_many([prim(frame) for _ in ts], ts)
    return ts


# --------------------------------------------------------------------------- gathers and scatters


def all_gather(
    x: PyTree,
    axis_name: AxisNames,
    *,
    axis: int = 0,
    tiled: bool = False,
    axis_index_groups: Sequence[Sequence[int]] | None = None,
) -> PyTree:
    """Every instance receives the values of all instances, stacked along a new ``axis``.

    With ``tiled=True`` they are concatenated along the existing ``axis`` instead. With
    ``axis_index_groups`` (groups of equal size) each instance gathers its own group.
    The transpose is :func:`psum_scatter`.

    Example:
        >>> import torch, torchpmap
        >>> f = lambda x: torchpmap.all_gather(x, "i")
        >>> torchpmap.pmap(f, axis_name="i")(torch.arange(3))
        tensor([[0, 1, 2],
                [0, 1, 2],
                [0, 1, 2]])
    """
    frames = _frames(axis_name, "all_gather", allow_empty=True)
    if not frames:  # JAX's result too: no dim of size 1 is added
        return _over_no_axis(x, "all_gather", axis_index_groups)
    groups = _check_groups(axis_index_groups, frames, "all_gather", equal_sizes=True)

    def position(t: torch.Tensor) -> int:
        if tiled and t.dim() == 0:
            raise ValueError(
                "all_gather: tiled=True needs a value of rank at least 1 to concatenate along; got a scalar"
            )
        return _normalize_dim(axis, t.dim() if tiled else t.dim() + 1, "all_gather", "axis")

    def gather(ts: Sequence[torch.Tensor]) -> Leaves:
        ats = [position(t) for t in ts]
        for frame in reversed(frames):  # least significant axis innermost
            ts = bind_many([AllGather(frame, axis=at, groups=groups) for at in ats], ts)
        return [t.flatten(at, at + len(frames) - (0 if tiled else 1)) for t, at in zip(ts, ats)]

    return _tree_apply("all_gather", x, gather, varying=frames)


def psum_scatter(
    x: PyTree,
    axis_name: AxisNames,
    *,
    scatter_dimension: int = 0,
    axis_index_groups: Sequence[Sequence[int]] | None = None,
    tiled: bool = False,
) -> PyTree:
    """``psum`` followed by each instance keeping only its own slice of the total.

    Without ``tiled`` the value's ``scatter_dimension`` must have the axis size and is
    removed: instance ``k`` receives ``psum(x)[k]`` along it. With ``tiled=True`` it must
    be divisible by the axis size and instance ``k`` receives the ``k``-th block. The
    transpose is :func:`all_gather`. Booleans are refused, as in JAX (``psum`` counts
    them): cast them to an integer dtype first.

    With ``axis_index_groups`` (groups of equal size) each group sums on its own, and the
    member at position ``p`` of its group keeps slice ``p`` of its group's sum: the
    ``scatter_dimension`` then has the group's size (or a multiple of it, tiled).

    Example:
        >>> import torch, torchpmap
        >>> x = torch.arange(16.).reshape(4, 4)
        >>> torchpmap.pmap(lambda r: torchpmap.psum_scatter(r, "i"), axis_name="i")(x)
        tensor([24., 28., 32., 36.])
        >>> grouped = lambda r: torchpmap.psum_scatter(r[:2], "i", axis_index_groups=[[0, 1], [2, 3]])
        >>> torchpmap.pmap(grouped, axis_name="i")(x)
        tensor([ 4.,  6., 20., 22.])
    """
    frames = _frames(axis_name, "psum_scatter", allow_empty=True)
    if not frames:
        return _over_no_axis(x, "psum_scatter", axis_index_groups)
    groups = _check_groups(axis_index_groups, frames, "psum_scatter", equal_sizes=True)
    n, over = _scattered_size(frames, groups)

    def dimension(t: torch.Tensor) -> int:
        if t.dtype == torch.bool:  # as JAX does; psum counts booleans
            raise TypeError(
                f"psum_scatter: cannot sum booleans (a value of shape {tuple(t.shape)}) over "
                f"{_axis_phrase(frames)}. Cast them first: psum_scatter(x.int(), ...) counts the True values."
            )
        if t.dim() == 0:
            raise ValueError(
                f"psum_scatter: needs a value of rank at least 1 to scatter over {_axis_phrase(frames)}; got a scalar"
            )
        dim = _normalize_dim(scatter_dimension, t.dim(), "psum_scatter", "scatter_dimension")
        size = t.shape[dim]
        if not tiled and size != n:
            raise ValueError(
                f"psum_scatter: scatter_dimension {scatter_dimension} of the value (shape {tuple(t.shape)}) has size "
                f"{size}, but it must equal {over}. Use tiled=True to scatter blocks."
            )
        if tiled and size % n:
            raise ValueError(
                f"psum_scatter: with tiled=True, scatter_dimension {scatter_dimension} of the value (shape "
                f"{tuple(t.shape)}) has size {size}, which is not divisible by {over}"
            )
        return dim

    def scatter(ts: Sequence[torch.Tensor]) -> Leaves:
        dims = [dimension(t) for t in ts]
        for k, frame in enumerate(frames):  # most significant axis first, each keeps its block
            blocks = tiled or k < len(frames) - 1
            ts = bind_many([PsumScatter(frame, dimension=dim, tiled=blocks, groups=groups) for dim in dims], ts)
        return ts

    return _tree_apply("psum_scatter", x, scatter, varying=frames)


# --------------------------------------------------------------------------- permutations


def _check_perm(perm: Any, n: int, frames: list[AxisFrame]) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(f"ppermute: perm must be a sequence of (source, destination) pairs, got {perm!r}") from None
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(
                f"ppermute: pair ({s}, {d}) in perm is out of range for {_axis_phrase(frames)}: indices must be in "
                f"0..{n - 1}"
            )
    for role, idx in (("source", 0), ("destination", 1)):
        seen = [p[idx] for p in pairs]
        dups = sorted({i for i in seen if seen.count(i) > 1})
        if dups:
            raise ValueError(
                f"ppermute: perm sends {'from' if idx == 0 else 'to'} {role} index {dups[0]} more than once: "
                f"{perm!r}. Each {role} may appear at most once."
            )
    return pairs


def ppermute(x: PyTree, axis_name: AxisNames, perm: Sequence[tuple[int, int]]) -> PyTree:
    """Sends values along the axis: for each ``(source, destination)`` pair in ``perm``,
    instance ``destination`` receives the value of instance ``source``. Instances that
    are no destination receive zeros. The transpose is ``ppermute`` with the pairs reversed.
    Over a tuple of axes the positions are numbered in the tuple's order (the first axis
    major), as ``axis_index`` of the tuple; inside a ``shard_map``, a tuple of its mesh's
    axes must name them in mesh order (JAX's ``shard_map`` refuses another order too).

    Example:
        >>> import torch, torchpmap
        >>> shift = lambda x: torchpmap.ppermute(x, "i", perm=[(j, (j + 1) % 4) for j in range(4)])
        >>> torchpmap.pmap(shift, axis_name="i")(torch.arange(4.))
        tensor([3., 0., 1., 2.])
    """
    frames = _frames(axis_name, "ppermute")
    pairs = _check_perm(perm, _total_size(frames), frames)
    if len(frames) == 1:
        permuted = (Ppermute(frames[0], perm=pairs),)
        return _tree_apply("ppermute", x, lambda ts: bind_many(permuted * len(ts), ts), varying=frames)
    source = [-1] * _total_size(frames)
    for s, d in pairs:
        source[d] = s
    names = tuple(f.name for f in frames)
    _check_mesh_order(names)
    return _tree_apply("ppermute", x, lambda ts: _receive_from(ts, names, source), varying=frames)


def _check_mesh_order(names: tuple[Hashable, ...]) -> None:
    """Inside a shard_map, a tuple of its mesh's axes must name them in mesh order: JAX's
    shard_map numbers such a tuple's positions in mesh order whatever the tuple's order,
    which reads as the tuple's order and gave wrong answers, so JAX refuses it (since 0.11;
    its vmap and pmap number positions in the tuple's order, as torchpmap's pmap does)."""
    mesh = _context.shard_map_axes.get()
    if len(names) < 2 or not all(n in mesh for n in names):
        return
    ordered = tuple(sorted(names, key=mesh.index))
    if ordered != names:
        raise ValueError(
            f"ppermute: inside a shard_map, axis_name={names!r} names the mesh's axes out of mesh order "
            f"(the mesh is {mesh!r}). Name them in mesh order, axis_name={ordered!r}, and number the positions "
            f"with {ordered[0]!r} major. JAX's shard_map refuses this too: it numbered such a tuple in mesh order, "
            "whatever the order written."
        )


def _receive_from(ts: list[torch.Tensor], axis_name: AxisNames, source: list[int]) -> Leaves:
    """ppermute over a product of axes: gather all values, keep the one from my source."""
    received = []
    for everyone in all_gather(ts, axis_name):
        mine = _per_instance(source, axis_name, everyone.device)

        def keep(everyone: torch.Tensor, mine: torch.Tensor = mine) -> torch.Tensor:
            value = everyone.index_select(0, mine.clamp(min=0).reshape(1)).squeeze(0)
            return torch.where(mine >= 0, value, torch.zeros_like(value))

        received.append(moved_as_signed(keep, everyone))
    return received


def pshuffle(x: PyTree, axis_name: AxisNames, perm: Sequence[int]) -> PyTree:
    """Instance ``i`` receives the value of instance ``perm[i]``; ``perm`` must be a
    permutation of the axis indices.

    Example:
        >>> import torch, torchpmap
        >>> f = lambda x: torchpmap.pshuffle(x, "i", perm=[2, 0, 1])
        >>> torchpmap.pmap(f, axis_name="i")(torch.tensor([10, 20, 30]))
        tensor([30, 10, 20])
    """
    frames = _frames(axis_name, "pshuffle")
    n = _total_size(frames)
    perm = list(perm)  # read once: an iterator's entries are checked, then used
    if sorted(int(p) for p in perm) != list(range(n)):
        raise ValueError(
            f"pshuffle: perm={list(perm)!r} must be a permutation of 0..{n - 1}, the indices of {_axis_phrase(frames)}"
        )
    return ppermute(x, axis_name, [(int(src), dst) for dst, src in enumerate(perm)])


def all_to_all(
    x: PyTree,
    axis_name: AxisNames,
    split_axis: int,
    concat_axis: int,
    *,
    axis_index_groups: Sequence[Sequence[int]] | None = None,
    tiled: bool = False,
) -> PyTree:
    """Each instance splits its value along ``split_axis`` into one piece per instance,
    sends piece ``k`` to instance ``k``, and receives the pieces addressed to it along
    ``concat_axis``.

    Without ``tiled``, ``x.shape[split_axis]`` must equal the axis size: the split axis
    is removed and the received pieces form a new axis at ``concat_axis`` (a position in
    the result). With ``tiled=True`` the size must be divisible by the axis size and the
    received blocks are concatenated along the existing ``concat_axis``. The transpose
    is ``all_to_all`` with the two axes swapped.

    With ``axis_index_groups`` (groups of equal size) the exchange stays within each
    group: ``x.shape[split_axis]`` has the group's size (or a multiple of it, tiled), and
    the member at position ``p`` of its group receives piece ``p`` of each member's
    value, in the group's order.

    Example:
        >>> import torch, torchpmap
        >>> x = torch.arange(9).reshape(3, 3)
        >>> torchpmap.pmap(lambda r: torchpmap.all_to_all(r, "i", 0, 0), axis_name="i")(x)
        tensor([[0, 3, 6],
                [1, 4, 7],
                [2, 5, 8]])
        >>> pairs = lambda r: torchpmap.all_to_all(r, "i", 0, 0, axis_index_groups=[[0, 1], [2, 3]])
        >>> torchpmap.pmap(pairs, axis_name="i")(torch.arange(8).reshape(4, 2))
        tensor([[0, 2],
                [1, 3],
                [4, 6],
                [5, 7]])
    """
    frames = _frames(axis_name, "all_to_all")
    groups = _check_groups(axis_index_groups, frames, "all_to_all", equal_sizes=True)
    n, over = _scattered_size(frames, groups)

    def axes(t: torch.Tensor) -> tuple[int, int]:
        if t.dim() == 0:
            raise ValueError("all_to_all: needs a value of rank at least 1 to split; got a scalar")
        split = _normalize_dim(split_axis, t.dim(), "all_to_all", "split_axis")
        concat = _normalize_dim(concat_axis, t.dim(), "all_to_all", "concat_axis")
        size = t.shape[split]
        if not tiled and size != n:
            raise ValueError(
                f"all_to_all: split_axis {split_axis} of the value (shape {tuple(t.shape)}) has size {size}, but it "
                f"must equal {over}. Use tiled=True to split it into equal blocks."
            )
        if tiled and size % n:
            raise ValueError(
                f"all_to_all: with tiled=True, split_axis {split_axis} of the value (shape {tuple(t.shape)}) has size "
                f"{size}, which is not divisible by {over}"
            )
        return split, concat

    def exchange(ts: list[torch.Tensor]) -> Leaves:
        split_concat = [axes(t) for t in ts]
        if len(frames) == 1:
            prims = [
                AllToAll(frames[0], split_axis=s, concat_axis=c, tiled=tiled, groups=groups) for s, c in split_concat
            ]
            return bind_many(prims, ts)
        everyone = all_gather(ts, axis_name)
        return [_my_pieces(e, axis_name, n, s, c, tiled) for e, (s, c) in zip(everyone, split_concat)]

    return _tree_apply("all_to_all", x, exchange, varying=frames)


def _my_pieces(
    everyone: torch.Tensor, axis_name: AxisNames, n: int, split: int, concat: int, tiled: bool
) -> torch.Tensor:
    """all_to_all over a product of axes, from every instance's value ``(source, *shape)``:
    keep the pieces for me."""
    if tiled:
        everyone = everyone.unflatten(1 + split, (n, everyone.shape[1 + split] // n))
    mine = axis_index(axis_name).reshape(1)
    pieces = moved_as_signed(lambda e: e.index_select(1 + split, mine), everyone).squeeze(1 + split)  # (source, *piece)
    out = pieces.movedim(0, concat)
    return out.flatten(concat, concat + 1) if tiled else out


def pswapaxes(x: PyTree, axis_name: AxisNames, axis: int) -> PyTree:
    """Swaps the named axis with positional ``axis`` of the value:
    ``all_to_all(x, axis_name, axis, axis)``.

    Example:
        >>> import torch, torchpmap
        >>> x = torch.arange(4).reshape(2, 2)
        >>> torchpmap.pmap(lambda r: torchpmap.pswapaxes(r, "i", 0), axis_name="i")(x)
        tensor([[0, 2],
                [1, 3]])
    """
    return all_to_all(x, axis_name, axis, axis)


# --------------------------------------------------------------------------- axis queries


def axis_index(axis_name: AxisNames) -> torch.Tensor:
    """The index of this instance along the named axis, as an int64 tensor.

    For a tuple of names, the row-major index over their product.

    Example:
        >>> import torch, torchpmap
        >>> torchpmap.pmap(lambda x: torchpmap.axis_index("i"), axis_name="i")(torch.zeros(3))
        tensor([0, 1, 2])
    """
    refuse_under_compile("axis_index")
    index = None
    frames = _frames(axis_name, "axis_index", allow_empty=True)
    for frame in frames:
        own = frame.token + frame.offset if frame.offset else frame.token
        index = own if index is None else index * frame.size + own
    if index is None:  # no axis: the only position, 0, as in JAX
        return torch.zeros((), dtype=torch.int64)
    return index


def axis_size(axis_name: AxisNames) -> int:
    """The number of instances along the named axis (a product for a tuple of names).

    Example:
        >>> import torch, torchpmap
        >>> torchpmap.pmap(lambda x: x * torchpmap.axis_size("i"), axis_name="i")(torch.ones(2))
        tensor([2., 2.])
    """
    return _total_size(_frames(axis_name, "axis_size", allow_empty=True))


def pvary(x: PyTree, axis_name: AxisNames) -> PyTree:
    """``x`` marked as varying along ``axis_name``: each instance holds its own copy.

    The values do not change. What changes is what the map knows of them: a value that
    is the same on every instance (a closed-over tensor, a ``psum``) becomes one that
    may differ, as JAX's ``pvary`` does under shard_map's ``check_vma``. Its transpose is
    ``psum``: the gradient of a value used by every instance sums their cotangents.

    Example:
        >>> import torch, torchpmap
        >>> w = torch.tensor(2.0)
        >>> torchpmap.pmap(lambda x: torchpmap.pvary(w, "i") * x, axis_name="i")(torch.arange(3.0))
        tensor([0., 2., 4.])
    """
    refuse_under_compile("pvary")
    frames = _frames(axis_name, "pvary")
    return _tree_apply("pvary", x, lambda ts: _reduce(ts, frames, Pvary))
