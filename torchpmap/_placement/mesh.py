"""Mesh: devices arranged in an n-D grid with named axes.

A pmap whose ``axis_name`` is an axis of the active mesh maps over that mesh axis:
nested pmaps over ``"data"`` and ``"model"`` put instance ``(d, m)`` on
``mesh.devices[d, m]``, and a collective over ``"model"`` runs among the devices of one
mesh row, over ``"data"`` among one column.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from torchpmap._placement import devices as _devices
from torchpmap._state import context as _context
from torchpmap._state import process_group as _process_group


class Mesh:
    """An n-D grid of devices with one name per axis.

    Use it as a context (``with mesh:``) or pass ``pmap(..., mesh=mesh)``.

    Example:
        >>> import torchpmap
        >>> mesh = torchpmap.Mesh([torchpmap.devices()[:1]], ("data", "model"))
        >>> mesh.shape
        {'data': 1, 'model': 1}
    """

    def __init__(self, devices: Any, axis_names: Sequence[Hashable]):
        grid = np.array(devices, dtype=object)
        axis_names = tuple(axis_names)
        ragged = _ragged(devices)
        if ragged is not None:
            raise ValueError(
                f"Mesh: the device list is ragged: {ragged}. A mesh is a full grid: give every row the same number "
                f"of devices ({len(axis_names)} nested level(s) of lists for the axis names {axis_names})"
            )
        if grid.ndim != len(axis_names):
            raise ValueError(
                f"Mesh: the device grid has {grid.ndim} dimensions (shape {grid.shape}) but {len(axis_names)} axis "
                f"names were given ({axis_names}); give one name per dimension"
            )
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"Mesh: axis names must be distinct, got {axis_names}")
        if grid.size == 0:
            raise ValueError(
                f"Mesh: the device grid is empty (shape {grid.shape}); every mesh axis needs at least one device, "
                f"e.g. torchpmap.Mesh(np.array(torchpmap.devices()).reshape(...), {axis_names!r})"
            )
        resolved = _devices.resolve(list(grid.flat))
        self.devices = np.array(resolved, dtype=object).reshape(grid.shape)
        self.axis_names = axis_names
        self._tokens: list = []  # one per open ``with`` of this mesh (re-entrant)

    @property
    def shape(self) -> dict[Hashable, int]:
        return dict(zip(self.axis_names, self.devices.shape))

    @property
    def size(self) -> int:
        return int(self.devices.size)

    def device_at(self, coords: dict[Hashable, int]) -> _devices.Device:
        """The device at ``coords``, which names every axis of the mesh with an index.

        Raises:
            KeyError: for an axis the mesh does not have, or one of its axes left out.
            IndexError: for an index outside an axis (negative indices count from the end).
        """
        if not isinstance(coords, dict):
            raise TypeError(f"Mesh.device_at: coords must be a dict from axis names to indices, got {coords!r}")
        unknown = [a for a in coords if a not in self.axis_names]
        missing = [a for a in self.axis_names if a not in coords]
        if unknown or missing:
            problems = []
            if unknown:
                problems.append(
                    f"{', '.join(map(repr, unknown))} {'is not an axis' if len(unknown) == 1 else 'are not axes'} of "
                    "this mesh"
                )
            if missing:
                problems.append(f"no index was given for {', '.join(map(repr, missing))}")
            raise KeyError(
                f"Mesh.device_at({coords!r}): {' and '.join(problems)}; give one index per axis of the mesh, "
                f"{self.shape}, e.g. {{{', '.join(f'{a!r}: 0' for a in self.axis_names)}}}"
            )
        return self._device_at(coords)

    def _device_at(self, coords: dict[Hashable, int]) -> _devices.Device:
        """The device at ``coords``; axes not named there are taken at index 0 (the engine's
        lookups: a pmap over one mesh axis, outside the maps of the others)."""
        index = []
        size: int
        for a, size in zip(self.axis_names, self.devices.shape):
            i = coords.get(a, 0)
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -size <= i < size:
                raise IndexError(
                    f"Mesh.device_at: the index for axis {a!r} must be an int in 0..{size - 1} (or -{size}..-1 from "
                    f"the end): the mesh has {size} device(s) along it (shape {self.shape}); got {i!r}"
                )
            index.append(int(i))
        return self.devices[tuple(index)]

    def __enter__(self) -> Mesh:
        # per context (and so per thread): another thread's pmaps never see this mesh
        self._tokens.append(_context.active_meshes.set(_context.active_meshes.get() + (self,)))
        return self

    def __exit__(self, *exc: Any) -> None:
        _context.active_meshes.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"Mesh(shape={self.shape}, devices={self.devices.tolist()})"




class AbstractMesh:
    """Named mesh axes with more positions than devices: what :func:`make_mesh` returns
    when there are too few devices for one position each.

    A map over it runs as ``pmap`` runs an axis larger than its devices: the positions
    of the first axis are spread evenly over ``devices``, and each device runs its
    positions vectorized (the other axes vectorized within them). The numbers are those
    of a mesh with one device per position, to rounding.

    Attributes:
        axis_names: the axes, major first.
        devices: the devices that hold the positions (their count divides the first axis).
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[Hashable], devices: Sequence[_devices.Device]):
        self.axis_names = tuple(axis_names)
        self._shape = tuple(int(n) for n in shape)
        self.devices = tuple(devices)

    @property
    def shape(self) -> dict[Hashable, int]:
        return dict(zip(self.axis_names, self._shape))

    @property
    def size(self) -> int:
        return int(np.prod(self._shape))

    def __repr__(self) -> str:
        return f"AbstractMesh(shape={self.shape}, devices={list(self.devices)})"


