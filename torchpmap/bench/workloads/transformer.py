"""(h) A small transformer's data-parallel training step: ``nn.TransformerEncoder`` (2 layers,
width 64, 4 heads, sequences of 32 tokens) with an embedding and a classifier head, 8
instances of 4 sequences, eager and ``jit=True``, against plain PyTorch taking the same
per-shard step.

Each column computes the averaged loss and the gradients (``data_parallel_step`` with
``optimizer=None``; the plain step calls ``backward`` on the mean of the shard losses),
so repeated calls do the same work. Dropout is off so that the columns can be compared.
``--quick`` (CI's smoke run) takes 2 instances of 2 sequences of 8 tokens and one layer:
the compiled columns' compile time grows with the unrolled instances and layers.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import Case, Cell, Config, Workload
from torchpmap.training import data_parallel_step

V, D = 100, 64  # vocabulary, width


class _Sizes(NamedTuple):
    instances: int
    sequences: int  # per instance
    tokens: int
    layers: int


FULL, QUICK = _Sizes(8, 4, 32, 2), _Sizes(2, 2, 8, 1)


def _sizes(cfg: Config) -> _Sizes:
    return QUICK if cfg.quick else FULL


class _Classifier(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 4, dim_feedforward=2 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(D, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def _model(cfg: Config) -> nn.Module:
    torch.manual_seed(0)
    return _Classifier(_sizes(cfg).layers).to(cfg.device)


def _batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    n, b, t, _ = _sizes(cfg)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (n, b, t), generator=g), torch.randint(0, 2, (n, b), generator=g)
    return x.to(cfg.device), y.to(cfg.device)


def _torchpmap(cfg: Config, jit: bool) -> Callable[[], torch.Tensor]:
    model = _model(cfg)
    step = data_parallel_step(model, F.cross_entropy, None, devices=fw.torchpmap_devices(), jit=jit)
    batch = _batch(cfg)

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # vmap's "no batching rule, slow path" notes: measured, not news
            warnings.simplefilter("ignore", UserWarning)
            return step(batch)

    return run


def _plain(cfg: Config, compiled: bool = False) -> Callable[[], torch.Tensor]:
    model = copy.deepcopy(_model(cfg))
    x, y = _batch(cfg)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack([F.cross_entropy(model(x[i]), y[i]) for i in range(len(x))]).mean()

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
    n, b, t, _ = _sizes(cfg)
    return [Case("transformer", f"transformer_step[{n}x{b}x{t}]", "step", columns, rtol=1e-4, atol=1e-5)]


WORKLOAD = Workload(
    "transformer",
    f"data-parallel step of a {FULL.layers}-layer TransformerEncoder classifier ({FULL.instances} x "
    f"{FULL.sequences} sequences of {FULL.tokens} tokens; --quick: {QUICK.instances} x {QUICK.sequences} of "
    f"{QUICK.tokens}, {QUICK.layers} layer), eager and jit=True",
    build,
)

