"""ShardedTensor: a pmap result that stays on the devices that computed it.

A pmap over several devices returns one shard per device instead of copying everything
to one place. The result behaves like a tensor where it is used as one (printing,
indexing, torch functions, numpy conversion), gathering onto one device only when it
must, and a pmap with the same placement takes its shards where they are, without a copy.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from torchpmap._devices import Device
from torchpmap._torch_private import pytree


class Shard(NamedTuple):
    device: Device
    tensor: torch.Tensor


class ShardedTensor:
    """A tensor split along ``dim`` into consecutive shards on several devices.

    A shard may itself be a ShardedTensor split along another dim: nested pmaps over the
    two axes of a device mesh return one, so that block ``(d, m)`` of the result stays on
    ``mesh.devices[d, m]``. Each top-level shard then names the first device of its block.

    Torch functions and operators on it (``torch.sum(st)``, ``st * 2``) and ``gather()``
    are differentiable; ``torch.as_tensor`` goes through DLPack and refuses a value that
    requires grad rather than silently detaching it.

    Example:
        >>> import torch
        >>> from torchpmap import Device, ShardedTensor
        >>> st = ShardedTensor([(Device("cpu", 0), torch.zeros(2)), (Device("cpu", 1), torch.ones(2))])
        >>> st.shape, st.devices()
        (torch.Size([4]), [cpu:0, cpu:1])
        >>> st
        tensor([0., 0., 1., 1.], devices=[cpu:0, cpu:1])
        >>> torch.as_tensor(st) * 2
        tensor([0., 0., 2., 2.])
    """

    def __init__(self, shards: Sequence[tuple[Device, torch.Tensor]], dim: int = 0):
        self.shards = [Shard(d, t) for d, t in shards]
        self.shard_dim = dim
        first = self.shards[0].tensor
        sizes = list(first.shape)
        sizes[dim] = sum(s.tensor.shape[dim] for s in self.shards)
        self._shape = torch.Size(sizes)
        self.dtype = first.dtype

    # ------------------------------------------------------------------ tensor-like metadata

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    def dim(self) -> int:
        return len(self._shape)

    ndim = property(dim)

    def __len__(self) -> int:
        return self._shape[0]

    def devices(self) -> list[Device]:
        """The devices that hold the data, in shard order (a nested shard's, row-major)."""
        return [d for s in self.shards for d in (s.tensor.devices() if isinstance(s.tensor, ShardedTensor) else [s.device])]

    @property
    def requires_grad(self) -> bool:
        return any(s.tensor.requires_grad for s in self.shards)

    # ------------------------------------------------------------------ moving data

    def gather(self, device: torch.device | str | None = None) -> torch.Tensor:
        """All shards concatenated into one tensor on ``device`` (default: the first shard's)."""
        target = torch.device(device) if device is not None else self.shards[0].device.torch_device
        return torch.cat([s.tensor.to(target) for s in self.shards], self.shard_dim)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.gather().to(*args, **kwargs)

    def cpu(self) -> torch.Tensor:
        return self.gather("cpu")

    def numpy(self):
        return self.gather("cpu").detach().numpy()

    def tolist(self) -> list:
        return self.gather("cpu").tolist()

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def __dlpack__(self, **kwargs):  # how torch.as_tensor / torch.asarray convert it
        if self.requires_grad:
            raise RuntimeError(
                "torch.as_tensor on a ShardedTensor that requires grad would drop the autograd graph; use "
                "st.gather() (differentiable), or st.detach() if you do not need gradients"
            )
        return self.gather().__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.shards[0].tensor.__dlpack_device__()

    def item(self):
        return self.gather().item()

    # ------------------------------------------------------------------ views

    def movedim(self, source: int, destination: int) -> "ShardedTensor":
        """Like ``torch.movedim``: moves dims of every shard, keeping the sharding."""
        order = list(range(self.dim()))
        order.insert(destination % self.dim(), order.pop(source % self.dim()))
        moved = [(s.device, s.tensor.movedim(source, destination)) for s in self.shards]
        return ShardedTensor(moved, order.index(self.shard_dim))

    def unsqueeze(self, dim: int) -> "ShardedTensor":
        """Like ``torch.unsqueeze``, keeping the sharding (no data moves)."""
        dim = dim % (self.dim() + 1)
        shards = [(s.device, s.tensor.unsqueeze(dim)) for s in self.shards]
        return ShardedTensor(shards, self.shard_dim + (dim <= self.shard_dim))

    def select(self, dim: int, index: int) -> Any:
        """Like ``torch.select``; along another dim than the sharded one, no data moves."""
        dim = dim % self.dim()
        if dim == self.shard_dim:
            return self[(slice(None),) * dim + (index,)]
        shards = [(s.device, s.tensor.select(dim, index)) for s in self.shards]
        return ShardedTensor(shards, self.shard_dim - (dim < self.shard_dim))

    def __getitem__(self, index: Any) -> torch.Tensor:
        first = index[0] if isinstance(index, tuple) and index else index
        if self.shard_dim == 0 and isinstance(first, int):  # one row: read only its shard
            row = first % len(self)
            for shard in self.shards:
                if row < shard.tensor.shape[0]:
                    rest = index[1:] if isinstance(index, tuple) else ()
                    return shard.tensor[(row, *rest)]
                row -= shard.tensor.shape[0]
        return self.gather()[index]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        body = repr(self.gather())
        return f"{body[:-1]}, devices={self.devices()})"

    # ------------------------------------------------------------------ torch interop

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.gather() if isinstance(x, ShardedTensor) else x

        return func(*pytree.tree_map(unwrap, tuple(args)), **pytree.tree_map(unwrap, kwargs or {}))


def _forward_to_gathered(name: str):
    def method(self, *args, **kwargs):
        return getattr(torch.Tensor, name)(self.gather(), *args, **kwargs)

    method.__name__ = name
    return method


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__mod__", "__pow__", "__matmul__", "__neg__", "__abs__", "__eq__", "__ne__", "__lt__",
    "__le__", "__gt__", "__ge__", "__float__", "__int__", "__bool__", "sum", "mean", "max", "min", "float",
    "double", "long", "int", "reshape", "view", "flatten", "allclose", "equal", "detach", "clone", "contiguous",
):
    setattr(ShardedTensor, _name, _forward_to_gathered(_name))
del _name
ShardedTensor.__hash__ = object.__hash__


def as_local(value: Any, device: torch.device | None) -> Any:
    """A ShardedTensor gathered onto ``device``; anything else unchanged."""
    if isinstance(value, ShardedTensor):
        return value.gather(device)
    return value
