"""Part ``step``: ``data_parallel_step`` against plain PyTorch, eager, compiled, under bf16
autocast, and under fp16 autocast with a GradScaler.

Plain PyTorch here is one replica per shard, run in a loop: each shard's loss with its
own copy of the buffers (batch norm updates them), the gradient of the mean loss by
``backward``, the buffers set to their mean over the replicas, then the optimizer (and
scaler). That is the data-parallel step's documented meaning, so the two must agree to
the precision of the dtype: after the first step (loss, gradients, buffers) and after
several (parameters).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import torchpmap as tp
from torchpmap.bench.gpu_check.programs.common import (
    QUICK,
    Recorder,
    close,
    device,
    has_cuda,
    main_guard,
    sync_sites,
    unique,
)
from torchpmap.training import data_parallel_step

N, B = 4, 8  # instances, images per instance
STEPS = 3


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    jit: bool = False
    dtype: torch.dtype | None = None  # autocast
    scaled: bool = False  # a GradScaler
    tolerance: float = 1e-4


VARIANTS = [
    Variant("float32, eager"),
    Variant("float32, jit=True", jit=True),
    Variant("bf16 autocast, eager", dtype=torch.bfloat16, tolerance=5e-2),
    Variant("bf16 autocast, jit=True", jit=True, dtype=torch.bfloat16, tolerance=5e-2),
    Variant("fp16 autocast with a GradScaler, eager", dtype=torch.float16, scaled=True, tolerance=1e-2),
]


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, v: Variant,
               scaler: torch.amp.GradScaler | None) -> torch.Tensor:
    """One replica per shard, in a loop (see the module docstring)."""
    params = dict(model.named_parameters())
    floating = {k: b for k, b in model.named_buffers() if b.is_floating_point()}
    other = {k: b for k, b in model.named_buffers() if not b.is_floating_point()}
    losses, changes, counters = [], [], {}
    for i in range(x.shape[0]):
        state = {k: b.clone() for k, b in {**floating, **other}.items()}
        with torch.autocast(x.device.type, dtype=v.dtype, enabled=v.dtype is not None):
            losses.append(F.cross_entropy(functional_call(model, {**params, **state}, (x[i],)), y[i]))
        changes.append({k: state[k] - floating[k] for k in floating})
        counters = {k: state[k] for k in other}
    loss = torch.stack(losses).mean()
    opt.zero_grad(set_to_none=True)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    with torch.no_grad():
        for k in floating:
            floating[k].add_(torch.stack([c[k] for c in changes]).mean(0))
        for k, value in counters.items():
            other[k].copy_(value)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return loss.detach()


def run_variant(rec: Recorder, v: Variant, dev: torch.device) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(N, B, 3, 16, 16, generator=g).to(dev), torch.randint(0, 10, (N, B), generator=g).to(dev))
        for _ in range(STEPS)
    ]
    ours, ref = cnn().to(dev), cnn().to(dev)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    scalers = [torch.amp.GradScaler(dev.type, init_scale=2.0**10) if v.scaled else None for _ in range(2)]
    step = data_parallel_step(
        ours, F.cross_entropy, opts[0], grad_scaler=scalers[0], jit=v.jit, devices=tp.devices()[:1]
    )
    for s, (x, y) in enumerate(batches):
        with torch.autocast(dev.type, dtype=v.dtype, enabled=v.dtype is not None):
            loss = step((x, y))
        expected = plain_step(ref, opts[1], x, y, v, scalers[1])
        if s == 0:
            close(rec, f"{v.name}: loss", loss, expected, v.tolerance)
            close(rec, f"{v.name}: gradients", {k: p.grad for k, p in ours.named_parameters()},
                  {k: p.grad for k, p in ref.named_parameters()}, v.tolerance)
            close(rec, f"{v.name}: batch-norm buffers", dict(ours.named_buffers()), dict(ref.named_buffers()),
                  v.tolerance)
    close(rec, f"{v.name}: parameters after {STEPS} steps", dict(ours.named_parameters()),
          dict(ref.named_parameters()), v.tolerance)
    if v.scaled:
        ours_scaler, ref_scaler = (cast(torch.amp.GradScaler, s) for s in scalers)
        rec.check(f"{v.name}: the scalers agree", ours_scaler.get_scale() == ref_scaler.get_scale(),
                  f"scale {ours_scaler.get_scale()} vs {ref_scaler.get_scale()}")


def check_prefetch(rec: Recorder, dev: torch.device) -> None:
    """``prefetch_to_device`` on CUDA: pinned, copied on its own stream, the same values,
    and no host synchronisation while the batches are taken."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(N * B, 3, 16, 16, generator=g), torch.randint(0, 10, (N * B,), generator=g))
               for _ in range(6)]
    sites: list[str] = []
    got = []
    with sync_sites(sites):
        for x, y in tp.prefetch_to_device(iter(batches), size=2, n=N):
            got.append((x * 1, y * 1))  # the step's stream reads the batch
    torch.cuda.synchronize()
    rec.check("prefetch_to_device: batches on the GPU", all(x.device == dev and y.device == dev for x, y in got))
    expected = [tp.shard(b, n=N) for b in batches]
    close(rec, "prefetch_to_device: the same values", [[x.cpu(), y.cpu()] for x, y in got],
          [[x, y] for x, y in expected], 0.0)
    rec.check("prefetch_to_device: no host synchronisation", not sites, "; ".join(unique(sites)) or "none")


def main() -> int:
    rec = Recorder()
    dev = device()
    rec.measure("device", str(dev))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    warnings.simplefilter("error", tp.JitFallbackWarning)
    variants = VARIANTS
    if QUICK:
        variants = [v for v in VARIANTS if v.dtype is None]
        rec.skip("the autocast variants", "--quick")
    if not has_cuda():
        rec.skip("the step on a CUDA device", "no CUDA: the same step on the CPU")
    for v in variants:
        with rec.case(v.name):
            run_variant(rec, v, dev)
    if has_cuda():
        with rec.case("prefetch_to_device"):
            check_prefetch(rec, dev)
    else:
        rec.skip("prefetch_to_device to a CUDA device", "no CUDA")
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
