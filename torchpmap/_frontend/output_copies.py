"""Results never share memory with the arguments, with each other, or between instances.

``pmap(lambda t: t[:1])(x)`` computes a slice of each instance's row. Whether the result
shares ``x``'s memory used to depend on how the instances ran:

* vectorized on one device, and on several devices (each device's block of the result a
  view of its slice of ``x``), the result was a view of ``x``: writing into it wrote
  into ``x``;
* one at a time (after a fallback, or under ``disable_vectorization()``), the results
  were stacked into new memory, as a loop over the rows (``torch.stack``) makes them;
* an argument passed with ``in_axes=None`` came back as an expanded view of it on one
  device (whose writes torch refuses) and as the argument itself on a device running one
  instance.

So a write into the result changed the caller's argument on some placements only. JAX's
arrays cannot be written, and a loop copies: every placement now returns results in
memory of their own. The same holds between the results: ``(y, y)`` or ``(y, y[:1])``
came back sharing memory from one device (a write into one showed in the other) and
apart from several devices and a loop; the second is now copied everywhere. The check
compares storage addresses (``detach()``, ``.data`` and ``view(dtype)`` share an
argument's memory without being views of it: they came back sharing it on some
placements and copied on others) and copies only what shares memory with an argument or
an earlier result: a result computed from the arguments (``t + 1``) costs nothing more
than the check.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from torchpmap._placement.sharded import ShardedTensor


def unaliased(outputs: list[torch.Tensor], arguments: Sequence[object]) -> list[torch.Tensor]:
    """``outputs`` of a mapped call, each copied where it shares memory with one of the
    call's tensor ``arguments`` (a ShardedTensor's shards included) or with an earlier
    output, on its own device."""
    if _fresh(outputs, arguments):  # the common case: results of computations
        return outputs
    memories = {_memory(t) for a in arguments for t in _tensors(a)}
    kept = []
    for out in outputs:
        out = _copied(out, memories)
        memories.update(_memory(t) for t in _tensors(out))  # a later output sharing its memory is copied
        kept.append(out)
    return kept


def _fresh(outputs: list[torch.Tensor], arguments: Sequence[object]) -> bool:
    """Whether no output shares an argument's or another output's memory (plain loops:
    this runs on every call)."""
    seen = set()
    for a in arguments:
        if type(a) is torch.Tensor:
            seen.add(_memory(a))
        elif isinstance(a, ShardedTensor):
            seen.update(_memory(t) for t in _tensors(a))
    for out in outputs:
        if type(out) is not torch.Tensor and isinstance(out, ShardedTensor):  # its shards tell
            return False
        memory = _memory(out)
        if memory in seen:
            return False
        seen.add(memory)
    return True


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors whose memory ``value`` is: itself, and a ShardedTensor's shards (at
    every level of a nested one)."""
    if isinstance(value, ShardedTensor):
        return [value, *(t for s in value.shards for t in _tensors(s.tensor))]
    return [value] if isinstance(value, torch.Tensor) else []


def _memory(t: torch.Tensor) -> Hashable:
    """What identifies the memory ``t`` reads: its storage's address. A tensor that
    shares it without being a view (``detach()``, ``.data``, ``view(dtype)`` under vmap)
    has the same. Where there is no storage to read (a torch.func wrapper under a
    transform around the call, a ShardedTensor, an empty one), the identity of the tensor
    whose view ``t`` is (its base), or of ``t`` itself."""
    if type(t) is torch.Tensor:
        try:
            address: int = t.untyped_storage().data_ptr()
            if address:
                return address
        except (RuntimeError, NotImplementedError):  # no storage of its own to read
            pass
    return ("id", id(t if t._base is None else t._base))


def _copied(out: torch.Tensor, memories: set[Hashable]) -> torch.Tensor:
    if isinstance(out, ShardedTensor):
        if not any(_memory(t) in memories for t in _tensors(out)):
            return out
        return out.map_shards(lambda piece: _copied(piece, memories) if isinstance(piece, ShardedTensor)
                              else piece.clone(), out.shard_dim)
    return out.clone() if _memory(out) in memories else out


def own_rows(t: torch.Tensor) -> torch.Tensor:
    """A stacked result (instances along dim 0) whose rows, and elements, are each in
    memory of their own (see :func:`_elements_shared`).

    A value that is the same on every instance (a ``psum``, a broadcast argument) comes
    out of vmap as one row expanded over the instances (stride 0): a write into one row
    (``out[1].mul_(0)``) then changed every row on one device, where several devices, one
    at a time and a loop hold a row each. Such a result is copied; one whose rows are
    apart (a computation per instance) costs a stride read. A result taken with
    ``out_axes=None`` never comes here (its one row is all it keeps).

    Split over devices, each device's rows are its own output: where the instances
    returned one tensor that no instance computed (a tensor the function closes over),
    every device's shard is a view of it, so such shards are copied too, as one device
    copies the expanded row."""
    if type(t) is not torch.Tensor and isinstance(t, ShardedTensor):  # (the type test first: the common case)
        shared = _shards_sharing_memory(t)
        if not shared and not any(_elements_shared(s.tensor) for s in t.shards):
            return t
        pieces = [
            s.tensor.clone() if k in shared else s.tensor.contiguous() if _elements_shared(s.tensor) else s.tensor
            for k, s in enumerate(t.shards)
        ]
        return ShardedTensor(list(zip(t.devices(), pieces)), t.shard_dim)
    return t.contiguous() if _elements_shared(t) else t


def _shards_sharing_memory(t: ShardedTensor) -> set[int]:
    """The positions of the shards whose memory (see :func:`_memory`) another shard shares."""
    first: dict[Hashable, int] = {}
    shared: set[int] = set()
    for k, s in enumerate(t.shards):
        memory = _memory(s.tensor)
        if memory in first:
            shared.update((first[memory], k))
        else:
            first[memory] = k
    return shared


def _elements_shared(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory: a dim of several elements with stride 0.
    The rows (the same value on every instance), or inside each row: an instance that
    returns ``v.sum().expand(3)`` holds one number three times, where a loop's
    ``torch.stack`` gives each its own memory (a write into ``out[0, 0]`` changed the
    whole row on one device, and raised on several)."""
    if isinstance(t, ShardedTensor):
        return False
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))
