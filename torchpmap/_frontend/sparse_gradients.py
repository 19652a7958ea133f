"""Sparse gradients (``nn.Embedding(sparse=True)``) where a step takes its gradients under
``torch.func``: refused, saying what to change.

``data_parallel_step`` in one process takes its gradient by plain autograd, outside the
map, and an embedding's gradient stays sparse there (a ``SparseAdam`` steps it).
Elsewhere (several processes, a sharded step, ...: see
:data:`~torchpmap._frontend.instance_grad.PER_INSTANCE_GRADIENTS`) each instance's
gradient is taken under ``torch.func``, which has no sparse tensors: torch raised
"reshape is not implemented for sparse tensors" in a sharded step and "unsupported
memory format option Contiguous" across processes, naming neither the module nor the fix.
"""
from __future__ import annotations

import torch

from torchpmap._frontend.instance_grad import PER_INSTANCE_GRADIENTS


def refuse(model: torch.nn.Module) -> None:
    """Raises ``NotImplementedError`` for each trained ``nn.Embedding(sparse=True)`` of
    ``model``, naming them, where the step takes each instance's gradient."""
    found = [
        path or "(the model itself)" for path, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse and m.weight.requires_grad
    ]
    if found:
        raise NotImplementedError(
            f"data_parallel_step: the embedding(s) {found} make sparse gradients (nn.Embedding(sparse=True)), "
            f"and torch.func has no sparse tensors. {PER_INSTANCE_GRADIENTS}, where the gradient stays sparse. "
            "Here, make them dense (sparse=False; SGD, Adagrad and Adam step dense gradients, SparseAdam does not)."
        )
