"""The rules of the process exchange that its eager form and its compiled form share.

What the eager exchange (:mod:`torchpmap._engines.process_exchange`) and its ops for
compiled programs (:mod:`torchpmap._engines.process_ops`) must decide alike, since an eager
process and a compiled one meet in the same collectives: which sums go through an
all-reduce (:func:`sums_by_all_reduce`), the flat buffer per dtype that an all-reduce
sums (:func:`by_dtype`, :func:`split_flat`), and the transpose of gathering every
process' slice (:func:`transpose_gather`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from torchpmap._state.config import config

#: The dtypes an all-reduce sums on every backend torchpmap runs on (gloo, NCCL); others gather.
_ALL_REDUCE_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


def sums_by_all_reduce(ts: Sequence[torch.Tensor]) -> bool:
    """Whether the partial sums ``ts`` cross the processes as an all-reduce (large enough,
    see ``config.all_reduce_bytes``, and of dtypes every backend sums) rather than
    gathered. Never under ``config.bitwise_placement``: the all-reduce adds in its own
    order, the gather in one device's."""
    if config.bitwise_placement or not all(t.dtype in _ALL_REDUCE_DTYPES for t in ts):
        return False
    return sum(t.numel() * t.element_size() for t in ts) >= config.all_reduce_bytes


def by_dtype(ts: Sequence[torch.Tensor]) -> list[list[int]]:
    """The positions of ``ts``' tensors, grouped by dtype (in order of first appearance):
    an all-reduce sums one flat buffer per group."""
    groups: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(ts):
        groups.setdefault(t.dtype, []).append(k)
    return list(groups.values())


def split_flat(ts: Sequence[torch.Tensor], flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the flat buffers ``flats`` (one per group of :func:`by_dtype`) shaped as
    the tensors ``ts`` they were packed from."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(ts)
    for which, flat in zip(by_dtype(ts), flats):
        for k, piece in zip(which, flat.split([ts[k].numel() for k in which])):
            out[k] = piece.view(ts[k].shape)
    return out


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def transpose_gather(
    grads: Sequence[torch.Tensor | None],
    floats: Sequence[bool],
    scatter_sum: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
) -> list[torch.Tensor | None]:
    """The gradients of a gather's inputs, given its outputs' cotangents ``grads`` (zeros
    where an output got none): the cotangents of the inputs marked in ``floats`` only, whose
    dtypes (the same in every process) decide the layout, summed across processes by
    ``scatter_sum`` in one transfer; None for the others."""
    sent = [k for k, ok in enumerate(floats) if ok]
    out: list[torch.Tensor | None] = [None] * len(grads)
    if sent:
        for k, g in zip(sent, scatter_sum([cast(torch.Tensor, grads[k]) for k in sent])):  # zeros, not None
            out[k] = g
    return out
