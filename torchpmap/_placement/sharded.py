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
* A view (``st[3]``, ``select``, ``movedim``, iteration, ``view``, ``reshape`` when it can
  view, slicing, ``t()``, ...) is a :class:`ShardedView` (``detach()`` is a ShardedTensor
  of the detached shards): the view op replayed on the gathered value whenever it is
  read, and a write into it is a write into the gathered value, written back into the
  shards. So writes through views reach the ShardedTensor, as writes through a view
  reach its base; autograd sees an ordinary view of it (a write of a value that requires
  grad is recorded on it, a view made under ``no_grad`` refuses a write in grad mode). A
  row (``st[3]``, ``select`` along the sharded dim, a row of an iteration) is read from
  and written into the shard that holds it, without a gather (:class:`InShard`).
* The library's own reads of a part, where nobody else holds the result (a nested
  map's slice, ``out_axes``), keep the sharding: :func:`movedim_of_shards` and its
  siblings go through :class:`_Split`, whose pieces are views of the shards on the graph
  through the ShardedTensor.
* It behaves as a tensor or refuses: shards are checked when it is made (one dtype, one
  layout, one shape but along the sharded dim), indexing is bounds-checked as torch's,
  an in-place op on one whose shards are leaves that require grad raises as on a view
  of such a leaf, and an in-place op that would change its shape or strides (``resize_``,
  ``t_``, ``squeeze_``) raises instead of writing a mis-shaped value into the shards.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch

from torchpmap._placement.devices import Device
from torchpmap._state import torch_private as private
from torchpmap._state.context import cat_as_they_are
from torchpmap._state.torch_private import pytree


class Shard(NamedTuple):
    device: Device
    tensor: torch.Tensor


