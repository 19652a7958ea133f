"""Mesh: devices arranged in an n-D grid with named axes.

A pmap whose ``axis_name`` is an axis of the active mesh maps over that mesh axis:
nested pmaps over ``"data"`` and ``"model"`` put instance ``(d, m)`` on
``mesh.devices[d, m]``, and a collective over ``"model"`` runs among the devices of one
mesh row, over ``"data"`` among one column.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

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
        """The device at ``coords`` (axes not named there are taken at index 0)."""
        return self.devices[tuple(coords.get(a, 0) for a in self.axis_names)]

    def __enter__(self) -> "Mesh":
        # per context (and so per thread): another thread's pmaps never see this mesh
        self._tokens.append(_context.active_meshes.set(_context.active_meshes.get() + (self,)))
        return self

    def __exit__(self, *exc: Any) -> None:
        _context.active_meshes.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"Mesh(shape={self.shape}, devices={self.devices.tolist()})"




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

    def __init__(self, device_mesh, axis_names: Sequence[Hashable]):
        self.device_mesh = device_mesh
        st = _process_group.state()
        ranks = device_mesh.mesh
        grid = np.empty(tuple(ranks.shape), dtype=object)
        for index, r in zip(np.ndindex(*grid.shape), ranks.flatten().tolist()):
            grid[index] = st.devices[r]
        super().__init__(grid, axis_names)
        self._groups = {name: device_mesh.get_group(name) for name in self.axis_names}
        self._coords = {name: int(device_mesh.get_local_rank(name)) for name in self.axis_names}

    def group(self, axis_name: Hashable):
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
