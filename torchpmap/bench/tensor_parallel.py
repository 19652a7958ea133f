"""A tensor-parallel MLP step: torchpmap's shard_map over processes vs PyTorch's DTensor TP.

:func:`run_tp_comparison` starts ``nproc`` processes (gloo on CPU, NCCL with one GPU per
process; local by default, or one per simulated host, see :mod:`torchpmap.bench.cluster`).
Every process sees the whole batch; the MLP ``features -> hidden -> classes`` is split
Megatron-style over a ``model`` axis of all the processes: the first layer by its output
features (columns), the second by its input features (rows), so that the only exchange
of the forward is the all-reduce of the second layer's partial outputs. The columns, run
interleaved on the same data from the same initial parameters:

* ``torchpmap.tp``: the step written with :func:`torchpmap.shard_map` on a torch
  ``DeviceMesh``: ``torch.func.grad_and_value`` of the loss of the blocks (``psum`` over
  ``model`` of the partial outputs), SGD on the blocks, DTensors in and out;
* ``dtensor.tp``: ``parallelize_module`` with ``ColwiseParallel`` and ``RowwiseParallel``,
  ``loss.backward()``, ``torch.optim.SGD``;
* ``single``: the whole model in each process, the plain step with no exchange (one
  device's step: what TP splits).

Each repetition times one step of each column, in rotating order, all processes starting
together; a step's time is the slowest process'. The report gives medians, the median of
the per-repetition ratios to ``dtensor.tp``, and ``max_param_diff``: the largest
difference between the columns' full parameters at the end (all took the same steps).

Run it on its own: ``python -m torchpmap.bench.tensor_parallel --nproc 2 --steps 10``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from torchpmap._placement.dtensor import placements_for
from torchpmap.bench.interleaved import run_workers, summary, time_columns, write_report
from torchpmap.bench.launch import Host

#: The default MLP: features -> hidden -> classes, the hidden layer split over the processes
#: (3072: 2, 3 or 4 of them).
SIZES = (512, 3072, 512)
#: The columns (see the module docstring).
COLUMNS = ("torchpmap.tp", "dtensor.tp", "single")


def run_tp_comparison(
    nproc: int = 2,
    steps: int = 10,
    *,
    warmup: int = 2,
    batch: int = 128,
    lr: float = 0.1,
    timeout: float = 600.0,
    columns: Sequence[str] = COLUMNS,
    sizes: tuple[int, int, int] = SIZES,
    hosts: Callable[[int], Host] | None = None,
    master_addr: str = "127.0.0.1",
) -> dict[str, Any]:
    """Times a tensor-parallel MLP step under torchpmap's shard_map and under DTensor TP.

    Args:
        nproc: processes, one position of the ``model`` axis each; it must divide ``hidden``.
        steps: timed repetitions (one step of each column per repetition); ``warmup``
            untimed ones before.
        batch: samples per step, the same in every process.
        lr: the SGD learning rate of every column.
        timeout: seconds after which the processes are killed.
        columns: which of :data:`COLUMNS` to time.
        sizes: the MLP's (features, hidden, classes).
        hosts, master_addr: where each rank runs and where they meet (see
            :func:`torchpmap.bench.ddp.run_ddp_comparison`).

    Returns:
        A dict: ``nproc``, ``steps``, ``backend``, ``device``, ``model``, ``batch``,
        ``columns`` (per column: ``ms``, ``iqr_ms``, ``all_ms``, and ``ratio_to_dtensor``
        when ``dtensor.tp`` ran), ``max_param_diff`` and ``loss`` (torchpmap's last).

    Raises:
        ValueError: unknown columns, fewer than 2 processes, or ``nproc`` not dividing ``hidden``.
        RuntimeError: with the processes' output, when one of them fails.
    """
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        raise ValueError(f"run_tp_comparison: unknown columns {unknown}; choose from {list(COLUMNS)}")
    if nproc < 2:
        raise ValueError(f"run_tp_comparison: nproc must be at least 2, got {nproc}")
    if sizes[1] % nproc:
        raise ValueError(f"run_tp_comparison: nproc ({nproc}) must divide the hidden size ({sizes[1]})")
    args = [
        "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch), "--lr", str(lr), "--timeout",
        str(timeout), "--columns", ",".join(columns), "--sizes", ",".join(map(str, sizes)),
    ]
    return run_workers("torchpmap.bench.tensor_parallel", args, nproc, timeout=timeout, hosts=hosts,
                       master_addr=master_addr, what="run_tp_comparison")


# --------------------------------------------------------------------------- inside each process


def _model(sizes: tuple[int, int, int]) -> torch.nn.Sequential:
    features, hidden, classes = sizes
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


#: The blocks of torchpmap's column, named after the Sequential's parameters, and their specs.
_NAMES = {"w1": "0.weight", "b1": "0.bias", "w2": "2.weight", "b2": "2.bias"}


def _worker(
    report: str, steps: int, warmup: int, batch_size: int, lr: float, timeout: float, names: Sequence[str],
    sizes: tuple[int, int, int],
) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torchpmap as tp
    import torchpmap.distributed as tpd

    tpd.initialize(timeout=datetime.timedelta(seconds=timeout))
    rank, nproc = tp.process_index(), tp.process_count()
    device = tp.local_devices()[0].torch_device
    mesh = tpd.mesh((nproc,), ("model",))
    torch.manual_seed(0)
    initial = _model(sizes).to(device)
    P = tp.P
    specs = {"w1": P("model"), "b1": P("model"), "w2": P(None, "model"), "b2": P()}
    full: dict[str, Callable[[], dict[str, torch.Tensor]]] = {}  # each column's full parameters, at the end

    def torchpmap_column() -> Callable[[torch.Tensor, torch.Tensor], Any]:
        state = {
            k: distribute_tensor(initial.get_parameter(name).detach().clone(), mesh.device_mesh,
                                 placements_for(specs[k], mesh, "tensor_parallel"))
            for k, name in _NAMES.items()
        }

        def loss_of(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.relu(x @ p["w1"].T + p["b1"])  # this position's hidden features
            return F.cross_entropy(tp.psum(h @ p["w2"].T, "model") + p["b2"], y)

        def blocks(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
            grads, loss = torch.func.grad_and_value(loss_of)(p, x, y)
            return {k: p[k] - lr * grads[k] for k in p}, loss

        step = tp.shard_map(blocks, mesh=mesh.device_mesh, in_specs=(specs, P(), P()), out_specs=(specs, P()))

        def run(x: torch.Tensor, y: torch.Tensor) -> Any:
            new, loss = step(state, x, y)
            state.update(new)
            return loss.to_local() if hasattr(loss, "to_local") else loss

        full["torchpmap.tp"] = lambda: {_NAMES[k]: v.full_tensor() for k, v in state.items()}
        return run

    def module_column(name: str) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        module: torch.nn.Module = copy.deepcopy(initial)
        if name == "dtensor.tp":
            module = parallelize_module(module, mesh.device_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(module.parameters(), lr=lr)

        def run(x: torch.Tensor, y: torch.Tensor) -> Any:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(module(x), y)
            loss.backward()
            opt.step()
            return loss

        full[name] = lambda: {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in module.named_parameters()
        }
        return run

    builders = {"torchpmap.tp": torchpmap_column, "dtensor.tp": lambda: module_column("dtensor.tp"),
                "single": lambda: module_column("single")}
    columns = {name: builders[name]() for name in names}

    g = torch.Generator().manual_seed(1)
    features, _, classes = sizes

    def batch() -> tuple[torch.Tensor, torch.Tensor]:  # the same batch in every process
        return (torch.randn(batch_size, features, generator=g).to(device),
                torch.randint(0, classes, (batch_size,), generator=g).to(device))

    seconds, loss = time_columns(
        columns, batch, warmup=warmup, steps=steps, device=device, keeps_loss=lambda name: name == "torchpmap.tp"
    )
    params = {name: full[name]() for name in columns}
    first, *others = list(params.values())
    diff = max(((first[k] - other[k]).abs().max().item() for other in others for k in first), default=0.0)
    if rank == 0:
        per_column = summary(seconds, "dtensor.tp", "ratio_to_dtensor")
        result = {
            "nproc": nproc,
            "steps": steps,
            "warmup": warmup,
            "backend": str(dist.get_backend()),
            "device": str(device),
            "model": f"MLP {sizes[0]}-{sizes[1]}-{sizes[2]} (hidden split over {nproc} processes), cross-entropy, "
                     f"SGD(lr={lr})",
            "batch": batch_size,
            "columns": per_column,
            "max_param_diff": diff,
            "loss": loss,
        }
        write_report(report, result)
    tpd.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="torchpmap shard_map vs DTensor tensor parallelism, an MLP step")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--columns", help=f"comma-separated, from {','.join(COLUMNS)}")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="the MLP's features,hidden,classes")
    parser.add_argument("--worker", metavar="REPORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = cast("tuple[int, int, int]", tuple(int(v) for v in args.sizes.split(",")))
    columns = args.columns.split(",") if args.columns else list(COLUMNS)
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.batch, args.lr, args.timeout, columns, sizes)
        return
    result = run_tp_comparison(
        args.nproc, args.steps, warmup=args.warmup, batch=args.batch, lr=args.lr, timeout=args.timeout,
        columns=columns, sizes=sizes,
    )
    for column in result["columns"].values():
        column.pop("all_ms")
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
