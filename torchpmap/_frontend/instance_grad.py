"""Each instance's gradient in the data-parallel steps: ``torch.func.grad_and_value``, with
what it refuses told in the step's terms.

The steps (:mod:`torchpmap.training`, :mod:`torchpmap._frontend.sharded_step`) take each
instance's gradient with torch.func on several devices, across processes and with
``shard_params``; on one device without ``shard_params`` the replicated step takes the
gradient of the mean loss with plain autograd instead. torch.func refuses saved tensor
hooks (``torch.utils.checkpoint(..., use_reentrant=False)``,
``torch.autograd.graph.save_on_cpu``), which plain autograd runs: the refusal names the
placements and the ways out, where torch's own message named neither.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.func import grad_and_value

Aux = TypeVar("Aux")
Tensors = dict[str, torch.Tensor]


#: Where ``data_parallel_step`` takes each instance's gradient under ``torch.func`` (the
#: rest take the gradient of the mean loss with plain autograd), for error messages.
PER_INSTANCE_GRADIENTS = (
    "The step takes each instance's gradient with torch.func.grad across processes, with shard_params, with "
    "jit=True on several devices, with randomness='per_instance', an enabled GradScaler, "
    "config.bitwise_placement or an nn.Embedding(scale_grad_by_freq=True); otherwise (in one process) it "
    "takes the gradient of the mean loss with plain autograd"
)


def instance_grad_and_value(
    loss_of: Callable[[Tensors], tuple[torch.Tensor, Aux]], params: Tensors
) -> tuple[Tensors, tuple[torch.Tensor, Aux]]:
    """``grad_and_value(loss_of, has_aux=True)(params)``; saved tensor hooks are refused
    with a :class:`NotImplementedError` that says what to do."""
    try:
        return grad_and_value(loss_of, has_aux=True)(params)
    except RuntimeError as refused:
        if "saved tensor hooks" not in str(refused):
            raise
        raise NotImplementedError(
            "data_parallel_step: the model's forward sets saved tensor hooks (torch.utils.checkpoint with "
            f"use_reentrant=False, torch.autograd.graph.save_on_cpu), which torch.func.grad refuses. "
            f"{PER_INSTANCE_GRADIENTS}, where they work. Here, leave out the activation checkpointing (for a "
            "model too large without it: shard_params=True, whose layer-by-layer gathering keeps the peak near "
            "one layer's weights), or write the step with torchpmap.pmap and loss.backward()."
        ) from refused