class InShard(NamedTuple):
    """Where a view of a ShardedTensor lies within one of its shards: ``view`` of shard
    ``shard``'s tensor is the view's data (the same memory)."""

    shard: int
    view: Callable[[torch.Tensor], Any]

    def of(self, st: ShardedTensor) -> torch.Tensor:
        """The view's data: a plain view of the shard's memory, outside autograd (it shares
        the shard's version counter)."""
        with torch.no_grad():
            return self.view(st.shards[self.shard].tensor.detach())


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
        pairs, dim = _checked_shards(shards, dim)
        if any(s.tensor.requires_grad for s in pairs):
            # in grad mode or not (a function under no_grad that enabled grad itself returned
            # these): as the shards are, the whole is differentiable, as one device's result is
            with torch.enable_grad():
                return _Assemble.apply(dim, pairs, *(s.tensor for s in pairs))
        return _wrap(pairs, dim)

    # ------------------------------------------------------------------ where the data is

    def devices(self) -> list[Device]:
        """The devices that hold the data, in shard order (a nested shard's, row-major)."""
        return [
            d for s in self.shards for d in (s.tensor.devices() if isinstance(s.tensor, ShardedTensor) else [s.device])
        ]

    def gather(self, *args: Any, **kwargs: Any) -> torch.Tensor:
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
        """Like ``Tensor.to``: where nothing would change (the dtype and every shard's
        device already the target's), this ShardedTensor itself, as torch returns the
        tensor itself (a write into the result reaches it, as on one device); else the
        gathered value converted, a plain tensor."""
        if self._to_changes_nothing(args, kwargs):
            return self
        return self.gather().to(*args, **kwargs)

    def cpu(self) -> torch.Tensor:  # type: ignore[override]  # no memory_format: a gather
        """Itself where every shard is on the CPU already (as ``Tensor.cpu``), else the
        gathered value there."""
        if all(s.tensor.device.type == "cpu" for s in self.shards):
            return self
        return self.gather("cpu")

    def _to_changes_nothing(self, args: tuple, kwargs: dict) -> bool:
        """Whether ``to(*args, **kwargs)`` leaves every shard as it is: probed on a 0-d
        tensor of the dtype per shard device (no copy of the data). A memory format, a copy
        asked for, or a positional flag (``non_blocking``, ``copy``) goes the gathered way."""
        if "memory_format" in kwargs or kwargs.get("copy") or any(isinstance(a, bool) for a in args):
            return False
        for device in {s.tensor.device for s in self.shards}:
            probe = torch.empty((), dtype=self.dtype, device=device)
            if probe.to(*args, **kwargs) is not probe:
                return False
        return True

    def detach(self) -> ShardedTensor:
        """A ShardedTensor of the shards detached: the same memory, no autograd history
        (``nn.Parameter(st)`` takes it, as it takes a tensor)."""
        return _wrap([Shard(s.device, s.tensor.detach()) for s in self.shards], self.shard_dim)

    @property  # torch.Tensor.data is a C descriptor: this one reads and writes the shards
    def data(self) -> ShardedTensor:
        """As a tensor's ``.data``: the same memory without autograd history (:meth:`detach`)."""
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``st.data = value`` puts ``value``'s data in the shards, each piece on its shard's
        device (a view of ``value`` where it is already there, as a tensor then shares the
        value's memory; a ShardedTensor split alike gives its shards). The autograd history
        stays, as on a tensor. Torch's own setter would swap the wrapper's metadata and
        leave the shards as they were, so the value was silently not read."""
        if value is self:
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"ShardedTensor.data must be set to a tensor, got {type(value).__name__}")
        if value.shape != self.shape or value.dtype != self.dtype:
            raise ValueError(
                f"ShardedTensor.data = value: the value has shape {tuple(value.shape)} and dtype {value.dtype}, but "
                f"the shards hold a {tuple(self.shape)} {self.dtype} value split along dim {self.shard_dim}, and keep "
                "their shapes. Set it to a value of that shape and dtype, or make a new one (st.gather() is a plain "
                "tensor; torchpmap.ShardedTensor(...) builds one from shards)."
            )
        sizes = [s.tensor.shape[self.shard_dim] for s in self.shards]
        if _split_alike(value, self.shard_dim, sizes) and not has_nested_shards(self):
            pieces = [s.tensor.detach() for s in cast(ShardedTensor, value).shards]
        else:
            whole = _concatenated(value, value.device) if isinstance(value, ShardedTensor) else value.detach()
            pieces = list(whole.split(sizes, self.shard_dim))
        for k, (shard, piece) in enumerate(zip(self.shards, pieces)):
            if isinstance(shard.tensor, ShardedTensor):  # a nested mesh block: its own shards take the piece
                shard.tensor.data = piece
            else:
                self.shards[k] = Shard(shard.device, piece.to(shard.tensor.device))

    def numpy(self, *, force: bool = False) -> Any:
        """The gathered value as a NumPy array: a copy (the shards' memory is not one
        array's), so a write into it does not reach the shards. Refused for a value that
        requires grad unless ``force``, as torch refuses."""
        _refuse_numpy_of_grad(self, force)
        return _concatenated(self, torch.device("cpu")).numpy()

    def tolist(self) -> Any:
        return _concatenated(self, torch.device("cpu")).tolist()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        if copy is False:  # as numpy answers for a tensor (torch's __array__ takes no copy)
            raise ValueError("Unable to avoid copy while creating an array as requested.")
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

    # ------------------------------------------------------------------ views
    # st[i], select, movedim, unsqueeze and iteration are torch's own: ShardedViews, autograd
    # views of st (see ShardedView). The library's own reads that keep the sharding, where no
    # user holds the result, are movedim_of_shards, select_of_shards, unsqueeze_of_shards and
    # row_of_shards (below the class).

    def __setitem__(self, index: Any, value: Any) -> None:
        """``st[index] = value``: computed on the gathered value, written back into the shards."""
        updated = self.gather().clone()
        updated[index] = value
        self.copy_(updated)

    def map_shards(self, view: Callable[[torch.Tensor], torch.Tensor], dim: int) -> ShardedTensor:
        """``view`` of every shard, on its own device, as a ShardedTensor split along
        ``dim`` (the caller says where the split lands): differentiable, no gather. For
        ops that act on each shard's rows alone (a permutation of the other dims, a
        reshape merging the split dim with dims after it)."""
        return ShardedTensor([(s.device, view(p)) for s, p in zip(self.shards, shard_pieces(self))], dim)

    # ------------------------------------------------------------------ Python protocols

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        body = repr(_concatenated(self, self.device))[:-1]
        if self.grad_fn is not None:
            body += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            body += ", requires_grad=True"
        return f"{body}, devices={self.devices()})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling keeps the shards where they are; ``torch.load(weights_only=True)``
        loads it (its one function is on torch's safe list once torchpmap is imported)."""
        # the shards' data, detached: a result that requires grad loads as a leaf that requires
        # grad, as a tensor saved by torch.save does
        shards = [((s.device.platform, s.device.id, s.device.process_index), s.tensor.detach()) for s in self.shards]
        return (_rebuild_sharded, (shards, self.shard_dim, self.requires_grad))

    def __deepcopy__(self, memo: dict) -> ShardedTensor:
        if self.grad_fn is not None:  # as torch refuses a non-leaf tensor
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the "
                "moment. If you were attempting to deepcopy a module, this may be because of a torch.nn.utils."
                "weight_norm usage, see https://github.com/pytorch/pytorch/pull/103001"
            )
        out = _wrap([Shard(s.device, copy.deepcopy(s.tensor.detach(), memo)) for s in self.shards], self.shard_dim)
        if self.requires_grad:
            out.requires_grad_()
        return out

    # ------------------------------------------------------------------ ops

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares it without func
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})


