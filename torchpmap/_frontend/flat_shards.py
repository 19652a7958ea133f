"""One parameter as ``N`` equal flat shards: flattened, padded, split.

A sharded step splits every parameter over the ``N`` instances of the data axis. Each
is flattened and zero-padded to ``N * s`` elements, ``s = ceil(numel / N)``, and
instance ``i`` holds elements ``i*s .. (i+1)*s - 1``: every instance holds one row of
one shape, whatever the parameter's shape and whether ``N`` divides any of its dims
(ZeRO-3's and FSDP's flat parameters do the same). A tiled ``all_gather`` of the rows is
the padded flat value again; :meth:`FlatLayout.unflatten` cuts the padding off and gives
back the parameter's shape. The padding is zero and stays zero under an elementwise
optimizer: its gradient is zero (the forward never reads it).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """How one parameter is split into rows, one per instance.

    Attributes:
        shape: the parameter's shape.
        instances: ``N``, the number of rows (the data axis' size, every process' instances).
    """

    shape: torch.Size
    instances: int

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def row(self) -> int:
        """``s``, the elements in each instance's row (at least 1)."""
        return max(1, -(-self.numel // self.instances))

    def rows(self, full: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Rows ``first .. first + count - 1`` of ``full`` (a tensor of ``shape``), a new
        ``(count, s)`` tensor on ``full``'s device."""
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(
                f"FlatLayout.rows: expected a tensor of shape {tuple(self.shape)}, got {tuple(full.shape)}"
            )
        flat = full.detach().reshape(-1)
        padded = torch.zeros(self.instances * self.row, dtype=full.dtype, device=full.device)
        padded[: self.numel] = flat
        return padded.view(self.instances, self.row)[first : first + count].clone()

    def unflatten(self, gathered: torch.Tensor) -> torch.Tensor:
        """The parameter from its ``N * s`` gathered elements (differentiable)."""
        return gathered[: self.numel].view(self.shape)
