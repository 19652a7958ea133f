"""PartitionSpecs and DTensor placements, on a mesh of processes.

A spec names, per tensor dim, the mesh axes that split it; a DTensor's placements name,
per mesh dim, what it does to the tensor: ``Shard(d)`` where the spec names that axis at
dim ``d``, ``Replicate()`` where the spec does not name it. A dim split over several
axes, ``P(("x", "y"))``, is ``Shard(d)`` on both, ``x`` major, which DTensor expresses
only when ``x`` comes before ``y`` in the mesh. ``Partial()`` (an unreduced sum) has no
spec: a DTensor holding one is reduced first.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from torchpmap._placement.mesh import ProcessMesh
from torchpmap._placement.partition_spec import PartitionSpec


def _dtensor_api() -> Any:
    from torch.distributed import tensor as dtensor

    return dtensor


def is_dtensor(x: Any) -> bool:
    try:
        return isinstance(x, _dtensor_api().DTensor)
    except ImportError:  # a torch without torch.distributed
        return False


def placements_for(spec: PartitionSpec | None, mesh: ProcessMesh, what: str) -> list[Any]:
    """The DTensor placements (one per mesh dim) that ``spec`` stands for."""
    api = _dtensor_api()
    placements: list[Any] = [api.Replicate() for _ in mesh.axis_names]
    if spec is None:
        return placements
    for d in range(len(spec)):
        axes = spec.axes_of(d)
        positions = [mesh.axis_names.index(a) for a in axes]
        if positions != sorted(positions):
            raise ValueError(
                f"{what}: {spec!r} splits dim {d} over {axes}, major first, but DTensor can only split one dim over "
                f"several mesh dims in the mesh's order ({mesh.axis_names}); list them as "
                f"{tuple(sorted(axes, key=mesh.axis_names.index))}"
            )
        for p in positions:
            placements[p] = api.Shard(d)
    return placements


def local_block(x: Any, spec: PartitionSpec | None, mesh: ProcessMesh, what: str) -> torch.Tensor:
    """This process' block of the DTensor ``x`` as ``spec`` splits it: taken as it is when
    its placements are the spec's, else after ``redistribute`` (which also reduces a
    ``Partial``). Differentiable, as DTensor's own conversions are."""
    if tuple(x.device_mesh.mesh.flatten().tolist()) != tuple(mesh.device_mesh.mesh.flatten().tolist()) or tuple(
        x.device_mesh.mesh.shape
    ) != tuple(mesh.device_mesh.mesh.shape):
        raise ValueError(
            f"{what} is a DTensor on another device mesh ({x.device_mesh}) than shard_map's ({mesh.device_mesh}); "
            "redistribute it onto shard_map's mesh first"
        )
    wanted = placements_for(spec, mesh, what)
    if list(x.placements) != wanted:
        x = x.redistribute(x.device_mesh, wanted)
    return x.to_local()


class _NoGradientOutside(torch.autograd.Function):
    """Passes a shard_map result across processes through, and refuses ``.backward()``
    through it: only under ``check_vma=False`` (with it, shard_map differentiates the
    call as a whole, see :mod:`torchpmap._frontend.shard_map_backward`)."""

    @staticmethod
    def forward(x: torch.Tensor, what: str) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.what = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise NotImplementedError(
            f"{ctx.what}: .backward() through a shard_map result across processes needs check_vma=True: the "
            "gradient is then taken inside the map, where check_vma's rules count a replicated result's "
            "cotangent once (without them, every process' copy would be counted). Pass check_vma=True, or take "
            "gradients inside the map yourself (torch.func.grad in the function given to shard_map)."
        )


def as_dtensor(local: torch.Tensor, spec: PartitionSpec | None, mesh: ProcessMesh, what: str) -> Any:
    """The DTensor whose block on this process is ``local``, as ``spec`` assembles it.
    Gradients do not flow back through it (a clear error, see :class:`_NoGradientOutside`)."""
    api = _dtensor_api()
    if local.requires_grad and torch.is_grad_enabled():
        local = _NoGradientOutside.apply(local, what)
    placements = placements_for(spec, mesh, what)
    shape = list(local.shape)
    if spec is not None:
        for d in range(len(spec)):
            shape[d] *= math.prod(mesh.shape[a] for a in spec.axes_of(d))
    stride = torch.empty(shape, device="meta").stride()
    return api.DTensor.from_local(local, mesh.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride)


def process_mesh_of(device_mesh: Any, what: str) -> ProcessMesh:
    """torchpmap's :class:`ProcessMesh` over a torch ``DeviceMesh``, whose dim names are
    the axis names."""
    names: Sequence[Hashable] | None = getattr(device_mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError(
            f"{what}: the DeviceMesh has no dim names; shard_map's specs name mesh axes, so build it with "
            "init_device_mesh(..., mesh_dim_names=('data', 'model'))"
        )
    return ProcessMesh(device_mesh, tuple(names))