def _wrap(shards: list[Shard], dim: int) -> ShardedTensor:
    """A ShardedTensor over ``shards`` with no autograd history of its own."""
    first = shards[0].tensor
    sizes = list(first.shape)
    sizes[dim] = sum(s.tensor.shape[dim] for s in shards)
    out = private.make_wrapper_subclass(
        ShardedTensor, sizes, dtype=first.dtype, device=first.device, requires_grad=False
    )
    out.shards, out.shard_dim = shards, dim
    return out


def _checked_shards(shards: Any, dim: Any) -> tuple[list[Shard], int]:
    """The ``(device, tensor)`` pairs as Shards and ``dim`` normalized, or an error naming
    the shard that does not fit: a ShardedTensor is one tensor, so its shards have one
    dtype and layout, and one shape but along ``dim``."""
    try:
        pairs = [Shard(*pair) for pair in shards]
    except TypeError:
        raise TypeError(
            f"ShardedTensor takes a list of (Device, tensor) pairs, got {shards!r}; e.g. "
            "ShardedTensor([(Device('cpu', 0), torch.zeros(2)), (Device('cpu', 1), torch.ones(2))])"
        ) from None
    if not pairs:
        raise ValueError("ShardedTensor needs at least one shard, got none: a (Device, tensor) pair per device")
    for k, (device, t) in enumerate(pairs):
        if not isinstance(device, Device) or not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ShardedTensor: shard {k} is ({type(device).__name__}, {type(t).__name__}); each shard is a "
                "(torchpmap.Device, torch.Tensor) pair"
            )
    first = pairs[0].tensor
    rank = first.dim()
    if rank == 0:
        raise ValueError(
            "ShardedTensor: the shards are 0-d tensors, which have no dim to be concatenated along; give each "
            "shard at least one dim (t.unsqueeze(0) for one value per shard)"
        )
    if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
        raise ValueError(
            f"ShardedTensor: dim={dim!r} is not a dim of shards of rank {rank} (shape {tuple(first.shape)})"
        )
    dim %= rank
    trailing = lambda t: (*t.shape[:dim], "*", *t.shape[dim + 1 :])  # noqa: E731
    for k, (_, t) in enumerate(pairs[1:], start=1):
        for what, mine, theirs in (
            ("dtype", t.dtype, first.dtype),
            ("layout", t.layout, first.layout),
            ("rank", t.dim(), rank),
        ):
            if mine != theirs:
                raise ValueError(
                    f"ShardedTensor: shard {k} has {what} {mine}, shard 0 has {theirs}; every shard must have the same "
                    f"{what}"
                )
        if trailing(t) != trailing(first):
            raise ValueError(
                f"ShardedTensor: shard {k} has shape {tuple(t.shape)}, shard 0 has {tuple(first.shape)}; the shards "
                f"may differ only along dim {dim}, the one they are concatenated along"
            )
    # a lazily conjugated or negated view (v.conj()) holds its sign in a bit that the
    # wrapper's ops do not carry: resolve it here (no copy for a plain tensor)
    pairs = [Shard(d, t.resolve_conj().resolve_neg()) for d, t in pairs]
    return pairs, dim


def _rebuild_sharded(shards: list, dim: int, requires_grad: bool = False) -> ShardedTensor:
    """The inverse of :meth:`ShardedTensor.__reduce_ex__` (devices as plain tuples, so that
    ``torch.load(weights_only=True)`` needs only this function on its safe list)."""
    st = ShardedTensor([(Device(*device), t) for device, t in shards], dim)
    if requires_grad:
        st.requires_grad_()
    return st


def _materialized(t: torch.Tensor) -> torch.Tensor:
    """A ShardedTensor or ShardedView's value as a plain tensor on its device (a copy,
    outside autograd); anything else as it is."""
    if isinstance(t, ShardedTensor):
        return _concatenated(t, t.device)
    if isinstance(t, ShardedView):
        if t.local is not None:  # a view of one shard's memory: as a tensor's view reads its base's
            return t.local.of(t.base)
        return t.replay(_concatenated(t.base, t.base.device))
    return t


