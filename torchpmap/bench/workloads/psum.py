"""(c) ``psum`` of 64 MiB in all (float32) over 8 instances vs ``torch.sum`` of the stack.

torchpmap and ``jax.vmap`` return the total once (``out_axes=None``), as ``torch.sum``
does; ``jax.pmap`` leaves it on each of its devices, which is what a psum is there.
"""

from __future__ import annotations

import torch

import torchpmap
from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import NA, Case, Cell, Config, Workload

INSTANCES = 8
AXIS = "i"


def total_mib(cfg: Config) -> int:
    return 4 if cfg.quick else 64


def instance_psum(x: torch.Tensor) -> torch.Tensor:
    return torchpmap.psum(x, AXIS)


def build(cfg: Config) -> list[Case]:
    mib = total_mib(cfg)
    per_instance = mib * 2**20 // 4 // INSTANCES
    x = torch.rand(INSTANCES, per_instance, generator=torch.Generator().manual_seed(0)).to(cfg.device)
    tp = torchpmap.pmap(instance_psum, axis_name=AXIS, out_axes=None, devices=fw.torchpmap_devices())
    columns: dict[str, Cell] = {
        "torchpmap": fw.torch_impl(cfg, tp, x),
        "torch": fw.torch_impl(cfg, torch.sum, x, 0),
        "jax.pmap": _jax_pmap(x),
        "jax.vmap": _jax_vmap(x),
    }
    if not cfg.quick:  # compiling costs seconds; CI's quick run leaves it to mlp_step and dispatch
        jit = torchpmap.pmap(instance_psum, axis_name=AXIS, out_axes=None, devices=fw.torchpmap_devices(), jit=True)
        columns["torchpmap.jit"] = fw.torch_impl(cfg, jit, x)
    return [Case("psum", f"psum[{mib} MiB]", "call", columns, rtol=1e-5, atol=1e-5)]


def _jax_pmap(x: torch.Tensor) -> Cell:
    jax = fw.jax_pmap_or_na(INSTANCES)
    if isinstance(jax, NA):
        return jax
    (xs,) = fw.shard_for_pmap(INSTANCES, x)
    step = jax.pmap(lambda v: jax.lax.psum(v, AXIS), axis_name=AXIS)
    return fw.jax_impl(step, xs, result=fw.first)


def _jax_vmap(x: torch.Tensor) -> Cell:
    jax = fw.jax_or_na()
    if isinstance(jax, NA):
        return jax
    step = jax.vmap(lambda v: jax.lax.psum(v, AXIS), axis_name=AXIS, out_axes=None)
    return fw.jax_impl(jax.jit(step), fw.to_jax(x))


WORKLOAD = Workload("psum", "psum of 64 MiB in all over 8 instances vs torch.sum of the stack", build)
