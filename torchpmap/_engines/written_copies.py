"""In-place writes into copies of the caller's arguments reach the caller.

An instance may write in place into its own slice of a mapped argument, and the caller
sees the write (as with ``torch.func.vmap``): on one device the slice is a view of the
caller's tensor. Where an engine hands the function a *copy* instead (a ``ShardedTensor``
gathered because its shards are not where the instances run, a tensor moved to the device
of the instances), the write would stay in the copy, and the caller's tensor would differ
between placements. So an engine notes its copies (:func:`copies`) and, after the function
ran, writes back each copy whose version counter moved (:func:`write_back`).

The vectorized engine looks only at the arguments it placed (the common case, a tensor
already on the device, taken as a view, costs nothing); a device thread compares each
slice with its argument (a type test and a device comparison).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torchpmap._engines import closure_writes
from torchpmap._placement.sharded import ShardedTensor, ShardedView, rewriting_unchanged_quietly


def trackable() -> contextlib.AbstractContextManager[None]:
    """Where an engine makes its copies. Under ``torch.inference_mode`` a copy would be an
    inference tensor, which keeps no version counter, so a write into it could not be seen
    (and reading its counter raises): the copy is made with inference mode off, and grad
    mode off as inference mode had it. It is a plain tensor, written into in place, under
    inference mode, as any other."""
    return _outside_inference_mode() if torch.is_inference_mode_enabled() else contextlib.nullcontext()


@contextlib.contextmanager
def _outside_inference_mode() -> Iterator[None]:
    with torch.inference_mode(False), torch.no_grad():
        yield


def is_copy(argument: Any, part: Any) -> bool:
    """Whether ``part``, what the function receives for ``argument`` (a slice of it, or
    all of it), is a copy rather than a view: a gathered ShardedTensor (not one of its
    shards) or ShardedView, or a tensor on another device."""
    if isinstance(argument, ShardedTensor):
        return all(part is not s.tensor for s in argument.shards)
    if isinstance(argument, ShardedView):  # a copy, or a view of one of its base's shards
        if part.requires_grad:  # on the graph through its base: a write is written back through autograd
            return True
        memory = part.untyped_storage().data_ptr()
        return all(memory != s.tensor.untyped_storage().data_ptr() for s in argument.base.shards)
    return isinstance(argument, torch.Tensor) and isinstance(part, torch.Tensor) and part.device != argument.device


def copies(
    arguments: Sequence[Any], parts: Sequence[Any], only: Sequence[int] | None = None, *, nested: bool = False
) -> dict[int, int | None]:
    """The positions of ``parts`` that are copies of their ``arguments`` (among ``only``,
    or all), each with its version counter now; None where the counter cannot tell.

    Under inference mode, inside a dispatch mode (a journal's, watching a first attempt:
    :mod:`~torchpmap._engines.closure_writes`), an in-place write through some views
    (``movedim``, vmap's ``in_dims=1``) moves no version counter (torch 2.11-2.14): such
    copies are written back whether or not their counter moved. ``nested``: the parts go
    to maps of their own (shard_map's), whose first attempts may run under such a mode
    where this caller cannot see it: under inference mode, every copy is so."""
    blind = torch.is_inference_mode_enabled() and (nested or closure_writes.watching())
    found: dict[int, int | None] = {}
    for i in range(len(parts)) if only is None else only:
        if is_copy(arguments[i], parts[i]):
            found[i] = None if blind else parts[i]._version
    return found


def write_back(
    arguments: Sequence[Any],
    parts: Sequence[Any],
    noted: dict[int, int | None],
    region: Callable[[int, Any], Any] = lambda i, argument: argument,
) -> None:
    """Copies each noted part whose version moved (the function wrote into it) into its
    argument's ``region`` (all of it unless given: a device's slice, say)."""
    with rewriting_unchanged_quietly():  # a part that is its shard's memory holds the values already
        for i, version in noted.items():
            if version is None or parts[i]._version != version:
                region(i, arguments[i]).copy_(parts[i])