def _is_view(func: Any) -> bool:
    """Whether ``func`` returns a view of its first argument (and writes nothing). Not
    ``to``, which may return its argument or a copy (its schema aliases too): it runs on
    the gathered value (``torch.as_tensor`` of a ShardedTensor made under
    ``inference_mode`` dispatches it, and its replay on a meta tensor copied)."""
    known = _views.get(func)
    if known is None:
        schema = private.op_schema(func)
        known = bool(
            schema is not None
            and schema.name not in _MAYBE_COPIES
            and not schema.is_mutable
            and schema.returns
            and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write
            and schema.arguments
            and schema.arguments[0].alias_info is not None
        )
        _views[func] = known
    return known


_views: dict[Any, bool] = {}
_MAYBE_COPIES = ("aten::to",)


def _base_and_replay(t: Any) -> tuple[ShardedTensor, Callable[[torch.Tensor], torch.Tensor]]:
    if isinstance(t, ShardedView):
        return t.base, t.replay
    return t, _identity


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _item(replay: Callable[[torch.Tensor], Any], i: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Result ``i`` of ``replay`` (a view op that returns several views)."""
    return lambda b: replay(b)[i]


def _view_of(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view op on a ShardedTensor (or a view of one): ShardedViews of its base, their
    metadata (shape, strides, offset) those of the same view of a tensor laid out as the base."""
    base, inner = _base_and_replay(args[0])
    rest = args[1:]

    def replay(b: torch.Tensor) -> Any:
        return func(inner(b), *rest, **kwargs)

    meta = replay(torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device="meta"))
    local = _in_one_shard(func, args, kwargs)
    if isinstance(meta, (list, tuple)):
        return type(meta)(
            ShardedView(base, _item(replay, i), m, _local_item(local, i)) for i, m in enumerate(meta)
        )
    return ShardedView(base, replay, meta, cast("InShard | None", local), _along(func, args, kwargs))


_ALONG_IDENTITY = frozenset({torch.ops.aten.alias.default, torch.ops.aten.detach.default,
                             torch.ops.aten.view_as_real.default})


def _along(func: Any, args: tuple, kwargs: dict) -> int | None:
    """The dim of a view op's result along which it is the same op applied to each shard
    of its base, concatenated (the sharded dim, moved); ``None`` when the op reads across
    shards or may (a reshape, a slice of the sharded dim, an expand, ``as_strided``). Only
    ops that move the sharded dim or leave it whole qualify; their arguments never name
    its size, so replaying them on one shard gives that shard's part."""
    src = args[0]
    if isinstance(src, ShardedView):
        q = src.along
    else:
        q = None if has_nested_shards(src) else src.shard_dim
    if q is None:
        return None
    rank, rest = src.dim(), list(args[1:])
    aten = torch.ops.aten
    try:
        if func in _ALONG_IDENTITY:
            return q
        if func is aten.t.default:
            return q if rank < 2 else 1 - q
        if func is aten.transpose.int:
            a, b = rest[0] % rank, rest[1] % rank
            return b if q == a else a if q == b else q
        if func is aten.permute.default:
            return [d % rank for d in rest[0]].index(q)
        if func is aten.select.int:
            dim = rest[0] % rank
            return None if dim == q else q - (dim < q)
        if func is aten.slice.Tensor:
            dim = (rest[0] if rest else kwargs.get("dim", 0)) % rank
            if dim != q:
                return q
            start = rest[1] if len(rest) > 1 else kwargs.get("start")
            end = rest[2] if len(rest) > 2 else kwargs.get("end")
            step = rest[3] if len(rest) > 3 else kwargs.get("step", 1)
            whole = start in (None, 0) and (end is None or end >= src.shape[q]) and step == 1
            return q if whole else None
        if func is aten.unsqueeze.default:
            dim = rest[0] % (rank + 1)
            return q + (dim <= q)
        if func in (aten.squeeze.dim, aten.squeeze.dims):
            dims = rest[0] if func is aten.squeeze.dims else [rest[0]]
            gone = {d % rank for d in dims if src.shape[d % rank] == 1}
            return None if q in gone else q - sum(d < q for d in gone)
    except (IndexError, ValueError, TypeError):
        return None
    return None


_SELECT = torch.ops.aten.select.int
_UNBIND = torch.ops.aten.unbind.int


def _in_one_shard(func: Any, args: tuple, kwargs: dict) -> InShard | list[InShard] | None:
    """Where a view op's result lies within one shard: a row along the sharded dim
    (``select``, each of ``unbind``'s), or any view of such a view; else ``None``."""
    src, rest = args[0], args[1:]
    if isinstance(src, ShardedView):
        if src.local is None:
            return None
        inner = src.local

        def view(t: torch.Tensor) -> Any:
            return func(inner.view(t), *rest, **kwargs)

        return InShard(inner.shard, view)
    if has_nested_shards(src):
        return None
    if func is _SELECT:
        dim, index = rest[0] % src.dim(), rest[1]
        if dim == src.shard_dim:
            return InShard(*_row_view(src, dim, index % src.shape[dim]))
    if func is _UNBIND:
        dim = (rest[0] if rest else kwargs.get("dim", 0)) % src.dim()
        if dim == src.shard_dim:
            return [InShard(*_row_view(src, dim, i)) for i in range(src.shape[dim])]
    return None


