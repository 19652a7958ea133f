"""The transpose of gathering every process' slice, shared by the eager exchange
(:mod:`torchpmap._engines.distributed`) and its op for compiled programs
(:mod:`torchpmap._engines.process_ops`)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def transpose_gather(
    grads: Sequence[Optional[torch.Tensor]],
    floats: Sequence[bool],
    scatter_sum: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
) -> list[Optional[torch.Tensor]]:
    """The gradients of a gather's inputs, given its outputs' cotangents ``grads`` (zeros
    where an output got none): the cotangents of the inputs marked in ``floats`` only, whose
    dtypes (the same in every process) decide the layout, summed across processes by
    ``scatter_sum`` in one transfer; None for the others."""
    sent = [k for k, ok in enumerate(floats) if ok]
    out: list[Optional[torch.Tensor]] = [None] * len(grads)
    if sent:
        for k, g in zip(sent, scatter_sum([grads[k] for k in sent])):
            out[k] = g
    return out
