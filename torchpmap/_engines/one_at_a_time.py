"""The engine of one instance at a time: each instance its own thread, in plain Python.

Debug mode (``with torchpmap.disable_vectorization():``) and the fallback when vmap cannot
run a function (:mod:`torchpmap._engines.dispatch`) run every instance as an instance
thread (:mod:`torchpmap._engines.instance_threads`) on the device it would use, one
running at a time (the holder of a baton), so ``print``, ``pdb`` and ``.item()`` work
inside the function; the instances still meet at collectives.
"""
from __future__ import annotations

import torch

from torchpmap._engines import instance_threads, mesh_axes, vectorized
from torchpmap._engines.baton import Baton
from torchpmap._engines.mapped_call import MappedCall
from torchpmap._placement import devices as _devices
from torchpmap._placement.devices import Device


def run(call: MappedCall) -> list:
    """Runs each instance of ``call`` as a thread on the device it would use, one running at a time.
    An axis of size 0 has no instance to run: it runs vectorized, as on every other
    placement (vmap computes the results' shapes without an instance)."""
    if call.size == 0:
        return vectorized.run(call)
    if call.mesh is not None:  # an axis of a device mesh: each instance on its position's device
        return mesh_axes.run(call, call.mesh, baton=_baton)
    if call.devices is None:  # vmap: where the inputs are
        first = next((t for t in call.mapped), None)
        here = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        placed = [
            next((d for d in _devices.local_devices() if d.torch_device == here), Device(here.type, here.index or 0))
        ]
    else:
        placed = list(call.devices)
    per_device = call.size // len(placed)
    instance_devices = [placed[j // per_device] for j in range(call.size)]
    return instance_threads.run(call, lambda coords: instance_devices, call.size, None, baton=_baton)


_baton = Baton()  # held by the instance thread that is running Python code