def _row_view(st: ShardedTensor, dim: int, index: int) -> tuple[int, Callable[[torch.Tensor], torch.Tensor]]:
    shard, row = _holder(st, index)
    return shard, lambda t: t.select(dim, row)


def _holder(st: ShardedTensor, index: int) -> tuple[int, int]:
    """The shard that holds ``index`` along the sharded dim, and the index within it."""
    for k, s in enumerate(st.shards):
        size = s.tensor.shape[st.shard_dim]
        if index < size:
            return k, index
        index -= size
    raise IndexError(f"index {index} is out of bounds of the shards")


def _local_item(local: InShard | list[InShard] | None, i: int) -> InShard | None:
    """Result ``i``'s place within a shard, of a view op that returns several views."""
    if isinstance(local, list):
        return local[i]
    if local is None:
        return None
    return InShard(local.shard, lambda t: local.view(t)[i])


def _holds_sharded(values: Any) -> bool:
    """Whether an op's arguments (lists, tuples and dicts of them) hold a ShardedTensor or
    ShardedView (without pytree's flatten: a view op's arguments are a few ints)."""
    for v in values:
        if isinstance(v, (ShardedTensor, ShardedView)):
            return True
        if isinstance(v, (list, tuple)) and _holds_sharded(v):
            return True
        if isinstance(v, dict) and _holds_sharded(v.values()):
            return True
    return False


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Every op on ShardedTensors and ShardedViews (see the module docstring)."""
    if args and isinstance(args[0], (ShardedTensor, ShardedView)) and _is_view(func):
        if not _holds_sharded(args[1:]) and not _holds_sharded(kwargs.values()):
            return _view_of(func, args, kwargs)
    written = _written(func, args, kwargs)
    if written and all(isinstance(w, ShardedView) and w.local is not None for w in written):
        return _write_in_shards(func, args, kwargs, cast("list[ShardedView]", written))
    bases: dict[int, tuple[ShardedTensor, torch.Tensor]] = {}  # the gathered value of every base written into
    for w in written:
        base, _ = _base_and_replay(w)
        if id(base) not in bases:
            _refuse_writing_leaves(func, base)
            bases[id(base)] = (base, _concatenated(base, base.device))
    plains = {}  # what a written argument stands for: (a view of) its base's gathered value
    for w in written:
        base, replay = _base_and_replay(w)
        plains[id(w)] = replay(bases[id(base)][1])

    def plain(v: Any) -> Any:
        if isinstance(v, (ShardedTensor, ShardedView)):
            if id(v) in plains:
                return plains[id(v)]
            base, replay = _base_and_replay(v)
            if id(base) in bases:  # it reads what this op writes: the same memory, as in torch
                return replay(bases[id(base)][1])
            return _materialized(v)
        return v

    before = {k: _layout(t) for k, t in plains.items()}
    out = func(*pytree.tree_map(plain, args), **pytree.tree_map(plain, kwargs))
    if not written:
        return out
    for w in written:
        _refuse_changed_layout(func, w, plains[id(w)], before[id(w)])
    for base, whole in bases.values():  # an in-place op: its result goes back into the shards
        _scatter(whole, base)
    by_plain = {id(plains[id(w)]): w for w in written}
    return pytree.tree_map(lambda v: by_plain.get(id(v), v), out)


def _write_in_shards(func: Any, args: tuple, kwargs: dict, written: list[ShardedView]) -> Any:
    """An in-place op on views that lie within one shard each (``st[i].mul_(2)``): run on
    the shards' memory where it is, no gather; each written shard's version counter moves,
    as a write through a view moves its base's."""
    for w in written:
        _refuse_writing_leaves(func, w.base)
    plains = {id(w): cast(InShard, w.local).of(w.base) for w in written}
    before = {k: _layout(t) for k, t in plains.items()}

    def plain(v: Any) -> Any:
        if isinstance(v, (ShardedTensor, ShardedView)):
            return plains[id(v)] if id(v) in plains else _materialized(v)
        return v

    out = func(*pytree.tree_map(plain, args), **pytree.tree_map(plain, kwargs))
    for w in written:
        _refuse_changed_layout(func, w, plains[id(w)], before[id(w)])
        torch.autograd.graph.increment_version(w.base.shards[cast(InShard, w.local).shard].tensor)
    by_plain = {id(plains[id(w)]): w for w in written}
    return pytree.tree_map(lambda v: by_plain.get(id(v), v), out)


