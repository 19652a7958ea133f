"""Sparse gradients (``nn.Embedding(sparse=True)``) where a step takes its gradients under
``torch.func``: refused, saying what to change.

``data_parallel_step`` on one device in one process takes its gradient by plain
autograd, outside the map, and an embedding's gradient stays sparse there (a
``SparseAdam`` steps it). Elsewhere (several devices, several processes, a sharded step)
each instance's gradient is taken under ``torch.func``, which has no sparse tensors:
torch raised "reshape is not implemented for sparse tensors" on several devices and
"unsupported memory format option Contiguous" across processes, naming neither the
module nor the fix.
"""
from __future__ import annotations

import torch


def refuse(model: torch.nn.Module, where: str) -> None:
    """Raises ``NotImplementedError`` for each trained ``nn.Embedding(sparse=True)`` of
    ``model``, naming them; ``where`` says which step cannot take them."""
    found = [
        path or "(the model itself)" for path, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse and m.weight.requires_grad
    ]
    if found:
        raise NotImplementedError(
            f"data_parallel_step: the embedding(s) {found} make sparse gradients (nn.Embedding(sparse=True)), "
            f"which the step cannot take {where}: there each instance's gradient is taken under torch.func, "
            "which has no sparse tensors. Make them dense (sparse=False; SGD, Adagrad and Adam step dense "
            "gradients, SparseAdam does not), or run the replicated step on one device in one process, where "
            "the gradient is taken by plain autograd and stays sparse."
        )
