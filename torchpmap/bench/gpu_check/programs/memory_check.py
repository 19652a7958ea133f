"""Part ``memory``: the peak CUDA memory of a data-parallel step against plain PyTorch's.

An MLP (1024-4096-4096-1024, 25 M parameters) trained with SGD on 8 instances of 256
samples. Each column's peak is ``torch.cuda.max_memory_allocated`` during one warmed step
minus what was allocated before it (parameters, gradients, optimizer state, the batch):
the step's own working memory. Plain PyTorch takes the step once on the whole batch
(what one process would do) and in a loop over the shards (the least it can hold).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import torchpmap as tp
from torchpmap.bench.gpu_check.programs.common import Recorder, has_cuda, main_guard
from torchpmap.training import data_parallel_step

N, B, WIDTH = 8, 256, 4096
#: A step whose working memory exceeds this many times plain PyTorch's (whole batch) fails.
MAX_RATIO = 3.0


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1024))


def peak_of(make: Callable[[nn.Module, torch.optim.Optimizer], Callable[[], object]]) -> float:
    """The working memory of one warmed step, in MiB."""
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = make(model, opt)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del model, opt, step
    torch.cuda.empty_cache()
    return peak


def main() -> int:
    rec = Recorder()
    if not has_cuda():
        rec.skip("peak CUDA memory of a step", "no CUDA (torch.cuda.max_memory_allocated needs a CUDA device)")
        return rec.finish()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, B, 1024, generator=g).cuda(), torch.randn(N, B, 1024, generator=g).cuda()

    def plain_whole(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], object]:
        def step() -> object:
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x.flatten(0, 1)), y.flatten(0, 1))
            loss.backward()
            opt.step()
            return loss
        return step

    def plain_loop(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], object]:
        def step() -> object:
            opt.zero_grad(set_to_none=True)
            for i in range(N):
                (F.mse_loss(model(x[i]), y[i]) / N).backward()
            opt.step()
            return None
        return step

    def ours(jit: bool) -> Callable[[nn.Module, torch.optim.Optimizer], Callable[[], object]]:
        def make(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], object]:
            step = data_parallel_step(model, F.mse_loss, opt, jit=jit, devices=tp.devices()[:1])
            return lambda: step((x, y))
        return make

    peaks = {}
    for name, make in (("plain, whole batch", plain_whole), ("plain, loop over shards", plain_loop),
                       ("torchpmap eager", ours(False)), ("torchpmap jit=True", ours(True))):
        with rec.case(f"peak memory: {name}"):
            peaks[name] = peak_of(make)
            rec.measure(f"working memory, {name} (MiB)", round(peaks[name], 1))
    base = peaks.get("plain, whole batch")
    grads = sum(p.numel() for p in mlp().parameters()) * 4 / 2**20  # one gradient, MiB
    for name, bound, why in (
        # eager on one device: the gradient of the mean loss, taken outside the map, so each
        # weight's gradient is one product over all samples (until 2026-11-27 vmap made one
        # gradient per instance: 5.65x plain on an H100)
        ("torchpmap eager", lambda b: MAX_RATIO * b, f"{MAX_RATIO}x plain"),
        # compiled: each weight's gradient is one product over all samples, as plain PyTorch's
        ("torchpmap jit=True", lambda b: MAX_RATIO * b, f"{MAX_RATIO}x plain"),
    ):
        if name in peaks and base:
            ratio = peaks[name] / base
            rec.measure(f"{name} / plain whole batch", round(ratio, 2))
            rec.check(f"{name}: working memory at most {why}", peaks[name] <= bound(base),
                      f"{peaks[name]:.0f} MiB vs {base:.0f} MiB plain ({ratio:.2f}x); one gradient is {grads:.0f} MiB")
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