def _refuse_changed_layout(func: Any, w: torch.Tensor, plain: torch.Tensor, before: tuple) -> None:
    if _layout(plain) != before:
        raise RuntimeError(
            f"{func.name()}: a {type(w).__name__} cannot change its shape or strides in place (its shards keep "
            f"theirs; shape {tuple(w.shape)}). Gather it first (st.gather() is a plain tensor) or make a new one."
        )


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().data_ptr()


def _refuse_writing_leaves(func: Any, st: ShardedTensor) -> None:
    """As autograd refuses an in-place op on a view of a leaf that requires grad (a
    ShardedTensor's shards are its memory): unless grad mode is off."""
    if not torch.is_grad_enabled():
        return
    for k, shard in enumerate(st.shards):
        t = shard.tensor
        if isinstance(t, ShardedTensor):
            _refuse_writing_leaves(func, t)
        elif t.requires_grad and t.grad_fn is None:
            raise RuntimeError(
                f"{func.name()}: a ShardedTensor whose shards are leaf tensors that require grad (shard {k}, on "
                f"{shard.device}) is being used in an in-place operation, which writes into those leaves; as for a "
                "view of a leaf Variable that requires grad, this is refused. Write under torch.no_grad(), or "
                "into a copy (st.gather() or torch.as_tensor(st) * 1)."
            )


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history; a ShardedTensor stays sharded."""
    if isinstance(t, ShardedTensor):
        return _wrap([Shard(s.device, _detached(s.tensor)) for s in t.shards], t.shard_dim)
    return t.detach()


def _concatenated(st: ShardedTensor, device: torch.device) -> torch.Tensor:
    """The shards' data in one plain tensor on ``device``, outside autograd."""
    with torch.no_grad():
        return cat_as_they_are([_part(s.tensor, device).detach().to(device) for s in st.shards], st.shard_dim)


