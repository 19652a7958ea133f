"""The public transforms ``pmap``, ``vmap`` and ``shard_map``: signatures and documentation.

The machinery is in :mod:`torchpmap._frontend.call` (arguments and axes),
:mod:`torchpmap._frontend.shard_map` (blocks over a mesh) and :mod:`torchpmap._engines`
(running the instances).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from torchpmap._frontend.call import MapOptions, MappedFunction, _as_int_tuple
from torchpmap._frontend.function_cache import mapped_function
from torchpmap._frontend.shard_map import AnyMesh, MeshLike, ShardMapOptions, ShardMapped, Specs
from torchpmap._placement.devices import DeviceLike
from torchpmap._placement.mesh import Mesh
from torchpmap._state.type_aliases import AxisName, AxisSpec, Randomness


def pmap(
    fun: Callable[..., Any] | None = None,
    axis_name: AxisName | None = None,
    *,
    in_axes: AxisSpec = 0,
    out_axes: AxisSpec = 0,
    static_broadcasted_argnums: int | Sequence[int] = (),
    devices: Sequence[DeviceLike] | None = None,
    axis_size: int | None = None,
    donate_argnums: int | Sequence[int] = (),
    randomness: Randomness = "different",
    mesh: Mesh | None = None,
    jit: bool | Mapping[str, Any] = False,
) -> Callable[..., Any]:
    """Parallel map: runs ``fun`` once per slice of the mapped axis, as a single program
    on multiple data, with collectives across the instances addressed by ``axis_name``.

    ``fun`` is written for one slice: the mapped axis is removed from its arguments. The
    results of all instances are stacked along ``out_axes``. The mapped axis may be
    larger than the number of devices: each device then runs ``size / device_count``
    instances, vectorized (JAX raises instead); a size that does not divide evenly is a
    ValueError.

    Args:
        fun: the per-instance function. Omit it to get a decorator.
        axis_name: a name for the mapped axis, used by collectives such as :func:`psum`.
        in_axes: for each positional argument, which axis to map: an int (negative
            counts from the end), None to pass the argument unchanged to every instance,
            or a pytree prefix of the arguments (a tuple with one entry per positional
            argument, holding ints, None or containers of those). Keyword arguments are
            always mapped over axis 0. Only tensors and numpy arrays can be mapped;
            numpy arrays become tensors.
        out_axes: where to put the mapped axis in each output: an int, None (for a
            value that is the same on every instance, e.g. a ``psum``: the value of
            instance 0 is returned, unchecked, as in JAX), or a pytree prefix of the output.
        static_broadcasted_argnums: positions of arguments passed unchanged to every
            instance without any conversion; they must be hashable and passed
            positionally. ``in_axes`` stays indexed by the original positions.
        devices: the devices to use, in order (default: all of :func:`devices`).
        axis_size: the expected size of the mapped axis (checked), or the number of
            instances when no argument is mapped.
        donate_argnums: positions of arguments whose memory the caller gives up. They
            are validated; torchpmap does not yet reuse their buffers, so donation is
            only a hint (the same as JAX on CPU).
        randomness: how random ops behave across instances, as in ``torch.func.vmap``:
            ``"different"`` (default: each instance draws its own numbers, as separate
            devices would, reproducibly under ``torch.manual_seed`` for a given placement),
            ``"same"`` or ``"error"``; or ``"per_instance"``: instance ``i`` draws from
            its own stream, seeded from the call's seed and ``i``, so the numbers are the
            same on one device, on several and across processes (the random ops torch
            offers in Python, dropout included; a Python hop per torch call; not with
            ``jit=True``). See ``docs/device-threads.md``.
        mesh: a :class:`Mesh` (default: the one of an enclosing ``with mesh:``). When
            ``axis_name`` is one of its axes, the instances are placed along that mesh
            axis, and nested pmaps over other mesh axes fill the grid.
        jit: compile the mapped program with ``torch.compile``'s compiler (True, or a
            dict of ``torch.compile`` keyword arguments such as
            ``{"mode": "max-autotune"}``). True (or only inductor ``options``) compiles
            with inductor directly, without Dynamo's per-call guards, whose work the
            signature below already does.
            The vectorized program is traced once per input signature (shapes, strides, dtypes,
            devices, ``requires_grad``, non-tensor arguments, grad mode, autocast,
            default dtype), collectives included, and the trace is compiled; later
            calls with the same signature run the compiled code without running ``fun``
            in Python. As with ``jax.jit``, Python side effects happen only while
            tracing; a branch on a tensor's value cannot be traced, and that signature
            runs eagerly with a ``torchpmap.JitFallbackWarning``. Tensors that ``fun``
            closes over are read at every call, so in-place updates (an optimizer step)
            are seen. One device
            compiles, and so does each process of a multi-process run; on several
            devices in one process each device thread runs its own compiled slice,
            cut at the collectives, which meet eagerly (a mesh axis, random numbers,
            a write into an input and ``torch.compile`` options other than
            inductor's ``options`` run eagerly there, with the warning). Inside
            another transform (an enclosing pmap, ``torch.func.grad``) the call is part
            of the enclosing computation: traced into it when the enclosing pmap
            compiles, eager otherwise.

    Example:
        >>> import torch, torchpmap
        >>> def scaled_sum(x):
        ...     return torchpmap.psum(x * 2.0, axis_name="devices")
        >>> torchpmap.pmap(scaled_sum, axis_name="devices")(torch.arange(4.))
        tensor([12., 12., 12., 12.])
        >>> scale = torchpmap.pmap(lambda x, k: x * k, in_axes=(0, None))
        >>> scale(torch.arange(6.).reshape(2, 3), 10.0)
        tensor([[ 0., 10., 20.],
                [30., 40., 50.]])
    """
    if fun is None:
        return functools.partial(
            pmap,
            axis_name=axis_name,
            in_axes=in_axes,
            out_axes=out_axes,
            static_broadcasted_argnums=static_broadcasted_argnums,
            devices=devices,
            axis_size=axis_size,
            donate_argnums=donate_argnums,
            randomness=randomness,
            mesh=mesh,
            jit=jit,
        )
    statics = _as_int_tuple(static_broadcasted_argnums, "static_broadcasted_argnums")
    donated = _as_int_tuple(donate_argnums, "donate_argnums")
    if set(statics) & set(donated):
        raise ValueError(
            f"pmap: arguments {sorted(set(statics) & set(donated))} are both static and donated; "
            "static arguments are not tensors and cannot be donated"
        )
    given: Any = devices
    opts = MapOptions(
        kind="pmap",
        axis_name=axis_name,
        in_axes=in_axes,
        out_axes=out_axes,
        randomness=randomness,
        axis_size=axis_size,
        static_argnums=statics,
        donate_argnums=donated,
        # a single device (a string, a Device) is kept as it is, for the error that says so
        devices=given if given is None or isinstance(given, str) or not hasattr(given, "__iter__") else tuple(given),
        mesh=mesh,
        jit=jit,
    )
    return mapped_function(fun, opts)


def vmap(
    fun: Callable[..., Any] | None = None,
    in_axes: AxisSpec = 0,
    out_axes: AxisSpec = 0,
    axis_name: AxisName | None = None,
    randomness: Randomness = "error",
    *,
    axis_size: int | None = None,
    jit: bool | Mapping[str, Any] = False,
) -> Callable[..., Any]:
    """Vectorizing map with named-axis collectives, like ``jax.vmap(..., axis_name=...)``.

    The same program model as :func:`pmap`, run as one vectorized computation where the
    inputs already are, on any number of instances. ``out_axes=None`` is checked: an
    output that varies along the axis raises. ``randomness`` defaults to ``"error"``, as
    in ``torch.func.vmap``. ``jit`` compiles the program, as in :func:`pmap`.

    Example:
        >>> import torch, torchpmap
        >>> f = lambda x: x / torchpmap.psum(x, "batch")
        >>> torchpmap.vmap(f, axis_name="batch")(torch.tensor([1., 3.]))
        tensor([0.2500, 0.7500])
    """
    if fun is None:
        return functools.partial(
            vmap,
            in_axes=in_axes,
            out_axes=out_axes,
            axis_name=axis_name,
            randomness=randomness,
            axis_size=axis_size,
            jit=jit,
        )
    opts = MapOptions(
        kind="vmap",
        axis_name=axis_name,
        in_axes=in_axes,
        out_axes=out_axes,
        randomness=randomness,
        axis_size=axis_size,
        jit=jit,
    )
    return MappedFunction(fun, opts)


def shard_map(
    fun: Callable[..., Any] | None = None,
    *,
    mesh: MeshLike,
    in_specs: Specs,
    out_specs: Specs,
    check_vma: bool = True,
    jit: bool | Mapping[str, Any] = False,
) -> Callable[..., Any]:
    """Runs ``fun`` on every position of ``mesh``, each on its blocks of the arguments.

    Like ``jax.shard_map`` (with ``Auto`` mesh axes): global tensors go in, and each
    argument is split by its :class:`~torchpmap.PartitionSpec`: ``P('x', None)`` splits
    dim 0 over mesh axis ``x``, ``P(('x', 'y'))`` over ``x`` and ``y`` together (``x``
    major), and a mesh axis a spec does not name replicates the argument over it.
    ``fun`` sees its blocks with their rank kept (an ``(8, 4)`` tensor split 4 ways is a
    ``(2, 4)`` block) and calls collectives by mesh axis name. Its results are put
    together by ``out_specs``: blocks are concatenated along the dims a spec names; an
    axis a spec leaves out means the result is the same on every position along it. In
    one process, a result whose spec splits a dim over the first mesh axis (its major
    axis there) stays on that axis' devices, a :class:`~torchpmap.ShardedTensor`; other
    results are gathered on the first device.

    Args:
        fun: a function of the blocks (of each positional argument's leaves).
        mesh: a :class:`~torchpmap.Mesh`, or what :func:`~torchpmap.make_mesh` returns
            (with fewer devices than positions, the positions run vectorized: the same
            numbers on one device as on many).
        in_specs: a PartitionSpec per positional argument: a pytree prefix of the
            arguments tuple (a single spec applies to every argument). None, like
            ``P()``, replicates.
        out_specs: a PartitionSpec per output, a pytree prefix of the output.
        check_vma: an output whose spec leaves out an axis along which it varies raises
            (JAX's varying-manual-axes check). Values vary along the axes their input
            specs name; ``psum``, ``pmean`` and ``all_gather`` over an axis make them the
            same along it; :func:`~torchpmap.pvary` marks a value as varying. False
            takes the first position's value unchecked.
        jit: compile the program, as ``pmap(jit=True)``.

    Returns:
        A function taking the global arguments and returning the global results (also
        usable as a decorator through ``functools.partial``).

    Example:
        >>> import torch, torchpmap as tp
        >>> from torchpmap import P
        >>> mesh = tp.make_mesh((4, 2), ("batch", "model"))
        >>> def matmul(x, w):  # x: (2, 3) block of rows; w: (3, 2) block of columns
        ...     return x @ w
        >>> f = tp.shard_map(matmul, mesh=mesh, in_specs=(P("batch", None), P(None, "model")),
        ...                  out_specs=P("batch", "model"))
        >>> x, w = torch.randn(8, 3), torch.randn(3, 4)
        >>> torch.allclose(f(x, w), x @ w)
        True
        >>> @tp.shard_map(mesh=mesh, in_specs=P("batch"), out_specs=P())
        ... def total(x):
        ...     return tp.psum(x.sum(0), ("batch", "model")) / 2  # each row counted on both model positions
        >>> torch.allclose(total(x), x.sum(0))
        True
    """
    if fun is None:
        return functools.partial(
            shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, jit=jit
        )
    # a DeviceMesh becomes a mesh of processes in ShardMapped
    return ShardMapped(fun, ShardMapOptions(cast(AnyMesh, mesh), in_specs, out_specs, check_vma, jit))
