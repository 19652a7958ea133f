"""(h) A small transformer's data-parallel training step: ``nn.TransformerEncoder`` (2 layers,
width 64, 4 heads, sequences of 32 tokens) with an embedding and a classifier head, 8
instances of 4 sequences, eager and ``jit=True``, against plain PyTorch taking the same
per-shard step.

Each column computes the averaged loss and the gradients (``data_parallel_step`` with
``optimizer=None``; the plain step calls ``backward`` on the mean of the shard losses),
so repeated calls do the same work. Dropout is off so that the columns can be compared.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import Case, Cell, Config, Workload
from torchpmap.training import data_parallel_step

N, B, T, V, D = 8, 4, 32, 100, 64  # instances, sequences per instance, tokens, vocabulary, width


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 4, dim_feedforward=2 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return _Classifier().to(device)


def _batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (N, B, T), generator=g), torch.randint(0, 2, (N, B), generator=g)
    return x.to(device), y.to(device)


def _torchpmap(cfg: Config, jit: bool) -> Callable[[], torch.Tensor]:
    model = _model(cfg.device)
    step = data_parallel_step(model, F.cross_entropy, None, devices=fw.torchpmap_devices(), jit=jit)
    batch = _batch(cfg.device)

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # vmap's "no batching rule, slow path" notes: measured, not news
            warnings.simplefilter("ignore", UserWarning)
            return step(batch)

    return run


def _plain(cfg: Config, compiled: bool = False) -> Callable[[], torch.Tensor]:
    model = copy.deepcopy(_model(cfg.device))
    x, y = _batch(cfg.device)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack([F.cross_entropy(model(x[i]), y[i]) for i in range(N)]).mean()

    loss_fn = torch.compile(loss_of) if compiled else loss_of

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(x, y)
        loss.backward()
        return loss.detach()

    return run


def build(cfg: Config) -> list[Case]:
    columns: dict[str, Cell] = {
        "torchpmap": fw.torch_impl(cfg, _torchpmap(cfg, jit=False)),
        "torchpmap.jit": fw.torch_impl(cfg, _torchpmap(cfg, jit=True)),
        "torch": fw.torch_impl(cfg, _plain(cfg)),
        "torch.compile": fw.torch_impl(cfg, _plain(cfg, compiled=True)),
    }
    return [Case("transformer", f"transformer_step[{N}x{B}x{T}]", "step", columns, rtol=1e-4, atol=1e-5)]


WORKLOAD = Workload(
    "transformer",
    f"data-parallel step of a 2-layer TransformerEncoder classifier ({N} x {B} sequences of {T} tokens), "
    "eager and jit=True",
    build,
)

