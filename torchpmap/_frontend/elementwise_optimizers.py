"""The torch optimizers whose update is elementwise, so that they may step on shards.

A sharded step (``data_parallel_step(shard_params=...)``) hands each optimizer a slice
of every parameter, its gradient and its state. That is the same update as on the whole
parameter only when every element's new value depends on that element alone (its
value, gradient and state) and on scalars shared by all elements (the learning rate,
the step count): SGD, momentum, weight decay, Adam's moments. An update that mixes
elements (LBFGS's dot products and line search, Adafactor's row and column means,
Muon's orthogonalization) would compute something else on a slice, silently. So the
list below is closed: exactly these classes, not their subclasses (a subclass may
override ``step``), and anything else is refused.
"""
from __future__ import annotations

import torch

#: Optimizers whose ``step`` is elementwise: per element, given the shared scalars.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


#: The state entries of :data:`ELEMENTWISE` that are scalars shared by every element (a
#: step count, ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``): copied to every shard,
#: never split, even for a 0-dim parameter, whose own state has the same shape ``()``.
SHARED_STATE: frozenset[str] = frozenset({"step", "eta", "mu", "mu_product"})


def check_elementwise(optimizer: torch.optim.Optimizer, what: str) -> None:
    """Raises unless ``optimizer`` is exactly one of :data:`ELEMENTWISE`."""
    if type(optimizer) in ELEMENTWISE:
        return
    kind = type(optimizer)
    names = ", ".join(c.__name__ for c in ELEMENTWISE)
    subclass = next((c.__name__ for c in ELEMENTWISE if isinstance(optimizer, c)), None)
    why = (
        f"it subclasses {subclass}, and a subclass may change step() to mix elements"
        if subclass
        else "its update is not known to be elementwise"
    )
    raise TypeError(
        f"{what}: the optimizer is a {kind.__module__}.{kind.__qualname__}, which cannot step on shards: {why}, and "
        "on a slice of each parameter an update that mixes elements (dot products, norms, row means) silently "
        f"computes something else. Sharded steps take one of torch.optim's elementwise optimizers ({names}); "
        "for any other, train with the replicated step (leave shard_params out)."
    )
