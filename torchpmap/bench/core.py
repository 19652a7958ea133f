"""The vocabulary of the suite: columns, workloads, cases and their implementations.

A :class:`Workload` (``--only`` selects one by name) builds one or more :class:`Case`\\ s,
each a row of the table. A case maps column names to an :class:`Impl` (something to
time) or an :class:`NA` (why that column has no number).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SUBJECT = "torchpmap"
JIT = "torchpmap.jit"
JIT_1DEV = "torchpmap.1dev.jit"

#: Every column, in table order. The first is the subject, the others are baselines.
COLUMNS: dict[str, str] = {
    SUBJECT: "torchpmap.pmap",
    "torch": "plain PyTorch, the same math as one batched computation",
    "torch.compile": "torch.compile of that plain PyTorch step (default inductor options)",
    "jax.pmap": "jax.pmap on CPU, 8 forced host devices",
    "jax.vmap": "jax.jit(jax.vmap(..., axis_name=...))",
    "torch.ddp": "torch DistributedDataParallel, 2 processes (gloo)",
    "torchpmap.1dev": "torchpmap.pmap on one device",
    "torchpmap.jit": "torchpmap.pmap(jit=True): traced once, compiled with torch.compile",
    JIT_1DEV: "torchpmap.pmap(jit=True) on one device",
}


def jit_baseline(name: str) -> bool:
    """Whether ``torchpmap.jit`` is compared with column ``name``: every column but
    torchpmap's own, and its compiled one-device column."""
    return name == JIT_1DEV or not name.startswith(SUBJECT)


@dataclasses.dataclass(frozen=True)
class NA:
    """A column without a number, and why."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Impl:
    """One column of one case.

    ``call`` runs the computation once and returns its output only when it is finished
    (it synchronizes). ``result`` turns an output into numpy arrays comparable with the
    reference column's; it is applied to the first output at once.
    """

    call: Callable[[], Any]
    result: Callable[[Any], Any] = lambda out: to_numpy(out)


Cell = Impl | NA


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings shared by every workload."""

    quick: bool
    device: torch.device

    @property
    def sync(self) -> Callable[[], None]:
        return torch.cuda.synchronize if self.device.type == "cuda" else _no_op


def _no_op() -> None:
    return None


@dataclasses.dataclass
class Case:
    """One row of the table.

    Attributes:
        workload: the name of the workload that built it.
        name: the row's label (a workload may have several rows, e.g. one per size).
        unit: what one time is for (``"call"``, ``"step"``, ``"instance"``).
        per: a call's time is divided by this (the instances, for time per instance).
        columns: the cells; columns left out are "does not apply".
        reference: the column whose result the others must match.
        rtol, atol: the tolerance of that match.
        external: for work that runs outside this process: returns the samples and
            results of its columns itself instead of handing over callables.
    """

    workload: str
    name: str
    unit: str
    columns: dict[str, Cell]
    per: int = 1
    reference: str = "torch"
    rtol: float = 1e-5
    atol: float = 1e-6
    external: Callable[[], ExternalResult] | None = None


@dataclasses.dataclass(frozen=True)
class ExternalResult:
    """What an external case measured: per-call samples and results of its columns,
    the columns it could not run, and the result they all must match."""

    samples: dict[str, list[float]]
    results: dict[str, Any]
    unavailable: dict[str, NA]
    expected: Any
    calls_per_sample: int = 1


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named family of cases. ``needs`` returns why it cannot run here, or None."""

    name: str
    description: str
    build: Callable[[Config], list[Case]]
    needs: Callable[[], str | None] = lambda: None


# --------------------------------------------------------------------------- results as numpy


def to_numpy(tree: Any) -> Any:
    """Tensors and arrays (torch, JAX, numpy) of a dict/list/tuple tree as numpy arrays."""
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_numpy(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    return np.asarray(tree)


def leaves(tree: Any) -> list[np.ndarray]:
    """The arrays of a numpy tree in a fixed order (dicts by sorted key)."""
    if isinstance(tree, dict):
        return [a for k in sorted(tree) for a in leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [a for v in tree for a in leaves(v)]
    return [np.asarray(tree)]


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest elementwise difference between two trees; inf if their shapes differ."""
    xs, ys = leaves(a), leaves(b)
    if len(xs) != len(ys) or any(x.shape != y.shape for x, y in zip(xs, ys)):
        return float("inf")
    return max((float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(xs, ys) if x.size), default=0.0)


def all_close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    xs, ys = leaves(a), leaves(b)
    if len(xs) != len(ys) or any(x.shape != y.shape for x, y in zip(xs, ys)):
        return False
    return all(np.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(xs, ys))
