"""Part ``host-sync``: a warmed data-parallel step makes no host synchronisation, eager and
compiled, in three set-ups:

* one device (no exchange);
* 2 processes over gloo with CUDA tensors, both on the one GPU;
* NCCL with a single process (NCCL refuses two processes on one GPU; with
  ``TORCHPMAP_SINGLE_PROCESS_GROUP=1`` the process group of one still runs every exchange).

Each step runs twice under ``torch.cuda.set_sync_debug_mode("warn")``, which lists every
synchronisation with where it came from, then once under ``"error"``, where one would
raise. A positive control (``.item()``) shows that the watch sees a synchronisation.
"""
from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import torchpmap as tp
from torchpmap.bench.gpu_check.outcome import RESULT_ENV, Findings
from torchpmap.bench.gpu_check.programs.common import (
    SYNC_WARNING,
    Recorder,
    describe,
    has_cuda,
    main_guard,
    sync,
    sync_sites,
    syncs_are_errors,
    unique,
)
from torchpmap.training import data_parallel_step

WARM_STEPS = 3


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


#: (label, hidden width, instances per process): 1024 makes 4.3 MB of gradients, all-reduced
#: in buckets during the backward across processes; 64 makes 0.02 MB, averaged in one gather.
MODELS = [("bucketed gradients (4.3 MB)", 1024, 1), ("small gradients (0.02 MB), 2 instances per process", 64, 2)]


#: gloo moves CUDA tensors through host memory: its worker thread copies them out and
#: synchronises with that copy (not the step's thread), so "error" mode fails gloo's own work.
GLOO_STAGES = (
    "gloo moves CUDA tensors through host memory and waits for those copies in its own worker threads, so "
    "set_sync_debug_mode('error') fails gloo's work itself; the step's thread is watched in 'warn' mode, and "
    "gloo's own waits are counted from its warnings"
)


def check_step(rec: Recorder, setup: str, width: int, n_local: int, jit: bool, strict: bool = True) -> None:
    """Warms a step up, then watches it for host synchronisations; ``strict``: also runs
    one under ``"error"`` mode."""
    name = f"{setup}, {'jit=True' if jit else 'eager'}, MLP width {width}"
    dev = tp.local_devices()[0].torch_device
    model = mlp(width).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = data_parallel_step(model, F.cross_entropy, opt, jit=jit)
    g = torch.Generator().manual_seed(tp.process_index())
    batches = [
        (torch.randn(n_local, 32, 64, generator=g).to(dev), torch.randint(0, 10, (n_local, 32), generator=g).to(dev))
        for _ in range(2)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)
        for s in range(WARM_STEPS):
            step(batches[s % 2])
        sync()
        sites: list[str] = []
        with sync_sites(sites):
            for s in range(2):
                step(batches[s % 2])
        sync()
        rec.check(f"{name}: no host synchronisation (warn mode)", not sites,
                  "; ".join(unique(sites)) if sites else "none in 2 warmed steps")
        if not strict:
            return
        try:
            with syncs_are_errors():
                loss = step(batches[0])
            sync()
            rec.check(f"{name}: a step under set_sync_debug_mode('error')", bool(torch.isfinite(loss)),
                      f"loss {loss.item():.4f}")
        except Exception as error:  # noqa: BLE001 -- the finding
            rec.check(f"{name}: a step under set_sync_debug_mode('error')", False, describe(error))


def positive_control(rec: Recorder) -> None:
    sites: list[str] = []
    x = torch.ones(4, device="cuda")
    with sync_sites(sites):
        x.sum().item()
    rec.check("positive control: .item() under the watch is seen", len(sites) == 1,
              f"{len(sites)} site(s) seen: {'; '.join(sites)}")


def worker(backend: str) -> int:
    """One process of a multi-process set-up (launched by :func:`main`)."""
    import torchpmap.distributed as tpd

    rec = Recorder()
    setup = f"{backend}, {os.environ['WORLD_SIZE']} process(es), rank {os.environ['RANK']}"
    try:
        tpd.initialize(backend=backend)
        rec.measure(f"{setup}: devices", ", ".join(map(str, tp.devices())))
        cuda_through_gloo = backend == "gloo" and tp.local_devices()[0].platform == "cuda"
        if cuda_through_gloo:
            rec.skip(f"{setup}: steps under set_sync_debug_mode('error')", GLOO_STAGES)
        for _, width, n_local in MODELS:
            for jit in (False, True):
                with rec.case(f"{setup}, {'jit=True' if jit else 'eager'}, MLP width {width}"):
                    check_step(rec, setup, width, n_local, jit, strict=not cuda_through_gloo)
    except Exception as error:  # noqa: BLE001
        rec.check(f"{setup}: set-up", False, describe(error))
    finally:
        status = rec.finish()
        tpd.shutdown()
    return status


def _merge(rec: Recorder, label: str, finished: list, result_base: str) -> None:
    for f in finished:
        outside = f.output.count(SYNC_WARNING)  # C++ warnings of threads without Python (gloo's workers)
        rec.measure(f"{label}, rank {f.rank}: synchronisations reported outside the step's thread", outside)
        path = f"{result_base}.rank{f.rank}"
        if os.path.exists(path):
            with open(path) as fh:
                found = Findings.from_json(json.load(fh))
            rec.findings.checks += found.checks
            rec.findings.measurements.update(found.measurements)
        if f.returncode is None:
            rec.check(f"{label}, rank {f.rank}: finished in time", False, f"killed after {f.seconds:.0f} s")
        if f.returncode not in (0, None) or not os.path.exists(path):
            rec.check(f"{label}, rank {f.rank}: exit status", False,
                      f"exit {f.returncode}; output ends: {f.output[-1500:]}")
        print(f"----- {label}, rank {f.rank} (exit {f.returncode}) -----\n{f.output[-4000:]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=["gloo", "nccl"])
    args = parser.parse_args(argv)
    if args.worker:
        os.environ[RESULT_ENV] = f"{os.environ.get(RESULT_ENV, 'host-sync.json')}.rank{os.environ['RANK']}"
        return worker(args.worker)

    rec = Recorder()
    dry = not has_cuda() and os.environ.get("GPU_CHECK_DRY_RUN") == "1"  # the harness, tried on the CPU
    if not has_cuda() and not dry:
        rec.skip("host synchronisations in a warmed step (one device, gloo with CUDA tensors, NCCL)",
                 "no CUDA: torch.cuda.set_sync_debug_mode watches CUDA only")
        return rec.finish()
    if dry:
        rec.skip("the watch for synchronisations", "a dry run on the CPU (GPU_CHECK_DRY_RUN=1): nothing is watched")
    else:
        positive_control(rec)
    for _, width, n_local in MODELS[:1]:
        for jit in (False, True):
            with rec.case(f"one device, {'jit=True' if jit else 'eager'}"):
                check_step(rec, "one device", width, n_local, jit)

    from torchpmap.bench.launch import launch

    base = os.environ.get(RESULT_ENV) or os.path.abspath("host-sync.json")
    program = ["-m", "torchpmap.bench.gpu_check.programs.host_sync", "--worker"]
    single = "gloo" if dry else "nccl"
    for backend, nproc, env in (("gloo", 2, {}), (single, 1, {"TORCHPMAP_SINGLE_PROCESS_GROUP": "1"})):
        label = f"{backend}, {nproc} process(es)"
        with rec.case(f"{label}: launch"):
            finished = launch([*program, backend], nproc, timeout=150, env={RESULT_ENV: base, **env})
            _merge(rec, label, finished, base)
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