def make_mesh(
    axis_shapes: Sequence[int], axis_names: Sequence[Hashable], *, devices: Sequence[Any] | None = None
) -> Mesh | AbstractMesh:
    """A mesh of the given shape and axis names over ``devices`` (default: all of them).

    With at least as many devices as positions, a :class:`Mesh` of the first
    ``prod(axis_shapes)`` devices, laid out row-major. With fewer, an
    :class:`AbstractMesh`: the positions run vectorized, several per device, so that the
    same program runs on one device and on many. Its devices are the most of ``devices``
    whose count divides the first axis (``devices`` given explicitly must all divide
    it). Like ``jax.make_mesh`` with ``AxisType.Auto`` axes.

    Example:
        >>> import torchpmap as tp
        >>> mesh = tp.make_mesh((4, 2), ("batch", "model"), devices=tp.devices()[:1])
        >>> mesh.shape
        {'batch': 4, 'model': 2}
    """
    shape, names = tuple(axis_shapes), tuple(axis_names)
    if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise ValueError(f"make_mesh: axis_shapes must be positive ints, one per axis, got {axis_shapes!r}")
    if len(shape) != len(names):
        raise ValueError(
            f"make_mesh: axis_shapes {shape} has {len(shape)} axes but {len(names)} axis names were given: {names}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"make_mesh: axis names must be distinct, got {names}")
    chosen = list(_devices.resolve(devices)) if devices is not None else _devices.devices()
    positions = int(np.prod(shape))
    if len(chosen) >= positions:
        return Mesh(np.array(chosen[:positions], dtype=object).reshape(shape), names)
    usable = [d for d in range(len(chosen), 0, -1) if shape[0] % d == 0][0]
    if devices is None:  # all of them: as many as divide the first axis
        chosen = chosen[:usable]
    if shape[0] % len(chosen):
        raise ValueError(
            f"make_mesh: {positions} positions (shape {dict(zip(names, shape))}) on {len(chosen)} devices: with fewer "
            f"devices than positions, the positions of the first axis {names[0]!r} ({shape[0]}) are spread evenly "
            f"over the devices, and {len(chosen)} does not divide {shape[0]}. Pass devices=torchpmap.devices()"
            f"[:{usable}], or a first axis that {len(chosen)} divides."
        )
    return AbstractMesh(shape, names, chosen)


def _ragged(devices: Any) -> str | None:
    """How a nested list of devices is ragged (the first place where lists of one level
    differ in length, or mix lists and devices), or None for a full grid."""
    level = [devices]
    depth = 0
    while True:
        nested = [isinstance(x, (list, tuple, np.ndarray)) for x in level]
        if not any(nested):
            return None
        if not all(nested):
            return f"at nesting level {depth}, some entries are lists and others are devices"
        lengths = [len(x) for x in level]
        if len(set(lengths)) > 1:
            where = "its rows" if depth == 1 else f"the lists at nesting level {depth}"
            return f"{where} have different lengths {lengths}"
        level = [y for x in level for y in x]
        depth += 1


def current() -> Mesh | None:
    """The mesh of the enclosing mesh pmap in this thread, else the innermost ``with mesh``."""
    state = _context.instance_thread.get()
    if state is not None:
        return state.mesh
    active = _context.active_meshes.get()
    return active[-1] if active else None


class ProcessMesh(Mesh):
    """A :class:`torchpmap.Mesh` whose devices are processes: one device per process,
    laid out row-major by rank, with one ``torch.distributed`` process group per axis.

    Made by :func:`mesh`. Used as a context (``with m:``) or as ``pmap(..., mesh=m)``,
    a pmap over one of its axes exchanges only with the processes along that axis (those
    that share this process' coordinates on the other axes).

    Attributes:
        device_mesh: the underlying ``torch.distributed.device_mesh.DeviceMesh``.
    """

    def __init__(self, device_mesh: Any, axis_names: Sequence[Hashable]):
        self.device_mesh = device_mesh
        st = _process_group.state()
        ranks = device_mesh.mesh
        grid = np.empty(tuple(ranks.shape), dtype=object)
        for index, r in zip(np.ndindex(*grid.shape), ranks.flatten().tolist()):
            grid[index] = st.devices[r]
        super().__init__(grid, axis_names)
        self._groups = {name: device_mesh.get_group(name) for name in self.axis_names}
        self._coords = {name: int(device_mesh.get_local_rank(name)) for name in self.axis_names}

    def group(self, axis_name: Hashable) -> Any:
        """The process group of the processes along ``axis_name`` (this process' row)."""
        return self._groups[self._axis(axis_name)]

    def coordinate(self, axis_name: Hashable) -> int:
        """This process' index along ``axis_name``."""
        return self._coords[self._axis(axis_name)]

    def _axis(self, axis_name: Hashable) -> Hashable:
        if axis_name not in self._groups:
            raise KeyError(f"{axis_name!r} is not an axis of this mesh; its axes are {self.axis_names}")
        return axis_name

    def __repr__(self) -> str:
        coords = ", ".join(f"{a}={i}" for a, i in self._coords.items())
        return f"ProcessMesh(shape={self.shape}, this process at {coords})"
