"""A data-parallel training step: torchpmap over processes vs DistributedDataParallel.

:func:`run_ddp_comparison` starts ``nproc`` local processes (gloo on CPU, NCCL with one
GPU per process), builds the same MLP twice in each (same initial parameters), and runs
the two steps interleaved on the same data:

* **torchpmap**: ``pmap(instance_step, axis_name="batch", in_axes=(None, 0, 0),
  out_axes=None)`` with ``torch.func.grad`` per instance and ``pmean`` of the gradients
  over all processes' instances, then ``optimizer.step()``;
* **DDP**: ``DistributedDataParallel(model)``, ``loss.backward()`` (bucketed all-reduce
  of the gradients), ``optimizer.step()``.

Each repetition times one step of each, in alternating order, every process starting
together (a barrier before each timed step, not counted); a step's time is the slowest
process' time. The report gives medians and the median of the per-repetition ratios,
and checks that both models went through the same updates (``max_param_diff``).

Run it on its own: ``python -m torchpmap.bench.ddp --nproc 2 --steps 20``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch

#: The model: an MLP ``features -> hidden -> hidden -> classes`` with cross-entropy.
FEATURES, HIDDEN, CLASSES = 64, 256, 10


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
) -> dict[str, Any]:
    """Times a data-parallel training step under torchpmap and under DDP, in ``nproc`` processes.

    Args:
        nproc: the number of processes (on CPU, gloo over loopback).
        steps: timed repetitions (one step of each column per repetition).
        warmup: untimed repetitions before.
        batch_per_process: samples per process per step (the global batch is
            ``nproc * batch_per_process``).
        instances_per_process: torchpmap instances per process (the process' samples are
            split among them and run vectorized); DDP has one replica per process.
        lr: SGD learning rate (both columns).
        timeout: seconds after which the processes are killed.
        jit: compile the torchpmap step (``pmap(..., jit=True)``, inductor).

    Returns:
        A dict: ``nproc``, ``steps``, ``warmup``, ``backend``, ``device``, ``model``,
        ``parameters``, ``global_batch``, ``torchpmap_ms`` / ``ddp_ms`` (medians),
        ``torchpmap_iqr_ms`` / ``ddp_iqr_ms``, ``ratio`` (median of the per-repetition
        ratios torchpmap / DDP), ``torchpmap_ms_all`` / ``ddp_ms_all`` (every sample),
        ``max_param_diff`` (largest difference between the two models' parameters at the
        end: both took the same steps) and ``loss`` (the last step's mean loss).

    Raises:
        RuntimeError: with the processes' output, when one of them fails.
    """
    from torchpmap._launch import launch

    if nproc < 2:
        raise ValueError(f"run_ddp_comparison: nproc must be at least 2, got {nproc}")
    if batch_per_process % instances_per_process:
        raise ValueError("run_ddp_comparison: batch_per_process must be divisible by instances_per_process")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        argv = [
            "-m", "torchpmap.bench.ddp", "--worker", report, "--steps", str(steps), "--warmup", str(warmup),
            "--batch-per-process", str(batch_per_process), "--instances-per-process", str(instances_per_process),
            "--lr", str(lr), "--timeout", str(timeout),
        ] + (["--jit"] if jit else [])
        finished = launch(argv, nproc, timeout=timeout)
        if any(f.returncode != 0 for f in finished) or not os.path.exists(report):
            logs = "\n".join(f"--- rank {f.rank} (exit code {f.returncode})\n{f.output[-4000:]}" for f in finished)
            raise RuntimeError(f"run_ddp_comparison: a process failed\n{logs}")
        with open(report) as f:
            return json.load(f)


# --------------------------------------------------------------------------- inside each process


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def _iqr(samples: list[float]) -> float:
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q3 - q1


def _worker(
    report: str, steps: int, warmup: int, batch_per_process: int, instances: int, lr: float, timeout: float, jit: bool
) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.func import functional_call, grad_and_value

    import torchpmap as tp
    import torchpmap.distributed as tpd
    from torchpmap.training import shard

    tpd.initialize(timeout=datetime.timedelta(seconds=timeout))
    rank, nproc = tp.process_index(), tp.process_count()
    device = tp.local_devices()[0].torch_device

    torch.manual_seed(0)
    tp_model = _model().to(device)
    ddp_module = copy.deepcopy(tp_model)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_module, device_ids=[device.index] if device.type == "cuda" else None)
    tp_opt = torch.optim.SGD(tp_model.parameters(), lr=lr)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=lr)

    def loss_fn(params, x, y):
        return F.cross_entropy(functional_call(tp_model, params, (x,)), y)

    def instance_step(params, x, y):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        return tp.pmean((grads, loss), "batch")  # one exchange, as DDP's one bucketed all-reduce

    p_step = tp.pmap(instance_step, axis_name="batch", in_axes=(None, 0, 0), out_axes=None, jit=jit)

    def torchpmap_step(x, y):
        params = {k: p.detach() for k, p in tp_model.named_parameters()}
        grads, loss = p_step(params, *shard((x, y), instances))
        for k, p in tp_model.named_parameters():
            p.grad = grads[k]
        tp_opt.step()
        return loss

    def ddp_step(x, y):
        ddp_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        ddp_opt.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    g = torch.Generator().manual_seed(1)
    columns = {"torchpmap": torchpmap_step, "ddp": ddp_step}
    times: dict[str, list[float]] = {k: [] for k in columns}
    loss = None
    for rep in range(warmup + steps):
        # the global batch of this repetition, the same in every process; each takes its share
        x = torch.randn(nproc * batch_per_process, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (nproc * batch_per_process,), generator=g)
        mine = slice(rank * batch_per_process, (rank + 1) * batch_per_process)
        x, y = x[mine].to(device), y[mine].to(device)
        order = list(columns) if rep % 2 == 0 else list(reversed(columns))
        for name in order:
            dist.barrier()
            sync()
            start = time.perf_counter()
            out = columns[name](x, y)
            sync()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
            if name == "torchpmap":
                loss = float(out)
    # a step lasts as long as its slowest process
    stacked = torch.tensor([times["torchpmap"], times["ddp"]], dtype=torch.float64, device=device)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    tp_s, ddp_s = stacked[0].tolist(), stacked[1].tolist()
    diff = max(
        (a.detach() - b.detach()).abs().max().item() for a, b in zip(tp_model.parameters(), ddp_module.parameters())
    )
    if rank == 0:
        ms = lambda v: [round(t * 1e3, 4) for t in v]  # noqa: E731
        result = {
            "nproc": nproc,
            "steps": steps,
            "warmup": warmup,
            "backend": str(dist.get_backend()),
            "device": str(device),
            "model": f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, cross-entropy, SGD(lr={lr})",
            "parameters": sum(p.numel() for p in tp_model.parameters()),
            "global_batch": nproc * batch_per_process,
            "instances_per_process": instances,
            "jit": jit,
            "torchpmap_ms": statistics.median(tp_s) * 1e3,
            "ddp_ms": statistics.median(ddp_s) * 1e3,
            "torchpmap_iqr_ms": _iqr(tp_s) * 1e3,
            "ddp_iqr_ms": _iqr(ddp_s) * 1e3,
            "ratio": statistics.median(a / b for a, b in zip(tp_s, ddp_s)),
            "torchpmap_ms_all": ms(tp_s),
            "ddp_ms_all": ms(ddp_s),
            "max_param_diff": diff,
            "loss": loss,
        }
        with open(report + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(report + ".tmp", report)
    tpd.shutdown()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="torchpmap vs DistributedDataParallel, data-parallel MLP step")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-per-process", type=int, default=128)
    parser.add_argument("--instances-per-process", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--jit", action="store_true", help="compile the torchpmap step (pmap(jit=True))")
    parser.add_argument("--worker", metavar="REPORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(
            args.worker, args.steps, args.warmup, args.batch_per_process, args.instances_per_process, args.lr,
            args.timeout, args.jit,
        )
        return
    result = run_ddp_comparison(
        args.nproc, args.steps, warmup=args.warmup, batch_per_process=args.batch_per_process,
        instances_per_process=args.instances_per_process, lr=args.lr, timeout=args.timeout, jit=args.jit,
    )
    short = {k: v for k, v in result.items() if not k.endswith("_all")}
    json.dump(short, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
