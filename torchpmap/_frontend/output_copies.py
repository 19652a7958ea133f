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
memory of their own. The same holds between the results: ``(y, y)`` or ``(y, y[:1])``
came back sharing memory from one device (a write into one showed in the other) and
apart from several devices and a loop; the second is now copied everywhere. The check
is on metadata alone (a view's ``_base``, a tensor's identity) and copies only what
aliases an argument or an earlier result: a result computed from the arguments
(``t + 1``) costs nothing more than the check.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from torchpmap._placement.sharded import ShardedTensor


def unaliased(outputs: list[torch.Tensor], arguments: Sequence[object]) -> list[torch.Tensor]:
    """``outputs`` of a mapped call, each copied where it is (a view of) one of the call's
    tensor ``arguments`` (a ShardedTensor's shards included) or of an earlier output, on
    its own device."""
    if _fresh(outputs, arguments):  # the common case: results of computations
        return outputs
    roots = {_root(t) for a in arguments for t in _tensors(a)}
    kept = []
    for out in outputs:
        out = _copied(out, roots)
        roots.update(_root(t) for t in _tensors(out))  # a later output sharing its memory is copied
        kept.append(out)
    return kept


def _fresh(outputs: list[torch.Tensor], arguments: Sequence[object]) -> bool:
    """Whether no output can share an argument's or another output's memory, from
    metadata alone (plain loops: this runs on every call)."""
    seen: set[int] | None = set() if len(outputs) > 1 else None
    for out in outputs:
        if out._base is not None or isinstance(out, ShardedTensor):  # a ShardedTensor: its shards tell
            return False
        for a in arguments:
            if out is a:
                return False
        if seen is not None:  # the same tensor returned twice
            if id(out) in seen:
                return False
            seen.add(id(out))
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
