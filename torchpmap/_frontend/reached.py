"""Which tensors a loss depends on, read from autograd's graph.

``loss.backward()`` gives a ``.grad`` to the leaves the loss reaches and to no others; a
data-parallel step must do the same, so that an optimizer that skips ``p.grad is None``
(``AdamW`` neither decays nor moves such a parameter) behaves as in plain PyTorch. The
graph is walked from ``loss.grad_fn`` back to its leaves: a leaf is reached when its
``AccumulateGrad`` node is, a tensor computed inside the step (a parameter gathered from
its shards) when the node that made it is.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def reached(loss: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``tensors`` that ``loss`` depends on through autograd's graph (for a
    leaf: those that ``loss.backward()`` would give a ``.grad``), in ``tensors``' order;
    raises when it reaches none of them (a detached loss, or one computed from other
    tensors)."""
    leaves = {id(t): k for k, t in tensors.items() if t.grad_fn is None}
    made = {t.grad_fn: k for k, t in tensors.items() if t.grad_fn is not None}
    found: set[str] = set()
    seen: set[Any] = set()
    stack = [getattr(loss, "grad_fn", None)]
    while stack and len(found) < len(tensors):
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in made:
            found.add(made[node])
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf of the graph
        if variable is not None:
            name = leaves.get(id(variable))
            if name is not None:
                found.add(name)
            continue
        stack.extend(child for child, _ in node.next_functions)
    if not found:
        detached = not isinstance(loss, torch.Tensor) or loss.grad_fn is None
        raise ValueError(
            "data_parallel_step: the loss does not depend on any of the model's parameters that require grad "
            f"({len(tensors)} of "
            f"them){' (it carries no autograd graph: detached, or made from plain numbers)' if detached else ''}, "
            "so the step could not change the model. Compute the loss from the model's output (do not .detach() "
            "it or call .item()), and check that the parameters you train have requires_grad=True."
        )
    return [k for k in tensors if k in found]
