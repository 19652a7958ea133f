"""The floating buffers of a data-parallel step (batch-norm running statistics): each
instance updates its own copy; after the step the model holds their mean.

Each instance sends the value it ended with and, beside it, which elements it changed
(:func:`sent`). The model's buffer becomes the mean of the instances' values where any
instance changed it, and keeps its own bits where none did (:func:`write`). A running
maximum that starts at ``-inf`` (a quantization observer's) ends at the mean of the
instances' maxima; sending only each instance's change (``new - old``) and adding its mean
to the old value made that ``-inf + inf``, NaN, and lost a start value of ``-1e9`` to
rounding.
"""
from __future__ import annotations

import torch

Tensors = dict[str, torch.Tensor]
Sent = dict[str, tuple[torch.Tensor, torch.Tensor]]


def sent(state: Tensors, floating: Tensors) -> Sent:
    """What an instance sends of each floating buffer (averaged over the instances with
    ``pmean``): its value after the forward, and 1 where it changed an element (0 where
    not), in the buffer's dtype."""
    out: Sent = {}
    for k, old in floating.items():
        new = state[k].detach()
        out[k] = (new, (new != old).to(new.dtype))
    return out


def write(buffer: torch.Tensor, mean: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Sets ``buffer`` to the instances' mean ``mean[0]`` where any of them changed it
    (``mean[1]``, the mean of their flags, is not 0: a sum of zeros is exactly 0)."""
    value, changed = (t.to(buffer.device) for t in mean)
    with torch.no_grad():
        buffer.copy_(torch.where(changed != 0, value.to(buffer.dtype), buffer))
