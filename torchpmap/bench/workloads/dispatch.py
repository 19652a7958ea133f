"""(a) Dispatch: ``x + 1`` over 8 instances, the fixed cost of one mapped call."""

from __future__ import annotations

import torch

import torchpmap
from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import NA, Case, Cell, Config, Workload

INSTANCES = 8


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def build(cfg: Config) -> list[Case]:
    x = torch.arange(INSTANCES * 4, dtype=torch.float32, device=cfg.device).reshape(INSTANCES, 4)
    columns: dict[str, Cell] = {
        "torchpmap": fw.torch_impl(cfg, torchpmap.pmap(add_one, devices=fw.torchpmap_devices()), x),
        "torch": fw.torch_impl(cfg, add_one, x),
        "jax.pmap": _jax_pmap(x),
        "jax.vmap": _jax_vmap(x),
        "torchpmap.jit": fw.torch_impl(cfg, torchpmap.pmap(add_one, devices=fw.torchpmap_devices(), jit=True), x),
    }
    return [Case("dispatch", "dispatch", "call", columns)]


def _jax_pmap(x: torch.Tensor) -> Cell:
    jax = fw.jax_pmap_or_na(INSTANCES)
    if isinstance(jax, NA):
        return jax
    (xs,) = fw.shard_for_pmap(INSTANCES, x)
    return fw.jax_impl(jax.pmap(add_one), xs)


def _jax_vmap(x: torch.Tensor) -> Cell:
    jax = fw.jax_or_na()
    if isinstance(jax, NA):
        return jax
    return fw.jax_impl(jax.jit(jax.vmap(add_one, axis_name="i")), fw.to_jax(x))


WORKLOAD = Workload("dispatch", "x + 1 over 8 instances: the per-call overhead", build)
