"""The engine of a mesh axis: one thread per device along the axis.

A pmap over mesh axis ``A`` (``pmap(..., mesh=)``, or inside ``with mesh:``) runs one
instance thread (:mod:`torchpmap._engines.instance_threads`) per device along ``A``, at the
mesh coordinates of the enclosing mesh pmaps. Nested pmaps over the other mesh axes fill
the grid: instance ``(d, m)`` runs on ``mesh.devices[d, m]``.
"""
from __future__ import annotations

from torchpmap._engines import instance_threads
from torchpmap._engines.baton import Baton
from torchpmap._engines.mapped_call import MappedCall
from torchpmap._placement import mesh as _mesh


def run(call: MappedCall, mesh: _mesh.Mesh, baton: Baton | None = None) -> list:
    """Runs ``call`` over mesh axis ``call.axis_name``: ``call.size / count`` instances
    on each of the ``count`` devices along it. With ``baton`` (debug mode, or a function
    vmap cannot run), the instances run one at a time, each as the thread of its
    position's device (one instance per device only, for now)."""
    axis, count = call.axis_name, mesh.shape[call.axis_name]
    if call.size % count:
        raise ValueError(
            f"pmap over mesh axis {axis!r}: the mapped axis has size {call.size}, which is not a multiple of the "
            f"{count} devices along that mesh axis (mesh shape {mesh.shape})"
        )
    if baton is not None and call.size != count:
        raise NotImplementedError(
            f"pmap over mesh axis {axis!r}: its {call.size} instances cannot run one at a time (debug mode, or a "
            f"function torch.func.vmap cannot run) on the {count} devices along that axis: one at a time, a mesh "
            "axis needs one instance per device. Map as many instances as the axis has devices, or run the map "
            "without the mesh."
        )
    return instance_threads.run(
        call, lambda coords: [mesh._device_at({**coords, axis: j}) for j in range(count)], count, mesh, baton=baton
    )
