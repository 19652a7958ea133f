"""Engines: what runs the instances of a mapped call.

The front end (:mod:`torchpmap._front`) turns a call into a :class:`MappedCall`, a flat,
engine-neutral description, and hands it to :func:`run`. An engine returns every output
leaf with the mapped axis at dim 0; it never sees pytrees, in_axes or out_axes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from torchpmap._devices import Device


@dataclasses.dataclass(frozen=True, eq=False)
class MappedCall:
    """One call of a mapped function, flattened.

    Attributes:
        body: runs one instance: ``body(mapped_slices, broadcast_values)`` returns the
            instance's output leaves, all tensors.
        mapped: the mapped tensor leaves; ``in_dims[k]`` is the mapped dim of ``mapped[k]``.
        broadcast: values every instance sees unchanged.
        axis_name: the name collectives use, or None.
        size: the size of the mapped axis.
        randomness: as in ``torch.func.vmap``.
        devices: where to run; None means "where the inputs are" (``vmap``).
        mesh: the mesh whose axis ``axis_name`` names, if the call maps a mesh axis.
        must_be_unmapped: after ``body`` ran, the positions of output leaves that must
            not vary along the axis (``vmap``'s ``out_axes=None``), with their key paths.
            An engine raises ValueError for one that does.
    """

    body: Callable[[Sequence[torch.Tensor], Sequence[Any]], Sequence[torch.Tensor]]
    mapped: Sequence[torch.Tensor]
    in_dims: Sequence[int]
    broadcast: Sequence[Any]
    axis_name: Optional[Hashable]
    size: int
    randomness: str
    devices: Optional[Sequence[Device]]
    must_be_unmapped: Callable[[], dict[int, str]] = dict
    mesh: Any = None


def run(call: MappedCall) -> list[torch.Tensor]:
    """Runs ``call`` on the engine that fits it; outputs have the mapped axis at dim 0."""
    from torchpmap._config import config
    from torchpmap._engines import distributed, multi_device, threaded, vectorized

    if call.devices is not None and distributed.active():  # several processes: one slice each
        return distributed.run(call)

    if config.disable_vectorization:
        return threaded.run_one_at_a_time(call)
    if call.mesh is not None:
        return threaded.run_mesh(call, call.mesh)
    if call.devices is not None and len(call.devices) > 1:
        return multi_device.run(call)
    return vectorized.run(call)
