"""(g) Mixed precision: a data-parallel CNN step (conv, batch norm, 8 x 16 images) under
``torch.autocast`` bfloat16, and under float16 with a ``GradScaler``, against plain
PyTorch taking the same per-shard step under the same autocast.

Each column computes the averaged loss and the gradients (``data_parallel_step`` with
``optimizer=None``; the plain step calls ``backward`` on the mean of the shard losses),
so repeated calls do the same work.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import Case, Cell, Config, Workload
from torchpmap.training import data_parallel_step

N, B = 8, 16  # instances, images per instance


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    ).to(device)


def _batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, B, 3, 16, 16, generator=g), torch.randint(0, 10, (N, B), generator=g)
    return x.to(device), y.to(device)


def _torchpmap(cfg: Config, dtype: torch.dtype, scaled: bool) -> Callable[[], torch.Tensor]:
    model = _model(cfg.device)
    scaler = torch.amp.GradScaler(cfg.device.type, init_scale=2.0**8) if scaled else None
    step = data_parallel_step(model, F.cross_entropy, None, grad_scaler=scaler, devices=fw.torchpmap_devices())
    batch = _batch(cfg.device)

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(cfg.device.type, dtype=dtype):
            return step(batch)

    return run


def _plain(cfg: Config, dtype: torch.dtype, scaled: bool) -> Callable[[], torch.Tensor]:
    model = copy.deepcopy(_model(cfg.device))
    x, y = _batch(cfg.device)

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(cfg.device.type, dtype=dtype):
            loss = torch.stack([F.cross_entropy(model(x[i]), y[i]) for i in range(N)]).mean()
        (loss * 2.0**8 if scaled else loss).backward()
        return loss.detach().float()

    return run


def build(cfg: Config) -> list[Case]:
    cases = []
    for label, dtype, scaled in (("bf16", torch.bfloat16, False), ("fp16+scaler", torch.float16, True)):
        columns: dict[str, Cell] = {
            "torchpmap": fw.torch_impl(cfg, _torchpmap(cfg, dtype, scaled)),
            "torch": fw.torch_impl(cfg, _plain(cfg, dtype, scaled)),
        }
        cases.append(Case("mixed_precision", f"cnn_step[{label}]", "step", columns, rtol=5e-2, atol=5e-2))
    return cases


WORKLOAD = Workload(
    "mixed_precision",
    "data-parallel CNN step with batch norm (8 x 16 images 16x16) under autocast: bf16, and fp16 with a GradScaler",
    build,
)