def _part(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A shard's data as a plain tensor: a nested ShardedTensor's (or a view of one, as
    a nested mesh map's blocks merged by shard_map) gathered onto ``device``."""
    if isinstance(t, ShardedTensor):
        return _concatenated(t, device)
    if isinstance(t, ShardedView):
        if t.local is not None:
            return t.local.of(t.base).to(device)
        return t.replay(_concatenated(t.base, device))
    return t


def _scatter(whole: torch.Tensor, st: ShardedTensor) -> None:
    """Writes ``whole`` into ``st``'s shards, each on its own device.

    Below autograd (in ``__torch_dispatch__``) a write does not bump its tensor's version
    counter: each shard's is bumped here, so that a backward that saved a shard (``exp``
    saves its result) raises "modified by an inplace operation", as on one device,
    instead of differentiating with the overwritten values. Under
    :func:`rewriting_unchanged_quietly`, a shard that already holds its piece's values is
    left alone."""
    pieces = whole.split([s.tensor.shape[st.shard_dim] for s in st.shards], st.shard_dim)
    quiet = _rewriting_quietly.get()
    with torch.no_grad():
        for shard, piece in zip(st.shards, pieces):
            if quiet and torch.equal(shard.tensor, piece):
                continue
            shard.tensor.copy_(piece)
            torch.autograd.graph.increment_version(shard.tensor)


_rewriting_quietly: contextvars.ContextVar[bool] = contextvars.ContextVar("rewriting_quietly", default=False)


@contextlib.contextmanager
def rewriting_unchanged_quietly() -> Iterator[None]:
    """Writes into ShardedTensors that leave a shard's values as they are neither copy nor
    bump its version counter. For an engine's write-back of what a function wrote into the
    shard's own memory (a device's part taken in place, on the graph): autograd records
    the write on the ShardedTensor, and a tensor the function saved from that memory stays
    valid, as on one device, where the write was the function's only."""
    token = _rewriting_quietly.set(True)
    try:
        yield
    finally:
        _rewriting_quietly.reset(token)


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The ShardedTensors and ShardedViews that ``func`` writes in place (its ``a!`` arguments)."""
    schema = private.op_schema(func)
    if schema is None or not schema.is_mutable:
        return []
    values = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    return [
        v
        for a in schema.arguments
        if a.alias_info is not None
        and a.alias_info.is_write
        and isinstance(v := values.get(a.name), (ShardedTensor, ShardedView))
    ]


# What the library uses where it builds a new result from another (nothing outside sees
# the other, so a write into the new one need not reach it): the sharding kept, whether it
# requires grad or not.


def movedim_of_shards(st: ShardedTensor, source: int, destination: int) -> ShardedTensor:
    """``st.movedim(source, destination)`` as a ShardedTensor of each shard's, no data moved."""
    order = list(range(st.dim()))
    order.insert(destination % st.dim(), order.pop(source % st.dim()))
    return st.map_shards(lambda t: t.movedim(source, destination), order.index(st.shard_dim))


def unsqueeze_of_shards(st: ShardedTensor, dim: int) -> ShardedTensor:
    """``st.unsqueeze(dim)`` as a ShardedTensor of each shard's, no data moved."""
    dim = dim % (st.dim() + 1)
    return st.map_shards(lambda t: t.unsqueeze(dim), st.shard_dim + (dim <= st.shard_dim))


def select_of_shards(st: ShardedTensor, dim: int, index: int) -> torch.Tensor:
    """``st.select(dim, index)``: along the sharded dim, read from the shard that holds it
    (along another, a ShardedTensor of each shard's)."""
    dim = dim % st.dim()
    if dim == st.shard_dim:
        return row_of_shards(st, (slice(None),) * dim + (index,))
    return st.map_shards(lambda t: t.select(dim, index), st.shard_dim - (dim < st.shard_dim))


def row_of_shards(st: ShardedTensor, index: Any) -> torch.Tensor:
    """``st[i]`` (or ``st[i, ...]``) of a ShardedTensor split along dim 0: read from the
    shard that holds row ``i``, differentiably, bounds checked as torch checks them. Split
    along another dim, or any other index, ``st[index]`` as torch indexes it (a ShardedView)."""
    first = index[0] if isinstance(index, tuple) and index else index
    if st.shard_dim != 0 or not isinstance(first, int) or isinstance(first, bool):
        return torch.Tensor.__getitem__(st, index)
    rows = len(st)
    if not -rows <= first < rows:
        raise IndexError(f"index {first} is out of bounds for dimension 0 with size {rows}")
    shard, row = _holder(st, first % rows)
    rest = index[1:] if isinstance(index, tuple) else ()
    return shard_pieces(st)[shard][(row,) + rest]


def shard_pieces(st: ShardedTensor) -> list[torch.Tensor]:
    """The shards' tensors, on the graph through ``st`` when it requires grad (in grad
    mode): views of the shards' memory, their gradients routed into ``st``'s."""
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
        if _split_alike(grad, ctx.dim, ctx.sizes):  # a sharded gradient: each shard's piece is where it is
            pieces: Sequence[torch.Tensor] = [s.tensor for s in cast(ShardedTensor, grad).shards]
        else:
            pieces = grad.split(ctx.sizes, ctx.dim)
        grads = [p.to(d) if need else None for p, d, need in zip(pieces, ctx.devices, ctx.needs_input_grad[2:])]
        return (None, None, *grads)


def _split_alike(t: torch.Tensor, dim: int, sizes: list[int]) -> bool:
    """Whether ``t`` is a ShardedTensor of plain shards of these sizes along ``dim``."""
    return (
        isinstance(t, ShardedTensor) and t.shard_dim == dim and [s.tensor.shape[dim] for s in t.shards] == sizes
        and not has_nested_shards(t)
    )


def has_nested_shards(st: ShardedTensor) -> bool:
    """Whether a shard of ``st`` is itself a ShardedTensor (a nested mesh map's result)."""
    return any(isinstance(s.tensor, ShardedTensor) for s in st.shards)


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
        ctx.shard_devices = None if has_nested_shards(st) else [(s.device, s.tensor.device) for s in st.shards]
        return tuple(_detached(s.tensor) for s in st.shards)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:  # materialized: zeros where unused
        # the shards' gradients stay on their devices (a ShardedTensor) where they arrived there
        placed = ctx.shard_devices is not None and all(
            isinstance(g, torch.Tensor) and not isinstance(g, ShardedTensor) and g.device == where
            for g, (_, where) in zip(grads, ctx.shard_devices)
        )
        if placed:
            return _wrap([Shard(d, g) for g, (d, _) in zip(grads, ctx.shard_devices)], ctx.dim)
        return cat_as_they_are([g.to(ctx.device) for g in grads], ctx.dim)


class ShardedView(torch.Tensor):
    """A view of a :class:`ShardedTensor` (``st.view(-1)``, ``st[1:3]``, ``st.t()``,
    ``st.detach()``, ...) that does not keep the sharding: the view op, replayed on the
    gathered value whenever it is read. Writing into it writes into the ShardedTensor
    (into its shards), as writing into a view writes into its base; reading it after a
    write into the ShardedTensor sees the write. Ops on it return plain tensors.

    Example:
        >>> import torch
        >>> from torchpmap import Device, ShardedTensor
        >>> st = ShardedTensor([(Device("cpu", 0), torch.zeros(2, 2)), (Device("cpu", 1), torch.ones(2, 2))])
        >>> flat = st.view(-1)
        >>> flat[1:3] = 5.0
        >>> st
        tensor([[0., 5.],
                [5., 0.],
                [1., 1.],
                [1., 1.]], devices=[cpu:0, cpu:1])

    Attributes:
        base: the ShardedTensor it is a view of.
        replay: makes the view of a plain tensor laid out as ``base``.
        local: where the view lies within one shard (``st[i]``, and views of it): it is
            read from that shard and written into it, without a gather, and its device
            and ``data_ptr()`` are that shard's. ``None`` for a view across shards.
        along: the dim along which it is ``replay`` of each shard, concatenated (a
            column ``st[:, 0]``, ``st.t()``: the sharded dim, moved), so that a pmap
            mapping it along that dim takes each device's part as a view of its shard
            (:meth:`of_shard`); ``None`` for other views.
    """

    base: ShardedTensor
    replay: Callable[[torch.Tensor], torch.Tensor]
    local: InShard | None
    along: int | None
    __torch_function__ = private.disabled_torch_function

    @staticmethod
    def __new__(
        cls, base: ShardedTensor, replay: Callable[[torch.Tensor], torch.Tensor], meta: torch.Tensor,
        local: InShard | None = None, along: int | None = None,
    ) -> ShardedView:
        device = base.shards[local.shard].tensor.device if local is not None else base.device
        out = private.make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), storage_offset=meta.storage_offset(), dtype=meta.dtype,
            device=device, requires_grad=False,
        )
        out.base, out.replay, out.local, out.along = base, replay, local, along
        return out

    def of_shard(self, dim: int, shard: int) -> torch.Tensor | None:
        """Its part held by ``shard`` of its base along ``dim``: a view of that shard's
        memory (outside autograd), where the view is its op on each shard concatenated
        along ``dim`` (see ``along``); else ``None``."""
        if self.along is None or dim % max(self.dim(), 1) != self.along:
            return None
        return self.replay(self.base.shards[shard].tensor.detach())

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares it without func
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})

    def devices(self) -> list[Device]:
        """The devices of the ShardedTensor it is a view of."""
        return self.base.devices()

    def materialized(self, device: torch.device | None = None) -> torch.Tensor:
        """Its value now, a plain tensor on ``device`` (default: its own), differentiable."""
        target = torch.device(device) if device is not None else self.device
        return torch.as_tensor(self * 1 if self.requires_grad and torch.is_grad_enabled() else _materialized(self)).to(
            target
        )

    def numpy(self, *, force: bool = False) -> Any:
        """Its value as a NumPy array: a row within a CPU shard shares the shard's memory,
        any other view is a copy. Refused for a value that requires grad unless ``force``,
        as torch refuses."""
        _refuse_numpy_of_grad(self, force)
        return _materialized(self).cpu().numpy()

    def tolist(self) -> Any:
        return _materialized(self).tolist()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        if copy is False:  # as numpy answers for a tensor (torch's __array__ takes no copy)
            raise ValueError("Unable to avoid copy while creating an array as requested.")
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def data_ptr(self) -> int:
        """Where its data lies: a view within one shard (a row) is that shard's memory,
        as a tensor's view lies in its base's. A view across shards has no memory of its
        own (its value is gathered when read): 0."""
        return self.local.of(self.base).data_ptr() if self.local is not None else 0

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        body = repr(_materialized(self))[:-1]
        if self.grad_fn is not None:
            body += f", grad_fn=<{type(self.grad_fn).__name__}>"
        if self.local is not None:
            return f"{body}, a view of a ShardedTensor's shard on {self.base.devices()[self.local.shard]})"
        return f"{body}, a view of a ShardedTensor on devices={self.base.devices()})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # as its value (a copy): pickling keeps no view
        return _materialized(self).detach().clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return _materialized(self).detach().clone()


def _refuse_numpy_of_grad(t: torch.Tensor, force: bool) -> None:
    """torch's refusal of ``numpy()`` for a tensor that requires grad (one device raised it,
    several devices returned the array)."""
    if t.requires_grad and not force:
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")


def as_local(value: Any, device: torch.device | None) -> Any:
    """A ShardedTensor gathered onto ``device``, a ShardedView's value there; anything
    else unchanged."""
    if isinstance(value, ShardedTensor):
        return value.gather(device)
    if isinstance(value, ShardedView):
        return value.materialized(device)
    return value


# A ShardedTensor saved with torch.save loads with torch.load(weights_only=True).
torch.serialization.add_safe_globals([_rebuild_sharded])
