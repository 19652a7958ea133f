"""The mesh engine: pmaps over the named axes of a :class:`~torchpmap._mesh.Mesh`.

A pmap over mesh axis ``A`` runs one thread per device along ``A``, at the mesh
coordinates of the enclosing mesh pmaps (other axes at index 0). With one instance per
device the instance runs without a vmap level, so that a nested pmap over another mesh
axis can start threads of its own: instance ``(d, m)`` then runs on
``mesh.devices[d, m]``. A collective over ``A`` meets the threads that differ only in
their ``A`` coordinate, within the same nested call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import torch

from torchpmap import _axis_env, _devices, _mesh
from torchpmap._config import config
from torchpmap._engines import MappedCall, vectorized
from torchpmap._engines.multi_device import collect, refuse_enclosing_transforms, slice_for_device
from torchpmap._engines.rendezvous import Rendezvous, ThreadExchange
from torchpmap._engines.workers import pool
from torchpmap._mesh import Mesh
from torchpmap._sharded import ShardedTensor, as_local


@dataclasses.dataclass(eq=False)
class _ThreadState:
    """Where a mesh thread stands: its mesh coordinates and the call it belongs to."""

    mesh: Mesh
    rendezvous: Rendezvous
    coords: dict[Hashable, int]
    path: tuple
    frames: tuple[_axis_env.AxisFrame, ...] = ()
    nested_calls: int = 0


def _exchange(state: _ThreadState, axis: Hashable) -> ThreadExchange:
    mesh, coords = state.mesh, state.coords
    along = tuple(mesh.device_at({**coords, axis: j}).torch_device for j in range(mesh.shape[axis]))
    others = tuple(sorted(((a, i) for a, i in coords.items() if a != axis), key=repr))
    return ThreadExchange(state.rendezvous, coords[axis], along, (axis, state.path, others))


def _enter(mesh: Mesh, axis: Hashable) -> tuple[Rendezvous, tuple, dict, tuple]:
    """(rendezvous, call path, enclosing coordinates, enclosing frames) for a new mesh call."""
    parent: _ThreadState | None = getattr(_mesh._thread, "state", None)
    if parent is None:
        refuse_enclosing_transforms()
        return Rendezvous(config.collective_timeout), (object(),), {}, ()
    if axis in parent.coords:
        raise ValueError(f"pmap: mesh axis {axis!r} is already mapped by an enclosing pmap; name another mesh axis")
    if torch._C._functorch.maybe_current_level() is not None:
        raise NotImplementedError(
            f"pmap over mesh axis {axis!r}: it is nested in a pmap whose instances run vectorized (more instances "
            "than devices along its mesh axis) or in a torch.func transform, so it cannot spread over devices. "
            "Give each enclosing mesh axis one instance per device, or move the transform inside."
        )
    parent.nested_calls += 1
    return parent.rendezvous, parent.path + (parent.nested_calls,), parent.coords, parent.frames


def run(call: MappedCall, mesh: Mesh) -> list[ShardedTensor]:
    axis = call.axis_name
    count = mesh.shape[axis]
    if call.size % count:
        raise ValueError(
            f"pmap over mesh axis {axis!r}: the mapped axis has size {call.size}, which is not a multiple of the "
            f"{count} devices along that mesh axis (mesh shape {mesh.shape})"
        )
    k = call.size // count
    rendezvous, path, coords, frames = _enter(mesh, axis)
    devices = [mesh.device_at({**coords, axis: j}) for j in range(count)]

    def one_device(j: int) -> list[torch.Tensor]:
        state = _ThreadState(mesh, rendezvous, {**coords, axis: j}, path)
        rebound = tuple(dataclasses.replace(f, exchange=_exchange(state, f.name)) for f in frames)
        _mesh._thread.state = state
        _devices.set_current_default((devices[j],))
        try:
            with _axis_env.inherited(rebound):
                part = dataclasses.replace(
                    call,
                    mapped=[slice_for_device(t, dim, j, k, devices[j]) for t, dim in zip(call.mapped, call.in_dims)],
                    size=k,
                    devices=(devices[j],),
                )
                if k > 1:
                    return vectorized.run(part, offset=j * k, axis_size=call.size, exchange=_exchange(state, axis))
                return _run_single(part, state, rebound, offset=j, axis_size=call.size)
        except BaseException:
            rendezvous.fail(f"the instances {j * k}..{j * k + k - 1} on device {devices[j]}")
            raise
        finally:
            _mesh._thread.state = None
            _devices.set_current_default(None)

    futures = [pool.submit(lambda j=j: one_device(j)) for j in range(count)]
    per_device = collect(futures, devices, k)
    return [ShardedTensor(list(zip(devices, outs))) for outs in zip(*per_device)]


def _run_single(call: MappedCall, state: _ThreadState, enclosing: tuple, offset: int, axis_size: int) -> list:
    """One instance on this device, without a vmap level (see module docstring)."""
    device = call.devices[0].torch_device
    token = torch.zeros((), dtype=torch.long, device=device)
    frame = _axis_env.AxisFrame(
        call.axis_name, axis_size, token, 1, offset, _exchange(state, call.axis_name), vectorized=False
    )
    state.frames = enclosing + (frame,)
    slices = [t.select(dim, 0) for t, dim in zip(call.mapped, call.in_dims)]
    broadcast = [vectorized.place(v, device) for v in call.broadcast]
    with _axis_env.bound(frame):
        outputs = call.body(slices, broadcast)
    return [as_local(o, device).unsqueeze(0) for o in outputs]
