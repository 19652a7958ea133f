"""The workloads, in table order. Each module defines ``WORKLOAD``."""

from __future__ import annotations

from torchpmap.bench.core import Workload
from torchpmap.bench.workloads import (
    dispatch,
    mixed_precision,
    multidevice,
    multiprocess,
    psum,
    real_models,
    scaling,
    training,
    transformer,
)

WORKLOADS: list[Workload] = [
    dispatch.WORKLOAD,
    training.WORKLOAD,
    psum.WORKLOAD,
    scaling.WORKLOAD,
    multiprocess.WORKLOAD,
    multidevice.WORKLOAD,
    mixed_precision.WORKLOAD,
    transformer.WORKLOAD,
    real_models.WORKLOAD,
]


def by_name(names: list[str]) -> list[Workload]:
    """The workloads named, in table order; ValueError for an unknown name."""
    known = {w.name for w in WORKLOADS}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {sorted(known)}")
    return [w for w in WORKLOADS if w.name in names]
