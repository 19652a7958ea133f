"""shard_map: a function of blocks, mapped over every axis of a mesh.

A call is planned once per argument structure and then runs as nested pmaps, one per
mesh axis (major first):

1. **Blocks in.** Each argument leaf is reshaped (a view) so that every mesh axis its
   spec names becomes a leading dim of its own, in mesh order, followed by the block:
   ``(8, 6)`` with ``P(('x', 'y'))`` on a ``{x: 2, y: 2}`` mesh becomes ``(2, 2, 2, 6)``.
2. **Nested maps.** The pmap over mesh axis ``a`` maps dim 0 of the leaves whose spec
   names ``a`` and broadcasts the others, so ``f`` sees each leaf's block with its rank
   kept, and collectives over mesh axis names run among the positions of that axis.
   With a :class:`~torchpmap.Mesh`, position ``(i, j)`` runs on ``mesh.devices[i, j]``
   (eager, with no torch.func transform around the call; otherwise as on an
   AbstractMesh over the first axis' devices); with an :class:`~torchpmap.AbstractMesh`,
   the first axis' positions are spread over its devices and the rest run vectorized
   within them.
3. **Blocks out.** An output whose out spec names ``a`` is stacked along ``a``; one
   whose spec leaves ``a`` out is the same on every position of ``a`` (with
   ``check_vma``, a value that varies along ``a`` raises instead); the stacked leading
   dims are then merged back into the dims the spec names.

The same program gives the same numbers on any placement of the mesh positions, to
rounding (one device is the oracle, as for pmap).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from torchpmap._engines import written_copies
from torchpmap._engines.mapped_call import version_of
from torchpmap._frontend import shard_map_backward as _backward
from torchpmap._frontend.call import MapOptions, MappedFunction
from torchpmap._frontend.implicit_pvary import implicit_pvary
from torchpmap._frontend.tree_prefix import broadcast_prefix
from torchpmap._placement import devices as _devices
from torchpmap._placement import dtensor as _dtensor
from torchpmap._placement.mesh import AbstractMesh, Mesh, ProcessMesh
from torchpmap._placement.partition_spec import PartitionSpec
from torchpmap._placement.sharded import ShardedTensor, has_nested_shards
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.config import vectorization_disabled
from torchpmap._state.faults import OutputVaries
from torchpmap._state.torch_private import pytree

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: What shard_map runs over: a mesh with one device per position, or positions on fewer devices.
AnyMesh = Mesh | AbstractMesh

#: What ``shard_map(mesh=)`` takes: such a mesh, or a torch ``DeviceMesh`` (a mesh of processes).
MeshLike: TypeAlias = "AnyMesh | DeviceMesh"

#: ``in_specs``/``out_specs``: a :class:`PartitionSpec` (None: replicated), or a pytree prefix of
#: the arguments (the outputs) holding those (a tuple with one entry per positional argument).
Specs: TypeAlias = PartitionSpec | None | Sequence[Any] | Mapping[Any, Any]


def is_spec(x: Any) -> bool:
    """A leaf of an in_specs/out_specs pytree: a PartitionSpec, or None (replicated)."""
    return x is None or isinstance(x, PartitionSpec)


@dataclasses.dataclass(frozen=True)
class ShardMapOptions:
    """Everything about a shard_map except the function."""

    mesh: AnyMesh  # as given (a DeviceMesh too) until ShardMapped resolves it
    in_specs: Specs
    out_specs: Specs
    check_vma: bool
    jit: bool | Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class _Blocked:
    """One argument leaf, its blocks' axes and its description for messages."""

    value: Any
    axes: frozenset[Hashable]  # the mesh axes its spec names
    label: str
    # a ShardedTensor argument gathered to be split by its spec: the gathered copy (a
    # position's write into its block is written back into the shards after the call)
    gathered: torch.Tensor | None = None


def resolve_mesh(mesh: Any) -> AnyMesh:
    """``mesh`` as shard_map uses it: a torch ``DeviceMesh`` becomes a ProcessMesh."""
    if isinstance(mesh, (Mesh, AbstractMesh)):
        return mesh
    if type(mesh).__name__ == "DeviceMesh":
        return _dtensor.process_mesh_of(mesh, "shard_map")
    raise TypeError(
        f"shard_map: mesh must be a torchpmap.Mesh, what torchpmap.make_mesh returns, a process mesh "
        f"(torchpmap.distributed.mesh) or a torch DeviceMesh; got {mesh!r} of type {type(mesh).__name__}. "
        "Build one with torchpmap.make_mesh((4, 2), ('data', 'model'))."
    )


