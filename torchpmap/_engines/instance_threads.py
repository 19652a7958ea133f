"""Instance threads: one thread per slice of an axis, with nesting across threads.

Two engines run on them:

* **Mesh axes** (:mod:`torchpmap._engines.mesh_axes`). A pmap over mesh axis ``A`` runs
  one thread per device along ``A`` (at the mesh coordinates of the enclosing mesh pmaps,
  other axes at index 0). With one instance per device the instance runs without a vmap
  level, so that a nested pmap over another mesh axis can start threads of its own:
  instance ``(d, m)`` then runs on ``mesh.devices[d, m]``. Under shard_map's check_vma
  it runs in a vmap of one instead (vmap levels tell what varies along each axis), and
  the nested threads start under that level.
* **One instance at a time** (:mod:`torchpmap._engines.one_at_a_time`): debug mode
  (``config.disable_vectorization``) and the fallback when vmap cannot run a function.
  Every instance is its own thread, run in plain Python, one at a time, so ``print`` and
  ``pdb`` work inside the function.

A collective over ``A`` meets the threads that differ only in their ``A`` coordinate,
within the same nested call: the meeting key is (axis, call path, other coordinates).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from torchpmap._engines import batching_rules, vectorized
from torchpmap._engines.baton import Baton
from torchpmap._engines.mapped_call import MappedCall
from torchpmap._engines.multi_device import assembled, check_replicated, device_thread, run_threads, split_on_the_graph
from torchpmap._engines.random_per_thread import Seed, call_seed, settle
from torchpmap._engines.thread_exchange import Rendezvous, ThreadExchange
from torchpmap._engines.turn_versions import TurnVersions
from torchpmap._placement import mesh as _mesh
from torchpmap._placement.devices import Device
from torchpmap._state import axis_env as _axis_env
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.config import config

# For an axis, the device of each participant given the caller's coordinates.
Along = Callable[[dict], Sequence[Device]]


@dataclasses.dataclass(eq=False)
class _ThreadState:
    """Where an instance thread stands: its coordinates and the call it belongs to."""

    mesh: _mesh.Mesh | None
    rendezvous: Rendezvous
    coords: dict[Hashable, int]
    along: dict[Hashable, Along]
    path: tuple
    outer_level: int | None  # the torch.func level of the transforms around the whole call
    frames: tuple[_axis_env.AxisFrame, ...] = ()
    nested_calls: int = 0
    own_level: int | None = None  # the vmap level of the thread's own instance (shard_map's check_vma)


def _exchange(state: _ThreadState, axis: Hashable) -> ThreadExchange:
    devices = tuple(d.torch_device for d in state.along[axis](state.coords))
    others = tuple(sorted(((a, i) for a, i in state.coords.items() if a != axis), key=repr))
    return ThreadExchange(state.rendezvous, state.coords[axis], devices, (axis, state.path, others))


def _parent(axis: Hashable, what: str) -> _ThreadState | None:
    parent: _ThreadState | None = _context.instance_thread.get()
    if parent is None:
        return None
    if axis is not None and axis in parent.coords:
        raise ValueError(
            f"{what}: axis {axis!r} is already mapped by an enclosing map; give this map another axis_name"
        )
    if private.current_vmap_level() not in (parent.outer_level, parent.own_level):
        raise NotImplementedError(
            f"{what} over axis {axis!r}: it is nested in a map whose instances run vectorized, or in a torch.func "
            "transform, so it cannot start threads of its own. Give each enclosing mesh axis one instance per "
            "device, or move the transform inside."
        )
    return parent


def _threaded_frames() -> list[tuple[_axis_env.AxisFrame, ThreadExchange]]:
    """The enclosing axes whose slices run in threads, with their exchanges, outermost first."""
    return [(f, f.exchange) for f in _axis_env.current_frames() if isinstance(f.exchange, ThreadExchange)]


def _outer_slices(
    threaded: list[tuple[_axis_env.AxisFrame, ThreadExchange]], rendezvous: Rendezvous
) -> list[tuple[_axis_env.AxisFrame, ThreadExchange, int]]:
    """Of ``threaded``, the axes whose threads meet elsewhere (a multi-device pmap around
    a shard_map), each with its exchange and the number of this call among the nested
    calls of its slice: every thread of this call meets the other slices through a door
    of its own (see :meth:`ThreadExchange.for_nested`)."""
    found = []
    for f, ex in threaded:
        if ex.rendezvous is not rendezvous:
            ex.nested_calls += 1
            found.append((f, ex, ex.nested_calls))
    return found


def run(
    call: MappedCall, along: Along, count: int, mesh: _mesh.Mesh | None, baton: Baton | None = None
) -> list:
    """Runs ``call`` in ``count`` threads, ``call.size / count`` instances each."""
    call = split_on_the_graph(call)
    axis = call.axis_name if call.axis_name is not None else object()  # an unnamed axis still has coordinates
    k = call.size // count
    parent = _parent(call.axis_name, "pmap" if call.devices is not None else "vmap")
    frames: tuple[_axis_env.AxisFrame, ...]
    shared: Baton | None = None
    threaded = _threaded_frames()
    if parent is None:
        # inside the device thread of another call: its threads and these take turns on one
        # baton (a thread waiting for the other call's slices sets it down for all of them)
        shared = next((ex.rendezvous.baton for _, ex in reversed(threaded) if ex.rendezvous.baton is not None), None)
        rendezvous = Rendezvous(config.collective_timeout, shared or baton or Baton())
        path, coords, frames, outer_along = (object(),), {}, (), {}
        outer_level = private.current_vmap_level()
    else:
        parent.nested_calls += 1
        rendezvous, path, coords = parent.rendezvous, parent.path + (parent.nested_calls,), parent.coords
        frames, outer_along, mesh, outer_level = parent.frames, parent.along, mesh or parent.mesh, parent.outer_level
    devices = list(along(coords))
    seed = call_seed(call.randomness, devices[0].torch_device)
    outer = _outer_slices(threaded, rendezvous)

    def one_thread(j: int) -> list[torch.Tensor]:
        state = _ThreadState(mesh, rendezvous, {**coords, axis: j}, {**outer_along, axis: along}, path, outer_level)
        rebound = tuple(dataclasses.replace(f, exchange=_exchange(state, f.name)) for f in frames)
        doors = [ex.for_nested(number, j) for _, ex, number in outer]
        elsewhere = tuple(dataclasses.replace(f, exchange=door) for (f, _, _), door in zip(outer, doors))
        with _context.setting(_context.instance_thread, state), _axis_env.inherited(rebound + elsewhere):
            with device_thread(call, rendezvous, seed, j, k, devices[j]) as part:
                if k > 1:
                    out = vectorized.run(
                        part, offset=j * k, axis_size=call.size, exchange=_exchange(state, axis), seed=seed
                    )
                else:
                    out = _run_single(part, state, rebound, axis, offset=j, axis_size=call.size, seed=seed)
            for name in (*(f.name for f in rebound), axis):
                _exchange(state, name).leave()  # a meeting of any of its axes that still waits for it raises
            for door in doors:
                door.leave()
            return out

    bodies = [lambda j=j: one_thread(j) for j in range(count)]
    reads = batching_rules.value_reads()
    versions = TurnVersions.of(call.mapped) if parent is None else None  # a nested call's count with its parent's
    nested = parent is not None or shared is not None  # this thread holds the baton, and passes it on
    try:
        per_thread = run_threads(bodies, rendezvous, devices, k, nested=nested, versions=versions)
    finally:
        settle(seed)  # the caller's generator moves on only where a thread took the seed
    # each thread's vmap checked its own out_axes=None (for its slice), except in debug mode
    # and where an instance read a value into Python (the same on its slice, maybe not the others')
    if (k == 1 and not call.vma) or batching_rules.value_reads() != reads:
        check_replicated(call, per_thread)
    return _assemble(devices, per_thread, call.mapped)


def _run_single(
    call: MappedCall,
    state: _ThreadState,
    enclosing: tuple,
    axis: Hashable,
    offset: int,
    axis_size: int,
    seed: Seed,
) -> list:
    """One instance on this device. Its axis frame is recorded for the maps nested in it.

    Without a vmap level (see module docstring), and a nested mesh pmap's result stays
    sharded along its own axis (its blocks stay where they were computed); or in a vmap of
    one: for shard_map's check_vma (``call.vma``), whose level tells what varies along the
    axis, and under a torch.func transform around the call (the instances of a map that
    runs one at a time, in debug mode or after a fallback), whose backward then exchanges
    the collectives' cotangents as a vectorized map's does (without a level of its own, an
    instance's collective cannot be transposed by a transform that runs its backward in
    one thread). The level is recorded too, and nested mesh maps start their threads under
    it (see :func:`_parent`)."""
    levelled = call.vma or state.outer_level is not None

    def record(frame: _axis_env.AxisFrame) -> None:
        state.frames = enclosing + ((frame,) if call.axis_name is not None else ())
        if levelled:
            state.own_level = private.vmap_level_of(frame.token)

    exchange = _exchange(state, axis)
    if levelled:
        return vectorized.run(call, offset=offset, axis_size=axis_size, exchange=exchange, seed=seed, on_frame=record)
    return vectorized.run_one(
        call, offset=offset, axis_size=axis_size, exchange=exchange, seed=seed, on_frame=record, keep_sharded=True
    )


def _assemble(devices: list[Device], per_thread: list[list[torch.Tensor]], mapped: Sequence[Any] = ()) -> list:
    if len(set(devices)) == 1:  # debug mode on one device: plain tensors, as the vectorized engine returns
        return [_stacked(outs, mapped) for outs in zip(*per_thread)]
    return assembled(devices, per_thread)  # as from the multi-device engine


def _stacked(outs: Sequence[torch.Tensor], mapped: Sequence[Any]) -> torch.Tensor:
    """The instances' values of one output, stacked. With grad on, as vmap stacks them,
    where the caller runs under no_grad: a value the function computed with grad on (it
    enabled grad itself) keeps its graph. A value that is a view of an argument (the
    instance's slice, returned as it is) is stacked under the caller's grad mode, as the
    copy vmap's result of it gets (see output_copies)."""
    if _one_view(outs):
        return _expanded(outs)
    roots = {id(a._base if a._base is not None else a) for a in mapped if isinstance(a, torch.Tensor)}
    of_arguments = any(o._base is not None and id(o._base) in roots for o in outs)
    with contextlib.nullcontext() if of_arguments else torch.enable_grad():
        return _context.cat_as_they_are(outs)


def _one_view(outs: Sequence[torch.Tensor]) -> bool:
    """Whether every instance returned the same memory (a tensor the function closes over,
    as it is), which vmap returns as one row expanded over the instances: so does this."""
    first = outs[0]
    if type(first) is not torch.Tensor or not first.numel() or len(outs) < 2 or first.shape[0] != 1:
        return False
    if any(private.is_functorch_wrapped(o) for o in outs):  # under a transform: no storage to compare
        return False
    where = (first.untyped_storage().data_ptr(), first.storage_offset(), first.shape, first.stride(), first.dtype)
    return all(
        type(o) is torch.Tensor
        and (o.untyped_storage().data_ptr(), o.storage_offset(), o.shape, o.stride(), o.dtype) == where
        for o in outs[1:]
    )


def _expanded(outs: Sequence[torch.Tensor]) -> torch.Tensor:
    return outs[0].expand(len(outs) * outs[0].shape[0], *outs[0].shape[1:])
