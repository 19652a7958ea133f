"""ShardedTensor: a pmap result that stays on the devices that computed it.

A pmap over several devices returns one shard per device instead of copying everything
to one place. The result is a ``torch.Tensor`` (a wrapper subclass, as DTensor is): its
metadata is the whole value's, and every op on it reads the shards, gathering them onto
the first shard's device only when it must. Autograd sees it as one tensor whose
gradient splits into the shards' gradients, so ``torch.as_tensor``, hooks,
``torch.autograd.grad`` with respect to it, and in-place ops behave as on a plain
tensor. A pmap with the same placement takes its shards where they are, without a copy.

How it works, for a reader of the code:

* A ShardedTensor that requires grad is made by :class:`_Assemble`, an autograd function
  from the shards to the whole: its backward splits the whole's gradient along
  ``shard_dim`` and sends each piece to its shard's device.
* Ops reach :meth:`ShardedTensor.__torch_dispatch__` below autograd (the subclass turns
  ``__torch_function__`` off), which runs them on the gathered data and returns plain
  tensors. An op that writes a ShardedTensor in place writes the result back into its
  shards.
* Reading a part of it without a gather (``st[3]``, ``select``/``movedim``/``unsqueeze``
  keeping the sharding) goes through :class:`_Split`, so those reads stay on the graph
  through the ShardedTensor itself.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchpmap._placement.devices import Device
from torchpmap._state import torch_private as private
from torchpmap._state.torch_private import pytree


class Shard(NamedTuple):
    device: Device
    tensor: torch.Tensor


class ShardedTensor(torch.Tensor):
    """A tensor split along ``dim`` into consecutive shards on several devices.

    It is a ``torch.Tensor``: ``shape``, ``dtype``, ``requires_grad`` and ``grad_fn`` are
    the whole value's, torch functions and operators accept it, and ``torch.as_tensor``
    returns it as it is. ``device`` is the first shard's device. ``gather(device)``
    gives a plain tensor on one device. All of it is differentiable: the gradient of a
    ShardedTensor reaches each shard on its own device.

    A shard may itself be a ShardedTensor split along another dim: nested pmaps over the
    two axes of a device mesh return one, so that block ``(d, m)`` of the result stays on
    ``mesh.devices[d, m]``. Each top-level shard then names the first device of its block.

    Example:
        >>> import torch
        >>> from torchpmap import Device, ShardedTensor
        >>> st = ShardedTensor([(Device("cpu", 0), torch.zeros(2)), (Device("cpu", 1), torch.ones(2))])
        >>> st.shape, st.devices()
        (torch.Size([4]), [cpu:0, cpu:1])
        >>> st
        tensor([0., 0., 1., 1.], devices=[cpu:0, cpu:1])
        >>> torch.as_tensor(st) is st, isinstance(st, torch.Tensor)
        (True, True)
        >>> st * 2
        tensor([0., 0., 2., 2.])
    """

    shards: list[Shard]
    shard_dim: int
    __torch_function__ = private.disabled_torch_function

    @staticmethod
    def __new__(cls, shards: Sequence[tuple[Device, torch.Tensor]], dim: int = 0) -> ShardedTensor:
        pairs = [Shard(d, t) for d, t in shards]
        if torch.is_grad_enabled() and any(s.tensor.requires_grad for s in pairs):
            return _Assemble.apply(dim, pairs, *(s.tensor for s in pairs))
        return _wrap(pairs, dim)

    # ------------------------------------------------------------------ where the data is

    def devices(self) -> list[Device]:
        """The devices that hold the data, in shard order (a nested shard's, row-major)."""
        return [d for s in self.shards for d in (s.tensor.devices() if isinstance(s.tensor, ShardedTensor) else [s.device])]

    def gather(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """``gather(device=None)``: all shards concatenated into one plain tensor on
        ``device`` (default: the first shard's), differentiably.

        ``gather(dim, index)`` is ``torch.Tensor.gather``, so that code written for
        tensors (``logits.gather(1, labels)``) means the same on a ShardedTensor.
        """
        if (args and isinstance(args[0], int)) or "dim" in kwargs or "index" in kwargs:
            return torch.Tensor.gather(self, *args, **kwargs)
        device = kwargs.pop("device", args[0] if args else None)
        target = torch.device(device) if device is not None else self.device
        if torch.is_grad_enabled() and self.requires_grad:
            return _Gather.apply(self, target)
        return _concatenated(self, target)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Like ``Tensor.to``, on the gathered value: a plain tensor."""
        return self.gather().to(*args, **kwargs)

    def cpu(self) -> torch.Tensor:
        return self.gather("cpu")

    def numpy(self, *, force: bool = False) -> Any:
        """The gathered value as a NumPy array (detached, as ``.tolist()``)."""
        return _concatenated(self, torch.device("cpu")).numpy()

    def tolist(self) -> Any:
        return _concatenated(self, torch.device("cpu")).tolist()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def __dlpack__(self, **kwargs: Any) -> Any:
        if self.requires_grad:
            raise RuntimeError(
                "Can't export a ShardedTensor that requires grad through DLPack (the graph cannot travel); use "
                "st.detach() first, or torch.as_tensor(st), which keeps it"
            )
        return _concatenated(self, self.device).__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return _concatenated(self, self.device).__dlpack_device__()

    # ------------------------------------------------------------------ views that keep the sharding

    def movedim(self, source: int, destination: int) -> ShardedTensor:  # type: ignore[override]
        """Like ``torch.movedim``: moves dims of every shard, keeping the sharding."""
        order = list(range(self.dim()))
        order.insert(destination % self.dim(), order.pop(source % self.dim()))
        return self._per_shard(lambda t: t.movedim(source, destination), order.index(self.shard_dim))

    def unsqueeze(self, dim: int) -> ShardedTensor:  # type: ignore[override]
        """Like ``torch.unsqueeze``, keeping the sharding (no data moves)."""
        dim = dim % (self.dim() + 1)
        return self._per_shard(lambda t: t.unsqueeze(dim), self.shard_dim + (dim <= self.shard_dim))

    def select(self, dim: int, index: int) -> Any:  # type: ignore[override]
        """Like ``torch.select``; along another dim than the sharded one, no data moves."""
        dim = dim % self.dim()
        if dim == self.shard_dim:
            return self[(slice(None),) * dim + (index,)]
        return self._per_shard(lambda t: t.select(dim, index), self.shard_dim - (dim < self.shard_dim))

    def __getitem__(self, index: Any) -> torch.Tensor:
        first = index[0] if isinstance(index, tuple) and index else index
        if self.shard_dim == 0 and isinstance(first, int):  # one row: read only its shard
            row = first % len(self)
            for piece in _pieces(self):
                if row < piece.shape[0]:
                    rest = index[1:] if isinstance(index, tuple) else ()
                    return piece[(row, *rest)]
                row -= piece.shape[0]
        return self.gather()[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        """``st[index] = value``: computed on the gathered value, written back into the shards."""
        updated = self.gather().clone()
        updated[index] = value
        self.copy_(updated)

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    def _per_shard(self, view: Callable[[torch.Tensor], torch.Tensor], dim: int) -> ShardedTensor:
        return ShardedTensor([(s.device, view(p)) for s, p in zip(self.shards, _pieces(self))], dim)

    # ------------------------------------------------------------------ Python protocols

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        body = repr(_concatenated(self, self.device))[:-1]
        if self.grad_fn is not None:
            body += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            body += ", requires_grad=True"
        return f"{body}, devices={self.devices()})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickling keeps the shards where they are
        return (ShardedTensor, ([(s.device, s.tensor) for s in self.shards], self.shard_dim))

    def __deepcopy__(self, memo: dict) -> ShardedTensor:
        return ShardedTensor([(s.device, copy.deepcopy(s.tensor, memo)) for s in self.shards], self.shard_dim)

    # ------------------------------------------------------------------ ops

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        buffers = {id(st): _concatenated(st, st.device) for st in written}

        def plain(v: Any) -> Any:
            if isinstance(v, ShardedTensor):
                return buffers[id(v)] if id(v) in buffers else _concatenated(v, v.device)
            return v

        out = func(*pytree.tree_map(plain, args), **pytree.tree_map(plain, kwargs))
        if not written:
            return out
        by_buffer = {id(buffers[id(st)]): st for st in written}
        for st in written:  # an in-place op: its result goes back into the shards
            _scatter(buffers[id(st)], st)
        return pytree.tree_map(lambda v: by_buffer.get(id(v), v), out)


def _wrap(shards: list[Shard], dim: int) -> ShardedTensor:
    """A ShardedTensor over ``shards`` with no autograd history of its own."""
    first = shards[0].tensor
    sizes = list(first.shape)
    sizes[dim] = sum(s.tensor.shape[dim] for s in shards)
    out = private.make_wrapper_subclass(ShardedTensor, sizes, dtype=first.dtype, device=first.device, requires_grad=False)
    out.shards, out.shard_dim = shards, dim
    return out


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history; a ShardedTensor stays sharded."""
    if isinstance(t, ShardedTensor):
        return _wrap([Shard(s.device, _detached(s.tensor)) for s in t.shards], t.shard_dim)
    return t.detach()


def _concatenated(st: ShardedTensor, device: torch.device) -> torch.Tensor:
    """The shards' data in one plain tensor on ``device``, outside autograd."""
    with torch.no_grad():
        parts = [_concatenated(s.tensor, device) if isinstance(s.tensor, ShardedTensor) else s.tensor for s in st.shards]
        return torch.cat([p.detach().to(device) for p in parts], st.shard_dim)


def _scatter(whole: torch.Tensor, st: ShardedTensor) -> None:
    """Writes ``whole`` into ``st``'s shards, each on its own device."""
    pieces = whole.split([s.tensor.shape[st.shard_dim] for s in st.shards], st.shard_dim)
    with torch.no_grad():
        for shard, piece in zip(st.shards, pieces):
            shard.tensor.copy_(piece)


def _written(func: Any, args: tuple, kwargs: dict) -> list[ShardedTensor]:
    """The ShardedTensors that ``func`` writes in place (its ``a!`` arguments)."""
    schema = private.op_schema(func)
    if schema is None or not schema.is_mutable:
        return []
    values = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    return [
        v for a in schema.arguments
        if a.alias_info is not None and a.alias_info.is_write and isinstance(v := values.get(a.name), ShardedTensor)
    ]


def _pieces(st: ShardedTensor) -> list[torch.Tensor]:
    """The shards' tensors, on the graph through ``st`` when it requires grad."""
    if torch.is_grad_enabled() and st.requires_grad:
        return list(_Split.apply(st))
    return [s.tensor for s in st.shards]


class _Assemble(torch.autograd.Function):
    """Shards -> the ShardedTensor over them; the gradient splits back into the shards."""

    @staticmethod
    def forward(ctx: Any, dim: int, shards: list[Shard], *tensors: torch.Tensor) -> ShardedTensor:
        ctx.dim, ctx.sizes, ctx.devices = dim, [t.shape[dim] for t in tensors], [t.device for t in tensors]
        return _wrap(shards, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        pieces = grad.split(ctx.sizes, ctx.dim)
        grads = [p.to(d) if need else None for p, d, need in zip(pieces, ctx.devices, ctx.needs_input_grad[2:])]
        return (None, None, *grads)


class _Gather(torch.autograd.Function):
    """A ShardedTensor -> its value on one device."""

    @staticmethod
    def forward(ctx: Any, st: ShardedTensor, device: torch.device) -> torch.Tensor:
        ctx.device = st.device
        return _concatenated(st, device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad.to(ctx.device), None


class _Split(torch.autograd.Function):
    """A ShardedTensor -> its shards (a nested one stays sharded), on the graph through it."""

    @staticmethod
    def forward(ctx: Any, st: ShardedTensor) -> tuple:
        ctx.dim, ctx.device = st.shard_dim, st.device
        return tuple(_detached(s.tensor) for s in st.shards)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:  # materialized: zeros where unused
        return torch.cat([g.to(ctx.device) for g in grads], ctx.dim)


def as_local(value: Any, device: torch.device | None) -> Any:
    """A ShardedTensor gathered onto ``device``; anything else unchanged."""
    if isinstance(value, ShardedTensor):
        return value.gather(device)
    return value
