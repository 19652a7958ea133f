"""Results never share memory with the arguments: a result that is (a view of) an argument is copied.

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
memory of their own. The check is on metadata alone (a view's ``_base``, a tensor's
identity) and copies only what aliases an argument: a result computed from the arguments
(``t + 1``) costs nothing more than the check.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from torchpmap._placement.sharded import ShardedTensor


def unaliased(outputs: list[torch.Tensor], arguments: Sequence[object]) -> list[torch.Tensor]:
    """``outputs`` of a mapped call, each copied where it is (a view of) one of the call's
    tensor ``arguments`` (a ShardedTensor's shards included), on its own device."""
    if _fresh(outputs, arguments):  # the common case: results of computations
        return outputs
    roots = {_root(t) for a in arguments for t in _tensors(a)}
    return [_copied(o, roots) for o in outputs]


def _fresh(outputs: list[torch.Tensor], arguments: Sequence[object]) -> bool:
    """Whether no output can share an argument's memory, from metadata alone (plain loops:
    this runs on every call)."""
    for out in outputs:
        if out._base is not None or isinstance(out, ShardedTensor):  # a ShardedTensor: its shards tell
            return False
        for a in arguments:
            if out is a:
                return False
    return True


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors whose memory ``value`` is: itself, and a ShardedTensor's shards (at
    every level of a nested one)."""
    if isinstance(value, ShardedTensor):
        return [value, *(t for s in value.shards for t in _tensors(s.tensor))]
    return [value] if isinstance(value, torch.Tensor) else []


def _root(t: torch.Tensor) -> int:
    """The id of the tensor whose memory ``t`` is: its base for a view, else itself."""
    return id(t if t._base is None else t._base)


def _copied(out: torch.Tensor, roots: set[int]) -> torch.Tensor:
    if isinstance(out, ShardedTensor):
        if not any(_root(t) in roots for t in _tensors(out)):
            return out
        return out.map_shards(lambda piece: _copied(piece, roots) if isinstance(piece, ShardedTensor)
                              else piece.clone(), out.shard_dim)
    return out.clone() if _root(out) in roots else out
