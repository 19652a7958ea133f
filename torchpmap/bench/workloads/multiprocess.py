"""(e) Multi-process data parallelism: the MLP step of (b) in 2 processes, torchpmap vs DDP.

Each of the 2 CPU processes (gloo) holds 4 of the 8 instances (4 x 64 samples). The
columns are timed interleaved inside the processes, in lockstep (a fixed number of
steps per sample and of repetitions, so that every collective has its partner), and
rank 0 reports.

The torchpmap columns call ``torchpmap.distributed.initialize()`` once
``torch.distributed`` is initialized, after which a pmap's axis spans all processes and
each process passes its own instances; ``torchpmap.jit`` is the same step with
``jit=True`` (each process runs its slice as a compiled program).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from torchpmap.bench import frameworks as fw
from torchpmap.bench import timing
from torchpmap.bench.core import NA, Case, Cell, Config, ExternalResult, Impl, Workload, to_numpy
from torchpmap.bench.workloads import _mlp

PROCESSES = 2
COLUMNS = ("torchpmap", "torchpmap.jit", "torch.ddp")
_CPU = Config(quick=True, device=torch.device("cpu"))


def needs() -> str | None:
    if not torch.distributed.is_available():
        return "needs torch.distributed"
    if importlib.util.find_spec("torchpmap.distributed") is None:
        return "needs torchpmap.distributed"
    return None


def build(cfg: Config) -> list[Case]:
    plan = _plan(cfg)
    return [
        Case(
            "distributed",
            f"distributed[{PROCESSES} proc]",
            "step",
            {},
            rtol=1e-4,
            atol=1e-5,
            external=lambda: run_processes(plan, COLUMNS),
        )
    ]


#: Steps per sample, the same in every process (lockstep): a sample of several steps
#: averages out the jitter of one step's exchange (a step is a few ms on CPU).
STEPS_PER_SAMPLE = 8


def _plan(cfg: Config) -> timing.Plan:
    return timing.Plan(reps=7, warmup=2) if cfg.quick else timing.Plan(reps=41, warmup=5)


def run_processes(plan: timing.Plan, columns: Sequence[str]) -> ExternalResult:
    """Runs the columns in ``PROCESSES`` fresh processes and collects rank 0's report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.pkl")
        args = (f"file://{os.path.join(tmp, 'store')}", plan, tuple(columns), report)
        torch.multiprocessing.spawn(_worker, args=args, nprocs=PROCESSES, join=True)
        with open(report, "rb") as f:
            samples, calls, results, unavailable = pickle.load(f)
    params = _mlp.init_params(_CPU.device)
    expected = to_numpy(_mlp.plain_step(params, *_mlp.flatten_batch(*_mlp.make_data(_CPU.device))))
    return ExternalResult(samples, results, {k: NA(v) for k, v in unavailable.items()}, expected, calls)


def _worker(rank: int, init_method: str, plan: timing.Plan, columns: tuple[str, ...], report: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PROCESSES))
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=PROCESSES)
    try:
        _measure_columns(rank, plan, columns, report)
    finally:
        # The columns are gone with _measure_columns' frame, but a DistributedDataParallel
        # sits in reference cycles: collect it now, while its process group lives. Left to
        # the interpreter's exit, its reducer is destroyed after the group and the process
        # aborts ("terminate called without an active exception"): 10 runs in 80 of plain
        # torch 2.13.0 DDP over gloo, none in 80 with this collection.
        gc.collect()
        # torchpmap's side first (its fault watch uses this group's store), then the group.
        importlib.import_module("torchpmap.distributed").shutdown()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _measure_columns(rank: int, plan: timing.Plan, columns: tuple[str, ...], report: str) -> None:
    cells = {name: _BUILDERS[name](rank) for name in columns}
    impls = {name: c for name, c in cells.items() if isinstance(c, Impl)}
    results = {name: impl.result(impl.call()) for name, impl in impls.items()}
    calls = 1 if plan.reps < 10 else STEPS_PER_SAMPLE  # quick mode: one step per sample
    measured = timing.measure({name: impl.call for name, impl in impls.items()}, plan, calls_per_sample=calls)
    if rank == 0:
        unavailable = {name: c.reason for name, c in cells.items() if isinstance(c, NA)}
        with open(report, "wb") as f:
            pickle.dump((measured.samples, calls, results, unavailable), f)


def _local_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    per = _mlp.INSTANCES // PROCESSES
    x, y = _mlp.make_data(_CPU.device)
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _torchpmap_column(rank: int, jit: bool = False) -> Cell:
    distributed = importlib.import_module("torchpmap.distributed")
    initialize = getattr(distributed, "initialize", None)
    if initialize is None:
        return NA("torchpmap.distributed has no initialize()")
    initialize()
    return fw.torch_impl(_CPU, _mlp.torchpmap_step(jit=jit), _mlp.init_params(_CPU.device), *_local_data(rank))


def _ddp_column(rank: int) -> Cell:
    model = _sequential(_mlp.init_params(_CPU.device))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=_mlp.LR)
    x, y = _mlp.flatten_batch(*_local_data(rank))

    def step() -> torch.nn.Sequential:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        return model

    return Impl(step, _params_of)


def _sequential(params: _mlp.Params) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for k in range(1, len(_mlp.SIZES)):
        w, b = params[f"w{k}"], params[f"b{k}"]
        linear = torch.nn.Linear(*w.shape)
        with torch.no_grad():
            linear.weight.copy_(w.T)
            linear.bias.copy_(b)
        layers += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _params_of(model: torch.nn.Sequential) -> dict[str, Any]:
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    out: dict[str, Any] = {}
    for k, linear in enumerate(linears, start=1):
        out[f"w{k}"] = linear.weight.detach().T.numpy().copy()
        out[f"b{k}"] = linear.bias.detach().numpy().copy()
    return out


_BUILDERS: dict[str, Callable[[int], Cell]] = {
    "torchpmap": _torchpmap_column,
    "torchpmap.jit": lambda rank: _torchpmap_column(rank, jit=True),
    "torch.ddp": _ddp_column,
}

WORKLOAD = Workload(
    "distributed",
    f"the MLP step in {PROCESSES} processes: torchpmap.distributed vs DistributedDataParallel",
    build,
    needs,
)