def check_options(opts: ShardMapOptions) -> None:
    mesh = opts.mesh
    for what, specs in (("in_specs", opts.in_specs), ("out_specs", opts.out_specs)):
        for path, spec in pytree.tree_leaves_with_path(specs, is_leaf=is_spec):
            where = f"shard_map {what}{pytree.keystr(path)}"
            if not is_spec(spec):
                raise TypeError(
                    f"{where} is {spec!r} of type {type(spec).__name__}; the leaves of {what} are PartitionSpecs "
                    f"(torchpmap.P('data', None)), or None for an argument replicated over the whole mesh"
                )
            _check_spec_axes(spec, mesh, where)
    if not isinstance(opts.jit, (bool, Mapping)):
        raise TypeError(
            f"shard_map: jit must be True, False or a dict of torch.compile keyword arguments, got {opts.jit!r}"
        )


def _check_spec_axes(spec: PartitionSpec | None, mesh: AnyMesh, where: str) -> None:
    if spec is None:
        return
    seen: set[Hashable] = set()
    for axis in spec.axes():
        if axis not in mesh.shape:
            raise ValueError(
                f"{where} = {spec!r} names mesh axis {axis!r}, but the mesh's axes are {mesh.axis_names} "
                f"(shape {mesh.shape}); name one of those, or None for a dim that is not split"
            )
        if axis in seen:
            raise ValueError(
                f"{where} = {spec!r} names mesh axis {axis!r} twice; a mesh axis splits at most one dim of a "
                "tensor (to split one dim over several axes, give them as a tuple: P(('x', 'y')))"
            )
        seen.add(axis)


