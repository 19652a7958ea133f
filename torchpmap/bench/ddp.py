"""A data-parallel training step: torchpmap over processes vs DistributedDataParallel.

:func:`run_ddp_comparison` starts ``nproc`` processes (gloo on CPU, NCCL with one GPU
per process; local by default, or one per simulated host, see
:mod:`torchpmap.bench.cluster`), builds the same MLP in each column (same initial
parameters), and runs the columns interleaved on the same data:

* ``torchpmap``: :func:`torchpmap.training.data_parallel_step` (``torch.func.grad`` per
  instance inside a pmap over all processes' instances, the ``pmean`` of the gradients,
  ``optimizer.step()``); with one instance per process its all-reduce starts bucket by
  bucket during the backward, as DDP's;
* ``torchpmap.jit``: the same with ``jit=True`` (one all-reduce after the backward);
* ``torchpmap.by_hand``: the step written by hand, ``pmap(instance_step, axis_name="batch",
  in_axes=(None, 0, 0), out_axes=None)`` with ``torch.func.grad`` per instance and
  ``pmean`` of the gradients, then ``optimizer.step()``: the same math, its exchange
  started only once ``grad`` has returned every gradient (against ``torchpmap``: what
  the overlap gains);
* ``ddp``: ``DistributedDataParallel(model)``, ``loss.backward()`` (bucketed all-reduce
  of the gradients, overlapped with the backward), ``optimizer.step()``;
* ``compute``: the same step on the process' shard with no exchange at all (what a step
  would cost if the network were free);
* ``allreduce``: one ``all_reduce`` of as many float32 values as the model has
  parameters, alone (what the exchange costs if nothing overlaps it);
* ``pmean``: torchpmap's ``pmean`` of the same values over the processes, alone (its
  exchange against torch's all-reduce).

Each repetition times one step of each column, in rotating order, every process
starting together (a barrier before each timed step, not counted); a step's time is the
slowest process' time. The report gives medians, the median of the per-repetition ratios
to DDP, and checks that the training columns went through the same updates
(``max_param_diff``).

Run it on its own: ``python -m torchpmap.bench.ddp --nproc 2 --steps 20``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from torchpmap.bench.interleaved import run_workers, summary, time_columns, write_report
from torchpmap.bench.launch import Host

#: The default model: an MLP ``features -> hidden -> hidden -> classes`` with cross-entropy.
FEATURES, HIDDEN, CLASSES = 64, 256, 10
#: The columns a comparison can time (see the module docstring).
COLUMNS = (
    "torchpmap", "torchpmap.jit", "torchpmap.by_hand", "ddp", "compute", "allreduce", "pmean",
    "torchpmap.fsdp", "fsdp2",
)
_TRAINING = ("torchpmap", "torchpmap.jit", "torchpmap.by_hand", "ddp", "compute", "torchpmap.fsdp", "fsdp2")


def run_ddp_comparison(
    nproc: int = 2,
    steps: int = 20,
    *,
    warmup: int = 3,
    batch_per_process: int = 128,
    instances_per_process: int = 1,
    lr: float = 0.1,
    timeout: float = 600.0,
    jit: bool = False,
    columns: Sequence[str] | None = None,
    sizes: tuple[int, int, int] = (FEATURES, HIDDEN, CLASSES),
    hosts: Callable[[int], Host] | None = None,
    master_addr: str = "127.0.0.1",
) -> dict[str, Any]:
    """Times a data-parallel training step under torchpmap and under DDP, in ``nproc`` processes.

    Args:
        nproc: the number of processes (on CPU, gloo over loopback unless ``hosts`` says otherwise).
        steps: timed repetitions (one step of each column per repetition).
        warmup: untimed repetitions before.
        batch_per_process: samples per process per step (the global batch is
            ``nproc * batch_per_process``).
        instances_per_process: torchpmap instances per process (the process' samples are
            split among them and run vectorized); DDP has one replica per process.
        lr: SGD learning rate (every training column).
        timeout: seconds after which the processes are killed.
        jit: with the default columns, compile the torchpmap step (``pmap(..., jit=True)``).
        columns: which of :data:`COLUMNS` to time (default: ``torchpmap`` or
            ``torchpmap.jit``, and ``ddp``).
        sizes: the MLP's (features, hidden, classes).
        hosts: where each rank runs (:class:`torchpmap.bench.launch.Host`); default: here.
        master_addr: rank 0's address, where the others meet it.

    Returns:
        A dict: ``nproc``, ``steps``, ``warmup``, ``backend``, ``device``, ``model``,
        ``parameters``, ``global_batch``, ``columns`` (per column: ``ms`` median, ``iqr_ms``,
        ``ratio_to_ddp`` (median of the per-repetition ratios, when ``ddp`` ran), ``all_ms``
        every sample), ``max_param_diff`` (largest difference between the training
        columns' parameters at the end: all took the same steps) and ``loss`` (the last
        step's mean loss). For the default columns also ``torchpmap_ms``, ``ddp_ms`` and
        ``ratio``, as before.

    Raises:
        RuntimeError: with the processes' output, when one of them fails.
    """
    chosen = list(columns) if columns is not None else ["torchpmap.jit" if jit else "torchpmap", "ddp"]
    unknown = sorted(set(chosen) - set(COLUMNS))
    if unknown:
        raise ValueError(f"run_ddp_comparison: unknown columns {unknown}; choose from {list(COLUMNS)}")
    if nproc < 2:
        raise ValueError(f"run_ddp_comparison: nproc must be at least 2, got {nproc}")
    if batch_per_process % instances_per_process:
        raise ValueError("run_ddp_comparison: batch_per_process must be divisible by instances_per_process")
    args = [
        "--steps", str(steps), "--warmup", str(warmup), "--batch-per-process", str(batch_per_process),
        "--instances-per-process", str(instances_per_process), "--lr", str(lr), "--timeout", str(timeout),
        "--columns", ",".join(chosen), "--sizes", ",".join(map(str, sizes)),
    ]
    result = run_workers("torchpmap.bench.ddp", args, nproc, timeout=timeout, hosts=hosts, master_addr=master_addr,
                         what="run_ddp_comparison")
    first = next((c for c in chosen if c.startswith("torchpmap")), None)
    if first is not None and "ddp" in chosen:  # the keys of the two-column comparison
        result.update(
            torchpmap_ms=result["columns"][first]["ms"], ddp_ms=result["columns"]["ddp"]["ms"],
            ratio=result["columns"][first]["ratio_to_ddp"],
        )
    return result


# --------------------------------------------------------------------------- inside each process


def _model(sizes: tuple[int, int, int]) -> torch.nn.Module:
    features, hidden, classes = sizes
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


def _worker(
    report: str, steps: int, warmup: int, batch_per_process: int, instances: int, lr: float, timeout: float,
    names: Sequence[str], sizes: tuple[int, int, int],
) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.func import functional_call, grad_and_value

    import torchpmap as tp
    import torchpmap.distributed as tpd
    from torchpmap.training import ShardedStep, data_parallel_step, shard

    tpd.initialize(timeout=datetime.timedelta(seconds=timeout))
    rank, nproc = tp.process_index(), tp.process_count()
    device = tp.local_devices()[0].torch_device
    torch.manual_seed(0)
    initial = _model(sizes).to(device)
    models = {name: copy.deepcopy(initial) for name in names if name in _TRAINING}

    def torchpmap_column(jit: bool) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        model = models["torchpmap.jit" if jit else "torchpmap"]
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        step = data_parallel_step(model, F.cross_entropy, opt, jit=jit)
        return lambda x, y: step(shard((x, y), instances))

    gather_at_end: dict[str, Callable[[], None]] = {}  # the sharded columns: full parameters back into the module

    def sharded_column() -> Callable[[torch.Tensor, torch.Tensor], Any]:
        model = models["torchpmap.fsdp"]
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        step = cast(ShardedStep, data_parallel_step(model, F.cross_entropy, opt, shard_params=True))
        gather_at_end["torchpmap.fsdp"] = step.gather_params
        return lambda x, y: step(shard((x, y), instances))

    def fully_sharded(module: torch.nn.Module) -> None:
        """FSDP2 on ``module``: each Linear its own unit (gathered when used), then the root."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (nproc,))
        for layer in module.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)

        def full_parameters() -> None:
            with torch.no_grad():
                for p in module.parameters():
                    p.full = p.full_tensor()  # type: ignore[attr-defined]

        gather_at_end["fsdp2"] = full_parameters

    def by_hand_column() -> Callable[[torch.Tensor, torch.Tensor], Any]:
        model = models["torchpmap.by_hand"]
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, params, (x,)), y)

        def instance_step(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
            grads, loss = grad_and_value(loss_fn)(params, x, y)
            return tp.pmean((grads, loss), "batch")  # one exchange, after the backward

        p_step = tp.pmap(instance_step, axis_name="batch", in_axes=(None, 0, 0), out_axes=None)

        def step(x: torch.Tensor, y: torch.Tensor) -> Any:
            params = {k: p.detach() for k, p in model.named_parameters()}
            grads, loss = p_step(params, *shard((x, y), instances))
            for k, p in model.named_parameters():
                p.grad = grads[k]
            opt.step()
            return loss

        return step

    def plain_column(name: str) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        module = models[name]
        net = module
        if name == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None
            )
        elif name == "fsdp2":
            fully_sharded(module)  # in place: its parameters become DTensors before the optimizer sees them
        opt = torch.optim.SGD(net.parameters(), lr=lr)

        def step(x: torch.Tensor, y: torch.Tensor) -> Any:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    flat = torch.zeros(sum(p.numel() for p in initial.parameters()), device=device)

    def allreduce(x: torch.Tensor, y: torch.Tensor) -> None:
        dist.all_reduce(flat)
        return None

    mean_over_processes = tp.pmap(lambda v: tp.pmean(v, "batch"), axis_name="batch")

    def pmean(x: torch.Tensor, y: torch.Tensor) -> Any:
        return mean_over_processes(flat[None])

    builders = {
        "torchpmap": lambda: torchpmap_column(False), "torchpmap.jit": lambda: torchpmap_column(True),
        "torchpmap.by_hand": by_hand_column,
        "ddp": lambda: plain_column("ddp"), "compute": lambda: plain_column("compute"), "allreduce": lambda: allreduce,
        "pmean": lambda: pmean, "torchpmap.fsdp": sharded_column, "fsdp2": lambda: plain_column("fsdp2"),
    }
    columns = {name: builders[name]() for name in names}

    g = torch.Generator().manual_seed(1)
    features, _, classes = sizes

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        # the global batch of this repetition, the same in every process; each takes its share
        x = torch.randn(nproc * batch_per_process, features, generator=g)
        y = torch.randint(0, classes, (nproc * batch_per_process,), generator=g)
        mine = slice(rank * batch_per_process, (rank + 1) * batch_per_process)
        return x[mine].to(device), y[mine].to(device)

    seconds, loss = time_columns(
        columns, batch, warmup=warmup, steps=steps, device=device, keeps_loss=lambda name: name.startswith("torchpmap")
    )
    for gather in gather_at_end.values():
        gather()

    def full(p: torch.Tensor) -> torch.Tensor:
        return getattr(p, "full", p).detach()  # FSDP2's DTensor: its full_tensor(), gathered above

    trained = [m for name, m in models.items() if name != "compute"]
    diff = max(
        (
            (full(a) - full(b)).abs().max().item()
            for other in trained[1:]
            for a, b in zip(trained[0].parameters(), other.parameters())
        ),
        default=0.0,
    )
    if rank == 0:
        per_column = summary(seconds, "ddp", "ratio_to_ddp")
        result = {
            "nproc": nproc,
            "steps": steps,
            "warmup": warmup,
            "backend": str(dist.get_backend()),
            "device": str(device),
            "model": f"MLP {sizes[0]}-{sizes[1]}-{sizes[1]}-{sizes[2]}, cross-entropy, SGD(lr={lr})",
            "parameters": flat.numel(),
            "global_batch": nproc * batch_per_process,
            "instances_per_process": instances,
            "columns": per_column,
            "max_param_diff": diff,
            "loss": loss,
        }
        write_report(report, result)
    # DistributedDataParallel sits in reference cycles: collect it while its process group
    # lives, or the interpreter's exit may destroy its reducer after the group and abort
    # the process (see torchpmap/bench/workloads/multiprocess.py).
    del columns, builders
    gc.collect()
    tpd.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="torchpmap vs DistributedDataParallel, data-parallel MLP step")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-per-process", type=int, default=128)
    parser.add_argument("--instances-per-process", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--jit", action="store_true", help="compile the torchpmap step (pmap(jit=True))")
    parser.add_argument("--columns", help=f"comma-separated, from {','.join(COLUMNS)}")
    parser.add_argument("--sizes", default=f"{FEATURES},{HIDDEN},{CLASSES}", help="the MLP's features,hidden,classes")
    parser.add_argument("--worker", metavar="REPORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = cast("tuple[int, int, int]", tuple(int(v) for v in args.sizes.split(",")))
    columns = args.columns.split(",") if args.columns else None
    if args.worker:
        _worker(
            args.worker, args.steps, args.warmup, args.batch_per_process, args.instances_per_process, args.lr,
            args.timeout, columns or [], sizes,
        )
        return
    result = run_ddp_comparison(
        args.nproc, args.steps, warmup=args.warmup, batch_per_process=args.batch_per_process,
        instances_per_process=args.instances_per_process, lr=args.lr, timeout=args.timeout, jit=args.jit,
        columns=columns, sizes=sizes,
    )
    for column in result["columns"].values():
        column.pop("all_ms")
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
