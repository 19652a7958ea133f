"""The front end shared by ``pmap`` and ``vmap``: arguments, axes and outputs.

A call is checked and flattened into a :class:`~torchpmap._engines.mapped_call.MappedCall`; an
engine runs it; the flat results are stacked along ``out_axes`` and put back into the
output's pytree. Nothing here knows which engine runs.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np
import torch

from torchpmap._engines import dispatch
from torchpmap._engines.compiled import ProgramCache, signature_of
from torchpmap._engines.mapped_call import MappedCall, OutputLayout, VmapFallback
from torchpmap._frontend import aliasing, output_copies
from torchpmap._frontend.tree_prefix import as_index, broadcast_prefix, check_axis_spec, normalize_axis_spec
from torchpmap._placement import devices as _devices
from torchpmap._placement import mesh as _mesh
from torchpmap._placement.devices import DeviceLike
from torchpmap._placement.mesh import Mesh
from torchpmap._placement.sharded import ShardedTensor, ShardedView, as_local, movedim_of_shards, row_of_shards
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.compile_guard import refuse_under_compile
from torchpmap._state.torch_private import pytree
from torchpmap._state.type_aliases import AxisName, AxisSpec, Randomness

_RANDOMNESS = get_args(Randomness)  # ("error", "different", "same", "per_instance")
_MAX_CACHED_LAYOUTS = 64  # argument structures remembered per mapped function
_LEAF_SPEC = pytree.tree_flatten(0)[1]
_NO_NONES: dict[int, None] = {}  # a lone tensor output has no None leaves (read, never written)


@dataclasses.dataclass(frozen=True)
class MapOptions:
    """Everything about a mapped function except the function itself."""

    kind: Literal["pmap", "vmap"]
    axis_name: AxisName | None
    in_axes: AxisSpec
    out_axes: AxisSpec
    randomness: Randomness
    axis_size: int | None = None
    static_argnums: tuple[int, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    devices: tuple[DeviceLike, ...] | DeviceLike | None = None  # a single device: refused by check_options
    mesh: Mesh | None = None
    jit: bool | Mapping[str, Any] = False  # False, True, or keyword arguments for torch.compile
    # shard_map's check_vma: out_axes=None checked as vmap checks it (OutputVaries if the output
    # varies), and collectives transpose by JAX's varying-manual-axes rules (see AxisFrame.vma)
    vma: bool = False


def normalized(opts: MapOptions) -> MapOptions:
    """``opts`` with integers of other types (numpy's) as Python ints, as JAX accepts them."""
    in_axes, out_axes = normalize_axis_spec(opts.in_axes), normalize_axis_spec(opts.out_axes)
    axis_size = as_index(opts.axis_size)
    if in_axes is opts.in_axes and out_axes is opts.out_axes and axis_size is opts.axis_size:
        return opts
    return dataclasses.replace(opts, in_axes=in_axes, out_axes=out_axes, axis_size=axis_size)


def check_options(opts: MapOptions) -> None:
    what = opts.kind
    if isinstance(opts.in_axes, list):
        raise ValueError(
            f"{what}: in_axes must be an int, None or a tuple with one entry per positional argument; "
            f"got the list {opts.in_axes!r}. Use a tuple: in_axes={tuple(opts.in_axes)!r}"
        )
    check_axis_spec(opts.in_axes, f"{what} in_axes")
    check_axis_spec(opts.out_axes, f"{what} out_axes")
    try:
        hash(opts.axis_name)
    except TypeError:
        raise TypeError(
            f"{what}: axis_name must be hashable (a string, usually), got {opts.axis_name!r}"
            + (
                f"; for one axis write axis_name={opts.axis_name[0]!r}"
                if isinstance(opts.axis_name, list) and len(opts.axis_name) == 1
                else ""
            )
        ) from None
    if opts.randomness not in _RANDOMNESS:
        raise ValueError(f"{what}: randomness must be one of {_RANDOMNESS}, got {opts.randomness!r}")
    if opts.axis_size is not None and (
        not isinstance(opts.axis_size, int) or isinstance(opts.axis_size, bool) or opts.axis_size < 1
    ):
        raise ValueError(f"{what}: axis_size must be a positive int or None, got {opts.axis_size!r}")
    if opts.mesh is not None and not isinstance(opts.mesh, _mesh.Mesh):
        raise TypeError(
            f"{what}: mesh must be a torchpmap.Mesh (or None for the one of an enclosing `with mesh:`), got "
            f"{type(opts.mesh).__name__} {opts.mesh!r}. Build one with torchpmap.Mesh(devices, axis_names), or "
            "torchpmap.distributed.mesh(shape, axis_names) across processes."
        )
    if opts.devices is not None:
        _devices.resolve(opts.devices)
    if opts.jit and opts.randomness == "per_instance":
        raise NotImplementedError(
            f"{what}: jit=True with randomness='per_instance' is not supported yet (the compiled program would draw "
            "from torch.compile's generator, not from each instance's stream). Drop jit=True, or use "
            "randomness='different'."
        )
    if not isinstance(opts.jit, (bool, Mapping)):
        raise TypeError(
            f"{what}: jit must be True, False or a dict of torch.compile keyword arguments "
            f"(e.g. {{'mode': 'max-autotune'}}), got {opts.jit!r}"
        )


def qualified_name(fun: Callable) -> str:
    """``fun``'s qualified name (a partial's function's, a callable object's class')."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    name = getattr(fun, "__qualname__", None)
    return name if isinstance(name, str) else type(fun).__qualname__


def program_of(fun: Callable, opts: MapOptions) -> tuple[int, str]:
    """``(digest, description)`` of a mapped program: its function's qualified name,
    ``in_axes``, ``out_axes`` and axis name (see ``MappedCall.program``). The digest is
    stable across processes (not Python's ``hash``, which varies per process)."""
    description = (
        f"{opts.kind} of {qualified_name(fun)!r} with in_axes={opts.in_axes!r}, out_axes={opts.out_axes!r}, "
        f"axis_name={opts.axis_name!r}"
    )
    raw = hashlib.blake2b(description.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True), description


def _as_int_tuple(x: int | Sequence[int], name: str) -> tuple[int, ...]:
    """``static_broadcasted_argnums``/``donate_argnums`` as a tuple of ints."""
    x = as_index(x)
    items = (x,) if isinstance(x, int) else tuple(map(as_index, x)) if isinstance(x, (tuple, list, range)) else None
    if items is None or any(not isinstance(i, int) or isinstance(i, bool) for i in items):
        raise TypeError(f"pmap: {name} must be an int or a sequence of ints, got {x!r}")
    return items


@dataclasses.dataclass(frozen=True)
class _OutPlan:
    """How the outputs of one output structure are stacked: each leaf's out axis (with
    its key path, for messages), and the keys when the output is a plain dict of leaves."""

    axes: list[tuple[int | None, str]]
    dict_keys: tuple[Any, ...] | None


def _keys_of_flat_dict(tree: Any) -> tuple[Any, ...] | None:
    """The keys of ``tree`` when it is a plain dict whose values are leaves, else None."""
    if type(tree) is not dict or any(not pytree.tree_is_leaf(v) for v in tree.values()):
        return None
    return tuple(tree)


def _shallow_flatten(args: tuple) -> tuple[list[torch.Tensor], tuple[tuple[str, ...] | None, ...]] | None:
    """Positional arguments that are tensors, or dicts of tensors keyed by strings (a
    model's parameters), flattened without a pytree pass, in pytree's order: the leaves
    and the structure (``None`` for a tensor, a dict's keys in order). None for anything
    else. A call's own cost, paid on every call: pytree's pass takes several times longer.
    """
    leaves: list[torch.Tensor] = []
    shape: list[tuple[str, ...] | None] = []
    for arg in args:
        kind = type(arg)
        if kind is torch.Tensor:
            leaves.append(arg)
            shape.append(None)
        elif kind is dict:
            keys = tuple(arg)
            values = arg.values()
            if not all(type(k) is str for k in keys) or not all(type(v) is torch.Tensor for v in values):
                return None
            leaves.extend(values)
            shape.append(keys)
        else:
            return None
    return leaves, tuple(shape)


@dataclasses.dataclass(slots=True)
class _Flat:
    """The flattened positional and keyword arguments of one call."""

    leaves: list[Any]
    layout: list[tuple[Any, str]]  # each leaf's (axis, label for messages)
    spec: pytree.TreeSpec | None  # None: the arguments are just positional tensors
    structure: Hashable  # the arguments' structure: what the leaf axes depend on
    mapped_slots: list[int]
    in_dims: list[int]
    size: int


def _sharded_broadcasts_gathered(flat: _Flat, broadcast_slots: Sequence[int]) -> _Flat:
    """``flat`` with each ``in_axes=None`` argument that is a ShardedTensor or a view of one
    gathered once, differentiably, onto its first device: every instance reads all of it.
    Each device had gathered a copy of its own, so a write into it in place reached
    neither the argument nor the shared-write check (one device's plain tensor raises)."""
    if not any(isinstance(flat.leaves[k], (ShardedTensor, ShardedView)) for k in broadcast_slots):
        return flat
    leaves = list(flat.leaves)
    for k in broadcast_slots:
        if isinstance(leaves[k], (ShardedTensor, ShardedView)):
            leaves[k] = as_local(leaves[k], None)
    return dataclasses.replace(flat, leaves=leaves)


def _at_path(spec: Any, k: int) -> str:
    """`` at <key path>`` of leaf ``k`` of an output with pytree ``spec`` ('' for a lone leaf)."""
    if spec.num_leaves == 1:
        return ""
    paths = [
        pytree.keystr(path)
        for path, _ in pytree.tree_leaves_with_path(pytree.tree_unflatten([0] * spec.num_leaves, spec))
    ]
    return f" at {paths[k]}"


class MappedFunction:
    """A function mapped by ``pmap`` or ``vmap``; calling it runs the map."""

    def __init__(self, fun: Callable, opts: MapOptions):
        if not callable(fun):
            raise TypeError(f"{opts.kind}: the first argument must be a callable, got {fun!r}")
        opts = normalized(opts)
        check_options(opts)
        self.fun, self.opts = fun, opts
        # argument structure -> (leaf axes, the structure's number, its pytree spec)
        self._layouts: dict[Any, tuple[list[tuple[Any, str]], int, pytree.TreeSpec | None]] = {}
        self._out_layouts: dict[Any, _OutPlan] = {}  # output structure -> how to stack it
        self._last_out_plan: tuple[Any, _OutPlan] | None = None  # the last one, by identity
        self._vmap_fallback = VmapFallback()
        self._programs = ProgramCache({} if opts.jit is True else opts.jit) if opts.jit else None
        self._program = program_of(fun, opts) if opts.kind == "pmap" else None
        functools.update_wrapper(self, fun, updated=())

    def __repr__(self) -> str:
        return (
            f"<{self.opts.kind} of {getattr(self.fun, '__qualname__', self.fun)!r}, axis_name={self.opts.axis_name!r}>"
        )

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # so that a decorated method binds self
        return self if obj is None else functools.partial(self, obj)

    # ------------------------------------------------------------------ call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        what = self.opts.kind
        refuse_under_compile(what)
        if self.opts.static_argnums or self.opts.donate_argnums:
            statics = self._statics(args)
            dyn_args = tuple(a for i, a in enumerate(args) if i not in statics)
        else:
            statics, dyn_args = {}, args
        flat = self._flatten(args, statics, dyn_args, kwargs)
        if len(flat.mapped_slots) == len(flat.leaves):  # the common case: every leaf mapped
            broadcast_slots: list[int] = []
            mapped_leaves = flat.leaves
        else:
            mapped = set(flat.mapped_slots)
            broadcast_slots = [k for k in range(len(flat.leaves)) if k not in mapped]
            flat = _sharded_broadcasts_gathered(flat, broadcast_slots)
            mapped_leaves = [flat.leaves[k] for k in flat.mapped_slots]
        layout = OutputLayout()  # filled by body; restored by a compiled program that skips it
        # the common case: positional tensors, all mapped; an instance's arguments are its slices
        direct = flat.spec is None and not statics and not broadcast_slots

        def body(slices: Sequence[torch.Tensor], broadcast: Sequence[Any]) -> list[torch.Tensor]:
            if direct:
                return self._flatten_output(self.fun(*slices), layout)
            leaves = list(flat.leaves)
            for slot, value in zip(flat.mapped_slots, slices):
                leaves[slot] = value
            for slot, value in zip(broadcast_slots, broadcast):  # as placed by the engine
                leaves[slot] = value
            if flat.spec is None:
                call_args, call_kwargs = leaves, {}
            else:
                call_args, call_kwargs = pytree.tree_unflatten(leaves, flat.spec)
                call_args = list(call_args)
            for i in sorted(statics):
                call_args.insert(i, statics[i])
            return self._flatten_output(self.fun(*call_args, **call_kwargs), layout)

        mesh = self._mesh()
        devices = self._devices_for(flat.size, mesh) if what == "pmap" else None
        if mesh is not None and not isinstance(mesh, _mesh.ProcessMesh) and _under_a_transform_of_its_own():
            devices, mesh = self._axis_devices(mesh, flat.size), None
        call = MappedCall(
            body=body,
            mapped=mapped_leaves,
            in_dims=flat.in_dims,
            broadcast=[flat.leaves[k] for k in broadcast_slots] if broadcast_slots else [],
            axis_name=self.opts.axis_name,
            size=flat.size,
            randomness=self.opts.randomness,
            devices=devices,
            mesh=mesh,
            must_be_unmapped=(
                (lambda: self._replicated_outputs(layout)) if what == "vmap" or self.opts.vma else None
            ),
            programs=self._programs,
            signature=signature_of(flat.structure, statics, flat.leaves) if self._programs is not None else None,
            output_layout=layout,
            vmap_fallback=self._vmap_fallback,
            vma=self.opts.vma,
            program=self._program,
        )
        # pmap: a write to memory that several instances share raises on every placement
        watched = aliasing.watch(
            flat.leaves, flat.mapped_slots, flat.in_dims, broadcast_slots, flat.size, _devices.process_count,
            lambda slot: self._in_label(flat, slot), what,
        ) if what == "pmap" else None
        if watched is None:
            outputs = dispatch.run(call)
        else:  # called from here too, so that the engines' warnings point at the same frame
            try:
                outputs = dispatch.run(call)
            except RuntimeError as error:
                explained = watched.explain(error)
                if explained is None:
                    raise
                raise explained from error
            watched.check()
        return self._stack_outputs(output_copies.unaliased(outputs, flat.leaves), layout)

    def _in_label(self, flat: _Flat, slot: int) -> tuple[str, Any]:
        axis, label = flat.layout[slot]
        return label, axis

    # ------------------------------------------------------------------ arguments


    def _statics(self, args: tuple) -> dict[int, Any]:
        for i in self.opts.donate_argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"pmap: donate_argnums includes {i}, but only {len(args)} positional arguments were passed. "
                    f"Donated arguments must be passed positionally."
                )
        statics: dict[int, Any] = {}
        for i in self.opts.static_argnums:
            pos = i + len(args) if i < 0 else i
            if not 0 <= pos < len(args):
                raise ValueError(
                    f"pmap: static_broadcasted_argnums includes {i}, but only {len(args)} positional arguments were "
                    f"passed. All static broadcasted arguments must be passed positionally."
                )
            try:
                hash(args[pos])
            except TypeError:
                raise ValueError(
                    f"pmap: static broadcasted argument {pos} ({self._arg_label(pos)}) must be hashable, but got "
                    f"{type(args[pos]).__name__}: {args[pos]!r}. Pass a hashable value (a tuple instead of a list, "
                    "say), or pass it as a regular argument with in_axes None."
                ) from None
            statics[pos] = args[pos]
        return statics

    @functools.cached_property
    def _param_names(self) -> list[str]:
        try:
            params = inspect.signature(self.fun).parameters.values()
        except (TypeError, ValueError):
            return []
        return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def _arg_label(self, pos: int) -> str:
        names = self._param_names
        return f"argument {names[pos]!r}" if pos < len(names) else f"positional argument {pos}"

    def _positional_axes(self, args: tuple, statics: dict[int, Any]) -> list[Any]:
        in_axes = self.opts.in_axes
        if not isinstance(in_axes, tuple):
            return [in_axes] * (len(args) - len(statics))
        if len(in_axes) != len(args):
            raise ValueError(
                f"{self.opts.kind}: in_axes has {len(in_axes)} entries but the function was called with "
                f"{len(args)} positional arguments; give one entry per positional argument"
                + (" (static arguments included, their entries are ignored)" if statics else "")
            )
        return [a for i, a in enumerate(in_axes) if i not in statics]

    def _flatten(self, args: tuple, statics: dict[int, Any], dyn_args: tuple, kwargs: dict) -> _Flat:
        shallow = None if kwargs else _shallow_flatten(dyn_args)
        spec: pytree.TreeSpec | None
        if shallow is not None:  # the common cases need no pytree pass
            leaves, shape = shallow
            key: Any = ("shallow", shape, tuple(statics), len(args))
        else:
            leaves, spec = pytree.tree_flatten((dyn_args, kwargs))
            # A leaf's axis depends only on the arguments' structure: match the in_axes
            # prefix once per structure, so that a repeated call skips it.
            key = (spec, tuple(statics), len(args))
        known = self._layouts.get(key)
        if known is None:
            layout, structure = self._leaf_axes(args, statics, dyn_args, kwargs), key
            if shallow is not None:  # positional tensors only: body passes the slices on as they are
                spec = None if all(part is None for part in shallow[1]) else pytree.tree_flatten((dyn_args, kwargs))[1]
            if len(self._layouts) < _MAX_CACHED_LAYOUTS:
                # a small number stands for the structure from now on: a compiled program's
                # cache hashes and compares it on every call (a pytree spec, recursively)
                structure = len(self._layouts)
                self._layouts[key] = (layout, structure, spec)
        else:
            layout, structure, spec = known
        mapped_slots, in_dims, sizes = [], [], []
        for k, (leaf, (axis, label)) in enumerate(zip(leaves, layout)):
            if type(leaf) is not torch.Tensor and (
                isinstance(leaf, np.ndarray) or (isinstance(leaf, np.generic) and axis is not None)
            ):
                leaf = leaves[k] = torch.as_tensor(leaf)
            if axis is None or leaf is None:  # None: an empty subtree, as in JAX (an optional argument not given)
                continue
            mapped_slots.append(k)
            in_dims.append(self._mapped_dim(leaf, axis, label))
            sizes.append(leaf.shape[axis])
        if len(set(sizes)) > 1:
            self._raise_inconsistent(leaves, layout, mapped_slots)
        return _Flat(leaves, layout, spec, structure, mapped_slots, in_dims, self._common_size(sizes))

    def _leaf_axes(self, args: tuple, statics: dict[int, Any], dyn_args: tuple, kwargs: dict) -> list[tuple[Any, str]]:
        """(axis, label for messages) of every argument leaf, in flatten order."""
        what = self.opts.kind
        positions = [i for i in range(len(args)) if i not in statics]
        layout: list[tuple[Any, str]] = []
        for pos, arg, axis in zip(positions, dyn_args, self._positional_axes(args, statics)):
            label = self._arg_label(pos)
            for leaf_axis, path in broadcast_prefix(axis, arg, f"{what} in_axes[{pos}] (for {label})"):
                layout.append((leaf_axis, f"{label}{' at ' + path if path else ''}"))
        for name, value in kwargs.items():  # keyword arguments are always mapped over axis 0
            for path, _ in pytree.tree_leaves_with_path(value):
                layout.append((0, f"keyword argument {name!r}{' at ' + pytree.keystr(path) if path else ''}"))
        return layout

    def _mapped_dim(self, leaf: Any, axis: int, label: str) -> int:
        """The non-negative mapped dim of ``leaf``, or a TypeError/ValueError naming it."""
        what = self.opts.kind
        if not isinstance(leaf, (torch.Tensor, ShardedTensor)):
            raise TypeError(
                f"{what} in_axes maps {label} along axis {axis}, but it is a {type(leaf).__name__} "
                f"({leaf!r}), which has no axes. Only tensors and numpy arrays can be mapped: give it "
                f"in_axes None to pass it unchanged to every instance, or pass a tensor."
            )
        if leaf.is_nested or (leaf.layout is not torch.strided and what == "pmap"):
            self._refuse_kind(leaf, f"{label} is mapped along axis {axis}")
        rank = leaf.dim()
        if not -rank <= axis < rank:
            raise ValueError(
                f"{what} was asked to map {label} along axis {axis}, which needs a rank of at least "
                f"{axis + 1 if axis >= 0 else -axis}, but it has rank {rank} (shape {tuple(leaf.shape)}). "
                f"Fix in_axes for it, or give it None to broadcast it."
            )
        return axis % rank

    def _refuse_kind(self, t: torch.Tensor, where: str, output: bool = False) -> None:
        """A sparse or nested tensor where pmap needs a dense one: the same TypeError on every placement."""
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        fix = (
            "Return it dense (x.to_dense()), or return what it is made of (indices and values) as dense tensors."
            if output else
            "Convert it (x.to_dense(); for a nested tensor whose pieces have one shape, torch.stack(x.unbind())), "
            "or pass it with in_axes None: every instance then sees it whole, unchanged, on every placement."
        )
        raise TypeError(
            f"{self.opts.kind}: {where}, but it is a {kind} tensor (layout {t.layout}). {self.opts.kind} maps and "
            "returns dense (strided) tensors only: an instance's argument is a slice of a mapped tensor and its "
            "results are stacked (on several devices, sent between them), which sparse and nested tensors do not "
            f"support alike on every placement. {fix}"
        )

    def _raise_inconsistent(self, leaves: list, layout: list[tuple[Any, str]], mapped_slots: list[int]) -> None:
        found = [(leaves[k].shape[layout[k][0]], layout[k]) for k in mapped_slots]
        lines = "\n".join(
            f"  * size {size}: axis {axis} of {label} (shape {tuple(leaves[k].shape)})"
            for k, (size, (axis, label)) in zip(mapped_slots, found)
        )
        raise ValueError(
            f"{self.opts.kind} got inconsistent sizes for the mapped axes: every mapped argument must have the "
            f"same size along its mapped axis, but found sizes {sorted({s for s, _ in found})}:\n{lines}"
        )

    def _common_size(self, sizes: list[int]) -> int:
        what, axis_size = self.opts.kind, self.opts.axis_size
        if not sizes:
            if axis_size is not None:
                return axis_size
            raise ValueError(
                f"{what} needs at least one mapped argument, but in_axes maps none (every entry is None and no "
                f"keyword arguments were given). Map an argument, or pass axis_size= to say how many instances to run."
            )
        size = sizes[0]
        if axis_size is not None and axis_size != size:
            raise ValueError(f"{what}: axis_size={axis_size} was given, but the mapped arguments have size {size}")
        return size

    def _mesh(self) -> _mesh.Mesh | None:
        """The mesh this call maps over, if its axis name is a mesh axis."""
        if self.opts.kind != "pmap":
            return None
        mesh = self.opts.mesh or _mesh.current()
        if mesh is None or self.opts.axis_name not in mesh.axis_names:
            return None
        if self.opts.devices is not None:
            raise ValueError(
                f"pmap over mesh axis {self.opts.axis_name!r}: the mesh places the instances, so devices= cannot be "
                "given too"
            )
        return mesh

    def _axis_devices(self, mesh: Mesh, size: int) -> tuple[_devices.Device, ...]:
        """Where a mesh axis' instances run under a torch.func transform (see
        :func:`_under_a_transform_of_its_own`): the devices along the axis (the other axes at
        index 0), as a plain multi-device pmap's; inside a device thread, that thread's own
        device (a nested mesh axis runs vectorized there)."""
        if _context.default_devices.get() is not None:
            return self._devices_for(size, None)
        along = tuple(slice(None) if a == self.opts.axis_name else 0 for a in mesh.axis_names)
        return tuple(mesh.devices[along].tolist())

    def _devices_for(self, size: int, mesh: Mesh | None) -> tuple[_devices.Device, ...]:
        if mesh is not None:
            return tuple(mesh.devices.flat)
        devs = _devices.resolve(self.opts.devices)
        if size <= len(devs):
            return devs[:size]
        if size % len(devs):
            raise ValueError(
                f"pmap: the mapped axis has size {size}, which does not divide evenly over the {len(devs)} devices "
                f"used ({list(devs)}): each device runs the same number of instances. Use a size that is a "
                f"multiple of {len(devs)} or at most {len(devs)}, or pass devices= with a count that divides {size}."
            )
        return devs

    # ------------------------------------------------------------------ outputs

    def _flatten_output(self, out: Any, layout: OutputLayout) -> list[torch.Tensor]:
        # the common case: no pytree pass
        if type(out) is torch.Tensor and out.layout is torch.strided and not out.is_nested:
            layout.record(_LEAF_SPEC, 1, _NO_NONES)
            return [out]
        leaves, spec = pytree.tree_flatten(out)
        tensors: list[torch.Tensor] = []
        constants: dict[int, Any] = {}
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, (torch.Tensor, ShardedTensor)):
                if (leaf.layout is not torch.strided or leaf.is_nested) and self.opts.kind == "pmap":
                    self._refuse_kind(
                        leaf, f"the mapped function returned output leaf {k}{_at_path(spec, k)}", output=True
                    )
                tensors.append(leaf)
            elif isinstance(leaf, (bool, int, float, complex, np.ndarray, np.generic)):
                tensors.append(torch.as_tensor(leaf))
            elif leaf is None:
                constants[k] = None
            else:
                raise TypeError(
                    f"{self.opts.kind}: the mapped function returned a {type(leaf).__name__} ({leaf!r}) at output "
                    f"leaf {k}; outputs must be pytrees of tensors, numpy arrays or numbers"
                )
        layout.record(spec, len(leaves), constants)
        return tensors

    def _out_plan(self, layout: OutputLayout) -> _OutPlan:
        spec = layout.spec
        last = self._last_out_plan
        if last is not None and last[0] is spec:  # a compiled program hands back the same spec object
            return last[1]
        plan = self._out_layouts.get(spec)
        if plan is None:
            tree = pytree.tree_unflatten([None] * layout.leaves, spec)
            axes = list(broadcast_prefix(self.opts.out_axes, tree, f"{self.opts.kind} out_axes"))
            plan = _OutPlan(axes, _keys_of_flat_dict(tree))
            if len(self._out_layouts) < _MAX_CACHED_LAYOUTS:
                self._out_layouts[spec] = plan
        self._last_out_plan = (spec, plan)
        return plan

    def _replicated_outputs(self, layout: OutputLayout) -> dict[int, str]:
        """Tensor-output positions whose out axis is None, with their key paths."""
        tensor_axes = [a for k, a in enumerate(self._out_plan(layout).axes) if k not in layout.none_leaves]
        return {k: path for k, (axis, path) in enumerate(tensor_axes) if axis is None}

    def _stack_outputs(self, outputs: list[torch.Tensor], layout: OutputLayout) -> Any:
        spec, constants = layout.spec, layout.none_leaves
        # one tensor, stacked where the engine put it
        if spec is _LEAF_SPEC and self.opts.out_axes == 0 and not constants:
            return output_copies.own_rows(outputs[0])
        plan = self._out_plan(layout)
        result: list[Any] = []
        it = iter(outputs)
        for k, (axis, path) in enumerate(plan.axes):
            if k in constants:
                result.append(constants[k])
                continue
            t = next(it)
            result.append(self._place_out_axis(t, axis, path))
        if plan.dict_keys is not None:  # a flat dict (parameters, say): no pytree pass
            return dict(zip(plan.dict_keys, result))
        return pytree.tree_unflatten(result, spec)

    def _place_out_axis(self, t: torch.Tensor | ShardedTensor, axis: int | None, path: str) -> Any:
        # a new result from the stacked one, which nothing else sees: sharded, it keeps its
        # sharding (no ShardedView of it, as a user's views of a result that requires grad are)
        if axis is None:
            return row_of_shards(t, 0) if isinstance(t, ShardedTensor) else t[0]
        t = output_copies.own_rows(t)
        rank = t.dim()
        if not -rank <= axis < rank:
            raise ValueError(
                f"{self.opts.kind} out_axes{path} is {axis}, but the output there has rank {rank - 1} per instance "
                f"(shape {tuple(t.shape[1:])}), so the mapped axis can go at positions {-rank}..{rank - 1}"
            )
        return movedim_of_shards(t, 0, axis) if isinstance(t, ShardedTensor) else t.movedim(0, axis)


def _under_a_transform_of_its_own() -> bool:
    """Whether a torch.func transform that the mesh engine's threads cannot carry encloses
    this call: one around the outermost mesh pmap (its backward would run every position's
    node in one thread, where they cannot exchange), or one inside a mesh position's
    thread around a nested mesh pmap. Such a call runs as a multi-device pmap over the
    axis' devices instead (see ``MappedFunction._axis_devices``): the same numbers, on fewer
    devices. A mesh position's own vmap level (shard_map's check_vma) is no such transform,
    and a mesh of processes runs one position per process whatever encloses it."""
    level = private.current_vmap_level()
    if level is None:
        return False
    thread = _context.instance_thread.get()
    return thread is None or level not in (thread.outer_level, thread.own_level)