class ShardMapped:
    """A function mapped by ``shard_map``; calling it runs it on every mesh position."""

    def __init__(self, fun: Callable, opts: ShardMapOptions):
        if not callable(fun):
            raise TypeError(f"shard_map: the first argument must be a callable, got {fun!r}")
        opts = dataclasses.replace(opts, mesh=resolve_mesh(opts.mesh))
        check_options(opts)
        self.fun, self.opts = fun, opts
        self._maps: dict[tuple, MappedFunction] = {}  # argument structure -> the nested pmaps
        functools.update_wrapper(self, fun, updated=())

    def __repr__(self) -> str:
        return f"<shard_map of {getattr(self.fun, '__qualname__', self.fun)!r} over {self.opts.mesh!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"shard_map: keyword arguments ({', '.join(kwargs)}) are not supported: in_specs describes the "
                "positional arguments. Pass them positionally, with a spec each."
            )
        if isinstance(self.opts.mesh, ProcessMesh) and self.opts.check_vma:
            leaves, tree = pytree.tree_flatten(args)
            if _backward.wants_gradient(leaves):  # .backward() from outside: a vjp inside (see shard_map_backward)
                return _backward.call(self, args, leaves, tree, self._in_spec_leaves(args))
        return self.run(args)

    def run(self, args: tuple) -> Any:
        """The call itself: blocks in, the nested maps, blocks out."""
        leaves, tree = pytree.tree_flatten(args)
        specs = self._in_spec_leaves(args)
        labels = _leaf_labels(args)
        blocked = [self._block(leaf, spec, label) for leaf, spec, label in zip(leaves, specs, labels)]
        grid = self._on_every_device()
        key = (tree, tuple(b.axes for b in blocked), grid)
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = self._maps[key] = self._nest(tree, [b.axes for b in blocked], grid)
        watched = self._replicated_inputs(leaves, blocked)
        # a ShardedTensor argument gathered: each position writes its own block into the copy
        gathered = [b.gathered for b in blocked]
        copied = written_copies.copies(leaves, gathered, [k for k, g in enumerate(gathered) if g is not None],
                                       nested=True)
        try:
            stacked = mapped(*(b.value for b in blocked))
        except OutputVaries as varies:
            raise self._varies(varies) from None
        for seen, versions, label, axes in watched:
            if _versions(seen) != versions:
                raise self._written(label, axes)
        if copied:  # into the shards
            written_copies.write_back(leaves, gathered, copied)
        return self._unblock_all(stacked)

    def _replicated_inputs(
        self, leaves: list[Any], blocked: list[_Blocked]
    ) -> list[tuple[torch.Tensor, tuple[int, ...], str, list[Hashable]]]:
        """The argument tensors that several positions see (their spec leaves out a mesh axis
        of more than one position), with their version counters now, in one process.

        A write into one of them is refused after the call, as pmap refuses a write into an
        argument with in_axes None: how many times it happened depends on the placement (one
        device wrote a block replicated along an inner axis once, a device per position once
        per position)."""
        mesh = self.opts.mesh
        if isinstance(mesh, ProcessMesh) or private.current_vmap_level() is not None:
            return []
        sizes = mesh.shape
        watched = []
        for leaf, b in zip(leaves, blocked):
            if type(leaf) is torch.Tensor or isinstance(leaf, ShardedTensor):
                shared = [a for a in mesh.axis_names if sizes[a] > 1 and a not in b.axes]
                if shared:
                    seen = leaf if b.gathered is None else b.gathered  # what the positions write into
                    watched.append((seen, _versions(seen), b.label, shared))
        return watched

    def _written(self, label: str, axes: list[Hashable]) -> RuntimeError:
        return RuntimeError(
            f"shard_map: the function wrote in place into {label}, whose in_spec leaves out mesh axes {axes}, so "
            "several positions share its block and how many times it was written depends on the placement (its "
            "contents are now undefined). Write into a copy (x = x.clone()), or name those axes in its in_spec so "
            "that each position holds a block of its own."
        )

    def remapped(self, fun: Callable[..., Any], in_specs: Specs, out_specs: Specs) -> ShardMapped:
        """A shard_map of ``fun`` over the same mesh, under check_vma, eager (the vjp of
        :mod:`~torchpmap._frontend.shard_map_backward`)."""
        opts = dataclasses.replace(self.opts, in_specs=in_specs, out_specs=out_specs, check_vma=True, jit=False)
        return ShardMapped(fun, opts)

    def _in_spec_leaves(self, args: tuple) -> list[PartitionSpec | None]:
        """The in spec of each argument leaf."""
        return [spec for spec, _ in broadcast_prefix(self.opts.in_specs, args, "shard_map in_specs", is_leaf=is_spec)]

    def out_spec_leaves(self, results: Any) -> list[tuple[PartitionSpec | None, Any]]:
        """Each result leaf's out spec, with the leaf."""
        return list(broadcast_prefix(self.opts.out_specs, results, "shard_map out_specs", is_leaf=is_spec))

    # ------------------------------------------------------------------ blocks in

    def _block(self, leaf: Any, spec: PartitionSpec | None, label: str) -> _Blocked:
        """``leaf`` with each mesh axis its spec names as a leading dim (mesh order); on a
        mesh of processes, this process' block only (those dims of size 1)."""
        mesh = self.opts.mesh
        if isinstance(mesh, ProcessMesh):
            return self._process_block(leaf, spec, label, mesh)
        return self._global_block(leaf, spec, label)

    def _process_block(self, leaf: Any, spec: PartitionSpec | None, label: str, mesh: ProcessMesh) -> _Blocked:
        """A DTensor's local block (redistributed to the spec if need be), or this process'
        block of a tensor that every process holds whole."""
        named = [a for a in mesh.axis_names if spec is not None and a in spec.axes()]
        if _dtensor.is_dtensor(leaf):
            if spec is not None and len(spec) > leaf.dim():
                raise self._rank_error(spec, leaf, label)
            for d in range(leaf.dim()):
                self._check_divides(leaf.shape[d], spec, d, label)
            local = _dtensor.local_block(leaf, spec, mesh, f"shard_map: {label}")
            return _Blocked(local.reshape([1] * len(named) + list(local.shape)), frozenset(named), label)
        blocked = self._global_block(leaf, spec, label)
        value = blocked.value
        for k, axis in enumerate(named):
            value = value.narrow(k, mesh.coordinate(axis), 1)
        return _Blocked(value, blocked.axes, label)

    def _check_divides(self, n: int, spec: PartitionSpec | None, d: int, label: str) -> int:
        """The number of blocks dim ``d`` is split into; ValueError unless they divide its size."""
        mesh_shape = self.opts.mesh.shape
        axes = spec.axes_of(d) if spec is not None else ()
        k = math.prod(mesh_shape[a] for a in axes)
        if n % k:
            sizes = ", ".join(f"{a!r}: {mesh_shape[a]}" for a in axes)
            raise ValueError(
                f"shard_map: dim {d} of {label} has size {n}, which its in_spec {spec!r} splits over mesh axes "
                f"{axes} ({sizes}: {k} blocks), but {k} does not divide {n}. Pad the dim to a multiple of {k}, "
                "or split it over other axes."
            )
        return k

    def _global_block(self, leaf: Any, spec: PartitionSpec | None, label: str) -> _Blocked:
        mesh_shape = self.opts.mesh.shape
        if spec is None or not spec.axes():
            if spec is not None and isinstance(leaf, (torch.Tensor, ShardedTensor)) and len(spec) > leaf.dim():
                raise self._rank_error(spec, leaf, label)
            return _Blocked(leaf, frozenset(), label)
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"shard_map: {label} is {type(leaf).__name__}, not a tensor, but its in_spec {spec!r} splits it over "
                f"mesh axes {spec.axes()}; give it the spec P() (replicated), or pass a tensor"
            )
        if len(spec) > leaf.dim():
            raise self._rank_error(spec, leaf, label)
        shape: list[int] = []
        where: dict[Hashable, int] = {}  # mesh axis -> its dim in `shape`
        block_dims: list[int] = []
        for d, n in enumerate(leaf.shape):
            axes = spec.axes_of(d)
            k = self._check_divides(n, spec, d, label)
            for a in axes:
                where[a] = len(shape)
                shape.append(mesh_shape[a])
            block_dims.append(len(shape))
            shape.append(n // k)
        named = [a for a in self.opts.mesh.axis_names if a in where]
        order = [where[a] for a in named] + block_dims
        in_place = self._taken_in_place(leaf, spec, shape, where, order)
        if in_place is not None:
            return _Blocked(in_place, frozenset(named), label)
        if isinstance(leaf, ShardedTensor):  # gathered once, a plain tensor for the maps
            with written_copies.trackable():  # under inference mode too, a copy whose writes are seen
                gathered = leaf.gather()
            return _Blocked(gathered.reshape(shape).permute(order), frozenset(named), label, gathered)
        value = leaf.reshape(shape).permute(order)
        return _Blocked(value, frozenset(named), label)

    def _taken_in_place(
        self, leaf: Any, spec: PartitionSpec, shape: list[int], where: dict[Hashable, int], order: list[int]
    ) -> ShardedTensor | None:
        """A ShardedTensor argument's blocks, each shard's on its own device (no gather), or
        None where its shards are not where the mesh would put them.

        The reverse of :meth:`_stays_split`: ``leaf`` (a previous shard_map's or pmap's
        result) is split along dim ``d`` over the first mesh axis' devices, in their order,
        in equal consecutive shards, and the in_spec splits ``d`` with the first mesh axis
        as its major axis. Then each device's shard holds exactly the blocks of that
        device's first-axis positions, and its blocks are the same view of the shard as
        of the whole (with its share of the first axis' positions)."""
        if not isinstance(leaf, ShardedTensor) or has_nested_shards(leaf):
            return None
        mesh = self.opts.mesh
        first = mesh.axis_names[0]
        d = leaf.shard_dim
        axes = spec.axes_of(d)
        devices = list(first_axis_devices(mesh))
        if not axes or axes[0] != first or leaf.devices() != devices or mesh.shape[first] % len(devices):
            return None
        if any(s.tensor.shape[d] * len(devices) != leaf.shape[d] for s in leaf.shards):
            return None
        local = list(shape)
        local[where[first]] = mesh.shape[first] // len(devices)
        return leaf.map_shards(lambda shard: shard.reshape(local).permute(order), 0)

    @staticmethod
    def _rank_error(spec: PartitionSpec, leaf: Any, label: str) -> ValueError:
        return ValueError(
            f"shard_map: the in_spec of {label} is {spec!r}, with {len(spec)} entries, but the tensor has rank "
            f"{leaf.dim()} (shape {tuple(leaf.shape)}); a spec has at most one entry per dim"
        )

    # ------------------------------------------------------------------ the nested maps

    def _on_every_device(self) -> bool:
        """Whether this call runs each position of the mesh on its own device (a thread
        per position, in a grid: see :mod:`~torchpmap._engines.instance_threads`), or the
        first axis' positions on their devices with the other axes vectorized on them.

        Every position on its device takes a :class:`~torchpmap.Mesh` (one device per
        position), eager, with no torch.func transform around the call (its levels
        would have to travel through two generations of threads) and vectorization on
        (debug mode runs positions one at a time). ``jit=True`` compiles the first axis'
        slices (mesh axes are not compiled). The numbers are the same either way, to
        rounding: one device is the oracle for both."""
        return (
            isinstance(self.opts.mesh, Mesh)
            and not self.opts.jit
            and private.current_vmap_level() is None
            and not vectorization_disabled()
        )

    def _nest(self, tree: pytree.TreeSpec, leaf_axes: Sequence[frozenset[Hashable]], grid: bool) -> MappedFunction:
        """The nested pmaps over the mesh axes, for one argument structure; ``grid``: each
        position on its own device (see :meth:`_on_every_device`)."""
        fun, mesh, out_specs = self.fun, self.opts.mesh, self.opts.out_specs

        def blocks(*leaves: Any) -> Any:
            axes = _context.shard_map_axes.set(tuple(mesh.axis_names))  # ppermute checks tuples' order by it
            try:
                if not self.opts.check_vma:
                    return fun(*pytree.tree_unflatten(list(leaves), tree))
                with implicit_pvary(mesh.axis_names):  # JAX's gradients inside the map (see implicit_pvary)
                    return fun(*pytree.tree_unflatten(list(leaves), tree))
            finally:
                _context.shard_map_axes.reset(axes)

        mapped: Callable = blocks
        names = mesh.axis_names
        for level in reversed(range(len(names))):
            axis = names[level]
            in_axes = tuple(0 if axis in axes else None for axes in leaf_axes)
            out_axes = pytree.tree_map(
                lambda spec, axis=axis: 0 if spec is not None and axis in spec.axes() else None,
                out_specs,
                is_leaf=is_spec,
            )
            if isinstance(mesh, ProcessMesh):  # one position per process: a local portion of one
                placement: dict[str, Any] = {"mesh": mesh}
                local_size = 1
            elif grid:  # position (i, j, ...) on mesh.devices[i, j, ...], each axis a vmap of one
                placement = {"mesh": mesh}
                local_size = mesh.shape[axis]
            else:  # the first axis spread over the devices, the rest vectorized inside (see first_axis_devices)
                # inside an enclosing pmap's device thread (or one instance run alone), every
                # position runs on that instance's device, as any nested pmap does: naming
                # the mesh's devices there was refused, on 1 and 2 devices only
                pinned = _devices.current_default() is not None
                placement = {"devices": first_axis_devices(mesh) if level == 0 and not pinned else None}
                local_size = mesh.shape[axis]
            opts = MapOptions(
                kind="pmap",
                axis_name=axis,
                in_axes=in_axes,
                out_axes=out_axes,
                axis_size=local_size,
                randomness="different",
                jit=self.opts.jit if level == 0 else False,
                vma=self.opts.check_vma,
                **placement,
            )
            mapped = MappedFunction(mapped, opts)
        return mapped  # type: ignore[return-value]

    def _varies(self, varies: OutputVaries) -> ValueError:
        return ValueError(
            f"shard_map: the output at {varies.path or '(the root)'} varies along a mesh axis that its out_spec "
            f"leaves out (out_specs = {self.opts.out_specs!r}), so it cannot be taken as the same on every position "
            "of that axis. Reduce it over the axis (psum, pmean, all_gather), name the axis in the out_spec to "
            "stack the blocks, or pass check_vma=False to take the first position's value unchecked."
        )

    # ------------------------------------------------------------------ blocks out

    def _unblock_all(self, stacked: Any) -> Any:
        out_specs = self.opts.out_specs
        pairs = list(broadcast_prefix(out_specs, stacked, "shard_map out_specs", is_leaf=is_spec))
        leaves, tree = pytree.tree_flatten(stacked)
        return pytree.tree_unflatten([self._unblock(x, s, p) for x, (s, p) in zip(leaves, pairs)], tree)

    def _unblock(self, x: Any, spec: PartitionSpec | None, path: str) -> Any:
        """A stacked output (a leading dim per mesh axis its spec names, then the block)
        -> the global value: each dim of the block with its axes' dims merged in."""
        mesh = self.opts.mesh
        if isinstance(mesh, ProcessMesh):  # this process' block (its stacked dims of size 1) as a DTensor
            named = [a for a in mesh.axis_names if spec is not None and a in spec.axes()]
            local = x.reshape(x.shape[len(named):]) if named else x
            return _dtensor.as_dtensor(local, spec, mesh, f"shard_map: the output at {path or '(the root)'}")
        if spec is None or not spec.axes():
            return x
        mesh_names = self.opts.mesh.axis_names
        named = [a for a in mesh_names if a in spec.axes()]
        rank = x.dim() - len(named)
        if len(spec) > rank:
            raise ValueError(
                f"shard_map: the out_spec of the output at {path or '(the root)'} is {spec!r}, with {len(spec)} "
                f"entries, but each position returns a block of rank {rank} (shape {tuple(x.shape[len(named):])}); "
                "a spec has at most one entry per dim"
            )
        order: list[int] = []
        for d in range(rank):
            order += [named.index(a) for a in spec.axes_of(d)] + [len(named) + d]

        def merge(blocks: torch.Tensor) -> torch.Tensor:
            sizes = [
                blocks.shape[len(named) + d] * math.prod(blocks.shape[named.index(a)] for a in spec.axes_of(d))
                for d in range(rank)
            ]
            return blocks.permute(order).reshape(sizes)

        split = self._stays_split(x, spec, named, rank)
        if split is not None:  # each device's blocks are consecutive along `split`: they stay there
            return x.map_shards(merge, split)
        return merge(torch.as_tensor(x))

    def _stays_split(self, x: Any, spec: PartitionSpec, named: list[Hashable], rank: int) -> int | None:
        """The output dim along which ``x``'s devices' blocks lie one after another (so the
        result can stay split over them as they are), or None (it is gathered).

        ``x`` is split over the devices along its first stacked dim, the first mesh axis
        (consecutive positions per device). Its blocks stay where they are when that axis
        is the major axis of the output dim it is merged into (``P('data')``,
        ``P(('data', 'model'))``); under ``P(('model', 'data'))`` a device's blocks
        interleave with the others' along the dim, and the result is gathered."""
        first = self.opts.mesh.axis_names[0]
        if not isinstance(x, ShardedTensor) or x.shard_dim != 0 or not named or named[0] != first:
            return None
        for d in range(rank):
            axes = spec.axes_of(d)
            if first in axes:
                return d if axes[0] == first else None
        return None


def _versions(t: torch.Tensor) -> tuple[int, ...]:
    """The version counters that a write into ``t`` moves: its own, and a ShardedTensor's
    shards' (a position may write into its shard's block in place). An inference tensor
    keeps none (-1): a write into it under inference mode is not seen."""
    if isinstance(t, ShardedTensor):
        return (version_of(t), *(v for s in t.shards for v in _versions(s.tensor)))
    return (version_of(t),)


def first_axis_devices(mesh: AnyMesh) -> tuple[Any, ...]:
    """The devices the first mesh axis' positions run on, and where results split over
    that axis stay: an AbstractMesh's own; a Mesh's devices along its first axis (the
    other axes at index 0).

    On a Mesh run as a grid (:meth:`ShardMapped._on_every_device`) the other axes'
    positions run on their own devices, each axis a vmap of one in its thread (vmap
    levels are what tell a value that is the same on every position of an axis from one
    that varies, which check_vma's transposes need), and their blocks come back to
    their row's first-axis device. Otherwise they run vectorized on that device."""
    if isinstance(mesh, AbstractMesh):
        return mesh.devices
    return tuple(mesh.devices[(slice(None),) + (0,) * (mesh.devices.ndim - 1)].tolist())


def _leaf_labels(args: tuple) -> list[str]:
    """How messages name each argument leaf: ``argument 0 at ['w']``."""
    labels = []
    for i, arg in enumerate(args):
        for path, _ in pytree.tree_leaves_with_path(arg):
            labels.append(f"argument {i}{' at ' + pytree.keystr(path) if path else ''}")
    return labels
