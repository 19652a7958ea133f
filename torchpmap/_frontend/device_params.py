"""The parameters as each device's slice of a step sees them, for a gradient summed over
the devices in their order.

``data_parallel_step`` in one process takes the gradient of the mean loss by plain
autograd, outside the map, so that each weight's gradient is one product over a device's
samples rather than one per instance and their mean. On several devices every device's
forward reads the same parameters, and autograd would add the devices' contributions
into each parameter's gradient in the order its engine happens to run them: that order
follows sequence numbers that each device thread counts for itself, so the last bits of
a gradient changed from run to run (a resumed run no longer repeated the run it
resumed). So each slice's forward reads views of its own (:meth:`DeviceParams.own`), the
gradient is taken with respect to each slice's views, and the slices' gradients are
added in the order of the slices (:meth:`DeviceParams.gradients`).

The slices call :meth:`~DeviceParams.own` before anything else, in their first turns,
which the device threads (and the instance threads of one instance at a time) take in
their order: the order of the calls is the order of the slices.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

Tensors = dict[str, torch.Tensor]


class DeviceParams:
    """Each slice's views of the parameters, noted in the slices' order."""

    def __init__(self) -> None:
        self._views: list[Tensors] = []
        self._lock = threading.Lock()

    def own(self, params: Tensors) -> Tensors:
        """In a slice of the step, before anything else: views of ``params`` for it."""
        views = {k: v.view_as(v) for k, v in params.items()}
        with self._lock:
            self._views.append(views)
        return views

    def gradients(
        self, objective: torch.Tensor, names: Sequence[str], leaves: Tensors
    ) -> dict[str, torch.Tensor | None]:
        """The gradient of ``objective`` for each of ``names``: every slice's, added in
        the slices' order, on its parameter's device (None where no slice reached it)."""
        inputs = [views[k] for views in self._views for k in names]
        found = torch.autograd.grad(objective, inputs, allow_unused=True)
        total: dict[str, torch.Tensor | None] = dict.fromkeys(names)
        for i, g in enumerate(found):
            if g is None:  # a slice that did not reach it (or a failed attempt's views)
                continue
            k = names[i % len(names)]
            g = g.to(leaves[k].device)
            so_far = total[k]
            total[k] = g if so_far is None else so_far + g
        return total
