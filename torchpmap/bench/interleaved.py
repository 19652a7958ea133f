"""Timing several training columns side by side in a group of processes.

The multi-process comparisons (:mod:`torchpmap.bench.ddp`, :mod:`torchpmap.bench.tensor_parallel`)
build one step function per column in every process, then call :func:`time_columns`: each
repetition draws a batch and times one step of every column, in an order that rotates with
the repetition, all processes starting each step together (a barrier, not counted); a
step's time is the slowest process'. :func:`summary` turns the samples into the report's
per-column entries, which process 0 writes (:func:`write_report`) and the launcher reads
(:func:`run_workers`).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from torchpmap.bench.launch import Host, launch

#: One column's step: ``(x, y) -> its loss`` (or anything: only the torchpmap columns' loss is kept).
Step = Callable[[torch.Tensor, torch.Tensor], Any]


def time_columns(
    columns: Mapping[str, Step],
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    *,
    warmup: int,
    steps: int,
    device: torch.device,
    keeps_loss: Callable[[str], bool],
) -> tuple[dict[str, list[float]], float | None]:
    """Per column, its ``steps`` timed seconds (the slowest process' per repetition), and
    the last loss of a column ``keeps_loss`` names. ``batch()`` gives each repetition's
    batch, drawn the same way in every process."""
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {k: [] for k in columns}
    loss = None
    names = list(columns)
    for rep in range(warmup + steps):
        x, y = batch()
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            dist.barrier()
            sync()
            start = time.perf_counter()
            out = columns[name](x, y)
            sync()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
            if keeps_loss(name):
                loss = float(out)
    stacked = torch.tensor([times[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest process
    return dict(zip(names, stacked.tolist())), loss


def iqr(samples: list[float]) -> float:
    """The inter-quartile range (0 for fewer than 2 samples)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q3 - q1


def summary(seconds: Mapping[str, list[float]], reference: str, ratio_key: str) -> dict[str, dict[str, Any]]:
    """Per column: ``ms`` (median), ``iqr_ms``, ``all_ms`` (every sample) and, when the
    ``reference`` column ran, ``ratio_key``: the median of the per-repetition ratios to it."""
    out: dict[str, dict[str, Any]] = {}
    for name, samples in seconds.items():
        out[name] = {
            "ms": statistics.median(samples) * 1e3,
            "iqr_ms": iqr(samples) * 1e3,
            "all_ms": [round(t * 1e3, 4) for t in samples],
        }
        if reference in seconds:
            out[name][ratio_key] = statistics.median(a / b for a, b in zip(samples, seconds[reference]))
    return out


def run_workers(
    module: str, args: Sequence[str], nproc: int, *, timeout: float, hosts: Callable[[int], Host] | None,
    master_addr: str, what: str,
) -> dict[str, Any]:
    """Runs ``python -m module --worker REPORT *args`` in ``nproc`` processes and returns
    the report process 0 wrote; RuntimeError with the processes' output when one failed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        os.chmod(tmp, 0o777)  # a worker in another namespace runs as the same user
        finished = launch(["-m", module, "--worker", report, *args], nproc, timeout=timeout, hosts=hosts,
                          master_addr=master_addr)
        if any(f.returncode != 0 for f in finished) or not os.path.exists(report):
            logs = "\n".join(f"--- rank {f.rank} (exit code {f.returncode})\n{f.output[-4000:]}" for f in finished)
            raise RuntimeError(f"{what}: a process failed\n{logs}")
        with open(report) as f:
            return cast("dict[str, Any]", json.load(f))


def write_report(path: str, result: Mapping[str, Any]) -> None:
    """Writes ``result`` as JSON to ``path``, complete when it appears."""
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
